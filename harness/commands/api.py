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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields, replace
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
    CheckOptions as CheckOptions,
    CompareOptions as CompareOptions,
    MarkOptions as MarkOptions,
    Placement as Placement,
    ReplayContext,
    ReplayOptions as ReplayOptions,
    ResumeOptions as ResumeOptions,
    RunOptions as RunOptions,
    RunsOptions as RunsOptions,
)
from harness.commands.replay import ReplayResult, StudyReplayResult
from harness.commands.run import Preflight
from harness.commands.runs import Listing
from harness.commands.study import StudyOutcome
from harness.errors import UsageError
from harness.events import Listener
from harness.executors import (
    Outcome,
    Topology,
    backend,
    check_torchrun,
    topology_from_env,
    torchrun_topology,
)
from harness.judge.compare import Comparison
from harness.judge.tolerance import parse_tolerances
from harness.record.newrun import labels
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
        if o.seeds is not None or o.parallel is not None:
            multi = o.placement.multi_node()
            if multi or torchrun is not None:
                raise UsageError(f"a study runs its members one job after another on this machine: "
                                   f"{', '.join(multi) or 'torchrun'} cannot apply. Drop them, or run single runs.")
            known_executor(o.executor)
            study.check_counts(o.seeds, o.parallel)
            checked = run_command.check(o.checks(), topology=Topology(), warm_ranks=False)
            return study.run_study(o, checked=checked, named=named)
        layout = topology(o.executor, o.placement, torchrun) or Topology()
        checked = run_command.check(o.checks(), topology=layout)
        if checked.cfg.seeds is not None:  # `seeds: [...]` in the config: a study, from the config checked here (one load)
            if torchrun is not None or layout.multi_node:
                raise UsageError("a study runs its members one job after another on this machine: "
                                   f"{'torchrun' if torchrun is not None else '--nnodes'} cannot apply. Drop it, or "
                                   "set seeds=null for a single run.")
            outcome: Outcome | StudyOutcome = study.run_study(o, checked=checked, named=named)
        else:
            outcome = run_command.run(o, topology=layout, named=named, checked=checked)
        if o.calibrate and isinstance(outcome, StudyOutcome):
            raise UsageError(f"--calibrate: the config made study {outcome.run_id} (`seeds:`); calibrate a member "
                               "with `harness calibrate MEMBER_ID`.")
        if o.calibrate and outcome.status == T.FINISHED:
            # Right after the run, on the same machine and image: the reference its replays are judged against.
            calibrate_command.calibrate(CalibrateOptions(outcome.run_id, tracking_uri=o.tracking_uri),
                                        replay=replay_command.replay)
        return outcome


# -- calibrate ------------------------------------------------------------------------------------------
def calibrate(options: CalibrateOptions) -> Calibration:
    """Re-execute the run's first steps with nudges of its weights; record the envelope its replays are
    judged against (WITHIN_ROUNDING)."""
    with _command(options.on_event):
        # A calibration's members are replays: the replay verb is handed to it (no verb imports another).
        return calibrate_command.calibrate(_with_full_ids(options, "run_id"), replay=replay_command.replay)


# -- replay ---------------------------------------------------------------------------------------------
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
            studied = replay_command.replay_study(replace(o, run_id=study_id), ReplayContext(tracker=tracker))
            studied.ui = ui_command.links(tracker, studied.run_id)
            return studied
        if o.members is not None or o.members_seed is not None:
            raise UsageError(f"--members and --members-seed apply to a study; run {o.run_id} is not one.")
        result = replay_command.replay(o, ReplayContext(tracker=tracker, topology=layout,
                                                        localizer=extensions.hook(extensions.LOCALIZE)))
        if result.comparison is not None:  # judged here (node 0 of a multi-node replay): where to look at it
            result.ui = ui_command.links(tracker, result.outcome.run_id, curves=True)
        return result


def by_keywords(verb: Callable[[ReplayOptions, ReplayContext], Any]) -> Callable[..., Any]:
    """A replay verb (commands/replay.py's replay or replay_study) as the extras that compose it call it (bisect,
    verify): the run id and keywords, each of ReplayOptions or of ReplayContext by its name (replay_study's
    `draw_seed` is `members_seed`)."""
    composed = {f.name for f in fields(ReplayContext)}

    def call(run_id: str, **given: Any) -> Any:
        if "draw_seed" in given:
            given["members_seed"] = given.pop("draw_seed")
        asked: dict[str, Any] = {k: tuple(v) if k in ("overrides", "tolerances") else v
                                 for k, v in given.items() if k not in composed and v is not None}
        return verb(ReplayOptions(run_id, **asked), ReplayContext(**{k: v for k, v in given.items() if k in composed}))
    return call


def compare_by_keywords(run_a: str, run_b: str, tracking_uri: str | None = None,
                        tolerances: Sequence[str] | None = None) -> Comparison:
    """The compare verb of two runs as bisect calls it."""
    return replay_command.compare(CompareOptions(run_a, run_b, tuple(tolerances or ()), tracking_uri=tracking_uri))


def _study_to_replay(tracker: Tracker, run_id: str, follow: bool) -> str | None:
    """The study that replaying RUN_ID means: itself, or (when following) the study a study replay was made from."""
    run = tracker.harness_run(run_id)
    if follow and run.tags.get(T.KIND) == T.KIND_STUDY_REPLAY and run.tags.get(T.REPLAY_OF):
        events.emit(events.Notice(f"run {run_id} is a replay of study {run.tags[T.REPLAY_OF]}; replaying the study"))
        return run.tags[T.REPLAY_OF]
    return run_id if is_study(run) else None


# -- compare --------------------------------------------------------------------------------------------
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
        compared = replay_command.compare(o)
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
def check(options: CheckOptions) -> Preflight:
    """The validated config, the code state and the warnings `harness run` would start with; HarnessError where it
    would refuse. Nothing is recorded."""
    o = options
    with _command(o.on_event):
        return run_command.preflight(o)


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

