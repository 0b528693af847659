"""`harness trace`: the command line of the trace extra (harness/cli/main.py adds it to the group)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from harness.cli.console import draw, emit, expected_errors
from harness.cli.options import TRACKING_HELP, json_option

if TYPE_CHECKING:  # imported where the command runs, so that `harness --help` stays instant
    from harness.extras.trace.command import TraceResult


@click.command()
@click.argument("run_id")
@click.option("--step", type=click.IntRange(min=0), required=True, help="The training step to trace (0-based).")
@click.option("--ranks", default="0", show_default=True, help="The ranks to trace, separated by commas.")
@click.option("--tracking-uri", default=None, help=TRACKING_HELP)
@json_option
@expected_errors
def trace(run_id: str, step: int, ranks: str, tracking_uri: str | None, as_json: bool) -> None:
    """Trace every op of step STEP of RUN_ID: name, module, input/output tensor hashes, the user's line.

    Restarts from the run's checkpoint at or before STEP (else from step 0), re-executes up to STEP
    with the recorded code and config, and records the trace as a run nested under RUN_ID (artifacts
    trace/rank<R>.jsonl.gz). Compare two traces with `harness compare TRACE_A TRACE_B`. Prints the
    trace run's id as the last line. Exit 0 traced, 1 the ranks failed, 2 bad input (nothing recorded).
    """
    from harness.extras.trace import api
    from harness.extras.trace.command import parse_ranks

    result = api.trace(api.TraceOptions(run_id, step, parse_ranks(ranks), tracking_uri=tracking_uri, on_event=draw))
    if result.reproduced is False:
        click.echo(f"Warning: the re-execution did not reproduce the run's record: {result.detail}", err=True)
    if as_json:
        emit(document(result))
    start = "step 0" if result.from_checkpoint is None else f"the checkpoint of step {result.from_checkpoint}"
    click.echo(f"traced step {result.step} of run {result.traced} on rank{'s' if len(result.ranks) > 1 else ''} "
               f"{','.join(map(str, result.ranks))} from {start} ({result.seconds:.1f}s)")
    click.echo(result.run_id)


def document(result: TraceResult) -> dict[str, Any]:
    """`trace`'s --json document (docs/json.md): the result's fields."""
    from harness.commands.documents import document as made, keys
    from harness.errors import EXIT_OK

    return made("trace", EXIT_OK, keys(result, detail=result.detail or None))
