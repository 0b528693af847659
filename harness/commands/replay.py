"""`harness replay` and `harness compare`: rerun a recorded run and judge it against the record."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from harness import events, executors, scratch, tags as T
from harness.commands.options import CompareOptions, ReplayContext, ReplayOptions
from harness.config import Experiment, parse_overrides
from harness.configschema import ExperimentConfig
from harness.errors import RunFailed, UsageError
from harness.executors import Outcome, Topology
from harness.fmt import json_safe
from harness.judge import noise
from harness.judge.compare import Comparison, compare_runs, original_steps
from harness.judge.handoff import judge_noise, judge_rounding
from harness.judge.tolerance import format_tolerances, judged_tolerance, parse_tolerances
from harness.judge.verdicts import Policy, Verdict, exit_code, meets
from harness.record import derived, loading, redaction, seal
from harness.record.calibration import envelope_of, weights_distance
from harness.record.newrun import create_record
from harness.record.replays import record_replay_verdicts
from harness.record.study import StudyRecord, load_study, member_records
from harness.rundata import UiLinks
from harness.runtime.plan import Steering
from harness.store.tracking import RunRecord, RunSummary, Tracker
from harness.systems import git as gitsource


@dataclass
class ReplayResult:
    original: RunSummary
    outcome: Outcome
    comparison: Comparison | None  # None on nodes other than 0 of a multi-node replay: node 0 judges it
    changes: list[str]
    records: tuple[RunRecord, RunRecord] | None = None  # (original, replay) as judged
    localized: Any = None  # trace.Localized: where a DIVERGED replay first differed (replay --localize)
    members: list[Outcome] = field(default_factory=list)  # `then`'s calibration members, in order
    ui: UiLinks | None = None  # where to look at the replay and its curves in the MLflow UI (None: not judged here)

    @property
    def judged(self) -> Comparison:
        """The comparison, where this process judged the replay (a study replay's members are judged where they run)."""
        assert self.comparison is not None, "only node 0 of a multi-node replay judges it"
        return self.comparison


def apply_changes(
    recorded: Experiment, world_size: int | None, overrides: list[str], allow_changes: bool
) -> tuple[Experiment, list[str]]:
    """--world-size and KEY=VALUE changes; the latter only with --allow-changes. Returns the experiment to replay (a
    new one where anything changed) and what changed."""
    if overrides and not allow_changes:
        raise UsageError(
            f"replay uses the recorded config; overrides {' '.join(overrides)} would change it. "
            "Pass --allow-changes to replay with them (they are recorded and reported)."
        )
    changes = list(overrides)
    fragments: list[tuple[str, Any]] = []
    if overrides:
        fragments.append(("overrides", parse_overrides(overrides)))
    if world_size is not None and world_size != recorded.config.world_size:
        fragments.append(("--world-size", OmegaConf.create({"world_size": world_size})))
        changes.append(f"world_size={world_size}")
    if not fragments:
        return recorded, []
    return recorded.with_changes(fragments, executors.schema(), source="recorded config"), changes


def follow_original(tracker: Tracker, run: RunSummary) -> RunSummary:
    """The run a replay or an audit was made from (and so on), which is what replaying it means."""
    return derived.followed(tracker, run, "replaying")


@dataclass
class _Prepared:
    """A replay as it stands before it is launched: what is replayed, how, and what the replay run is tagged with."""

    tracker: Tracker
    original: RunSummary
    loaded: loading.Loaded
    a: RunRecord | None  # the original's record, where it was read already
    experiment: Experiment  # what the replay runs: the recorded experiment with the replay's changes
    changes: list[str]
    tags: dict[str, str]
    data: Any  # record/rerun.py DataCheck
    steering: Steering
    envelope: Any  # the calibration's rounding envelope, or None
    given: Any  # the tolerances given for this judgement (judge/tolerance.py)
    study_members: Sequence[RunRecord] | None  # the study's member records, when the caller has them
    # (status judged, original, replay, comparison): set where the verdict was written before the run's seal
    judged: tuple[str, RunRecord, RunRecord, Comparison] | None = None

    @property
    def run_id(self) -> str:
        return self.original.run_id

    @property
    def cfg(self) -> ExperimentConfig:
        return self.experiment.config


def replay(options: ReplayOptions, context: ReplayContext | None = None) -> ReplayResult:
    """Rerun `options.run_id` as recorded and judge it.

    `context` (options.py ReplayContext) is what the composing layer adds: the store held open, the job's topology,
    the localizer that traces a DIVERGED replay where `localize` asks for it (the trace extra's after_replay, which
    the API hands in: no extra is imported here), a study's member records (a study replay judges every
    member against the same seeds), a commit to run instead of the recorded one (bisect's probes; the replay records
    the commit it ran), and a calibration's members: `perturb_seed`, whose weights start nudged and which is the
    reference, so not judged (its comparison is None); `sketch_at`, the step after which rank 0 sketches the weights
    (a replay of a calibrated run sketches them at the calibration's M by itself, to hold them to the members');
    `then`, further members run by the same ranks after this one, each recorded as a replay of its own (a backend
    that runs members: Backend.runs_members; their outcomes in ReplayResult.members). `options.steps` K: a first
    check - train only the first K steps, stop every rank there, and judge those steps (harness.replay.steps)."""
    context = context or ReplayContext()
    given = parse_tolerances(list(options.tolerances))  # bad input is said before anything else happens
    check_steps(options.steps, options.allow_incomplete)
    # First: an unreachable store is said before torch is even loaded.
    tracker = context.tracker or Tracker(options.tracking_uri)
    p = _prepare(options, context, tracker, given)
    outcome, job = _launch(p, options, context)
    if job.topology.node_rank != 0 or context.perturb_seed is not None:  # one job, one verdict: node 0's; a member: none
        return ReplayResult(p.original, outcome, None, p.changes, members=job.member_outcomes)
    return _judge(p, outcome, options, context)


def _prepare(options: ReplayOptions, context: ReplayContext, tracker: Tracker, given: Any) -> _Prepared:
    """Everything checked and decided before anything is recorded or launched: the run edited since its seal, not
    complete, its calibration edited, its data changed - each refused here, not after the run."""
    original = tracker.harness_run(options.run_id)
    if options.follow:
        original = follow_original(tracker, original)
    loaded = loading.load(tracker, original, loading.REPLAY, allow_incomplete=options.allow_incomplete)
    # A study replay has the member's record already (it judges every member against the same seeds).
    a = next((m for m in context.study_members or [] if m.run_id == original.run_id), None)
    if options.steps is not None:
        a = a or tracker.load_record(original.run_id)
        check_steps_of(options.steps, a)
    experiment, changes = _config(options, loaded.recorded, tracker)
    loaded.recorded.experiment = experiment
    envelope = None if context.perturb_seed is not None else calibration_envelope(tracker, original.run_id)
    sketch_at = context.sketch_at
    if envelope is not None and envelope.weights is not None and (options.steps is None
                                                                   or options.steps >= envelope.weights.step):
        sketch_at = envelope.weights.step  # its weights after the calibration's M steps, held to the members'
    data = loaded.recorded.check_data(options.repo, allow_changes=options.allow_data_changes,
                                      flag="--allow-data-changes", paths=dict(options.data_paths))
    if data.stats is not None:
        events.emit(events.Notice(data.stats.summary()))
    steering = Steering(stop_at=options.steps, perturb_seed=context.perturb_seed, sketch_at=sketch_at)
    if context.commit is not None and context.commit != original.tags.get(T.GIT_COMMIT):
        changes.append(f"commit={context.commit[:12]}")
    tags = _replay_tags(original, context, changes, given, steering, data)
    return _Prepared(tracker, original, loaded, a, experiment, changes, tags, data, steering, envelope, given,
                     context.study_members)


def _config(options: ReplayOptions, recorded: Any, tracker: Tracker) -> tuple[Experiment, list[str]]:
    """The config the replay runs and its changes (recorded and printed: no secret in them): the user's, then where
    it runs - a choice of the replay, not a change of the experiment, so no --allow-changes."""
    overrides = recorded.restore_secrets(list(options.overrides))  # a secret passed again is no change
    experiment, changes = apply_changes(recorded.experiment, options.world_size, overrides, options.allow_changes)
    changes = [redaction.redact_override(c, redaction.store_key(tracker.uri)) for c in changes]
    if options.executor is not None and options.executor != experiment.config.executor:
        experiment = experiment.with_changes([("--executor", OmegaConf.create({"executor": options.executor}))],
                                             executors.schema(), source="recorded config", check=False)
        changes.append(f"executor={options.executor}")
    placement = options.placement.backend_overrides()
    if placement:  # the backends' options (--nodes, --partition, ...): where the replay runs, likewise
        experiment = experiment.with_changes([("backend options", parse_overrides(placement))], executors.schema(),
                                             source="recorded config")
        changes.extend(placement)
    return experiment, changes


def _replay_tags(original: RunSummary, context: ReplayContext, changes: list[str], given: Any, steering: Steering,
                 data: Any) -> dict[str, str]:
    """The replay run's tags from its creation (a container's or batch job's ranks read the steering there). Where
    each secret came from (harness.config_redacted) is carried, for a replay of this replay; a patch
    --allow-secret-in-diff cut secrets from is carried too: this replay's code is not exact there either."""
    extra = derived.tags(T.KIND_REPLAY, original, copy=(T.CONFIG_REDACTED, T.GIT_PATCH_REDACTED),
                         extra=dict(context.extra_tags) or None)
    if original.tags.get(T.GIT_PATCH_REDACTED):
        events.emit(events.Warning(
            f"run {original.run_id} was recorded with secrets cut from its code patch (--allow-secret-in-diff, at "
            f"{original.tags[T.GIT_PATCH_REDACTED]}): this replay runs those lines with <redacted>, not as they ran."
        ))
    if changes:
        extra[T.CHANGES] = " ".join(changes)
    if given:
        extra[T.TOLERANCE] = format_tolerances(given)
    extra.update(steering.tags())
    if data.changes:
        extra[T.DATA_CHANGES] = "\n".join(c.line() for c in data.changes)
        for change in data.changes:
            events.emit(events.Warning(f"{change.line()} (allowed by --allow-data-changes)"))
    return extra


def _launch(p: _Prepared, options: ReplayOptions, context: ReplayContext) -> tuple[Outcome, Any]:
    """Record the replay run and run its ranks on the recorded code (or `context.commit`'s): the outcome and the job."""
    with p.loaded.recorded.code(options.repo, commit=context.commit) as (tree, exp_dir):
        # The worktree holds exactly the recorded code (checked above), which was admitted when it
        # was recorded: its untracked files are not refused a second time.
        git = gitsource.inspect(exp_dir, max_untracked_mib=None, allow_secrets=True)

        def recording(tagged: dict[str, str]) -> Callable[[dict[str, str]], str]:
            return lambda tags: create_record(
                p.tracker, p.experiment, exp_dir, git, image=tags, extra_tags=tagged,
                run_name=f"replay-of-{p.original.run_name}", experiment=p.original.experiment, data=p.data.manifest,
            )

        s = p.steering
        members = [(Steering(s.stop_at, seed, s.sketch_at), dict(tags)) for seed, tags in context.then]
        # A calibration's ranks start now, and import torch while its members' runs are recorded (as harness run's).
        ranks = executors.early_ranks(p.cfg, context.topology or Topology()) if members else None
        try:
            judge = None if context.perturb_seed is not None else _judging(p, options)
            job = p.loaded.recorded.job(
                tree, exp_dir, record=recording(p.tags), topology=context.topology, data=p.data.paths, steering=s,
                ranks=ranks, members=[(m, recording({**p.tags, **tags, **m.tags()})) for m, tags in members],
                judge=judge)
            outcome = executors.run(job)
        finally:
            if ranks is not None:
                ranks.stop()
                shutil.rmtree(Path(ranks.log_dir).parent, ignore_errors=True)
    return outcome, job


def _judging(p: _Prepared, options: ReplayOptions) -> Callable[[str, str, str], None]:
    """The judge the replay's job calls once the replay's record is complete, before it is sealed and closed
    (executors' Job.judge): the verdict is written then, and the run sealed once, with it. A replay killed from
    outside gets no verdict (raised once it is closed)."""
    def judge(replay_id: str, status: str, message: str) -> None:
        b = p.tracker.load_record(replay_id)
        b.status = status  # as it is about to be closed
        if status == T.FAILED and b.facts.get(T.FAILED_SIGNAL):
            return
        p.judged = (status, *_verdict(p, b, status, message, options, sealed=False))
    return judge


def _verdict(p: _Prepared, b: RunRecord, status: str, message: str, options: ReplayOptions,
             sealed: bool) -> tuple[RunRecord, RunRecord, Comparison]:
    """The replay judged against the original and the verdict recorded on it (`sealed`: onto the closed run)."""
    tracker = p.tracker
    a = p.a or tracker.load_record(p.run_id)
    failed = None if status == T.FINISHED else f"the replay {status}: {message}"
    members = list(p.study_members) if p.study_members is not None else None
    comparison = compare_runs(a, b, tolerance=judged_tolerance(a, b, p.given), replay_failed=failed,
                              incomplete_original=p.loaded.incomplete, first_steps=options.steps)
    comparison = with_rounding(tracker, comparison, a, b, p.envelope, members)
    comparison = with_noise(tracker, comparison, a, b, members)
    record_verdict(tracker, b.run_id, a, b, comparison, p.changes, sealed=sealed)
    return a, b, comparison


def _judge(p: _Prepared, outcome: Outcome, options: ReplayOptions, context: ReplayContext) -> ReplayResult:
    """The replay judged (where its backend did not judge it before its seal: after, onto the closed run), and
    localized where asked."""
    tracker, run_id, replay_id = p.tracker, p.run_id, outcome.run_id
    if p.judged is not None and p.judged[0] == outcome.status:
        _, a, b, comparison = p.judged
    else:  # judged after the close (a store that failed the close too: judged again as it ended)
        b = tracker.load_record(replay_id)
        killed = b.facts.get(T.FAILED_SIGNAL)
        if outcome.status == T.FAILED and killed:
            # Killed from outside (the OOM killer, kill -9): what the code would have done is unknown, so no verdict
            # is recorded against the original; the replay stays FAILED, with its reason.
            raise RunFailed(f"replay {replay_id} FAILED: {outcome.message}. A rank killed by {killed} from outside (the "
                            f"OOM killer, kill -9) is a failed replay, no verdict: none was recorded against run "
                            f"{run_id}. Free what killed it (memory), then replay it again: harness replay {run_id}")
        a, b, comparison = _verdict(p, b, outcome.status, outcome.message, options, sealed=True)
    # localize None: automatic when the run has checkpoints (a trace then re-executes at most checkpoint_every steps).
    localized = None
    localize = options.localize
    if comparison.verdict == Verdict.DIVERGED and context.localizer is not None and (
            localize or (localize is None and a.checkpoints)):
        localized = context.localizer(tracker, replay_id, comparison, p.changes, a, b, options.repo)
    record_replay_verdicts(tracker, p.original)
    return ReplayResult(p.original, outcome, comparison, p.changes, (a, b), localized)


def check_steps(steps: int | None, allow_incomplete: bool = False) -> None:
    """replay --steps K: what can be said before the run is even read (nothing is recorded)."""
    if steps is None:
        return
    if steps < 1:
        raise UsageError(f"--steps {steps}: a first check trains at least 1 step. Pass --steps 1 or more.")
    if allow_incomplete:
        raise UsageError("--steps judges the first K steps of a finished run; --allow-incomplete judges the steps a "
                           "FAILED or KILLED one reached. Pass one of them.")


def check_steps_of(steps: int, original: RunRecord) -> None:
    """K must lie within the original's steps (K equal to them is a full replay that says so)."""
    total = original_steps(original)
    if steps > total:
        raise UsageError(f"--steps {steps}: run {original.run_id} took {total} steps. Pass --steps {total} or fewer.")


def calibration_envelope(tracker: Tracker, run_id: str) -> Any:
    """The rounding envelope of the run's latest calibration (checked against its seal), or None."""
    return envelope_of(tracker, run_id)


def with_rounding(tracker: Tracker, cmp: Comparison, a: RunRecord, b: RunRecord, envelope: Any = False,
                  members: list[RunRecord] | None = None) -> Comparison:
    """A replay of a calibrated run that is not bit-identical, held to the calibration's rounding envelope (`envelope`:
    the one read before the replay ran; False: read it now). A study member's steps after the envelope's are held to
    it carried forward until it meets the seeds' spread (`members`: the study's, read here when not given)."""
    if meets(cmp.verdict, Policy.SETTLED) or not cmp.of_replay:
        return cmp
    if envelope is False:
        envelope = calibration_envelope(tracker, a.run_id)
    if envelope is None:
        return cmp
    moved = weights_distance(tracker, envelope, b.run_id)
    study_id = a.facts.get(T.STUDY)
    if members is None and study_id is not None and not meets(cmp.verdict, Policy.SETTLED):
        members = member_records(tracker, load_study(tracker, study_id))
    cmp = judge_rounding(cmp, a, b, envelope, moved, members if study_id is not None else None)
    w = envelope.weights
    if moved is None and w is not None and cmp.rounding is not None and (b.steps_total or 0) >= w.step:
        cmp.notes.append(f"{b.run_id} recorded no sketch of its weights after step {w.step} (a harness before "
                         "sketches, or another model): its weights were not held to the calibration's members'")
    return cmp


def with_noise(tracker: Tracker, cmp: Comparison, a: RunRecord, b: RunRecord,
               members: list[RunRecord] | None = None) -> Comparison:
    """A difference from a study member that bitwise could not hold to, judged against the study's seeds."""
    study_id = a.facts.get(T.STUDY)
    if study_id is None or cmp.verdict != Verdict.DIVERGED:
        return cmp
    if members is None:
        members = member_records(tracker, load_study(tracker, study_id))
    return judge_noise(cmp, a, b, study_id, members)


def verdict_tags(comparison: Comparison, markdown: str) -> dict[str, str]:
    """The tags a judged replay carries: its verdict, its report (the MLflow UI's description of the run) and the
    metrics the training did not determine, where the verdict names any."""
    out = {T.VERDICT: str(comparison.verdict), T.MLFLOW_RUN_NOTE: markdown}
    if comparison.undetermined:
        out[T.UNDETERMINED] = ",".join(comparison.undetermined)
    return out


def record_verdict(tracker: Tracker, replay_id: str, a: RunRecord, b: RunRecord, comparison: Comparison,
                   changes: list[str], sealed: bool = True) -> None:
    """Verdict tag, markdown report, comparison JSON and one plot per metric on the replay run. `sealed`: the run is
    closed and sealed already (its backend closed it elsewhere), so its seal says a verdict is being written, and it
    is sealed again with it; else the run's close seals it once, verdict included."""
    from harness.judge.report import plot_metrics, render_markdown

    if sealed:
        seal.open_for_verdict(tracker, replay_id)
    markdown = render_markdown(comparison, changes)
    tracker.set_tags(replay_id, verdict_tags(comparison, markdown))
    tracker.log_text(replay_id, markdown, T.ARTIFACT_REPORT)
    tracker.log_text(replay_id, json.dumps(comparison.to_dict(), indent=2), T.ARTIFACT_COMPARISON)
    with scratch.folder("plots") as tmp:
        plot_metrics(a, b, comparison, Path(tmp))
        tracker.log_dir(replay_id, Path(tmp), T.ARTIFACT_PLOTS_DIR)
    if sealed:
        seal.seal(tracker, replay_id)


def compare(options: CompareOptions) -> Comparison:
    """Delta and verdict between two existing runs, judged by run A's tolerance (a replay of A: the replay's, as
    judged_tolerance says) with `options.tolerances` (METRIC=ATOL[,RTOL]) on top; nothing is rerun or recorded."""
    run_a, run_b = options.run_a, options.run_b
    if run_b is None:
        raise UsageError(f"compare judges two runs: run {run_a} alone has no second run to be judged against.")
    given = parse_tolerances(list(options.tolerances))
    tracker = Tracker(options.tracking_uri, writable=False)  # comparing only reads
    first, second = loading.load(tracker, run_a, loading.COMPARE), loading.load(tracker, run_b, loading.COMPARE)
    a, b = first.record, second.record
    failed = None if b.status == T.FINISHED else f"run {run_b} is {b.status}"
    cmp = compare_runs(a, b, tolerance=judged_tolerance(a, b, given), replay_failed=failed)
    return with_noise(tracker, with_rounding(tracker, cmp, a, b), a, b)


# ---------------------------------------------------------------------------------------------
# A study: replay its members, judge them together


@dataclass
class StudyReplayResult:
    study: StudyRecord
    run_id: str  # the study replay run (kind study_replay), nested under the study
    verdict: str
    members: list[ReplayResult]  # in seed order
    equivalence: list[Any] = field(default_factory=list)  # noise.Equivalence per metric, when judged by noise
    draw_seed: int | None = None  # the seed that drew --members K
    reason: str = ""  # why the verdict is what it is, in a clause
    ui: UiLinks | None = None  # where to look at the study replay in the MLflow UI

    @property
    def exit_code(self) -> int:
        return exit_code(self.verdict)

    def summary(self) -> str:
        k, n = len(self.members), len(self.study.members)
        return f"{self.verdict}: {k} of {n} members replayed; {self.reason}"


def _draw(members: list[Any], k: int | None, seed: int | None) -> tuple[list[Any], int | None]:
    """All members, or k of them drawn with a seed that is recorded (so the draw can be repeated)."""
    if k is None or k >= len(members):
        if k is not None and k > len(members):
            raise UsageError(f"--members {k}: the study has {len(members)} finished members. Pass at most {len(members)}.")
        return members, None
    if seed is None:
        seed = random.SystemRandom().randrange(2**31)
    chosen = set(random.Random(seed).sample(range(len(members)), k))
    return [m for i, m in enumerate(members) if i in chosen], seed


def _study_verdict(results: list[ReplayResult], seeds: list[dict[str, float]], study_id: str) -> tuple[str, list[Any], str]:
    """The study replay's verdict from its members' comparisons; several members are judged together (TOST)."""
    verdicts = [r.judged.verdict for r in results]
    if all(v == Verdict.BITWISE for v in verdicts):
        return Verdict.BITWISE, [], "every member bit-identical"
    if all(meets(v, Policy.SAME_TRAINING) for v in verdicts):
        return Verdict.WITHIN_ROUNDING, [], "every member bit-identical or within its rounding envelope"
    if all(meets(v, Policy.WITHIN_TOLERANCE) for v in verdicts):
        return Verdict.WITHIN_TOLERANCE, [], "every member within tolerance"
    if Verdict.NOTHING_TO_COMPARE in verdicts:
        return Verdict.NOTHING_TO_COMPARE, [], "a member had nothing to compare"
    if Verdict.INCONCLUSIVE in verdicts and Verdict.DIVERGED not in verdicts:
        first = next(r for r in results if r.judged.verdict == Verdict.INCONCLUSIVE)
        return Verdict.INCONCLUSIVE, [], f"seed {first.original.tags.get(T.SEED)}: {first.judged.summary()}"
    # Only differences in values that were judged against the seeds can be noise.
    unjudged = [r for r in results if not meets(r.judged.verdict, Policy.WITHIN_TOLERANCE)
                and (r.judged.noise is None or r.judged.noise.reason)]
    if unjudged:
        first = unjudged[0]
        return Verdict.DIVERGED, [], f"seed {first.original.tags.get(T.SEED)}: {first.judged.summary()}"
    if len(results) == 1:
        return verdicts[0], [], results[0].judged.summary()
    tests = []
    finals = [tuple(noise.final_values(rec.metrics) for rec in r.records) for r in results if r.records]
    for metric in sorted(set.intersection(*(set(a) & set(b) for a, b in finals))):
        tests.append(noise.equivalence(metric, [a[metric] for a, _ in finals], [b[metric] for _, b in finals],
                                       [s[metric] for s in seeds if metric in s]))
    if tests and all(t.equivalent for t in tests):
        return Verdict.WITHIN_NOISE, tests, f"the {len(results)} replays are equivalent to their originals within one seed sd (TOST)"
    failing = [t for t in tests if not t.equivalent]
    return Verdict.DIVERGED, tests, "not equivalent within the seeds' noise: " + "; ".join(t.describe() for t in failing)


def replay_study(options: ReplayOptions, context: ReplayContext | None = None) -> StudyReplayResult:
    """Replay every member of study `options.run_id` (or `options.members` drawn with a recorded seed,
    `options.members_seed`) and judge them together; the other options are each member's replay's."""
    from harness.judge.report import render_study_markdown

    given = parse_tolerances(list(options.tolerances))  # bad input: said before the study replay is recorded
    context = context or ReplayContext()
    tracker = context.tracker or Tracker(options.tracking_uri)
    recorded = load_study(tracker, options.run_id)
    members = options.members
    loading.refuse(loading.STUDY_REPLAY, recorded.run)
    finished = [m for m in recorded.members if m.status == T.FINISHED]
    if members is not None and members < 1:
        raise UsageError(f"--members {members}: pass at least 1.")
    chosen, seed = _draw(finished, members, options.members_seed)
    for member in chosen:  # every member before the study replay is recorded
        seal.check(tracker, member.run_id)
    members_judged = member_records(tracker, recorded)
    tags = derived.tags(T.KIND_STUDY_REPLAY, recorded.run, version=recorded.run.tags[T.VERSION],
                        extra={T.STUDY_SIZE: str(len(chosen))})
    if seed is not None:
        tags[T.STUDY_MEMBERS_SEED] = str(seed)
    with derived.opened(tracker, recorded.run.experiment, tags, f"replay-of-{recorded.run.run_name}") as run_id:
        results = []
        for i, member in enumerate(chosen, 1):
            events.emit(events.Progress(f"study replay {run_id}: member {i} of {len(chosen)} "
                                        f"(seed {member.tags.get(T.SEED)}, run {member.run_id})", i, len(chosen)))
            # A member's difference is judged against the seeds' noise; tracing every member is not asked for.
            member_replay = replace(options, run_id=member.run_id, follow=False, localize=False, members=None,
                                    members_seed=None)
            results.append(replay(member_replay, replace(context, tracker=tracker, study_members=members_judged,
                                                         extra_tags={**context.extra_tags, T.STUDY_REPLAY: run_id})))
        verdict, tests, reason = _study_verdict(results, [noise.final_values(m.metrics) for m in members_judged],
                                                options.run_id)
        out = StudyReplayResult(recorded, run_id, verdict, results, tests, seed, reason)
        markdown = render_study_markdown(out)
        tracker.set_tags(run_id, {T.VERDICT: verdict, T.MLFLOW_RUN_NOTE: markdown,
                                  **({T.CHANGES: " ".join(results[0].changes)} if results and results[0].changes else {}),
                                  **({T.TOLERANCE: format_tolerances(given)} if given else {})})
        tracker.log_text(run_id, markdown, T.ARTIFACT_REPORT)
        tracker.log_text(run_id, json.dumps(json_safe(study_document(out)), indent=2), T.ARTIFACT_COMPARISON)
        return out


def study_document(result: StudyReplayResult) -> dict[str, Any]:
    """A study replay as its comparison.json records it (and `replay --json` prints it)."""
    return {
        "verdict": result.verdict, "summary": result.summary(), "exit_code": result.exit_code,
        "study_id": result.study.run_id, "draw_seed": result.draw_seed,
        "members": [{"original_id": r.original.run_id, "seed": r.original.tags.get(T.SEED),
                     "replay_id": r.outcome.run_id, "verdict": r.judged.verdict, "summary": r.judged.summary()}
                    for r in result.members],
        "equivalence": [asdict(t) for t in result.equivalence],
    }
