"""`harness verify`: the command line of the verify extra (harness/cli/main.py adds it to the group)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from harness.cli.console import draw, emit, expected_errors, say
from harness.cli.options import EXECUTOR, TRACKING_HELP, ExecutorOption, json_option

if TYPE_CHECKING:  # imported where the command runs, so that `harness --help` stays instant
    from harness.extras.verify.command import VerifyResult


@click.command()
@click.argument("claims_file", type=click.Path(path_type=Path))
@click.argument("overrides", nargs=-1, metavar="[KEY=VALUE]...")
@click.option("--replay", "do_replay", is_flag=True,
              help="Replay each study or run the claims rest on (once) and judge the claims on the replays.")
@click.option("--members", type=click.IntRange(min=1), default=None, help="--replay: replay K members of each study (default: all).")
@click.option("--world-size", type=click.IntRange(min=1), default=None, help="--replay: replay with another number of ranks.")
@click.option("--allow-changes", is_flag=True, help="--replay: replay with the KEY=VALUE overrides given after CLAIMS_FILE (a flag).")
@click.option("--executor", type=EXECUTOR, default=None, cls=ExecutorOption,
              help="--replay: where the replays run (default: as recorded).")
@click.option("--tracking-uri", default=None, help=TRACKING_HELP)
@json_option
@expected_errors
def verify(claims_file: Path, overrides: tuple[str, ...], do_replay: bool, members: int | None, world_size: int | None,
           allow_changes: bool, executor: str | None, tracking_uri: str | None, as_json: bool) -> None:
    """Check a paper's claims (CLAIMS_FILE) against the recorded studies and runs, optionally replaying them.

    Each claim's printed number must be what its runs produced, rounded as printed (HOLDS), or a mean
    within the seeds' noise (WITHIN_NOISE), else MISPRINTED; with --replay its replay must reproduce
    it (BITWISE, WITHIN_ROUNDING, WITHIN_TOLERANCE or WITHIN_NOISE). Prints the claims table,
    `claims: H of N hold`, and the verify run's id as the last line; the report's path on stderr.
    Exit 0 every claim holds, 1 one does not, 2 bad input (nothing recorded).
    """
    from harness.extras.verify import api
    from harness.extras.verify.report import HEADER, rows
    from harness.fmt import text_table

    result = api.verify(api.VerifyOptions(
        claims_file, tuple(overrides), replay=do_replay, members=members, world_size=world_size,
        allow_changes=allow_changes, executor=executor, tracking_uri=tracking_uri, on_event=draw,
    ))
    say(f"Report: {result.report_path}")
    if as_json:
        emit(document(result))
    click.echo(text_table([HEADER, *rows(result.verdicts, result.replayed)]))
    for verdict in result.verdicts:
        if verdict.typo:
            click.echo(f"Note: claim {verdict.claim.id}: {verdict.typo}")
    click.echo(f"claims: {result.held} of {len(result.verdicts)} hold")
    click.echo(result.run_id)
    sys.exit(result.exit_code)


def document(result: VerifyResult) -> dict[str, Any]:
    """`verify`'s --json document (docs/json.md): the result's fields, the verdicts as `claims`."""
    from harness.commands.documents import document as made, keys

    return made("verify", result.exit_code, keys(
        result, rename={"verdicts": "claims", "report_path": "report"}, held=result.held, total=len(result.verdicts)))
