"""The commands that make a run: run and check it, replay it, resume it, calibrate it, and the hidden `_execute` a
container or a Slurm task runs a recorded run with."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from harness.cli.console import Voice, draw, emit, exit_with, expected_errors, say, say_verdict
from harness.cli.options import (
    EXECUTOR,
    SECRET_IN_DIFF_HELP,
    TRACKING_HELP,
    BackendCommand,
    ExecutorOption,
    json_option,
    placement_options,
)
from harness.errors import UsageError
from harness.secrets import scrub


@click.command(cls=BackendCommand, context_settings={"ignore_unknown_options": False})
@click.argument("experiment_dir", type=click.Path(path_type=Path))
@click.argument("overrides", nargs=-1, metavar="[KEY=VALUE]...")
@click.option("--require-clean", is_flag=True, help="Refuse to run when the git tree has uncommitted changes.")
@click.option("--executor", type=EXECUTOR, default=None, cls=ExecutorOption,
              help="Where the ranks run (default: `executor` in experiment.yaml).")
@placement_options
@click.option("--allow-untracked-secrets", is_flag=True,
              help="Record untracked files named like secrets (.env, *.pem, id_rsa, ...) in the code patch.")
@click.option("--allow-secret-in-diff", is_flag=True, help=SECRET_IN_DIFF_HELP)
@click.option("--tracking-uri", default=None, help=TRACKING_HELP)
@click.option("--seeds", "seeds_n", type=int, default=None,
              help="Run a study: N runs with seeds seed, seed+1, ..., seed+N-1, nested under one study run.")
@click.option("--parallel", type=int, default=None, help="A study's members run J at once (default 1).")
@click.option("--calibrate", "calibrate", is_flag=True,
              help="Once the run FINISHED, calibrate it (harness calibrate, with its defaults): its replays on other "
                   "machines can then be judged WITHIN_ROUNDING.")
@click.option("--name", default=None,
              help="The run's name in MLflow and its UI (default: the experiment's name and the id's first 8 digits).")
@click.option("--tag", "user_tags", multiple=True, metavar="KEY=VALUE",
              help="A tag of your own on the run (a study: on it and its members); not harness.* or mlflow.*. Repeatable.")
@json_option
@expected_errors
def run(
    experiment_dir: Path,
    overrides: tuple[str, ...],
    require_clean: bool,
    executor: str | None,
    allow_untracked_secrets: bool,
    allow_secret_in_diff: bool,
    tracking_uri: str | None,
    seeds_n: int | None,
    parallel: int | None,
    calibrate: bool,
    name: str | None,
    user_tags: tuple[str, ...],
    as_json: bool,
    **placement: Any,
) -> None:
    """Record and launch EXPERIMENT_DIR as DDP, with KEY=VALUE config overrides.

    Prints progress on stderr and the MLflow run id as the last line of stdout. Started by torchrun,
    it runs as the rank torchrun made it; the job is still one run. With --seeds N (or `seeds:` in the
    config) it runs a study, one run per seed, and the last line is the study's run id. A sweep over
    values (Hydra's `train.lr=0.1,0.2`) is refused: run one per value.
    Exit 0 finished (a study: every member), 1 the training failed, 2 bad input (nothing recorded),
    130 / 143 interrupted (the run is recorded KILLED).
    """
    from harness.commands import api

    outcome = api.run(api.RunOptions(
        experiment_dir, tuple(overrides), seeds=seeds_n, parallel=parallel, require_clean=require_clean,
        executor=executor, placement=api.Placement.of(placement),
        allow_untracked_secrets=allow_untracked_secrets, allow_secret_in_diff=allow_secret_in_diff,
        tracking_uri=tracking_uri, on_event=draw,
        calibrate=calibrate, name=name, tags=tuple(user_tags),
    ))
    # torchrun gathers every rank's stdout on one terminal: the job's one run id is said once, by rank 0.
    _finish("run", outcome, tracking_uri, as_json, print_id=api.speaks_for_job())


def _finish(command: str, outcome: Any, tracking_uri: str | None, as_json: bool, print_id: bool = True) -> None:
    """A run's or a study's end: its table (a study), why it ended so, the link; its id last on stdout (with
    --json its document instead)."""
    from harness.commands import documents, ui
    from harness.commands.study import StudyOutcome

    study = isinstance(outcome, StudyOutcome)
    if study and not Voice.quiet:
        click.echo(outcome.table, err=True)
    if outcome.message:
        click.echo(f"{outcome.status}: {scrub(outcome.message)}", err=True)
    if print_id or study:
        try:
            seen = ui.seen(outcome.run_id, tracking_uri)
        except Exception:
            # The run is closed already; a store busy with other commands' closes (SQLite locked) must not keep its
            # id off stdout. Without --json the id is all a script needs; with it, the document needs the summary.
            if as_json:
                raise
            say(f"{'Study' if study else 'Run'} {outcome.run_id} {outcome.status}.")
            click.echo(outcome.run_id)
            exit_with(outcome.exit_code)
        what = f"Study {outcome.run_id} {outcome.status} ({len(outcome.members)} seeds)." if study else \
            f"Run {outcome.run_id} ({seen.summary.run_name}) {outcome.status}."
        say(f"{what} {seen.ui.hint}")
        if as_json:
            emit(documents.run(command, outcome, seen.summary))
        click.echo(outcome.run_id)
    exit_with(outcome.exit_code)


@click.command()
@click.argument("experiment_dir", type=click.Path(path_type=Path))
@click.argument("overrides", nargs=-1, metavar="[KEY=VALUE]...")
@click.option("--require-clean", is_flag=True, help="Refuse when the git tree has uncommitted changes.")
@click.option("--allow-untracked-secrets", is_flag=True,
              help="Accept untracked files whose names mark them as secrets (they would be recorded).")
@click.option("--allow-secret-in-diff", is_flag=True, help=SECRET_IN_DIFF_HELP)
@click.option("--tracking-uri", default=None, help=TRACKING_HELP)
@json_option
@expected_errors
def check(
    experiment_dir: Path, overrides: tuple[str, ...], require_clean: bool, allow_untracked_secrets: bool,
    allow_secret_in_diff: bool, tracking_uri: str | None, as_json: bool,
) -> None:
    """Check EXPERIMENT_DIR and KEY=VALUE overrides as `harness run` would, without running or recording.

    Validates the config, the code record (the uncommitted changes) and the world size against this
    machine, and says when the config would run a study (`seeds:`). Exit 0 when `harness run` would start,
    2 with the reason when it would refuse.
    """
    from harness.commands import api, documents

    checked = api.check(api.CheckOptions(
        experiment_dir, tuple(overrides), require_clean=require_clean, allow_untracked_secrets=allow_untracked_secrets,
        allow_secret_in_diff=allow_secret_in_diff, tracking_uri=tracking_uri, on_event=draw,
    ))
    for warning in checked.warnings:
        click.echo(f"Warning: {scrub(warning)}", err=True)
    if checked.data_stats is not None:
        say(checked.data_stats.summary())
    if as_json:
        emit(documents.check(checked, str(experiment_dir)))
    cfg = checked.cfg
    dirty = "+uncommitted changes" if checked.git.dirty else "clean"
    study = "" if cfg.seeds is None else \
        f"; a study: {len(cfg.seeds)} runs, seeds {', '.join(map(str, cfg.seeds))}"
    click.echo(f"ok: {experiment_dir} (world_size {cfg.world_size}, seed {cfg.seed}, commit {checked.git.commit[:10]} "
               f"{dirty}{study})")


def _data_paths(pairs: tuple[str, ...]) -> dict[str, str]:
    out: dict[str, str] = {}
    for pair in pairs:
        name, sep, path = pair.partition("=")
        if not sep or not name or not path:
            raise UsageError(f"--data {pair!r} is not NAME=PATH; e.g. --data train=/data/mnist.")
        out[name] = path
    return out


@click.command(cls=BackendCommand)
@click.argument("run_id")
@click.argument("overrides", nargs=-1, metavar="[KEY=VALUE]...")
@click.option("--world-size", type=click.IntRange(min=1), default=None, help="Replay with another number of ranks.")
@click.option("--allow-changes", is_flag=True,
              help="Replay with the KEY=VALUE overrides given after RUN_ID (a flag: `harness replay RUN_ID "
                   "train.lr=0.1 --allow-changes`); recorded and reported as changes.")
@click.option("--allow-data-changes", is_flag=True,
              help="Replay although the declared data no longer hashes as recorded (reported; never BITWISE).")
@click.option("--data", "data_paths", multiple=True, metavar="NAME=PATH",
              help="Read declared data NAME from PATH on this machine (e.g. where `harness import` put it). Repeatable.")
@click.option("--executor", type=EXECUTOR, default=None, cls=ExecutorOption,
              help="Where the replay runs (default: as recorded).")
@placement_options
@click.option("--allow-incomplete", is_flag=True,
              help="Replay a FAILED or KILLED run and compare only the steps it reached.")
@click.option("--no-follow", is_flag=True,
              help="Replay a replay or audit run itself, not the original it was made from.")
@click.option("--members", type=int, default=None,
              help="A study: replay K of its members, drawn at random (the draw's seed is recorded).")
@click.option("--members-seed", type=click.IntRange(min=0), default=None,
              help="A study with --members: the seed of the draw (to repeat an earlier one).")
@click.option("--tolerance", "tolerances", multiple=True, metavar="METRIC=ATOL[,RTOL]",
              help="Judge METRIC with this tolerance instead of the recorded replay.tolerance (recorded). Repeatable. "
                   "METRIC=inf leaves METRIC unjudged (a wall clock: train_runtime=inf). "
                   "weights=any lets the metrics decide where the parameters' fingerprints differ.")
@click.option("--localize/--no-localize", default=None,
              help="When the replay DIVERGES, trace its first divergent step and name the first differing op "
                   "(default: only when the run has checkpoints).")
@click.option("--steps", type=int, default=None, metavar="K",
              help="A first check before a full replay: train only the first K steps, stop there, and judge those "
                   "(the weights only where the original checkpointed step K). Recorded as harness.replay.steps.")
@click.option("--tracking-uri", default=None, help=TRACKING_HELP)
@json_option
@expected_errors
def replay(
    run_id: str,
    overrides: tuple[str, ...],
    world_size: int | None,
    allow_changes: bool,
    allow_data_changes: bool,
    data_paths: tuple[str, ...],
    executor: str | None,
    allow_incomplete: bool,
    no_follow: bool,
    members: int | None,
    members_seed: int | None,
    localize: bool | None,
    tolerances: tuple[str, ...],
    steps: int | None,
    tracking_uri: str | None,
    as_json: bool,
    **placement: Any,
) -> None:
    """Rerun RUN_ID exactly as recorded and say whether it reproduced.

    RUN_ID may be a study (harness run --seeds N): every member is replayed (or --members K of
    them) and judged together against the seeds' noise.

    The recorded commit (and patch) is checked out in a temporary git worktree; the recorded
    config, seed, world size and determinism settings are used. The replay is a new MLflow run
    nested under the original, with a report and plots (original and replay overlaid: stderr says
    where they are, and their page in the MLflow UI while one serves the store). The last two lines of stdout are
    `verdict: ...` and the replay's run id. Exit 0 reproduced, 1 diverged, inconclusive or nothing to compare,
    2 bad input (also a FAILED, KILLED or RUNNING run without --allow-incomplete).
    """
    from harness.commands import api, documents, text
    from harness.commands.replay import StudyReplayResult

    result = api.replay(api.ReplayOptions(
        run_id, tuple(overrides), world_size=world_size, allow_changes=allow_changes,
        allow_data_changes=allow_data_changes, data_paths=_data_paths(data_paths), executor=executor,
        placement=api.Placement.of(placement), allow_incomplete=allow_incomplete, follow=not no_follow,
        members=members, members_seed=members_seed, localize=localize, tolerances=tuple(tolerances),
        steps=steps, tracking_uri=tracking_uri, on_event=draw,
    ))
    if as_json and result.ui is not None:  # judged here: a study replay, or a replay this node judged
        say(result.ui.hint)
        emit(documents.replay(result))
    if isinstance(result, StudyReplayResult):
        *lines, verdict = text.replay_lines(result)
        for line in lines:
            click.echo(line)
        say_verdict(verdict)
        click.echo(result.run_id)
        sys.exit(result.exit_code)
    if result.comparison is None:  # another node of a multi-node replay: node 0 judges and records the verdict
        click.echo(f"Replay {result.outcome.run_id} {result.outcome.status} on this node; node 0 judges it.", err=True)
        if as_json:
            emit(documents.replay(result))
        click.echo(result.outcome.run_id)
        exit_with(result.outcome.exit_code)
    *lines, verdict = text.replay_lines(result)
    for line in lines:
        click.echo(line)
    if result.ui is not None:
        for line in (result.ui.hint, *result.ui.curves):
            say(line)
    say_verdict(verdict)
    click.echo(result.outcome.run_id)
    sys.exit(result.comparison.exit_code)


@click.command()
@click.argument("run_id")
@click.option("--tracking-uri", default=None, help=TRACKING_HELP)
@json_option
@expected_errors
def resume(run_id: str, tracking_uri: str | None, as_json: bool) -> None:
    """Continue a FAILED or KILLED run from its last complete checkpoint, in the same MLflow run.

    Uses the recorded code, config and environment like replay; metrics continue at their steps.
    Needs `checkpoint_every` > 0 in the run's config. The run's id is the last line of stdout.
    Exit 0 finished, 1 the training failed again, 2 refused (a FINISHED or RUNNING run, no complete
    checkpoint, or a re-execution that does not land on what the run recorded: said why), 130 / 143
    interrupted.
    """
    from harness.commands import api

    _finish("resume", api.resume(api.ResumeOptions(run_id, tracking_uri=tracking_uri, on_event=draw)), tracking_uri,
            as_json)


@click.command()
@click.argument("run_id")
@click.argument("overrides", nargs=-1, metavar="[KEY=VALUE]...")
@click.option("--members", "-k", type=int, default=None,
              help="How many nudged re-executions (default 8, at most 32).")
@click.option("--steps", "-m", type=int, default=None,
              help="How many first steps each re-executes (default: 50, or the run's steps when fewer).")
@click.option("--tracking-uri", default=None, help=TRACKING_HELP)
@json_option
@expected_errors
def calibrate(run_id: str, overrides: tuple[str, ...], members: int | None, steps: int | None,
              tracking_uri: str | None, as_json: bool) -> None:
    """Measure the rounding envelope of a FINISHED run's first steps, for WITHIN_ROUNDING verdicts.

    K members replay the run's first M steps as recorded (commit, config, seed, data, image), each with every
    weight nudged by up to 256 float32 ulps and on its share of this machine's other CPU kernels: how far they land
    from the run, in every logged value and in their weights after step M, is how far rounding alone carries it. The run itself
    is re-executed once more, unnudged, as the reference. A later replay that is not bit-identical (another CPU's or
    GPU's kernels) is judged against that envelope step by step and on its weights after step M: WITHIN_ROUNDING,
    or DIVERGED at the first step outside it. Costs (K + 1) x M training steps (said first), run one after another
    by one set of ranks under one progress bar; a short table of the envelope ends it. RUN_ID may be a replay
    or an audit: the run it was made from is calibrated. KEY=VALUE gives back a secret the record hides, as to
    `harness replay` (no other change is taken). The last line of stdout is the calibration run's id. Exit 0
    calibrated, 1 a member failed (or the store failed once the calibration was recorded: said what it left), 2 bad
    input (nothing recorded).
    """
    from harness.commands import api

    done = api.calibrate(api.CalibrateOptions(run_id, members=members, steps=steps, overrides=tuple(overrides),
                                              tracking_uri=tracking_uri, on_event=draw))
    if as_json:
        from harness.commands import documents

        emit(documents.calibrate(done))
    click.echo(done.table())
    click.echo(done.calibration_id)


@click.command(name="_execute", hidden=True)
@click.argument("run_id")
@click.option("--code-dir", type=click.Path(path_type=Path), required=True)
@click.option("--resume-step", type=int, default=None)
@click.option("--tracking-uri", default=None, help=TRACKING_HELP)
@expected_errors
def execute(run_id: str, code_dir: Path, resume_step: int | None, tracking_uri: str | None) -> None:
    """Run an already recorded run where this command runs (inside a container, or a Slurm job's task)."""
    from harness.commands import backends

    outcome = backends.execute(run_id, code_dir, tracking_uri, resume_step)
    if outcome.message:
        click.echo(f"{outcome.status}: {scrub(outcome.message)}", err=True)
    sys.exit(outcome.exit_code)
