"""What type checkers see of `harness` (PEP 561: harness/py.typed): the API's real names and signatures, which
__init__.py loads only on first use."""

from harness.commands.api import (
    AuditOptions as AuditOptions,
    CalibrateOptions as CalibrateOptions,
    CheckOptions as CheckOptions,
    CompareOptions as CompareOptions,
    ExportOptions as ExportOptions,
    ImportOptions as ImportOptions,
    Marked as Marked,
    MarkOptions as MarkOptions,
    Placement as Placement,
    ReplayOptions as ReplayOptions,
    ResumeOptions as ResumeOptions,
    RunOptions as RunOptions,
    RunsOptions as RunsOptions,
    audit as audit,
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
)
from harness.errors import (
    BackendError as BackendError,
    ConfigError as ConfigError,
    DataChanged as DataChanged,
    HarnessError as HarnessError,
    Interrupted as Interrupted,
    RepositoryError as RepositoryError,
    RunFailed as RunFailed,
    RunNotFound as RunNotFound,
    RunRefused as RunRefused,
    SecretRefused as SecretRefused,
    StoreUnavailable as StoreUnavailable,
    UsageError as UsageError,
)
from harness.extras.attest.api import (
    Attested as Attested,
    AttestOptions as AttestOptions,
    RecordVerified as RecordVerified,
    VerifyRecordOptions as VerifyRecordOptions,
    attest as attest,
    verify_record as verify_record,
)
from harness.extras.bisect.api import BisectOptions as BisectOptions, bisect as bisect
from harness.extras.trace.api import TraceOptions as TraceOptions, trace as trace
from harness.extras.verify.api import VerifyOptions as VerifyOptions, verify as verify

__version__: str
__all__: list[str]
