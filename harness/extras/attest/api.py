"""The Python API of the attest extra: `harness.attest` and `harness.verify_record`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import events
from harness.commands.api_bundles import write_attestation
from harness.events import Listener
from harness.extras.attest import signing
from harness.store.tracking import Tracker, full_ids

__all__ = ["AttestOptions", "Attested", "RecordVerified", "VerifyRecordOptions", "attest", "verify_record"]


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
        run_id = full_ids(o.tracking_uri, o.run_id)[0] or o.run_id
        write_attestation(o.output, signing.sign(Tracker(o.tracking_uri, writable=False), run_id, o.key))
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
        run_id = full_ids(o.tracking_uri, o.run_id)[0] or o.run_id
        return RecordVerified(run_id, signing.verify_record(Tracker(o.tracking_uri, writable=False), run_id,
                                                                  o.attestation, o.key))
