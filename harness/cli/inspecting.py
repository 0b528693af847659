"""The commands that look into recorded runs: list them (runs, ui), compare two, close a stale one (mark), and
audit a suspicious one. trace, bisect and verify are extras' commands (harness/extras)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from harness import tags as T
from harness.cli.console import draw, emit, expected_errors, say, say_verdict
from harness.cli.options import TRACKING_HELP, json_option
from harness.errors import EXIT_SIGINT


@click.command()
@click.argument("experiment", required=False)
@click.option("-n", "--limit", default=20, show_default=True, help="How many runs to list.")
@click.option("--all", "show_all", is_flag=True,
              help="Also list the runs counted under NESTED: calibrations and their members, traces, audits, a study's "
                   "seeds, a bisect's probes, a study replay's member replays.")
@click.option("--kind", type=click.Choice(T.KINDS), default=None,
              help="Only runs of this kind (nested ones too).")
@click.option("--status", type=click.Choice(T.LISTED_STATUSES, case_sensitive=False), default=None,
              help="Only runs with this status (nested ones too).")
@click.option("--tracking-uri", default=None, help=TRACKING_HELP)
@json_option
@expected_errors
def runs(experiment: str | None, limit: int, show_all: bool, kind: str | None, status: str | None,
         tracking_uri: str | None, as_json: bool) -> None:
    """List recent runs: id, experiment, start, status, world size, commit, image digest, replay verdicts.

    Lists the runs, studies, replays, study replays, bisects and verify runs you made. What a command
    made on its way - a calibration and its member replays, traces, audits, a study's seeds, a bisect's
    probes - is counted on its run's row under NESTED, e.g. `calibration 10, trace 3`, and listed with
    --all, --kind or --status. STATUS is STALE for a RUNNING run whose launcher stopped writing its
    heartbeat (close it with `harness mark`). VERDICTS counts the verdicts of a run's replays, e.g.
    `BITWISE 2, DIVERGED 1 (with changes)`, replays made with --allow-changes or --world-size counted
    apart; a replay still running or that failed without a verdict by its status.
    Exit 0 listed (also an empty store), 2 bad input (an unknown experiment, an unreadable store).
    """
    from harness.commands import api, documents

    listed = api.runs(api.RunsOptions(experiment, limit, tracking_uri=tracking_uri, on_event=draw, all=show_all,
                                      kind=kind, status=status.upper() if status else None))
    if as_json:
        emit(documents.runs(listed.runs))
    click.echo(listed.table())


@click.command()
@click.argument("experiment", required=False)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", type=click.IntRange(1, 65535), default=5050, show_default=True,
              help="Port to listen on (5000 is left to a local registry). `run` and `replay` link to it while it runs.")
@click.option("--tracking-uri", default=None, help=TRACKING_HELP)
@expected_errors
def ui(experiment: str | None, host: str, port: int, tracking_uri: str | None) -> None:
    """Open the MLflow UI on EXPERIMENT's runs and replays (default: the newest run's experiment).

    The page lists every run and replay with its verdict, world size, commit and image digest (a view
    harness saves in the experiment). Prints the page's link on stdout once the UI answers. On a local
    store this starts `mlflow server` until Ctrl-C; an http(s) store is a server already: its link is
    printed and nothing is started. Exit 130 stopped with Ctrl-C (143 SIGTERM), 0 a server store's link
    printed, 2 bad input (an unknown experiment, a port in use, a server that never answered).
    """
    import signal

    from harness.commands import ui as ui_command

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)  # the server goes with `harness ui` (serve stops it), however it is stopped
    try:
        with ui_command.serve(ui_command.UiOptions(experiment, host, port, tracking_uri)) as serving:
            click.echo(serving.page)
            if serving.overlay is not None:  # on stderr: stdout carries only the page's link
                say(f"Run {serving.overlaid} and its replays, every metric overlaid: {serving.overlay}")
            sys.exit(serving.wait())
    except KeyboardInterrupt:
        sys.exit(EXIT_SIGINT)


@click.command()
@click.argument("run_a", required=False)
@click.argument("run_b", required=False)
@click.option("--report", "report", type=click.Path(path_type=Path), default=None,
              help="Two traces: also write the localization report to PATH (HTML if it ends in .html, else markdown).")
@click.option("--tolerance", "tolerances", multiple=True, metavar="METRIC=ATOL[,RTOL]",
              help="Judge METRIC with this tolerance instead of the recorded replay.tolerance. Repeatable. "
                   "METRIC=inf leaves METRIC unjudged (a wall clock: train_runtime=inf). "
                   "weights=any lets the metrics decide where the parameters' fingerprints differ.")
@click.option("--tracking-uri", default=None, help=TRACKING_HELP)
@json_option
@expected_errors
def compare(run_a: str | None, run_b: str | None, report: Path | None, tolerances: tuple[str, ...],
            tracking_uri: str | None, as_json: bool) -> None:
    """Compare two existing runs (any experiments): environment delta and verdict, no rerun.

    RUN_A is the reference; its tolerance applies (RUN_B a replay of it: the replay's, with the
    --tolerance it was given), then --tolerance. RUN_A alone: compared with its newest replay.
    Where RUN_B is a replay of RUN_A, stderr says where its curves (original and replay overlaid)
    and report are. Exit 0 reproduced, 1 diverged, 2 bad input.
    Two trace runs (harness trace): the first op whose output differs while its inputs were equal,
    with its module, shapes, dtypes, the user's line and a likely cause; nothing is recorded.
    Exit 0 identical, 1 they differ.
    """
    from harness.commands import api, documents, text
    from harness.errors import UsageError

    if run_a is None:
        raise UsageError("compare needs a run: pass RUN (compared with its newest replay) or RUN_A RUN_B (two runs, "
                         "or two traces).")
    found = api.compare(api.CompareOptions(run_a, run_b, tuple(tolerances), report=report, tracking_uri=tracking_uri,
                                           on_event=draw))
    if not isinstance(found, api.Comparison) and report is not None:  # two traces: the trace extra wrote the report
        say(f"Report: {report}")
    if isinstance(found, api.Comparison) and found.ui is not None:  # a judged replay carries its curves
        for line in found.ui.curves:
            say(line)
    if as_json:
        emit(documents.compare(found))
    if not isinstance(found, api.Comparison):  # what an extra compares (two traces): its lines and its exit code
        for line in found.lines():
            click.echo(line)
        sys.exit(found.exit_code)
    *lines, verdict = text.comparison_lines(found)
    for line in lines:
        click.echo(line)
    say_verdict(verdict)
    sys.exit(found.exit_code)


@click.command()
@click.argument("run_id")
@click.option("--status", "status", type=click.Choice(list(T.INCOMPLETE)), required=True,
              help="How to close the run.")
@click.option("--force", is_flag=True, help="Close a run that has no heartbeat tags (nothing shows it is alive).")
@click.option("--tracking-uri", default=None, help=TRACKING_HELP)
@json_option
@expected_errors
def mark(run_id: str, status: str, force: bool, tracking_uri: str | None, as_json: bool) -> None:
    """Close a RUNNING run whose launcher is gone (stale heartbeat) as FAILED or KILLED.

    Refuses a run that is not RUNNING, or whose heartbeat is fresh (its launcher still runs:
    stop that with Ctrl-C or SIGTERM), or that has no heartbeat tags unless --force.
    Exit 0 closed, 2 refused.
    """
    from harness.commands import api, documents

    done = api.mark(api.MarkOptions(run_id, status, force=force, tracking_uri=tracking_uri, on_event=draw))
    if as_json:
        emit(documents.mark(done.run_id, done.status, done.reason))
    click.echo(f"Run {done.run_id} is now {done.status}: {done.reason}.")


@click.command()
@click.argument("run_id")
@click.option("--segments", "-k", type=click.IntRange(min=1), required=True,
              help="How many checkpoint-to-checkpoint segments to replay.")
@click.option("--seed", type=int, default=None, help="Seed of the random draw (printed; default: random).")
@click.option("--tracking-uri", default=None, help=TRACKING_HELP)
@json_option
@expected_errors
def audit(run_id: str, segments: int, seed: int | None, tracking_uri: str | None, as_json: bool) -> None:
    """Verify a FINISHED run by replaying K random segments between its checkpoints.

    Each drawn segment restarts from its start checkpoint and must reach the fingerprint the run
    recorded at its end, with bit-identical metrics. Prints the probability of catching one bad
    segment (K/N) and the compute spent relative to a full replay. The last two lines of stdout are
    `verdict: ...` and the audit's run id. Exit 0 all segments reproduced, 1 one did not, 2 bad input.
    """
    from harness.commands import api

    result = api.audit(api.AuditOptions(run_id, segments, seed=seed, tracking_uri=tracking_uri, on_event=draw))
    if as_json:
        from harness.commands import documents

        emit(documents.audit(result))
    for s in result.drawn:
        click.echo(f"segment {s.index} steps {s.start}-{s.end}: {'ok' if s.ok else 'FAILED'}"
                   f"{'' if s.ok else ' - ' + s.detail} ({s.seconds:.1f}s)")
    click.echo(f"P(catching one bad segment) = {len(result.drawn)}/{result.segments_total} = "
               f"{result.catch_probability:.2f}; compute = {result.step_fraction:.1%} of a full replay's steps")
    say_verdict(f"verdict: {result.summary()}")
    click.echo(result.audit_id)
    sys.exit(result.exit_code)
