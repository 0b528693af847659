"""The public Python API: one typed options object in, one typed result out, per verb.

`harness.run`, `harness.replay`, `harness.compare`, ... are these functions, one per verb of the command line
(export, import, attest and verify-record in api_bundles.py, re-exported here); the command line calls them
too, so the two cannot disagree. This
module is the one place that decides what a command means for the run it is given: a study or a single
run (replay; run --seeds or `seeds:` in the config), two traces or two runs (compare), and where the job's ranks
sit (the placement options and torchrun's environment -> a Topology). It is also the layer that composes verbs: no
verb module imports another (pyproject.toml's independence contract), so a verb that runs another (calibrate,
bisect and verify run replays; replay and bisect localize through trace) is handed that verb here.

While a command works it says what happens as `harness.events` (notices, warnings, progress) to
`on_event`; without one nothing is said. Expected failures raise HarnessError with the line the CLI prints.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness import events, extensions, seeds, tags as T
from harness.commands import (
    calibrate as calibrate_command,
    mark as mark_command,
    replay as replay_command,
    run as run_command,
    runs as runs_command,
    study,
    ui as ui_command,
)
from harness.commands.api_bundles import (
    ExportOptions as ExportOptions,
    ImportOptions as ImportOptions,
    export as export,
    import_ as import_,
)
from harness.commands.calibrate import Calibration
from harness.commands.options import (
    AuditOptions as AuditOptions,
    CalibrateOptions as CalibrateOptions,
    MarkOptions as MarkOptions,
    ResumeOptions as ResumeOptions,
    RunsOptions as RunsOptions,
)
from harness.commands.replay import ReplayResult, StudyReplayResult
from harness.commands.run import Preflight
from harness.commands.runs import Listing
from harness.commands.study import StudyOutcome
from harness.config import as_override
from harness.errors import UsageError
from harness.events import Listener
from harness.executors import (
    Outcome,
    Topology,
    backend,
    backends,
    check_torchrun,
    topology_from_env,
    torchrun_topology,
)
from harness.judge.compare import Comparison
from harness.judge.tolerance import parse_tolerances
from harness.record.newrun import Labels, labels
from harness.record.replays import newest_replay
from harness.record.study import is_study
from harness.store.tracking import Tracker, full_ids

if TYPE_CHECKING:  # audit and resume load torch (checkpoints) at import: imported where they run, so that
    # compare and replay stay as light as they are (compare imports no torch: it starts in well under a second)
    from harness.commands.audit import AuditResult

# Every verb of the core's command line but `ui` (a server that runs until Ctrl-C) and the internal `_execute`
# (tests/test_api.py walks the click group); the extras' verbs are added by __getattr__ below.
CORE = [
    "AuditOptions", "CalibrateOptions", "CheckOptions", "CompareOptions", "ExportOptions", "ImportOptions",
    "MarkOptions", "Marked", "Placement", "ReplayOptions", "ResumeOptions", "RunOptions", "RunsOptions", "audit",
    "calibrate", "check", "compare", "export", "import_", "mark", "replay", "resume", "run", "runs",
]


def __getattr__(name: str) -> Any:
    """`__all__` (the core's verbs and the extras') and the extras' names (api.trace, api.TraceOptions...), from the
    registry: this module imports no extra (pyproject.toml's contract)."""
    if name == "__all__":
        return sorted({*CORE, *extensions.api_names()})
    if not name.startswith("_"):  # a probe of a dunder (a tool's hasattr) loads no extra
        with contextlib.suppress(AttributeError):
            return extensions.api(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@contextlib.contextmanager
def _command(on_event: Listener | None) -> Iterator[None]:
    """One verb of the API: what it says goes to `on_event`, and the hash seed it pins for its ranks is the caller's
    again when it ends (seeds.given_back)."""
    with events.listening(on_event), seeds.given_back():
        yield


def _with_full_ids(options: Any, *names: str) -> Any:
    """`options` with the run ids in the fields `names` made whole: a unique prefix names a run everywhere an id
    does (as git's and docker's ids do); an ambiguous one is refused in one line (Tracker.resolve_id)."""
    given = [getattr(options, n) for n in names]
    full = full_ids(options.tracking_uri, *given)
    return options if full == given else replace(options, **dict(zip(names, full)))


# -- where the ranks run --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Placement:
    """Where a job's ranks run, beyond the backend: the nodes of a multi-node job, and the backends' own options.

    Each topology field is the command line option named in its comment; None: not given. `backend` holds the
    options the backends declare (harness/executors: each backend's `CliOption`s), by their names: one with a
    config key becomes a recorded `BACKEND.KEY=VALUE` override (`nodes=2`: slurm.nodes=2), one without is a choice
    for this job only (`allow_unpinned`).
    """

    nnodes: int | None = None  # --nnodes: nodes of a multi-node job (the same command runs on each)
    node_rank: int | None = None  # --node-rank: this node's rank (0 records the run)
    master_addr: str | None = None  # --master-addr: node 0's address, reachable from every node
    master_port: int | None = None  # --master-port: a free TCP port on node 0 for the rendezvous
    backend: Mapping[str, Any] = field(default_factory=dict)  # the backends' options given, by name

    @classmethod
    def of(cls, given: Mapping[str, Any]) -> Placement:
        """From parsed options by name (the CLI's): the topology fields, and every other one given as a backend's."""
        own = {"nnodes", "node_rank", "master_addr", "master_port"}
        return cls(**{k: v for k, v in given.items() if k in own},
                   backend={k: v for k, v in given.items() if k not in own and v is not None})

    def given(self) -> list[str]:
        """The command line flags of what is set: the topology's in declaration order, then the backends'."""
        flags = [_MULTI_NODE[f.name] for f in fields(self) if f.name in _MULTI_NODE and getattr(self, f.name) is not None]
        return flags + [opt.flag for _, opt in self._backend_options() if opt.dest in self.backend]

    def multi_node(self) -> list[str]:
        """The flags given that place this process among several nodes."""
        return [flag for flag in self.given() if flag in _MULTI_NODE.values()]

    def backend_overrides(self) -> list[str]:
        """The backends' options that set their config, as `BACKEND.KEY=VALUE` overrides (a replay records them)."""
        return [as_override(f"{name}.{opt.key}", str(self.backend[opt.dest])) for name, opt in self._backend_options()
                if opt.key is not None and opt.dest in self.backend]

    def job_options(self) -> dict[str, Any]:
        """The backends' options that are choices for this job only (no config key)."""
        return {opt.dest: self.backend[opt.dest] for _, opt in self._backend_options()
                if opt.key is None and opt.dest in self.backend}

    def _backend_options(self) -> list[tuple[str, Any]]:
        if not self.backend:  # nothing given: the backends need not load (runs and compares stay light)
            return []
        declared = [(name, opt) for name, b in backends().items() for opt in b.cli]
        unknown = sorted(set(self.backend) - {opt.dest for _, opt in declared})
        if unknown:
            raise UsageError(f"no backend takes the option(s) {', '.join(unknown)}; known: "
                               f"{', '.join(sorted({opt.dest for _, opt in declared}))}.")
        return declared


_MULTI_NODE = {"nnodes": "--nnodes", "node_rank": "--node-rank", "master_addr": "--master-addr",
               "master_port": "--master-port"}


def known_executor(name: str | None) -> None:
    """A named backend exists (registered), else HarnessError naming the known ones."""
    if name is not None:
        backend(name)


def topology(executor: str | None, placement: Placement, torchrun: Topology | None = None) -> Topology | None:
    """This process's place in the job; under torchrun (`torchrun`: its layout, torchrun_topology()), torchrun's. None:
    the backend chooses the job's nodes (Backend.places_nodes: a scheduler's tasks learn their place from it)."""
    known_executor(executor)
    if torchrun is not None:
        check_torchrun(torchrun, executor, placement.given())  # torchrun's layout leaves no placement to choose
        return torchrun
    if executor is not None and backend(executor).places_nodes:
        return None
    p = placement
    if p.nnodes is None and p.node_rank is None and p.master_addr is None and p.master_port is None:
        # What a scheduler set in the environment (a backend's own variables, else NODE_RANK & co), else one node.
        return topology_from_env() or Topology()
    if p.nnodes is None:
        raise UsageError("--node-rank, --master-addr and --master-port need --nnodes (the number of nodes).")
    return Topology(nnodes=p.nnodes, node_rank=p.node_rank or 0, master_addr=p.master_addr, master_port=p.master_port or 0)


def speaks_for_job() -> bool:
    """Whether this process says the job's run id: torchrun gathers every rank's stdout on one terminal, so
    only its rank 0 does; any other launcher is the job's one voice on its node."""
    layout = torchrun_topology()
    return layout is None or layout.speaks_for_job


# -- run ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunOptions:
    """`harness run EXPERIMENT_DIR [KEY=VALUE ...]`."""

    experiment_dir: Path  # the experiment folder (experiment.yaml and its entry), inside a git repository
    overrides: tuple[str, ...] = ()  # KEY=VALUE config overrides
    seeds: int | None = None  # --seeds N: a study of N runs with seeds seed .. seed+N-1 (also `seeds:` in the config)
    parallel: int | None = None  # --parallel J: a study's members run J at once
    require_clean: bool = False  # refuse a git tree with uncommitted changes
    executor: str | None = None  # a registered backend: local | docker | slurm | ... (default: `executor` in the config)
    placement: Placement = field(default_factory=Placement)
    allow_unpinned: bool = False  # accept an image pinned by the moving 'latest' tag
    allow_untracked_secrets: bool = False  # record untracked files named like secrets in the code patch
    allow_secret_in_diff: bool = False  # record a patch holding secrets with them cut out (tagged patch_redacted)
    tracking_uri: str | None = None  # default: $MLFLOW_TRACKING_URI, else sqlite:///./mlruns/mlflow.db
    on_event: Listener | None = None  # gets what the command says while it works; None: nothing is said
    calibrate: bool = False  # --calibrate: once the run FINISHED, `harness calibrate` it with the defaults
    name: str | None = None  # --name: the run's name in MLflow (default: the experiment's name and the id's start)
    tags: Mapping[str, str] | tuple[str, ...] = ()  # --tag KEY=VALUE: tags of the user's own (not harness./mlflow.)


def run(options: RunOptions) -> Outcome | StudyOutcome:
    """Record and launch the experiment: its Outcome, or a StudyOutcome when it is a study (--seeds or `seeds:`)."""
    o = options
    with _command(o.on_event):
        named = labels(o.name, o.tags)  # refused before anything is checked or recorded
        torchrun = torchrun_topology()  # this process is one of torchrun's ranks: decided once, handed down
        if o.calibrate and (o.seeds is not None or o.parallel is not None or o.placement.multi_node()
                            or torchrun is not None):
            raise UsageError("--calibrate calibrates one run on this machine, not a study or a multi-node job. Drop "
                               "it, and calibrate a run afterwards with `harness calibrate RUN_ID`.")
        overrides = [*o.overrides, *o.placement.backend_overrides()]
        if o.seeds is not None or o.parallel is not None:
            multi = o.placement.multi_node()
            if multi or torchrun is not None:
                raise UsageError(f"a study runs its members one job after another on this machine: "
                                   f"{', '.join(multi) or 'torchrun'} cannot apply. Drop them, or run single runs.")
            known_executor(o.executor)
            study.check_counts(o.seeds, o.parallel)
            checked = _checked(o, overrides, Topology(), warm_ranks=False)
            return _run_study(o, checked, named)
        layout = topology(o.executor, o.placement, torchrun) or Topology()
        checked = _checked(o, overrides, layout)
        if checked.cfg.seeds is not None:  # `seeds: [...]` in the config: a study, from the config checked here (one load)
            if torchrun is not None or layout.multi_node:
                raise UsageError("a study runs its members one job after another on this machine: "
                                   f"{'torchrun' if torchrun is not None else '--nnodes'} cannot apply. Drop it, or "
                                   "set seeds=null for a single run.")
            outcome: Outcome | StudyOutcome = _run_study(o, checked, named)
        else:
            outcome = run_command.run(
                o.experiment_dir, overrides, require_clean=o.require_clean, tracking_uri=o.tracking_uri,
                executor=o.executor, allow_unpinned=o.allow_unpinned, allow_untracked_secrets=o.allow_untracked_secrets,
                allow_secret_in_diff=o.allow_secret_in_diff, topology=layout, job_options=o.placement.job_options(),
                named=named, checked=checked,
            )
        if o.calibrate and isinstance(outcome, StudyOutcome):
            raise UsageError(f"--calibrate: the config made study {outcome.run_id} (`seeds:`); calibrate a member "
                               "with `harness calibrate MEMBER_ID`.")
        if o.calibrate and outcome.status == T.FINISHED:
            # Right after the run, on the same machine and image: the reference its replays are judged against.
            calibrate_command.calibrate(CalibrateOptions(outcome.run_id, tracking_uri=o.tracking_uri),
                                        replay=replay_command.replay)
        return outcome


def _checked(o: RunOptions, overrides: list[str], layout: Topology, warm_ranks: bool = True) -> Preflight:
    """What `harness run` checks before recording (the store reached, the config loaded once): a study or a run."""
    return run_command.check(o.experiment_dir, overrides, topology=layout, require_clean=o.require_clean,
                             tracking_uri=o.tracking_uri, executor=o.executor,
                             allow_untracked_secrets=o.allow_untracked_secrets,
                             allow_secret_in_diff=o.allow_secret_in_diff, warm_ranks=warm_ranks)


def _run_study(o: RunOptions, checked: Preflight, named: Labels) -> StudyOutcome:
    return study.run_study(o.experiment_dir, checked=checked, seeds_n=o.seeds, parallel=o.parallel,
                           tracking_uri=o.tracking_uri, allow_unpinned=o.allow_unpinned,
                           job_options=o.placement.job_options(), named=named)


# -- calibrate ------------------------------------------------------------------------------------------
def calibrate(options: CalibrateOptions) -> Calibration:
    """Re-execute the run's first steps with nudges of its weights; record the envelope its replays are
    judged against (WITHIN_ROUNDING)."""
    with _command(options.on_event):
        # A calibration's members are replays: the replay verb is handed to it (no verb imports another).
        return calibrate_command.calibrate(_with_full_ids(options, "run_id"), replay=replay_command.replay)


# -- replay ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ReplayOptions:
    """`harness replay RUN_ID [KEY=VALUE ...]`: a run, or a study (every member, or `members` of them)."""

    run_id: str  # a run, a study, or a replay / audit / study replay of one (followed unless follow=False)
    overrides: tuple[str, ...] = ()  # KEY=VALUE changes of the recorded config; need allow_changes
    world_size: int | None = None  # replay with another number of ranks
    allow_changes: bool = False
    allow_data_changes: bool = False  # replay although the declared data no longer hashes as recorded
    data_paths: dict[str, str] = field(default_factory=dict)  # declared data NAME -> where it is on this machine
    executor: str | None = None  # where the replay runs (default: as recorded)
    placement: Placement = field(default_factory=Placement)
    allow_incomplete: bool = False  # replay a FAILED or KILLED run, judged on the steps it reached
    follow: bool = True  # False: replay a replay or audit run itself, not the original it was made from
    members: int | None = None  # a study: replay K of its members drawn at random (the draw's seed is recorded)
    members_seed: int | None = None  # a study with `members`: the draw's seed
    localize: bool | None = None  # trace a DIVERGED replay's first divergent step (None: when it has checkpoints)
    tolerances: tuple[str, ...] = ()  # METRIC=ATOL[,RTOL] over the recorded replay.tolerance
    steps: int | None = None  # a first check: train and judge only the first K steps (harness.replay.steps)
    tracking_uri: str | None = None
    repo: Path | None = None  # the git repository holding the recorded commit (default: found from the cwd)
    on_event: Listener | None = None


def replay(options: ReplayOptions) -> ReplayResult | StudyReplayResult:
    """Rerun a recorded run, or a study's members, and judge it against the record."""
    with _command(options.on_event):
        o = _with_full_ids(options, "run_id")
        layout = topology(o.executor, o.placement)
        replay_command.check_steps(o.steps, o.allow_incomplete)
        # Writable: a replay records, so a read-only store is said first, whatever the run is.
        tracker = Tracker(o.tracking_uri)
        study_id = _study_to_replay(tracker, o.run_id, o.follow)
        if study_id is not None and o.steps is not None:
            raise UsageError(f"--steps: run {o.run_id} is a study. A first check replays one run: pass a member's id "
                               "(its values at the last step are judged against the study's seeds).")
        if study_id is not None:
            refused = [*o.placement.backend_overrides(), *o.placement.multi_node()]
            if refused:
                raise UsageError(f"a study is replayed member by member on this machine: {', '.join(refused)} cannot "
                                   "apply. Replay one member on several nodes with `harness replay MEMBER_ID ...`.")
            if o.members_seed is not None and o.members is None:
                raise UsageError("--members-seed draws --members K of the study's members; pass --members too.")
            studied = replay_command.replay_study(
                study_id, members=o.members, draw_seed=o.members_seed, world_size=o.world_size,
                overrides=list(o.overrides), allow_changes=o.allow_changes, allow_data_changes=o.allow_data_changes,
                data_paths=dict(o.data_paths), tracker=tracker, executor=o.executor, tolerances=list(o.tolerances),
                repo=o.repo,
            )
            studied.ui = ui_command.links(tracker, studied.run_id)
            return studied
        if o.members is not None or o.members_seed is not None:
            raise UsageError(f"--members and --members-seed apply to a study; run {o.run_id} is not one.")
        result = replay_command.replay(
            o.run_id, world_size=o.world_size, overrides=list(o.overrides), allow_changes=o.allow_changes,
            allow_data_changes=o.allow_data_changes, data_paths=dict(o.data_paths), tracker=tracker, repo=o.repo,
            executor=o.executor, allow_incomplete=o.allow_incomplete, follow=o.follow,
            placement=o.placement.backend_overrides(), topology=layout, localize=o.localize,
            tolerances=list(o.tolerances), steps=o.steps, localizer=extensions.hook(extensions.LOCALIZE),
        )
        if result.comparison is not None:  # judged here (node 0 of a multi-node replay): where to look at it
            result.ui = ui_command.links(tracker, result.outcome.run_id, curves=True)
        return result


def _study_to_replay(tracker: Tracker, run_id: str, follow: bool) -> str | None:
    """The study that replaying RUN_ID means: itself, or (when following) the study a study replay was made from."""
    run = tracker.harness_run(run_id)
    if follow and run.tags.get(T.KIND) == T.KIND_STUDY_REPLAY and run.tags.get(T.REPLAY_OF):
        events.emit(events.Notice(f"run {run_id} is a replay of study {run.tags[T.REPLAY_OF]}; replaying the study"))
        return run.tags[T.REPLAY_OF]
    return run_id if is_study(run) else None


# -- compare --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CompareOptions:
    """`harness compare RUN_A [RUN_B]`: two runs (delta and verdict; RUN_A alone: with its newest replay), or two
    traces (the first differing op)."""

    run_a: str  # the reference: its tolerance applies
    run_b: str | None = None  # None: run A's newest replay
    tolerances: tuple[str, ...] = ()  # two runs: METRIC=ATOL[,RTOL] over the recorded replay.tolerance
    report: Path | None = None  # two traces: also write the localization report here (HTML if .html, else markdown)
    tracking_uri: str | None = None
    on_event: Listener | None = None


def compare(options: CompareOptions) -> Comparison | extensions.Compared:
    """Judge two existing runs against each other (a Comparison), or what an extra compares (two traces: the trace
    extra's TraceDiff); nothing is rerun or recorded."""
    with _command(options.on_event):
        parse_tolerances(list(options.tolerances))  # bad input is said before the store is opened, as replay says it
        o = _with_full_ids(options, "run_a", *(("run_b",) if options.run_b is not None else ()))
        tracker = Tracker(o.tracking_uri, writable=False)  # comparing only reads
        if o.run_b is None:
            o = replace(o, run_b=newest_replay(tracker, o.run_a))
        assert o.run_b is not None
        other = extensions.hook(extensions.COMPARE)  # two traces (the trace extra), else None: two runs
        found = other(tracker, o.run_a, o.run_b, o.report) if other is not None else None
        if found is not None:
            return found
        if o.report is not None:
            raise UsageError("--report applies to two trace runs (harness trace); drop it, or pass two trace ids.")
        compared = replay_command.compare(o.run_a, o.run_b, o.tracking_uri, tolerances=list(o.tolerances))
        if compared.of_replay:
            judged = tracker.get_run(o.run_b)
            if judged.tags.get(T.VERDICT):  # a judged replay carries its curves (an unjudged one, a member: none)
                compared.ui = ui_command.links(tracker, judged, curves=True)
        return compared


# -- resume, audit ------------------------------------------------------------------------------------------
def resume(options: ResumeOptions) -> Outcome:
    """Prove the resume against the record, then continue the run in the same MLflow run: its Outcome."""
    from harness.commands import resume as resume_command  # loads torch (see the imports above)

    with _command(options.on_event):
        return resume_command.resume(_with_full_ids(options, "run_id"))


def audit(options: AuditOptions) -> AuditResult:
    from harness.commands import audit as audit_command  # loads torch (see the imports above)

    with _command(options.on_event):
        return audit_command.audit(_with_full_ids(options, "run_id"))



# -- check, runs, mark ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class CheckOptions:
    """`harness check EXPERIMENT_DIR [KEY=VALUE ...]`: what `harness run` checks, without running or recording."""

    experiment_dir: Path
    overrides: tuple[str, ...] = ()
    require_clean: bool = False
    allow_untracked_secrets: bool = False
    allow_secret_in_diff: bool = False
    tracking_uri: str | None = None
    on_event: Listener | None = None


def check(options: CheckOptions) -> Preflight:
    """The validated config, the code state and the warnings `harness run` would start with; HarnessError where it
    would refuse. Nothing is recorded."""
    o = options
    with _command(o.on_event):
        return run_command.preflight(o.experiment_dir, list(o.overrides), require_clean=o.require_clean,
                                     allow_untracked_secrets=o.allow_untracked_secrets,
                                     allow_secret_in_diff=o.allow_secret_in_diff, tracking_uri=o.tracking_uri)


def runs(options: RunsOptions) -> Listing:
    with _command(options.on_event):
        return runs_command.listing(options)


@dataclass(frozen=True)
class Marked:
    run_id: str
    status: str
    reason: str  # recorded as the run's harness.status_reason


def mark(options: MarkOptions) -> Marked:
    with _command(options.on_event):
        o = _with_full_ids(options, "run_id")
        return Marked(o.run_id, o.status, mark_command.mark(o))

