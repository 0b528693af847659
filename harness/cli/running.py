"""The `harness` command line: parse, call the library, print. torch and mlflow load only when needed."""

from __future__ import annotations

import functools
import os
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import click

from harness import events, tags as T
from harness.cli import progress
from harness.cli.help import OrderedGroup, teach
from harness.errors import EXIT_SIGINT, HarnessError, UsageError
from harness.secrets import scrub

_TRACKING_HELP = "MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite:///./mlruns/mlflow.db)."
_JSON_HELP = ("Print the result as one JSON document on stdout, and nothing else there (a refusal too: its `error`); "
              "the keys are in docs/json.md.")


class _Voice:
    """How much the CLI says on stderr (the global --quiet / --verbose); stdout carries only results either way."""

    quiet = False  # only warnings and errors: no notices, progress or links (the job's own output neither)
    verbose = False  # an error's traceback too, after its one line


class _Drawer:
    """The listener the commands get: an event from the library drawn on stderr: the ranks' steps as a bar, rank 0's
    output as it printed it, any other event as the line it says (above the bar while there is one). With --quiet
    only the warnings."""

    def __init__(self) -> None:
        self._bar = progress.Bar()

    def __call__(self, event: events.Event) -> None:
        if _Voice.quiet and not isinstance(event, events.Warning):
            return
        if isinstance(event, events.Steps):
            self._bar.steps(event)
        elif isinstance(event, events.RankOutput):
            self._bar.write(event.text)  # the user's own output, as rank 0's log has it
        else:
            self._bar.write(scrub(event.line()))


_draw = _Drawer()


def _say(line: str) -> None:
    """A line of the CLI's own for the user (a link, where a report went), on stderr; --quiet leaves it out."""
    if not _Voice.quiet:
        click.echo(line, err=True)


def _json_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("--json", "as_json", is_flag=True, help=_JSON_HELP)(fn)


def _emit(doc: dict[str, Any]) -> NoReturn:
    """A command's JSON document (harness/commands/documents.py) on stdout, then its exit code."""
    from harness.commands import documents

    click.echo(scrub(documents.dumps(doc)))  # the same scrubber as every line: a reason may quote outside text
    _exit(doc["exit_code"])


def _refused(message: str, exit_code: int, as_json: bool) -> NoReturn:
    """An expected failure: its one line on stderr (and with --json its document on stdout); --verbose adds the
    traceback."""
    if _Voice.verbose:
        import traceback

        click.echo(traceback.format_exc().rstrip(), err=True)
    message = scrub(message)  # outside text (an MLflow exception, a URL) may carry a password
    click.echo(f"Error: {message}", err=True)
    if as_json:
        from harness.commands import documents

        click.echo(documents.dumps(documents.error(click.get_current_context().command.name or "", exit_code, message)))
    _exit(exit_code)


