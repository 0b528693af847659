"""The Python API of the portable record: `harness.export`, `harness.import_`, `harness.attest` and
`harness.verify_record` (re-exported by harness/commands/api.py, the one front).

One typed options object in, one typed result out, as for every verb; the command line calls these too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import events
from harness.commands import bundle as bundle_command
from harness.commands.bundle import ExportResult, ImportResult
from harness.commands.options import ExportOptions as ExportOptions, ImportOptions as ImportOptions
from harness.errors import HarnessError
from harness.events import Listener
from harness.record import attest as attest_record
from harness.store.tracking import Tracker, full_ids

__all__ = ["AttestOptions", "Attested", "ExportOptions", "ImportOptions", "RecordVerified", "VerifyRecordOptions",
           "attest", "export", "import_", "verify_record"]


def _write(path: Path, data: bytes) -> None:
    """An attestation written, or a one-line refusal (a missing folder, a read-only one, a folder's name)."""
    try:
        path.write_bytes(data)
    except OSError as err:
        raise HarnessError(f"cannot write {path}: {err.strerror or err}. Pass a file in a folder that exists and "
                           "that you may write to.") from None


def _full_id(run_id: str, tracking_uri: str | None) -> str:
    """The run's whole id where a unique prefix of it was given (the store's one rule: Tracker.resolve_id)."""
    return full_ids(tracking_uri, run_id)[0] or run_id


# -- export, import --------------------------------------------------------------------------------------
def export(options: ExportOptions) -> ExportResult:
    o = options
    with events.listening(o.on_event):
        # Signed first: a bad key writes no bundle.
        envelope = None if o.sign_key is None else attest_record.sign(Tracker(o.tracking_uri, writable=False),
                                                                      o.run_id, o.sign_key)
        result = bundle_command.export(o)
        if envelope is not None:
            result.signed = o.output.with_name(o.output.name + ".intoto.json")
            try:
                _write(result.signed, envelope)
            except HarnessError:
                o.output.unlink(missing_ok=True)  # no bundle without the attestation asked for
                raise
        return result


def import_(options: ImportOptions) -> ImportResult:
    """`import` is Python's word: the verb's function is `harness.import_`."""
    o = options
    with events.listening(o.on_event):
        return bundle_command.import_bundle(o)


# -- attest, verify-record -----------------------------------------------------------------------------
@dataclass(frozen=True)
class AttestOptions:
    """`harness attest RUN_ID --key KEY -o OUTPUT`: a signed in-toto attestation of a sealed run."""

    run_id: str
    key: Path  # the ed25519 private key (PEM)
    output: Path  # the attestation to write (.json)
    tracking_uri: str | None = None
    on_event: Listener | None = None


@dataclass(frozen=True)
class Attested:
    run_id: str
    path: Path  # the attestation written


def attest(options: AttestOptions) -> Attested:
    with events.listening(options.on_event):
        o = options
        run_id = _full_id(o.run_id, o.tracking_uri)
        _write(o.output, attest_record.sign(Tracker(o.tracking_uri, writable=False), run_id, o.key))
        return Attested(run_id, o.output)


@dataclass(frozen=True)
class VerifyRecordOptions:
    """`harness verify-record RUN_ID --attestation FILE --key PUBLIC`: the run is the attested one, unchanged."""

    run_id: str
    attestation: Path  # from `harness attest` or `export --sign`
    key: Path  # the signer's ed25519 public key (PEM)
    tracking_uri: str | None = None
    on_event: Listener | None = None


@dataclass(frozen=True)
class RecordVerified:
    run_id: str  # the run checked (an imported copy keeps the attested run's id as harness.imported_from)
    statement: dict[str, Any]  # the attested in-toto Statement: `subject` (the final weights), `predicate`


def verify_record(options: VerifyRecordOptions) -> RecordVerified:
    """The attested Statement when the attestation holds for the run; HarnessError saying which check failed."""
    with events.listening(options.on_event):
        o = options
        run_id = _full_id(o.run_id, o.tracking_uri)
        return RecordVerified(run_id, attest_record.verify_record(Tracker(o.tracking_uri, writable=False), run_id,
                                                                  o.attestation, o.key))
