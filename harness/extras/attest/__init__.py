"""`harness attest` and `harness verify-record`: a sealed run's signed in-toto attestation (also `export --sign`),
and the check that a run is the attested one, unchanged."""

from harness.extensions import SIGN, Extra

EXTRA = Extra(
    "attest", cli="harness.extras.attest.cli", api="harness.extras.attest.api",
    names=("AttestOptions", "Attested", "RecordVerified", "VerifyRecordOptions", "attest", "verify_record"),
    hooks={SIGN: "harness.extras.attest.signing:sign"},
)