def _expected_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """HarnessError -> `Error: ...` on one line and its exit code; no traceback.

    A tracking-store failure that got past the Tracker (MLflow, SQLAlchemy or HTTP) is one line too:
    it is the store failing, not a bug to show a traceback for.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        as_json = bool(kwargs.get("as_json"))
        try:
            with events.listening(_draw):  # what the library says on its way, on stderr
                return fn(*args, **kwargs)
        except HarnessError as err:
            _refused(str(err), err.exit_code, as_json)
        except Exception as err:
            from harness.commands.terminal import is_store_error, resolve_uri, store_failure

            if not is_store_error(err):
                raise
            failure = store_failure(err, resolve_uri(kwargs.get("tracking_uri")))
            _refused(str(failure), failure.exit_code, as_json)

    return wrapper


def _exit(code: int) -> NoReturn:
    """Exit with `code`. torchrun stops every other rank the moment one exits: a rank that has said why it
    stops keeps its own exit code rather than dying of that SIGTERM on its way out."""
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        import signal

        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit(code)


@click.group(cls=OrderedGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="ddp-harness")
@click.option("-q", "--quiet", is_flag=True,
              help="Say only warnings and errors on stderr: no progress, rank output, notices or links.")
@click.option("-v", "--verbose", is_flag=True, help="With an error, also print its traceback (for a bug report).")
def main(quiet: bool, verbose: bool) -> None:
    """Run PyTorch DDP experiments so that they can be replayed and judged bit for bit.

    A run id may be given as a unique prefix of at least 6 of its hex digits (`harness replay 1a2b3c4d`).
    Every command that prints a result takes --json: one JSON document on stdout (docs/json.md).

    Exit codes: 0 success / reproduced, 1 training failed / diverged / nothing to compare, 2 bad input,
    130 interrupted (SIGINT), 143 terminated (SIGTERM).
    """
    if quiet and verbose:
        raise click.UsageError("--quiet and --verbose contradict each other; pass one.")
    _Voice.quiet, _Voice.verbose = quiet, verbose


class _ExecutorName(click.ParamType):
    """--executor NAME: any registered backend. Listed from the registry only when help is shown; an unknown name
    is refused by the command in one line (click's own refusal is a usage block)."""

    name = "executor"

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        from harness.commands.placement import backends

        return "[" + "|".join(backends()) + "]"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        return str(value)


_EXECUTOR = _ExecutorName()


class _ExecutorOption(click.Option):
    """--executor: its help ends with every registered backend's own line (Backend.help), read from the registry
    only when the help is shown (so that a command that runs no job never loads the backends)."""

    def get_help_record(self, ctx: click.Context) -> tuple[str, str] | None:
        from harness.commands.placement import backends

        own = self.help or ""
        self.help = own + " " + "; ".join(f"{name}: {b.help}" for name, b in backends().items() if b.help) + "."
        try:
            return super().get_help_record(ctx)
        finally:
            self.help = own


class _BackendCommand(click.Command):
    """A command that takes the backends' own options (harness/executors: each backend declares its CliOptions).

    They are made into click options when the command is first parsed or its help shown, so that the commands
    that run no job (`harness runs`, `compare`) never load the backends; they follow the placement options.
    """

    def get_params(self, ctx: click.Context) -> list[click.Parameter]:
        if not getattr(self, "_backend_options", False):
            self._backend_options = True
            at = next(i for i, p in enumerate(self.params) if p.name == "master_port") + 1
            self.params[at:at] = _backend_click_options(self.name or "")
        return super().get_params(ctx)


def _backend_click_options(command: str) -> list[click.Parameter]:
    from harness.commands.placement import backends

    made: list[click.Parameter] = []
    for declared in backends().values():
        for opt in declared.cli:
            if command not in opt.commands:
                continue
            if opt.type is bool:
                made.append(click.Option([opt.flag, opt.dest], is_flag=True, default=None, help=opt.help))
            elif opt.type is int:
                made.append(click.Option([opt.flag, opt.dest], type=click.IntRange(min=opt.min), default=None,
                                         help=opt.help))
            else:
                made.append(click.Option([opt.flag, opt.dest], type=opt.type, default=None, help=opt.help))
    return made


def _placement_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Where the job runs: its nodes (shared by run and replay); the backends' own options follow (_BackendCommand)."""
    options = [
        click.option("--nnodes", type=click.IntRange(min=1), default=None,
                     help="Nodes of a multi-node job; run the same command on each with its --node-rank."),
        click.option("--node-rank", type=click.IntRange(min=0), default=None, help="This node's rank (0 records the run)."),
        click.option("--master-addr", default=None, help="Node 0's address, reachable from every node."),
        click.option("--master-port", type=click.IntRange(1, 65535), default=None,
                     help="A free TCP port on node 0 for the job's rendezvous."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


@main.command(cls=_BackendCommand, context_settings={"ignore_unknown_options": False})
@click.argument("experiment_dir", type=click.Path(path_type=Path))
@click.argument("overrides", nargs=-1)
@click.option("--require-clean", is_flag=True, help="Refuse to run when the git tree has uncommitted changes.")
@click.option("--executor", type=_EXECUTOR, default=None, cls=_ExecutorOption,
              help="Where the ranks run (default: `executor` in experiment.yaml).")
@_placement_options
@click.option("--allow-untracked-secrets", is_flag=True,
              help="Record untracked files named like secrets (.env, *.pem, id_rsa, ...) in the code patch.")
@click.option("--allow-secret-in-diff", is_flag=True,
              help="Record uncommitted changes that hold a secret (a token, a password assigned a literal, a URL's "
                   "password) with each such secret cut from the stored patch; the run is tagged "
                   "harness.git.patch_redacted and a replay warns that its code is not exact there.")
@click.option("--tracking-uri", default=None, help=_TRACKING_HELP)
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
@_json_option
@_expected_errors
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
        tracking_uri=tracking_uri, on_event=_draw,
        calibrate=calibrate, name=name, tags=tuple(user_tags),
    ))
    # torchrun gathers every rank's stdout on one terminal: the job's one run id is said once, by rank 0.
    _finish("run", outcome, tracking_uri, as_json, print_id=api.speaks_for_job())


def _finish(command: str, outcome: Any, tracking_uri: str | None, as_json: bool, print_id: bool = True) -> None:
    """A run's or a study's end: its table (a study), why it ended so, the link; its id last on stdout (with
    --json its document instead)."""
    from harness.commands import documents
    from harness.commands.study import StudyOutcome
    from harness.commands.terminal import Tracker

    study = isinstance(outcome, StudyOutcome)
    if study and not _Voice.quiet:
        click.echo(outcome.table, err=True)
    if outcome.message:
        click.echo(f"{outcome.status}: {scrub(outcome.message)}", err=True)
    if print_id or study:
        tracker = Tracker(tracking_uri)
        summary = tracker.get_run(outcome.run_id)
        what = f"Study {outcome.run_id} {outcome.status} ({len(outcome.members)} seeds)." if study else \
            f"Run {outcome.run_id} ({summary.run_name}) {outcome.status}."
        _say(f"{what} {tracker.ui_hint(summary)}")
        if as_json:
            _emit(documents.run(command, outcome, summary))
        click.echo(outcome.run_id)
    _exit(outcome.exit_code)


@main.command()
@click.argument("experiment_dir", type=click.Path(path_type=Path))
@click.argument("overrides", nargs=-1)
@click.option("--require-clean", is_flag=True, help="Refuse when the git tree has uncommitted changes.")
@click.option("--allow-untracked-secrets", is_flag=True,
              help="Accept untracked files whose names mark them as secrets (they would be recorded).")
@click.option("--allow-secret-in-diff", is_flag=True,
              help="Record uncommitted changes that hold a secret (a token, a password assigned a literal, a URL's "
                   "password) with each such secret cut from the stored patch; the run is tagged "
                   "harness.git.patch_redacted and a replay warns that its code is not exact there.")
@click.option("--tracking-uri", default=None, help=_TRACKING_HELP)
@_json_option
@_expected_errors
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
        allow_secret_in_diff=allow_secret_in_diff, tracking_uri=tracking_uri, on_event=_draw,
    ))
    for warning in checked.warnings:
        click.echo(f"Warning: {scrub(warning)}", err=True)
    if checked.data_stats is not None:
        _say(checked.data_stats.summary())
    if as_json:
        _emit(documents.check(checked, str(experiment_dir)))
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


