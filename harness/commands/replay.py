"""`harness replay` and `harness compare`: rerun a recorded run and judge it against the record."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from harness import events, executors, scratch, tags as T
from harness.config import Experiment, parse_overrides
from harness.errors import RunFailed, UsageError
from harness.executors import Outcome, Topology
from harness.fmt import json_safe
from harness.judge import noise
from harness.judge.compare import (
    BITWISE,
    DIVERGED,
    INCONCLUSIVE,
    NOTHING_TO_COMPARE,
    WITHIN_NOISE,
    WITHIN_ROUNDING,
    WITHIN_TOLERANCE,
    Comparison,
    compare_runs,
    original_steps,
)
from harness.judge.handoff import judge_noise, judge_rounding
from harness.judge.tolerance import format_tolerances, judged_tolerance, parse_tolerances
from harness.judge.verdicts import Policy, exit_code, meets
from harness.record import derived, loading, redaction, seal
from harness.record.calibration import envelope_of, weights_distance
from harness.record.newrun import create_record
from harness.record.replays import record_replay_verdicts
from harness.record.study import StudyRecord, load_study, member_records
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


# What traces a DIVERGED replay and records where it first differed, on the replay: (tracker, replay_id, comparison,
# changes, original's record, replay's record, repo) -> trace.Localized. The trace verb's after_replay is one.
Localizer = Callable[[Tracker, str, Comparison, list[str], RunRecord, RunRecord, Path | None], Any]


def follow_original(tracker: Tracker, run: RunSummary) -> RunSummary:
    """The run a replay or an audit was made from (and so on), which is what replaying it means."""
    return derived.followed(tracker, run, "replaying")


def replay(
    run_id: str,
    *,
    world_size: int | None = None,
    overrides: list[str] | None = None,
    allow_changes: bool = False,
    allow_data_changes: bool = False,
    data_paths: dict[str, str] | None = None,
    tracking_uri: str | None = None,
    repo: Path | None = None,
    executor: str | None = None,
    allow_incomplete: bool = False,
    follow: bool = True,
    topology: Topology | None = None,
    placement: list[str] | None = None,
    tracker: Tracker | None = None,
    extra_tags: dict[str, str] | None = None,
    study_members: list[RunRecord] | None = None,
    localize: bool | None = None,
    localizer: Localizer | None = None,
    tolerances: list[str] | None = None,
    commit: str | None = None,
    steps: int | None = None,
    perturb_seed: int | None = None,
    sketch_at: int | None = None,
    then: list[tuple[int, dict[str, str]]] | None = None,
) -> ReplayResult:
    """Rerun `run_id` as recorded and judge it. `study_members`: the records of the study it belongs to, when
    the caller has them already (a study replay judges every member against the same seeds). `tolerances`:
    METRIC=ATOL[,RTOL] specs that override the recorded replay.tolerance for this judgement (recorded). `commit`:
    run the code of that commit of the repository instead of the recorded one (harness bisect's probes; the replay
    records the commit it ran). `steps` K: a first check - train only the first K steps, stop every rank there,
    and judge those steps (harness.replay.steps). `perturb_seed`: a calibration member (harness calibrate) - the
    weights start nudged; it is the reference, so it is not judged (its comparison is None); `sketch_at`: its
    rank 0 sketches the weights after that many steps (a replay of a calibrated run sketches them at the calibration's
    M by itself, to hold them to the members'). `then`: further calibration members, (perturb seed, their tags), run
by the same ranks after this one and each recorded as a replay of its own (a backend that runs members:
Backend.runs_members; their outcomes in ReplayResult.members). `localizer`: what
    traces a DIVERGED replay where `localize` asks for it (commands/trace.py's after_replay, which the API hands in:
    the trace verb is not imported here); None: no replay is localized."""
    given = parse_tolerances(tolerances)  # bad input is said before anything else happens
    check_steps(steps, allow_incomplete)
    # First: an unreachable store is said before torch is even loaded.
    tracker = tracker or Tracker(tracking_uri)

    original = tracker.harness_run(run_id)
    if follow:
        original = follow_original(tracker, original)
        run_id = original.run_id
    # Before anything is recorded: a run that is no training job, edited since its seal, or not complete is refused.
    loaded = loading.load(tracker, original, loading.REPLAY, allow_incomplete=allow_incomplete)
    incomplete = loaded.incomplete
    recorded = loaded.recorded
    # A study replay has the member's record already (it judges every member against the same seeds).
    a = next((m for m in study_members or [] if m.run_id == run_id), None)
    if steps is not None:
        a = a or tracker.load_record(run_id)
        check_steps_of(steps, a)
    overrides = recorded.restore_secrets(overrides or [])  # a secret passed again is no change
    experiment, changes = apply_changes(recorded.experiment, world_size, overrides, allow_changes)
    changes = [redaction.redact_override(c, redaction.store_key(tracker.uri)) for c in changes]  # recorded and printed: no secret in them
    if executor is not None and executor != experiment.config.executor:
        # Where it runs is a choice of the replay, not a change of the experiment: no --allow-changes.
        experiment = experiment.with_changes([("--executor", OmegaConf.create({"executor": executor}))],
                                             executors.schema(), source="recorded config", check=False)
        changes.append(f"executor={executor}")
    if placement:  # the backends' options (--nodes, --partition, ...): where the replay runs, likewise
        experiment = experiment.with_changes([("backend options", parse_overrides(placement))], executors.schema(),
                                             source="recorded config")
        changes.extend(placement)
    recorded.experiment = experiment
    cfg = experiment.config
    # Before anything is recorded or launched: a calibration edited since its seal is refused here, not after the run.
    envelope = None if perturb_seed is not None else calibration_envelope(tracker, run_id)
    if envelope is not None and envelope.weights is not None and (steps is None or steps >= envelope.weights.step):
        sketch_at = envelope.weights.step  # its weights after the calibration's M steps, held to the members'
    # Before anything is recorded or launched: the data must hash as recorded (or the change be allowed).
    data = recorded.check_data(repo, allow_changes=allow_data_changes, flag="--allow-data-changes", paths=data_paths)
    if data.stats is not None:
        events.emit(events.Notice(data.stats.summary()))
    # Where each secret came from (harness.config_redacted) is carried, for a replay of this replay.
    # A patch --allow-secret-in-diff cut secrets from is carried too: this replay's code is not exact there either.
    extra = derived.tags(T.KIND_REPLAY, original, copy=(T.CONFIG_REDACTED, T.GIT_PATCH_REDACTED), extra=extra_tags)
    if original.tags.get(T.GIT_PATCH_REDACTED):
        events.emit(events.Warning(
            f"run {original.run_id} was recorded with secrets cut from its code patch (--allow-secret-in-diff, at "
            f"{original.tags[T.GIT_PATCH_REDACTED]}): this replay runs those lines with <redacted>, not as they ran."
        ))
    if changes:
        extra[T.CHANGES] = " ".join(changes)
    if given:
        extra[T.TOLERANCE] = format_tolerances(given)
    steering = Steering(stop_at=steps, perturb_seed=perturb_seed, sketch_at=sketch_at)
    extra.update(steering.tags())  # on the run from its creation: a container's or batch job's ranks read it there
    if data.changes:
        extra[T.DATA_CHANGES] = "\n".join(c.line() for c in data.changes)
        for change in data.changes:
            events.emit(events.Warning(f"{change.line()} (allowed by --allow-data-changes)"))

    if commit is not None and commit != original.tags.get(T.GIT_COMMIT):
        changes.append(f"commit={commit[:12]}")
        extra[T.CHANGES] = " ".join(changes)
    with recorded.code(repo, commit=commit) as (tree, exp_dir):
        # The worktree holds exactly the recorded code (checked above), which was admitted when it
        # was recorded: its untracked files are not refused a second time.
        git = gitsource.inspect(exp_dir, max_untracked_mib=None, allow_secrets=True)

        def recording(tagged: dict[str, str]) -> Callable[[dict[str, str]], str]:
            return lambda tags: create_record(
                tracker, experiment, exp_dir, git, image=tags, extra_tags=tagged,
                run_name=f"replay-of-{original.run_name}", experiment=original.experiment, data=data.manifest,
            )

        members = [(Steering(steps, seed, sketch_at), tags) for seed, tags in then or []]
        # A calibration's ranks start now, and import torch while its members' runs are recorded (as harness run's).
        ranks = executors.early_ranks(cfg, topology or Topology()) if members else None
        try:
            job = recorded.job(tree, exp_dir, record=recording(extra), topology=topology, data=data.paths,
                               steering=steering, ranks=ranks,
                               members=[(s, recording({**extra, **tags, **s.tags()})) for s, tags in members])
            outcome = executors.run(job)
        finally:
            if ranks is not None:
                ranks.stop()
                shutil.rmtree(Path(ranks.log_dir).parent, ignore_errors=True)
        replay_id = outcome.run_id

    if job.topology.node_rank != 0 or perturb_seed is not None:  # one job, one verdict: node 0's; a member: none
        return ReplayResult(original, outcome, None, changes, members=job.member_outcomes)
    a = a or tracker.load_record(run_id)
    b = tracker.load_record(replay_id)
    killed = b.facts.get(T.FAILED_SIGNAL)
    if outcome.status == T.FAILED and killed:
        # Killed from outside (the OOM killer, kill -9): what the code would have done is unknown, so no verdict is
        # recorded against the original; the replay stays FAILED, with its reason.
        raise RunFailed(f"replay {replay_id} FAILED: {outcome.message}. A rank killed by {killed} from outside (the OOM "
                        f"killer, kill -9) is a failed replay, no verdict: none was recorded against run {run_id}. Free "
                        f"what killed it (memory), then replay it again: harness replay {run_id}")
    failed = None if outcome.status == T.FINISHED else f"the replay {outcome.status}: {outcome.message}"
    comparison = compare_runs(a, b, tolerance=judged_tolerance(a, b, given), replay_failed=failed,
                              incomplete_original=incomplete, first_steps=steps)
    comparison = with_rounding(tracker, comparison, a, b, envelope, study_members)
    comparison = with_noise(tracker, comparison, a, b, study_members)
    record_verdict(tracker, replay_id, a, b, comparison, changes)
    # localize None: automatic when the run has checkpoints (a trace then re-executes at most checkpoint_every steps).
    localized = None
    if comparison.verdict == DIVERGED and localizer is not None and (localize or (localize is None and a.checkpoints)):
        localized = localizer(tracker, replay_id, comparison, changes, a, b, repo)
    record_replay_verdicts(tracker, original)
    return ReplayResult(original, outcome, comparison, changes, (a, b), localized)


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
    if study_id is None or cmp.verdict != DIVERGED:
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


def record_verdict(
    tracker: Tracker, replay_id: str, a: RunRecord, b: RunRecord, comparison: Comparison, changes: list[str]
) -> None:
    """Verdict tag, markdown report, comparison JSON and one plot per metric on the replay run."""
    from harness.judge.report import plot_metrics, render_markdown

    seal.open_for_verdict(tracker, replay_id)
    markdown = render_markdown(comparison, changes)
    tracker.set_tags(replay_id, verdict_tags(comparison, markdown))
    tracker.log_text(replay_id, markdown, T.ARTIFACT_REPORT)
    tracker.log_text(replay_id, json.dumps(comparison.to_dict(), indent=2), T.ARTIFACT_COMPARISON)
    with scratch.folder("plots") as tmp:
        plot_metrics(a, b, comparison, Path(tmp))
        tracker.log_dir(replay_id, Path(tmp), T.ARTIFACT_PLOTS_DIR)
    seal.seal(tracker, replay_id)  # the replay closed before its verdict was written: sealed again with it


def compare(run_a: str, run_b: str, tracking_uri: str | None = None, tolerances: list[str] | None = None) -> Comparison:
    """Delta and verdict between two existing runs, judged by run A's tolerance (a replay of A: the replay's, as
    judged_tolerance says) with `tolerances` (METRIC=ATOL[,RTOL]) on top; nothing is rerun or recorded."""
    given = parse_tolerances(tolerances)
    tracker = Tracker(tracking_uri, writable=False)  # comparing only reads
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
    if all(v == BITWISE for v in verdicts):
        return BITWISE, [], "every member bit-identical"
    if all(meets(v, Policy.SAME_TRAINING) for v in verdicts):
        return WITHIN_ROUNDING, [], "every member bit-identical or within its rounding envelope"
    if all(meets(v, Policy.WITHIN_TOLERANCE) for v in verdicts):
        return WITHIN_TOLERANCE, [], "every member within tolerance"
    if NOTHING_TO_COMPARE in verdicts:
        return NOTHING_TO_COMPARE, [], "a member had nothing to compare"
    if INCONCLUSIVE in verdicts and DIVERGED not in verdicts:
        first = next(r for r in results if r.judged.verdict == INCONCLUSIVE)
        return INCONCLUSIVE, [], f"seed {first.original.tags.get(T.SEED)}: {first.judged.summary()}"
    # Only differences in values that were judged against the seeds can be noise.
    unjudged = [r for r in results if not meets(r.judged.verdict, Policy.WITHIN_TOLERANCE)
                and (r.judged.noise is None or r.judged.noise.reason)]
    if unjudged:
        first = unjudged[0]
        return DIVERGED, [], f"seed {first.original.tags.get(T.SEED)}: {first.judged.summary()}"
    if len(results) == 1:
        return verdicts[0], [], results[0].judged.summary()
    tests = []
    finals = [tuple(noise.final_values(rec.metrics) for rec in r.records) for r in results if r.records]
    for metric in sorted(set.intersection(*(set(a) & set(b) for a, b in finals))):
        tests.append(noise.equivalence(metric, [a[metric] for a, _ in finals], [b[metric] for _, b in finals],
                                       [s[metric] for s in seeds if metric in s]))
    if tests and all(t.equivalent for t in tests):
        return WITHIN_NOISE, tests, f"the {len(results)} replays are equivalent to their originals within one seed sd (TOST)"
    failing = [t for t in tests if not t.equivalent]
    return DIVERGED, tests, "not equivalent within the seeds' noise: " + "; ".join(t.describe() for t in failing)


def replay_study(
    study_id: str,
    *,
    members: int | None = None,
    draw_seed: int | None = None,
    tracking_uri: str | None = None,
    tracker: Tracker | None = None,
    **options: Any,
) -> StudyReplayResult:
    """Replay every member of a study (or `members` drawn with a recorded seed) and judge them together.

    `options` are replay()'s (world_size, overrides, allow_changes, executor, ...), the same for every member.
    """
    from harness.judge.report import render_study_markdown

    given = parse_tolerances(options.get("tolerances"))  # bad input: said before the study replay is recorded
    tracker = tracker or Tracker(tracking_uri)
    recorded = load_study(tracker, study_id)
    loading.refuse(loading.STUDY_REPLAY, recorded.run)
    finished = [m for m in recorded.members if m.status == T.FINISHED]
    if members is not None and members < 1:
        raise UsageError(f"--members {members}: pass at least 1.")
    chosen, seed = _draw(finished, members, draw_seed)
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
            result = replay(member.run_id, follow=False, tracker=tracker, extra_tags={T.STUDY_REPLAY: run_id},
                            study_members=members_judged, **{"localize": False, **options})
            results.append(result)
        verdict, tests, reason = _study_verdict(results, [noise.final_values(m.metrics) for m in members_judged], study_id)
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
