"""`harness replay` and `harness compare`: rerun a recorded run and judge it against the record."""

from __future__ import annotations

import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from harness import gitsource, liveness, runner
from harness import tags as T
from harness.compare import DIVERGED, Comparison, compare_runs, default_tolerance, judge_noise
from harness.config import compose, parse_overrides, validate
from harness.errors import HarnessError
from harness.executors import Outcome, Topology
from harness.recorded import RecordedRun
from harness.tracking import RunRecord, RunSummary, Tracker


@dataclass
class ReplayResult:
    original: RunSummary
    outcome: Outcome
    comparison: Comparison | None  # None on nodes other than 0 of a multi-node replay: node 0 judges it
    changes: list[str]


def apply_changes(
    cfg: DictConfig, world_size: int | None, overrides: list[str], allow_changes: bool
) -> tuple[DictConfig, list[str]]:
    """--world-size and KEY=VALUE changes; the latter only with --allow-changes. Returns what changed."""
    if overrides and not allow_changes:
        raise HarnessError(
            f"replay uses the recorded config; overrides {' '.join(overrides)} would change it. "
            "Pass --allow-changes to replay with them (they are recorded and reported)."
        )
    changes = list(overrides)
    fragments = [("recorded config", cfg)]
    if overrides:
        fragments.append(("overrides", parse_overrides(overrides)))
    if world_size is not None and world_size != cfg.world_size:
        fragments.append(("--world-size", OmegaConf.create({"world_size": world_size})))
        changes.append(f"world_size={world_size}")
    if len(fragments) == 1:
        return cfg, []
    new = compose(fragments)
    validate(new, None)
    return new, changes


_DERIVED_OF = {T.KIND_REPLAY: T.REPLAY_OF, T.KIND_AUDIT: T.AUDIT_OF}  # kind -> tag naming the run it was made from


def follow_original(tracker: Tracker, run: RunSummary) -> RunSummary:
    """The run a replay or an audit was made from (and so on), which is what replaying it means."""
    seen = {run.run_id}
    while (tag := _DERIVED_OF.get(run.tags.get(T.KIND, ""))) and run.tags.get(tag):
        source = tracker.harness_run(run.tags[tag])
        if source.run_id in seen:  # a hand-edited tag could close a loop
            break
        print(f"run {run.run_id} is {'an audit' if tag == T.AUDIT_OF else 'a replay'} of {source.run_id}; "
              f"replaying {source.run_id}", file=sys.stderr)
        seen.add(source.run_id)
        run = source
    return run


def check_replayable(run: RunSummary, allow_incomplete: bool) -> None:
    """Refuse a run whose record is not complete: there is no end to judge a replay against."""
    rid = run.run_id
    if run.status == T.RUNNING:
        now = time.time()
        if liveness.is_stale(run.tags, now):
            raise HarnessError(
                f"run {rid} is RUNNING but its launcher is gone (no heartbeat for "
                f"{liveness.heartbeat_age(run.tags, now):.0f} s). Close it with `harness mark {rid} --status FAILED`, "
                "then replay it with --allow-incomplete."
            )
        raise HarnessError(
            f"run {rid} is still RUNNING; its record is not complete. Wait until it ends, then replay it."
        )
    if run.status in T.INCOMPLETE and not allow_incomplete:
        try:  # the flattened config is in the params; a resume needs checkpoints
            checkpointed = int(run.params.get("checkpoint_every", "0")) > 0
        except ValueError:
            checkpointed = False
        resume = f"Resume it with `harness resume {rid}` (it has checkpoints), or pass" if checkpointed else "Pass"
        raise HarnessError(
            f"run {rid} is {run.status}: it stopped before its end, so a full replay cannot be judged against it. "
            f"{resume} --allow-incomplete to replay it and compare only the steps it reached."
        )


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
) -> ReplayResult:
    tracker = Tracker(tracking_uri)  # first: an unreachable store is said before torch is even loaded
    from harness import executors

    original = tracker.harness_run(run_id)
    if follow:
        original = follow_original(tracker, original)
        run_id = original.run_id
    check_replayable(original, allow_incomplete)
    incomplete = original.status in T.INCOMPLETE
    recorded = RecordedRun.load(tracker, original)
    cfg, changes = apply_changes(recorded.cfg, world_size, overrides or [], allow_changes)
    if executor is not None and executor != cfg.executor.value:
        # Where it runs is a choice of the replay, not a change of the experiment: no --allow-changes.
        cfg = compose([("recorded config", cfg), ("--executor", OmegaConf.create({"executor": executor}))])
        changes.append(f"executor={executor}")
    if placement:  # --nodes, --partition, ...: where a Slurm replay runs, likewise
        cfg = compose([("recorded config", cfg), ("Slurm options", parse_overrides(placement))])
        validate(cfg, None)
        changes.extend(placement)
    recorded.cfg = cfg
    # Before anything is recorded or launched: the data must hash as recorded (or the change be allowed).
    data = recorded.check_data(repo, allow_changes=allow_data_changes, flag="--allow-data-changes", paths=data_paths)
    if data.stats is not None:
        print(data.stats.summary(), file=sys.stderr)
    extra = {T.KIND: T.KIND_REPLAY, T.REPLAY_OF: run_id, T.MLFLOW_PARENT_RUN_ID: run_id}
    if changes:
        extra[T.CHANGES] = " ".join(changes)
    if data.changes:
        extra[T.DATA_CHANGES] = "\n".join(c.line() for c in data.changes)
        for change in data.changes:
            print(f"Warning: {change.line()} (allowed by --allow-data-changes)", file=sys.stderr)

    with recorded.code(repo) as (tree, exp_dir):
        # The worktree holds exactly the recorded code (checked above), which was admitted when it
        # was recorded: its untracked files are not refused a second time.
        git = gitsource.inspect(exp_dir, max_untracked_mib=None, allow_secrets=True)

        def record(tags: dict[str, str]) -> str:
            return runner.create_record(
                tracker, cfg, exp_dir, git, image=tags, extra_tags=extra,
                run_name=f"replay-of-{original.run_name}", experiment=original.experiment, data=data.manifest,
            )

        job = recorded.job(tree, exp_dir, record=record, topology=topology, data=data.paths)
        outcome = executors.run(job)
        replay_id = outcome.run_id

    if job.topology.node_rank != 0:  # one job, one verdict: node 0's
        return ReplayResult(original, outcome, None, changes)
    comparison = judge(tracker, run_id, replay_id, outcome, incomplete)
    record_verdict(tracker, replay_id, tracker.load_record(run_id), tracker.load_record(replay_id), comparison, changes)
    return ReplayResult(original, outcome, comparison, changes)