@main.command(cls=_BackendCommand)
@click.argument("run_id")
@click.argument("overrides", nargs=-1)
@click.option("--world-size", type=click.IntRange(min=1), default=None, help="Replay with another number of ranks.")
@click.option("--allow-changes", is_flag=True, help="Accept KEY=VALUE overrides of the recorded config.")
@click.option("--allow-data-changes", is_flag=True,
              help="Replay although the declared data no longer hashes as recorded (reported; never BITWISE).")
@click.option("--data", "data_paths", multiple=True, metavar="NAME=PATH",
              help="Read declared data NAME from PATH on this machine (e.g. where `harness import` put it). Repeatable.")
@click.option("--executor", type=_EXECUTOR, default=None, cls=_ExecutorOption,
              help="Where the replay runs (default: as recorded).")
@_placement_options
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
                   "weights=any lets the metrics decide where the parameters' fingerprints differ.")
@click.option("--localize/--no-localize", default=None,
              help="When the replay DIVERGES, trace its first divergent step and name the first differing op "
                   "(default: only when the run has checkpoints).")
@click.option("--steps", type=int, default=None, metavar="K",
              help="A first check before a full replay: train only the first K steps, stop there, and judge those "
                   "(the weights only where the original checkpointed step K). Recorded as harness.replay.steps.")
