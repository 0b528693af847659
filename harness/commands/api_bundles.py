"""The Python API of the portable record: `harness.export` and `harness.import_` (re-exported by
harness/commands/api.py, the one front; `harness.attest` and `harness.verify_record` are the attest extra's).

One typed options object in, one typed result out, as for every verb; the command line calls these too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from harness import events, extensions
from harness.commands import bundle as bundle_command
from harness.commands.bundle import ExportResult, ImportResult
from harness.commands.bundleformat import DEFAULT_MAX_RATIO, DEFAULT_MAX_UNPACKED_MIB, Limits
from harness.errors import HarnessError, UsageError
from harness.events import Listener
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
@dataclass(frozen=True)
class ExportOptions:
    """`harness export RUN_ID -o BUNDLE`: the run, its code and its replays in one portable bundle."""

    run_id: str
    output: Path  # the bundle to write (.tar.gz)
    with_checkpoints: bool = False
    with_image: bool = False  # the pinned image (docker save); import loads it
    with_data: bool = False  # the declared data's files, checked against their recorded sha256
    sign_key: Path | None = None  # an ed25519 private key (PEM): also write OUTPUT.intoto.json
    tracking_uri: str | None = None
    repo: Path | None = None  # the clone holding the recorded commit (default: found from the cwd)
    tree_only: bool = False  # the code bundle without the git history before the recorded commit
    on_event: Listener | None = None


def export(options: ExportOptions) -> ExportResult:
    o = options
    with events.listening(o.on_event):
        # Signed first: a bad key writes no bundle.
        envelope = None if o.sign_key is None else _sign(o)
        result = bundle_command.export(o.run_id, o.output, with_checkpoints=o.with_checkpoints,
                                       with_image=o.with_image, with_data=o.with_data, tracking_uri=o.tracking_uri,
                                       repo=o.repo, tree_only=o.tree_only)
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


@dataclass(frozen=True)
class ImportOptions:
    """`harness import BUNDLE`: verify a bundle and import its run and replays into this store."""

    bundle: Path
    data_dir: Path | None = None  # where the declared data goes (default ./harness-data/ORIGINAL_RUN_ID)
    tracking_uri: str | None = None
    on_event: Listener | None = None
    # The bounds checked on the manifest before anything is unpacked: every member's listed size summed (MiB), and
    # that sum over the bundle file's size. Raise them for a legitimately huge bundle from a source you trust.
    max_unpacked_mib: float = DEFAULT_MAX_UNPACKED_MIB
    max_ratio: float = DEFAULT_MAX_RATIO


def import_(options: ImportOptions) -> ImportResult:
    """`import` is Python's word: the verb's function is `harness.import_`."""
    o = options
    with events.listening(o.on_event):
        return bundle_command.import_bundle(o.bundle, tracking_uri=o.tracking_uri, data_dir=o.data_dir,
                                            limits=Limits(o.max_unpacked_mib, o.max_ratio))
