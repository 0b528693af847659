"""`harness attest` and `harness verify-record`: the command line of the attest extra (harness/cli/main.py adds
them to the group)."""

from __future__ import annotations

from pathlib import Path

import click

from harness.cli.console import draw, emit, expected_errors
from harness.cli.options import TRACKING_HELP, json_option


@click.command()
@click.argument("run_id")
@click.option("--key", type=click.Path(path_type=Path), required=True, help="The ed25519 private key (PEM) to sign with.")
@click.option("-o", "--output", type=click.Path(path_type=Path), required=True, help="The attestation to write (.json).")
@click.option("--tracking-uri", default=None, help=TRACKING_HELP)
@json_option
@expected_errors
def attest(run_id: str, key: Path, output: Path, tracking_uri: str | None, as_json: bool) -> None:
    """Sign an attestation of sealed run RUN_ID with a key the store does not hold.

    The attestation is an in-toto Statement (subject: the final weights' digest, harness.fingerprint;
    predicate: the run's id, status, seal and commit) in a DSSE envelope signed with ed25519. Check it with
    `harness verify-record RUN_ID --attestation FILE --key PUBLIC.pem`. Exit 0 written, 2 bad input (an edited
    or unsealed run, no final weights, a key that is not ed25519).
    """
    from harness.commands.documents import document
    from harness.errors import EXIT_OK
    from harness.extras.attest import api

    done = api.attest(api.AttestOptions(run_id, key, output, tracking_uri=tracking_uri, on_event=draw))
    if as_json:
        emit(document("attest", EXIT_OK, {"run_id": done.run_id, "path": str(done.path)}))
    click.echo(str(done.path))


@click.command(name="verify-record")
@click.argument("run_id")
@click.option("--attestation", type=click.Path(path_type=Path), required=True, help="From `harness attest` or `export --sign`.")
@click.option("--key", type=click.Path(path_type=Path), required=True, help="The signer's ed25519 public key (PEM).")
@click.option("--tracking-uri", default=None, help=TRACKING_HELP)
@json_option
@expected_errors
def verify_record(run_id: str, attestation: Path, key: Path, tracking_uri: str | None, as_json: bool) -> None:
    """Check that RUN_ID is the run an attestation signed by KEY attests, and unchanged since.

    The signature must verify with KEY, the run's seal must hold and be the attested one (an imported copy of
    the attested run: its seal must hold), and its final weights' digest must be the attested subject. Exit 0
    holds, 2 refused (one line saying which check failed).
    """
    from harness.commands.documents import document
    from harness.errors import EXIT_OK
    from harness.extras.attest import api

    held = api.verify_record(api.VerifyRecordOptions(run_id, attestation, key, tracking_uri=tracking_uri, on_event=draw))
    run_id, doc = held.run_id, held.statement
    if as_json:
        emit(document("verify-record", EXIT_OK, {
            "run_id": run_id, "attested_run_id": doc["predicate"]["run_id"],
            "sha256": doc["subject"][0]["digest"]["sha256"], "holds": True,
        }))
    click.echo(f"Run {run_id} is the attested run {doc['predicate']['run_id']}, unchanged: final weights sha256 "
               f"{doc['subject'][0]['digest']['sha256']}.")