def judge(
    tracker: Tracker, original_id: str, replay_id: str, outcome: Outcome | None = None, incomplete: bool = False
) -> Comparison:
    a, b = tracker.load_record(original_id), tracker.load_record(replay_id)
    failed = None
    if outcome is not None and outcome.status != T.FINISHED:
        failed = f"the replay {outcome.status}: {outcome.message}"
    cmp = compare_runs(a, b, tolerance=default_tolerance(a.config), replay_failed=failed, incomplete_original=incomplete)
    return with_noise(tracker, cmp, a, b)


def with_noise(tracker: Tracker, cmp: Comparison, a: RunRecord, b: RunRecord) -> Comparison:
    """A difference from a study member that bitwise could not hold to, judged against the study's seeds."""
    from harness import study

    study_id = a.facts.get(T.STUDY)
    if study_id is None or cmp.verdict != DIVERGED:
        return cmp
    recorded = study.load_study(tracker, study_id)
    return judge_noise(cmp, a, b, study_id, study.member_records(tracker, recorded))


def record_verdict(
    tracker: Tracker, replay_id: str, a: RunRecord, b: RunRecord, comparison: Comparison, changes: list[str]
) -> None:
    """Verdict tag, markdown report, comparison JSON and one plot per metric on the replay run."""
    from harness.report import plot_metrics, render_markdown

    markdown = render_markdown(comparison, changes)
    tracker.set_tags(replay_id, {T.VERDICT: comparison.verdict, T.MLFLOW_RUN_NOTE: markdown})
    tracker.log_text(replay_id, markdown, T.ARTIFACT_REPORT)
    tracker.log_text(replay_id, json.dumps(comparison.to_dict(), indent=2), T.ARTIFACT_COMPARISON)
    with tempfile.TemporaryDirectory() as tmp:
        plot_metrics(a, b, comparison, Path(tmp))
        tracker.log_dir(replay_id, Path(tmp), T.ARTIFACT_PLOTS_DIR)


def compare(run_a: str, run_b: str, tracking_uri: str | None = None) -> Comparison:
    """Delta and verdict between two existing runs, judged by run A's tolerance; nothing is rerun."""
    tracker = Tracker(tracking_uri, writable=False)  # comparing only reads
    a, b = tracker.load_record(run_a), tracker.load_record(run_b)
    failed = None if b.status == T.FINISHED else f"run {run_b} is {b.status}"
    cmp = compare_runs(a, b, tolerance=default_tolerance(a.config), replay_failed=failed)
    return with_noise(tracker, cmp, a, b)
