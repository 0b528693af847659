"""What type checkers see of `harness` (PEP 561: harness/py.typed): the API's real names and signatures, which
__init__.py loads only on first use."""

from harness.commands.api import (
    Attested as Attested,
    AttestOptions as AttestOptions,
    AuditOptions as AuditOptions,
    BisectOptions as BisectOptions,
    CalibrateOptions as CalibrateOptions,
    CheckOptions as CheckOptions,
    CompareOptions as CompareOptions,
    ExportOptions as ExportOptions,
    ImportOptions as ImportOptions,
    Marked as Marked,
    MarkOptions as MarkOptions,
    Placement as Placement,
    RecordVerified as RecordVerified,
    ReplayOptions as ReplayOptions,
    ResumeOptions as ResumeOptions,
    RunOptions as RunOptions,
    RunsOptions as RunsOptions,
    TraceOptions as TraceOptions,
    VerifyOptions as VerifyOptions,
    VerifyRecordOptions as VerifyRecordOptions,
    attest as attest,
    audit as audit,
    bisect as bisect,
    calibrate as calibrate,
    check as check,
    compare as compare,
    export as export,
    import_ as import_,
    mark as mark,
    replay as replay,
    resume as resume,
    run as run,
    runs as runs,
    trace as trace,
    verify as verify,
    verify_record as verify_record,
)

__version__: str
__all__: list[str]
