"""The commands that look into recorded runs: list them (runs, ui), compare two, close a stale one (mark), and the
tools for a suspicious run: audit, trace, bisect, verify a paper's claims."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from harness import tags as T
from harness.cli.console import draw, emit, expected_errors, say, say_verdict
from harness.cli.options import EXECUTOR, TRACKING_HELP, ExecutorOption, json_option
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
    from harness.commands.trace import TraceDiff
    from harness.errors import UsageError

    if run_a is None:
        raise UsageError("compare needs a run: pass RUN (compared with its newest replay) or RUN_A RUN_B (two runs, "
                         "or two traces).")
    found = api.compare(api.CompareOptions(run_a, run_b, tuple(tolerances), report=report, tracking_uri=tracking_uri,
                                           on_event=draw))
    if isinstance(found, TraceDiff) and report is not None:
        say(f"Report: {report}")
    if not isinstance(found, TraceDiff) and found.ui is not None:  # a judged replay carries its curves
        for line in found.ui.curves:
            say(line)
    if as_json:
        emit(documents.compare(found))
    if isinstance(found, TraceDiff):
        for line in found.lines():
            click.echo(line)
        sys.exit(1 if found.differs else 0)
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
    from harness.commands import api
    from harness.commands.trace import parse_ranks

    result = api.trace(api.TraceOptions(run_id, step, parse_ranks(ranks), tracking_uri=tracking_uri, on_event=draw))
    if result.reproduced is False:
        click.echo(f"Warning: the re-execution did not reproduce the run's record: {result.detail}", err=True)
    if as_json:
        from harness.commands import documents

        emit(documents.trace(result))
    start = "step 0" if result.from_checkpoint is None else f"the checkpoint of step {result.from_checkpoint}"
    click.echo(f"traced step {result.step} of run {result.traced} on rank{'s' if len(result.ranks) > 1 else ''} "
               f"{','.join(map(str, result.ranks))} from {start} ({result.seconds:.1f}s)")
    click.echo(result.run_id)


@click.command()
@click.argument("good")
@click.argument("bad")
@click.option("--max-probes", type=click.IntRange(min=1), default=24, show_default=True,
              help="At most this many probe replays; then it says how far the search got.")
@click.option("--localize", is_flag=True,
              help="Then trace the culprit's probe against GOOD and name the first op that differs.")
@click.option("--resume", "resume", default=None, metavar="BISECT_ID",
              help="Take up the probes of an earlier bisect of GOOD and BAD that was cut short (not run again).")
@click.option("--tracking-uri", default=None, help=TRACKING_HELP)
@json_option
@expected_errors
def bisect(good: str, bad: str, max_probes: int, localize: bool, resume: str | None, tracking_uri: str | None,
           as_json: bool) -> None:
    """Find which difference between runs GOOD and BAD flips the result: a commit between theirs, a config key.

    Each probe is a replay of GOOD, recorded and nested under one bisect run, with part of BAD's changes: the
    code of a commit on the path from GOOD's commit to BAD's (halved each time), or some of BAD's config values
    (split in halves until one alone flips it). Prints each probe, what cannot be varied on this machine, the
    culprit, and the bisect run's id as the last line. Run it inside a clone holding both commits.
    Exit 0 a culprit was found, 1 none was (said why), 2 bad input (nothing recorded).
    """
    from harness.commands import api

    result = api.bisect(api.BisectOptions(good, bad, max_probes=max_probes, tracking_uri=tracking_uri, localize=localize,
                                          resume=resume, on_event=draw))
    if as_json:
        from harness.commands import documents

        emit(documents.bisect(result))
    for line in result.lines():
        click.echo(line)
    click.echo(result.run_id)
    sys.exit(result.exit_code)


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
    from harness.commands import api, text
    from harness.fmt import text_table

    result = api.verify(api.VerifyOptions(
        claims_file, tuple(overrides), replay=do_replay, members=members, world_size=world_size,
        allow_changes=allow_changes, executor=executor, tracking_uri=tracking_uri, on_event=draw,
    ))
    say(f"Report: {result.report_path}")
    if as_json:
        from harness.commands import documents

        emit(documents.verify(result))
    click.echo(text_table(text.claims_table(result)))
    for verdict in result.verdicts:
        if verdict.typo:
            click.echo(f"Note: claim {verdict.claim.id}: {verdict.typo}")
    click.echo(f"claims: {result.held} of {len(result.verdicts)} hold")
    click.echo(result.run_id)
    sys.exit(result.exit_code)
