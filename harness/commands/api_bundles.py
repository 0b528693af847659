"""The Python API of the portable record: `harness.export` and `harness.import_` (re-exported by
harness/commands/api.py, the one front; `harness.attest` and `harness.verify_record` are the attest extra's).

One typed options object in, one typed result out, as for every verb; the command line calls these too.
"""

from __future__ import annotations

from pathlib import Path

from harness import events, extensions
from harness.commands import bundle as bundle_command
from harness.commands.bundle import ExportResult, ImportResult
from harness.commands.options import ExportOptions as ExportOptions, ImportOptions as ImportOptions
from harness.errors import HarnessError, UsageError
from harness.store.tracking import Tracker

__all__ = ["ExportOptions", "ImportOptions", "export", "import_"]


def write_attestation(path: Path, data: bytes) -> None:
    """An attestation written, or a one-line refusal (a missing folder, a read-only one, a folder's name)."""
    try:
        path.write_bytes(data)
    except OSError as err:
        raise HarnessError(f"cannot write {path}: {err.strerror or err}. Pass a file in a folder that exists and "
                           "that you may write to.") from None


# -- export, import --------------------------------------------------------------------------------------
def export(options: ExportOptions) -> ExportResult:
    o = options
    with events.listening(o.on_event):
        # Signed first: a bad key writes no bundle.
        envelope = None if o.sign_key is None else _sign(o)
        result = bundle_command.export(o)
        if envelope is not None:
            result.signed = o.output.with_name(o.output.name + ".intoto.json")
            try:
                write_attestation(result.signed, envelope)
            except HarnessError:
                o.output.unlink(missing_ok=True)  # no bundle without the attestation asked for
                raise
        return result


def _sign(o: ExportOptions) -> bytes:
    """The attestation of `export --sign`, by the attest extra."""
    sign = extensions.hook(extensions.SIGN)
    if sign is None:
        raise UsageError("--sign writes an attestation, which needs the attest extra (harness.extras.attest); "
                         "drop --sign.")
    signed: bytes = sign(Tracker(o.tracking_uri, writable=False), o.run_id, o.sign_key)
    return signed


def import_(options: ImportOptions) -> ImportResult:
    """`import` is Python's word: the verb's function is `harness.import_`."""
    o = options
    with events.listening(o.on_event):
        return bundle_command.import_bundle(o)
