"""The commands that look into recorded runs: list them (runs, ui), compare two, close a stale one (mark), and
audit a suspicious one. trace, bisect and verify are extras' commands (harness/extras)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from harness import tags as T
from harness.cli.console import _draw, _emit, _expected_errors, _say, _verdict
from harness.cli.options import _TRACKING_HELP, _json_option
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
@click.option("--tracking-uri", default=None, help=_TRACKING_HELP)
@_json_option
@_expected_errors
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

    listed = api.runs(api.RunsOptions(experiment, limit, tracking_uri=tracking_uri, on_event=_draw, all=show_all,
                                      kind=kind, status=status.upper() if status else None))
    if as_json:
        _emit(documents.runs(listed.runs))
    click.echo(listed.table())


@click.command()
@click.argument("experiment", required=False)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", type=click.IntRange(1, 65535), default=5050, show_default=True,
              help="Port to listen on (5000 is left to a local registry). `run` and `replay` link to it while it runs.")
@click.option("--tracking-uri", default=None, help=_TRACKING_HELP)
@_expected_errors
def ui(experiment: str | None, host: str, port: int, tracking_uri: str | None) -> None:
    """Open the MLflow UI on EXPERIMENT's runs and replays (default: the newest run's experiment).

    The page lists every run and replay with its verdict, world size, commit and image digest (a view
    harness saves in the experiment). Prints the page's link on stdout once the UI answers. On a local
    store this starts `mlflow server` until Ctrl-C; an http(s) store is a server already: its link is
    printed and nothing is started. Exit 130 stopped with Ctrl-C (143 SIGTERM), 0 a server store's link
    printed, 2 bad input (an unknown experiment, a port in use, a server that never answered).
    """
    import signal
    import subprocess

    from harness.commands.terminal import Tracker, display_uri, mlflow_ui, resolve_uri, server_url, ui_command

    uri = resolve_uri(tracking_uri)
    served = server_url(uri)
    if served:  # a tracking server is its own UI
        tracker = Tracker(uri)
        experiment_id = mlflow_ui.prepare(tracker, experiment)
        click.echo(mlflow_ui.page(served, experiment_id))
        _say_overlay(tracker, served, experiment_id)
        return
    base = mlflow_ui.link_base(host, port)  # what a browser here opens (bound to 0.0.0.0: the loopback)
    click.echo(f"Starting the MLflow UI for {display_uri(uri)} at {base} (Ctrl-C to stop) ...", err=True)
    cmd, env = ui_command(uri, host, port)
    # Its own process group: the server's worker goes with it, whoever stops `harness ui`. Its log goes
    # to stderr: stdout carries only the link.
    server = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=sys.stderr)

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        # Meanwhile (the server takes seconds to answer): pick the experiment and save its view. Read-only
        # (writable=False): a current local store is read without MLflow, which opens only to write the view.
        experiment_id = mlflow_ui.prepare(Tracker(uri, writable=False, must_exist=False), experiment)
        mlflow_ui.wait_ready(server, base)
        with mlflow_ui.announced(uri, base):  # `run` and `replay` link to this port while it serves
            click.echo(mlflow_ui.page(base, experiment_id))
            _say_overlay(Tracker(uri, writable=False, must_exist=False), base, experiment_id)
            sys.exit(server.wait())
    except KeyboardInterrupt:
        mlflow_ui.stop(server)
        sys.exit(EXIT_SIGINT)
    finally:
        mlflow_ui.stop(server)


def _say_overlay(tracker: Any, base: str, experiment_id: str | None) -> None:
    """On stderr (stdout carries only the page's link): the newest replay's run and its replays, curves overlaid."""
    from harness.commands.terminal import mlflow_ui

    if experiment_id is None:
        return
    found = mlflow_ui.overlay(tracker, experiment_id)
    if found is not None:
        original, replays = found
        click.echo(f"Run {original} and its replays, every metric overlaid: "
                   f"{mlflow_ui.compare_link(base, [original, *replays], [experiment_id])}", err=True)


@click.command()
@click.argument("run_a", required=False)
@click.argument("run_b", required=False)
@click.option("--report", "report", type=click.Path(path_type=Path), default=None,
              help="Two traces: also write the localization report to PATH (HTML if it ends in .html, else markdown).")
@click.option("--tolerance", "tolerances", multiple=True, metavar="METRIC=ATOL[,RTOL]",
              help="Judge METRIC with this tolerance instead of the recorded replay.tolerance. Repeatable. "
                   "METRIC=inf leaves METRIC unjudged (a wall clock: train_runtime=inf). "
                   "weights=any lets the metrics decide where the parameters' fingerprints differ.")
@click.option("--tracking-uri", default=None, help=_TRACKING_HELP)
@_json_option
@_expected_errors
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
    from harness.commands import api, documents
    from harness.commands.terminal import Tracker, comparison_lines, mlflow_ui, verdict_line
    from harness.errors import UsageError

    if run_a is None:
        raise UsageError("compare needs a run: pass RUN (compared with its newest replay) or RUN_A RUN_B (two runs, "
                         "or two traces).")
    found = api.compare(api.CompareOptions(run_a, run_b, tuple(tolerances), report=report, tracking_uri=tracking_uri,
                                           on_event=_draw))
    if not isinstance(found, api.Comparison) and report is not None:  # two traces: the trace extra wrote the report
        _say(f"Report: {report}")
    if isinstance(found, api.Comparison) and found.of_replay:
        tracker = Tracker(tracking_uri, writable=False)
        judged = tracker.get_run(found.run_b)
        if judged.tags.get(T.VERDICT):  # a judged replay carries its curves (an unjudged one, a member: none)
            for line in mlflow_ui.curves(tracker.uri, judged):
                _say(line)
    if as_json:
        _emit(documents.compare(found))
    if not isinstance(found, api.Comparison):  # what an extra compares (two traces): its lines and its exit code
        for line in found.lines():
            click.echo(line)
        sys.exit(found.exit_code)
    for line in comparison_lines(found, []):
        click.echo(line)
    _verdict(verdict_line(found))
    sys.exit(found.exit_code)


@click.command()
@click.argument("run_id")
@click.option("--status", "status", type=click.Choice(list(T.INCOMPLETE)), required=True,
              help="How to close the run.")
@click.option("--force", is_flag=True, help="Close a run that has no heartbeat tags (nothing shows it is alive).")
@click.option("--tracking-uri", default=None, help=_TRACKING_HELP)
@_json_option
@_expected_errors
def mark(run_id: str, status: str, force: bool, tracking_uri: str | None, as_json: bool) -> None:
    """Close a RUNNING run whose launcher is gone (stale heartbeat) as FAILED or KILLED.

    Refuses a run that is not RUNNING, or whose heartbeat is fresh (its launcher still runs:
    stop that with Ctrl-C or SIGTERM), or that has no heartbeat tags unless --force.
    Exit 0 closed, 2 refused.
    """
    from harness.commands import api, documents

    done = api.mark(api.MarkOptions(run_id, status, force=force, tracking_uri=tracking_uri, on_event=_draw))
    if as_json:
        _emit(documents.mark(done.run_id, done.status, done.reason))
    click.echo(f"Run {done.run_id} is now {done.status}: {done.reason}.")


@click.command()
@click.argument("run_id")
@click.option("--segments", "-k", type=click.IntRange(min=1), required=True,
              help="How many checkpoint-to-checkpoint segments to replay.")
@click.option("--seed", type=int, default=None, help="Seed of the random draw (printed; default: random).")
@click.option("--tracking-uri", default=None, help=_TRACKING_HELP)
@_json_option
@_expected_errors
def audit(run_id: str, segments: int, seed: int | None, tracking_uri: str | None, as_json: bool) -> None:
    """Verify a FINISHED run by replaying K random segments between its checkpoints.

    Each drawn segment restarts from its start checkpoint and must reach the fingerprint the run
    recorded at its end, with bit-identical metrics. Prints the probability of catching one bad
    segment (K/N) and the compute spent relative to a full replay. The last two lines of stdout are
    `verdict: ...` and the audit's run id. Exit 0 all segments reproduced, 1 one did not, 2 bad input.
    """
    from harness.commands import api

    result = api.audit(api.AuditOptions(run_id, segments, seed=seed, tracking_uri=tracking_uri, on_event=_draw))
    if as_json:
        from harness.commands import documents

        _emit(documents.audit(result))
    for s in result.drawn:
        click.echo(f"segment {s.index} steps {s.start}-{s.end}: {'ok' if s.ok else 'FAILED'}"
                   f"{'' if s.ok else ' - ' + s.detail} ({s.seconds:.1f}s)")
    click.echo(f"P(catching one bad segment) = {len(result.drawn)}/{result.segments_total} = "
               f"{result.catch_probability:.2f}; compute = {result.step_fraction:.1%} of a full replay's steps")
    _verdict(f"verdict: {result.summary()}")
    click.echo(result.audit_id)
    sys.exit(result.exit_code)