@click.option("--tracking-uri", default=None, help=_TRACKING_HELP)
@_json_option
@_expected_errors
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
    nested under the original, with a report and plots. The last two lines of stdout are
    `verdict: ...` and the replay's run id. Exit 0 reproduced, 1 diverged, inconclusive or nothing to compare,
    2 bad input (also a FAILED, KILLED or RUNNING run without --allow-incomplete).
    """
    from harness.commands import api, documents
    from harness.commands.replay import StudyReplayResult
    from harness.commands.terminal import Tracker, comparison_lines, study_replay_lines, verdict_line

    result = api.replay(api.ReplayOptions(
        run_id, tuple(overrides), world_size=world_size, allow_changes=allow_changes,
        allow_data_changes=allow_data_changes, data_paths=_data_paths(data_paths), executor=executor,
        placement=api.Placement.of(placement), allow_incomplete=allow_incomplete, follow=not no_follow,
        members=members, members_seed=members_seed, localize=localize, tolerances=tuple(tolerances),
        steps=steps, tracking_uri=tracking_uri, on_event=_draw,
    ))
    if as_json and (isinstance(result, StudyReplayResult) or result.comparison is not None):
        _say(Tracker(tracking_uri).ui_hint(result.run_id if isinstance(result, StudyReplayResult) else result.outcome.run_id))
        _emit(documents.replay(result))
    if isinstance(result, StudyReplayResult):
        for line in study_replay_lines(result):
            click.echo(line)
        click.echo(result.run_id)
        sys.exit(result.exit_code)
    if result.comparison is None:  # another node of a multi-node replay: node 0 judges and records the verdict
        click.echo(f"Replay {result.outcome.run_id} {result.outcome.status} on this node; node 0 judges it.", err=True)
        if as_json:
            _emit(documents.replay(result))
        click.echo(result.outcome.run_id)
        _exit(result.outcome.exit_code)
    for line in comparison_lines(result.comparison, result.changes):
        click.echo(line)
    for line in result.localized.lines() if result.localized is not None else []:
        click.echo(line)
    _say(Tracker(tracking_uri).ui_hint(result.outcome.run_id))
    click.echo(verdict_line(result.comparison))
    click.echo(result.outcome.run_id)
    sys.exit(result.comparison.exit_code)


@main.command()
@click.argument("good")
@click.argument("bad")
@click.option("--max-probes", type=click.IntRange(min=1), default=24, show_default=True,
              help="At most this many probe replays; then it says how far the search got.")
@click.option("--localize", is_flag=True,
              help="Then trace the culprit's probe against GOOD and name the first op that differs.")
@click.option("--resume", "resume", default=None, metavar="BISECT_ID",
              help="Take up the probes of an earlier bisect of GOOD and BAD that was cut short (not run again).")
@click.option("--tracking-uri", default=None, help=_TRACKING_HELP)
@_json_option
@_expected_errors
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
                                          resume=resume, on_event=_draw))
    if as_json:
        from harness.commands import documents

        _emit(documents.bisect(result))
    for line in result.lines():
        click.echo(line)
    click.echo(result.run_id)
    sys.exit(result.exit_code)


@main.command()
@click.argument("claims_file", type=click.Path(path_type=Path))
@click.argument("overrides", nargs=-1)
@click.option("--replay", "do_replay", is_flag=True,
              help="Replay each study or run the claims rest on (once) and judge the claims on the replays.")
@click.option("--members", type=click.IntRange(min=1), default=None, help="--replay: replay K members of each study (default: all).")
@click.option("--world-size", type=click.IntRange(min=1), default=None, help="--replay: replay with another number of ranks.")
@click.option("--allow-changes", is_flag=True, help="--replay: accept KEY=VALUE overrides of the recorded config.")
@click.option("--executor", type=_EXECUTOR, default=None, cls=_ExecutorOption,
              help="--replay: where the replays run (default: as recorded).")
@click.option("--tracking-uri", default=None, help=_TRACKING_HELP)
@_json_option
@_expected_errors
def verify(claims_file: Path, overrides: tuple[str, ...], do_replay: bool, members: int | None, world_size: int | None,
           allow_changes: bool, executor: str | None, tracking_uri: str | None, as_json: bool) -> None:
    """Check a paper's claims (CLAIMS_FILE) against the recorded studies and runs, optionally replaying them.

    Each claim's printed number must be what its runs produced, rounded as printed (HOLDS), or a mean
    within the seeds' noise (WITHIN_NOISE), else MISPRINTED; with --replay its replay must reproduce
    it (BITWISE, WITHIN_ROUNDING, WITHIN_TOLERANCE or WITHIN_NOISE). Prints the claims table,
    `claims: H of N hold`, and the verify run's id as the last line; the report's path on stderr.
    Exit 0 every claim holds, 1 one does not, 2 bad input (nothing recorded).
    """
    from harness.commands import api
    from harness.commands.terminal import CLAIMS_HEADER, claims_rows
    from harness.fmt import text_table

    result = api.verify(api.VerifyOptions(
        claims_file, tuple(overrides), replay=do_replay, members=members, world_size=world_size,
        allow_changes=allow_changes, executor=executor, tracking_uri=tracking_uri, on_event=_draw,
    ))
    _say(f"Report: {result.report_path}")
    if as_json:
        from harness.commands import documents

        _emit(documents.verify(result))
    click.echo(text_table([CLAIMS_HEADER, *claims_rows(result.verdicts, result.replayed)]))
    for verdict in result.verdicts:
        if verdict.typo:
            click.echo(f"Note: claim {verdict.claim.id}: {verdict.typo}")
    click.echo(f"claims: {result.held} of {len(result.verdicts)} hold")
    click.echo(result.run_id)
    sys.exit(result.exit_code)


@main.command()
@click.argument("run_a")
@click.argument("run_b")
@click.option("--report", "report", type=click.Path(path_type=Path), default=None,
              help="Two traces: also write the localization report to PATH (HTML if it ends in .html, else markdown).")
@click.option("--tolerance", "tolerances", multiple=True, metavar="METRIC=ATOL[,RTOL]",
              help="Judge METRIC with this tolerance instead of the recorded replay.tolerance. Repeatable. "
                   "weights=any lets the metrics decide where the parameters' fingerprints differ.")
@click.option("--tracking-uri", default=None, help=_TRACKING_HELP)
@_json_option
@_expected_errors
def compare(run_a: str, run_b: str, report: Path | None, tolerances: tuple[str, ...], tracking_uri: str | None,
            as_json: bool) -> None:
    """Compare two existing runs (any experiments): environment delta and verdict, no rerun.

    RUN_A is the reference; its tolerance applies (RUN_B a replay of it: the replay's, with the
    --tolerance it was given), then --tolerance. Exit 0 reproduced, 1 diverged, 2 bad input.
    Two trace runs (harness trace): the first op whose output differs while its inputs were equal,
    with its module, shapes, dtypes, the user's line and a likely cause; nothing is recorded.
    Exit 0 identical, 1 they differ.
    """
    from harness.commands import api, documents
    from harness.commands.terminal import comparison_lines, verdict_line
    from harness.commands.trace import TraceDiff

    found = api.compare(api.CompareOptions(run_a, run_b, tuple(tolerances), report=report, tracking_uri=tracking_uri,
                                           on_event=_draw))
    if isinstance(found, TraceDiff) and report is not None:
        _say(f"Report: {report}")
    if as_json:
        _emit(documents.compare(found))
    if isinstance(found, TraceDiff):
        for line in found.lines():
            click.echo(line)
        sys.exit(1 if found.differs else 0)
    for line in comparison_lines(found, []):
        click.echo(line)
    click.echo(verdict_line(found))
    sys.exit(found.exit_code)


@main.command()
@click.argument("run_id")
@click.option("--tracking-uri", default=None, help=_TRACKING_HELP)
@_json_option
@_expected_errors
def resume(run_id: str, tracking_uri: str | None, as_json: bool) -> None:
    """Continue a FAILED or KILLED run from its last complete checkpoint, in the same MLflow run.

    Uses the recorded code, config and environment like replay; metrics continue at their steps.
    Needs `checkpoint_every` > 0 in the run's config. The run's id is the last line of stdout.
    Exit 0 finished, 1 the training failed again, 2 refused (a FINISHED or RUNNING run, no complete
    checkpoint, or a re-execution that does not land on what the run recorded: said why), 130 / 143
    interrupted.
    """
    from harness.commands import api

    _finish("resume", api.resume(api.ResumeOptions(run_id, tracking_uri=tracking_uri, on_event=_draw)), tracking_uri,
            as_json)


@main.command()
@click.argument("run_id")
@click.option("--members", "-k", type=int, default=None,
              help="How many nudged re-executions (default 8, at most 32).")
@click.option("--steps", "-m", type=int, default=None,
              help="How many first steps each re-executes (default: 20, or the run's steps when fewer).")
@click.option("--tracking-uri", default=None, help=_TRACKING_HELP)
@_json_option
@_expected_errors
def calibrate(run_id: str, members: int | None, steps: int | None, tracking_uri: str | None, as_json: bool) -> None:
    """Measure the rounding envelope of a FINISHED run's first steps, for WITHIN_ROUNDING verdicts.

    K members replay the run's first M steps as recorded (commit, config, seed, data, image), each with every
    weight nudged by one ulp: how far they land from the run is how far rounding alone carries it. A later replay
    that is not bit-identical (another CPU's or GPU's kernels) is judged against that envelope step by step:
    WITHIN_ROUNDING, or DIVERGED at the first step outside it. Costs K x M training steps (said first). The last
    line of stdout is the calibration run's id. Exit 0 calibrated, 1 a member failed, 2 bad input.
    """
    from harness.commands import api

    done = api.calibrate(api.CalibrateOptions(run_id, members=members, steps=steps, tracking_uri=tracking_uri,
                                              on_event=_draw))
    if as_json:
        from harness.commands import documents

        _emit(documents.calibrate(done))
    click.echo(done.summary())
    click.echo(done.calibration_id)


@main.command()
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
    click.echo(f"verdict: {result.summary()}")
    click.echo(result.audit_id)
    sys.exit(result.exit_code)


@main.command()
@click.argument("run_id")
@click.option("--step", type=click.IntRange(min=0), required=True, help="The training step to trace (0-based).")
@click.option("--ranks", default="0", show_default=True, help="The ranks to trace, separated by commas.")
@click.option("--tracking-uri", default=None, help=_TRACKING_HELP)
@_json_option
@_expected_errors
def trace(run_id: str, step: int, ranks: str, tracking_uri: str | None, as_json: bool) -> None:
    """Trace every op of step STEP of RUN_ID: name, module, input/output tensor hashes, the user's line.

    Restarts from the run's checkpoint at or before STEP (else from step 0), re-executes up to STEP
    with the recorded code and config, and records the trace as a run nested under RUN_ID (artifacts
    trace/rank<R>.jsonl.gz). Compare two traces with `harness compare TRACE_A TRACE_B`. Prints the
    trace run's id as the last line. Exit 0 traced, 1 the ranks failed, 2 bad input (nothing recorded).
    """
    from harness.commands import api
    from harness.commands.trace import parse_ranks

    result = api.trace(api.TraceOptions(run_id, step, parse_ranks(ranks), tracking_uri=tracking_uri, on_event=_draw))
    if result.reproduced is False:
        click.echo(f"Warning: the re-execution did not reproduce the run's record: {result.detail}", err=True)
    if as_json:
        from harness.commands import documents

        _emit(documents.trace(result))
    start = "step 0" if result.from_checkpoint is None else f"the checkpoint of step {result.from_checkpoint}"
    click.echo(f"traced step {result.step} of run {result.traced} on rank{'s' if len(result.ranks) > 1 else ''} "
               f"{','.join(map(str, result.ranks))} from {start} ({result.seconds:.1f}s)")
    click.echo(result.run_id)


@main.command(name="export")
@click.argument("run_id")
@click.option("-o", "--output", type=click.Path(path_type=Path), required=True, help="The bundle to write (.tar.gz).")
@click.option("--with-checkpoints", is_flag=True, help="Include the run's checkpoints (left out by default: big).")
@click.option("--with-image", is_flag=True, help="Include the pinned image (docker save); import loads it.")
@click.option("--with-data", is_flag=True,
              help="Include the declared data's files, checked against their recorded sha256 (left out by default).")
@click.option("--sign", "sign_key", type=click.Path(path_type=Path), default=None,
              help="An ed25519 private key (PEM): also write OUTPUT.intoto.json, a signed attestation of the run.")
@click.option("--tracking-uri", default=None, help=_TRACKING_HELP)
@_json_option
@_expected_errors
def export_(run_id: str, output: Path, with_checkpoints: bool, with_image: bool, with_data: bool,
            sign_key: Path | None, tracking_uri: str | None, as_json: bool) -> None:
    """Write RUN_ID, its code and its replays to one portable bundle.

    The bundle holds the run's record (params, tags, every metric write with its step and timestamp,
    artifacts), a git bundle of the recorded commit, the replays of the run, and a manifest with the
    sha256 of every member. Run it inside a clone that has the recorded commit. Exit 0 written, 2 bad input
    (nothing written).
    """
    from harness.commands import api, documents

    result = api.export(api.ExportOptions(run_id, output, with_checkpoints=with_checkpoints, with_image=with_image,
                                          with_data=with_data, sign_key=sign_key, tracking_uri=tracking_uri,
                                          on_event=_draw))
    image = f", image {result.image}" if result.image else ""
    _say(f"Exported run {result.run_id} ({len(result.replays)} replays{image}): {result.members} files, "
         f"{result.size} bytes.")
    if result.signed is not None:
        _say(f"Signed attestation: {result.signed}")
    if as_json:
        _emit(documents.export(result, None if result.signed is None else str(result.signed)))
    click.echo(str(result.path))


@main.command()
@click.argument("run_id")
@click.option("--key", type=click.Path(path_type=Path), required=True, help="The ed25519 private key (PEM) to sign with.")
@click.option("-o", "--output", type=click.Path(path_type=Path), required=True, help="The attestation to write (.json).")
@click.option("--tracking-uri", default=None, help=_TRACKING_HELP)
@_json_option
@_expected_errors
def attest(run_id: str, key: Path, output: Path, tracking_uri: str | None, as_json: bool) -> None:
    """Sign an attestation of sealed run RUN_ID with a key the store does not hold.

    The attestation is an in-toto Statement (subject: the final weights' digest, harness.fingerprint;
    predicate: the run's id, status, seal and commit) in a DSSE envelope signed with ed25519. Check it with
    `harness verify-record RUN_ID --attestation FILE --key PUBLIC.pem`. Exit 0 written, 2 bad input (an edited
    or unsealed run, no final weights, a key that is not ed25519).
    """
    from harness.commands import api, documents

    done = api.attest(api.AttestOptions(run_id, key, output, tracking_uri=tracking_uri, on_event=_draw))
    if as_json:
        _emit(documents.attest(done.run_id, str(done.path)))
    click.echo(str(done.path))


@main.command(name="verify-record")
@click.argument("run_id")
@click.option("--attestation", type=click.Path(path_type=Path), required=True, help="From `harness attest` or `export --sign`.")
@click.option("--key", type=click.Path(path_type=Path), required=True, help="The signer's ed25519 public key (PEM).")
@click.option("--tracking-uri", default=None, help=_TRACKING_HELP)
@_json_option
@_expected_errors
def verify_record(run_id: str, attestation: Path, key: Path, tracking_uri: str | None, as_json: bool) -> None:
    """Check that RUN_ID is the run an attestation signed by KEY attests, and unchanged since.

    The signature must verify with KEY, the run's seal must hold and be the attested one (an imported copy of
    the attested run: its seal must hold), and its final weights' digest must be the attested subject. Exit 0
    holds, 2 refused (one line saying which check failed).
    """
    from harness.commands import api, documents

    held = api.verify_record(api.VerifyRecordOptions(run_id, attestation, key, tracking_uri=tracking_uri,
                                                     on_event=_draw))
    run_id, doc = held.run_id, held.statement
    if as_json:
        _emit(documents.verify_record(run_id, doc))
    click.echo(f"Run {run_id} is the attested run {doc['predicate']['run_id']}, unchanged: final weights sha256 "
               f"{doc['subject'][0]['digest']['sha256']}.")


@main.command(name="import")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--data-dir", type=click.Path(path_type=Path), default=None,
              help="Where the bundle's declared data goes (default ./harness-data/ORIGINAL_RUN_ID).")
@click.option("--tracking-uri", default=None, help=_TRACKING_HELP)
@_json_option
@_expected_errors
def import_(bundle: Path, data_dir: Path | None, tracking_uri: str | None, as_json: bool) -> None:
    """Verify BUNDLE (from `harness export`) and import its run and replays into this store.

    Every member is checked against the manifest before anything is written: a bundle with an altered
    or unlisted member, an absolute or `..` name, a link, device or fifo, a member larger than listed,
    or a newer format is refused whole. The run keeps its original id as the tag harness.imported_from,
    its metrics, steps and timestamps; `harness replay` then takes its code from the bundled commit.
    An image in the bundle is loaded into the local engine. Importing the same run again writes nothing.
    Prints the run id in this store as the last line. Exit 0 imported or already there, 2 refused.
    """
    from harness.commands import api, documents

    result = api.import_(api.ImportOptions(bundle, data_dir=data_dir, tracking_uri=tracking_uri, on_event=_draw))
    if result.already:
        _say(f"Run {result.original_id} is already in this store as {result.run_id}; nothing imported.")
    else:
        image = f"; image {result.image} loaded" if result.image else ""
        _say(f"Imported run {result.original_id} as {result.run_id} with {len(result.replays)} replays{image}.")
    if result.data:
        # Quoted for a shell: the command is meant to be pasted, and data folders often hold spaces.
        where = shlex.join(["replay", result.run_id, *(w for name, path in sorted(result.data.items())
                                                       for w in ("--data", f"{name}={path}"))])
        _say(f"Its declared data is in {', '.join(result.data.values())}: harness {where}")
    if as_json:
        _emit(documents.import_(result))
    click.echo(result.run_id)


@main.command(name="_execute", hidden=True)
@click.argument("run_id")
@click.option("--code-dir", type=click.Path(path_type=Path), required=True)
@click.option("--resume-step", type=int, default=None)
@click.option("--tracking-uri", default=None, help=_TRACKING_HELP)
@_expected_errors
def execute(run_id: str, code_dir: Path, resume_step: int | None, tracking_uri: str | None) -> None:
    """Run an already recorded run where this command runs (inside a container, or a Slurm job's task)."""
    from harness.commands import run as runner
    from harness.commands.placement import topology_from_env

    outcome = runner.execute_recorded(run_id, code_dir, tracking_uri, resume_step, topology_from_env())
    if outcome.message:
        click.echo(f"{outcome.status}: {scrub(outcome.message)}", err=True)
    sys.exit(outcome.exit_code)


@main.command()
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
        click.echo(mlflow_ui.page(served, mlflow_ui.prepare(Tracker(uri), experiment)))
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
            sys.exit(server.wait())
    except KeyboardInterrupt:
        mlflow_ui.stop(server)
        sys.exit(EXIT_SIGINT)
    finally:
        mlflow_ui.stop(server)


@main.command()
@click.argument("experiment", required=False)
@click.option("-n", "--limit", default=20, show_default=True, help="How many runs to list.")
@click.option("--tracking-uri", default=None, help=_TRACKING_HELP)
@_json_option
@_expected_errors
def runs(experiment: str | None, limit: int, tracking_uri: str | None, as_json: bool) -> None:
    """List recent runs: id, experiment, start, status, world size, commit, image digest, replay verdicts.

    STATUS is STALE for a RUNNING run whose launcher stopped writing its heartbeat (close it with
    `harness mark`). VERDICTS counts every replay of a run by verdict, e.g. `BITWISE 2, DIVERGED 1
    (with changes)`, replays made with --allow-changes or --world-size counted apart.
    Exit 0 listed (also an empty store), 2 bad input (an unknown experiment, an unreadable store).
    """
    from harness.commands import api, documents

    listed = api.runs(api.RunsOptions(experiment, limit, tracking_uri=tracking_uri, on_event=_draw))
    if as_json:
        _emit(documents.runs(listed.runs))
    click.echo(listed.table())


@main.command()
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


teach(main)

if __name__ == "__main__":  # pragma: no cover
    main()
