"""`harness audit`: verify a long run by replaying K random checkpoint-to-checkpoint segments.

The idea is Proof-of-Learning's (Jia et al., 2021): a run is a chain of checkpoints; each link
(segment) can be recomputed on its own from its start checkpoint, and its end fingerprint must match
what the run recorded. Drawing K of N links catches one bad link with probability K/N at K/N of
the cost of a full replay.
"""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from harness import events, executors, tags as T
from harness.commands.options import AuditOptions
from harness.errors import HarnessError, RunFailed, RunRefused, UsageError
from harness.executors import Job
from harness.executors.base import SegmentMessages
from harness.fmt import markdown_table
from harness.judge import reproduced
from harness.judge.verdicts import Verdict, exit_code
from harness.record import checkpoints as checkpoint_store, derived, loading
from harness.runtime import boundaries, checkpoint
from harness.runtime.plan import LaunchPlan
from harness.store.tracking import Tracker


@dataclass
class Segment:
    index: int
    start: int  # checkpoint step it starts from
    end: int  # checkpoint step it must reach, or the run's last step for the final segment
    expected: str  # the fingerprint the run recorded at `end` (the final one for the last segment)
    ok: bool = False
    detail: str = ""
    seconds: float = 0.0


@dataclass
class AuditResult:
    run_id: str
    audit_id: str
    seed: int
    segments_total: int
    drawn: list[Segment]
    steps_total: int
    verdict: str

    @property
    def exit_code(self) -> int:
        return exit_code(self.verdict)  # BITWISE or DIVERGED: every segment bit for bit

    @property
    def step_fraction(self) -> float:
        return sum(s.end - s.start for s in self.drawn) / max(self.steps_total, 1)

    @property
    def catch_probability(self) -> float:
        return len(self.drawn) / self.segments_total

    def summary(self) -> str:
        failed = [s for s in self.drawn if not s.ok]
        if failed:
            s = failed[0]
            return f"{Verdict.DIVERGED} in segment {s.index} (steps {s.start}-{s.end}): {s.detail}"
        return (
            f"{Verdict.BITWISE}: {len(self.drawn)} of {self.segments_total} segments reproduced their end fingerprints "
            f"({self.step_fraction:.0%} of the run's steps)"
        )


def segments_of(checkpoints: dict[int, str], final: str | None, steps_total: int | None) -> list[Segment]:
    """Consecutive checkpoints, plus the last checkpoint to the end of the run."""
    steps = sorted(checkpoints)
    out = [Segment(i, a, b, checkpoints[b]) for i, (a, b) in enumerate(zip(steps, steps[1:]))]
    if steps and final and steps_total is not None and steps_total > steps[-1]:
        out.append(Segment(len(out), steps[-1], steps_total, final))
    return out


def audit(options: AuditOptions) -> AuditResult:
    run_id, segments, seed, repo = options.run_id, options.segments, options.seed, options.repo
    tracking_uri = options.tracking_uri
    tracker = Tracker(tracking_uri)
    loaded = loading.load(tracker, run_id, loading.AUDIT)
    run, record = loaded.summary, loaded.record
    chain = segments_of(record.checkpoints, record.final_fingerprint, record.steps_total)
    if not chain:
        cause, fix = boundaries.no_checkpoint(int(loaded.recorded.cfg.checkpoint_every), run.tags.get(T.LOOP),
                                              run.tags.get(T.NOTICES, ""))
        raise RunRefused(
            f"run {run_id} has no checkpoint chain to audit ({cause}). Replay it in full instead: "
            f"`harness replay {run_id}`. {fix}"
        )
    if not 1 <= segments <= len(chain):
        raise UsageError(f"--segments must be between 1 and {len(chain)} (the run has {len(chain)} segments).")
    seed = int.from_bytes(os.urandom(4), "little") if seed is None else seed
    drawn = sorted(random.Random(seed).sample(chain, segments), key=lambda s: s.index)
    recorded = loaded.recorded
    recorded.restore_secrets([])  # from the environment variables they were read from
    cfg = recorded.cfg
    executors.check_segments(cfg, "audit", here=False)  # their backend runs segments: said before the draw
    store = checkpoint_store.open_for(tracker, run_id)
    # Only the drawn segments' start steps, fetched when a server holds them; absent files are refused, never
    # judged: nothing is recorded.
    store.require([seg.start for seg in drawn], cfg.world_size, "the audit", run.tags.get(T.IMPORTED_FROM))
    events.emit(events.Notice(
        f"Auditing {segments} of {len(chain)} segments of run {run_id} (seed {seed}): "
        f"{', '.join(f'{s.index} [{s.start}-{s.end})' for s in drawn)}. "
        f"P(catching one bad segment) = {segments}/{len(chain)} = {segments / len(chain):.2f}"
    ))
    directory = store.directory
    executors.check_segments(cfg, "audit")  # and this machine can run them
    data = recorded.check_data(repo)  # a segment replayed on other data proves nothing about the run
    try:
        with recorded.code(repo) as (tree, exp_dir):
            job = recorded.job(tree, exp_dir, data=data.paths)
            pending = [seg for seg in drawn if _start_is_recorded(seg, record, cfg.world_size, directory)]
            while pending:
                # All pending segments in one launch; a segment that crashes its ranks fails alone.
                pending = _run_segments(pending, record, job, directory)
    finally:
        store.cleanup()
    for i, seg in enumerate(drawn, 1):
        events.emit(events.Progress(f"  segment {seg.index} [{seg.start}-{seg.end}): "
                                    f"{'ok' if seg.ok else 'FAILED: ' + seg.detail}", i, len(drawn)))
    verdict = Verdict.BITWISE if all(s.ok for s in drawn) else Verdict.DIVERGED
    result = AuditResult(run_id, "", seed, len(chain), drawn, record.steps_total or 0, verdict)
    result.audit_id = _record(tracker, run, result)
    return result


def _start_is_recorded(seg: Segment, record, world_size: int, directory: Path) -> bool:
    """The start checkpoint must hold the weights the run recorded: a file altered afterwards fails here."""
    for rank in range(world_size):
        path = checkpoint.path_for(directory, seg.start, rank)
        try:
            claimed = checkpoint.load(path)["fingerprint"]
        except HarnessError as err:
            seg.detail = f"start checkpoint unreadable: {err}"
            return False
        if claimed != record.checkpoints[seg.start]:
            seg.detail = (
                f"start checkpoint {path.parent.name}/{path.name} holds weights {claimed[:12]}, "
                f"the run recorded {record.checkpoints[seg.start][:12]}"
            )
            return False
    return True


def _differing_tensors(got: dict[str, str] | None, recorded: dict | None) -> str:
    """`; tensors that differ: a, b` when both sides have per-tensor digests (a run from before them has none)."""
    if not got or not recorded or not recorded.get("tensors"):
        return ""
    want = recorded["tensors"]
    names = sorted(n for n in want.keys() | got.keys() if want.get(n) != got.get(n))
    shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    return f"; tensors that differ: {shown} (of {len(want.keys() | got.keys())})" if names else ""


def _run_segments(segments: list[Segment], record, job: Job, directory: Path) -> list[Segment]:
    """Replay `segments` in one set of ranks; returns those left unrun when a segment crashed them."""
    plans = [
        # The final segment runs to the end of training; the others stop at their end checkpoint.
        LaunchPlan(str(directory), 0, resume_step=seg.start, stop_at=None if seg.end not in record.checkpoints else seg.end)
        for seg in segments
    ]
    messages = SegmentMessages(len(plans))
    leftover: list[Segment] = []
    try:
        executors.run_segments(job, plans, messages, "audit")
    except RunFailed as err:
        crashed = messages.current or 0
        segments[crashed].detail = f"the segment failed: {err}"
        leftover = segments[crashed + 1:]
    reports = messages.reports
    now = time.monotonic()
    for i, (seg, report) in enumerate(zip(segments, reports)):
        if report.started is not None:
            following = reports[i + 1].started if i + 1 < len(reports) else None
            seg.seconds = (following if following is not None else now) - report.started
        if report.end is None:
            continue
        step, fp = report.end
        if fp != seg.expected:
            seg.detail = f"end fingerprint at step {step} is {str(fp)[:12]}, the run recorded {seg.expected[:12]}"
            seg.detail += _differing_tensors(report.tensors, (record.checkpoint_tensors or {}).get(step))
            continue
        mismatch = _first_metric_mismatch(report.logged, record)
        if mismatch:
            seg.detail = mismatch
            continue
        seg.ok = True
    return leftover


def _first_metric_mismatch(logged: dict[tuple[str, int], float], record) -> str:
    # An audited run is FINISHED: it recorded every value it logged, so one it lacks differs.
    held = reproduced.values(reproduced.series(record.metrics), logged, complete=record.status == T.FINISHED)
    if held.unheld_line:
        events.emit(events.Notice(f"audit: {held.unheld_line}."))
    return held.mismatch


def _record(tracker: Tracker, run, result: AuditResult) -> str:
    """An MLflow run nested under the audited one: verdict, drawn segments, report."""
    tags = derived.tags(T.KIND_AUDIT, run, version=run.tags[T.VERSION], runtime=True, extra={
        T.VERDICT: result.verdict,
        T.AUDIT_SEED: str(result.seed),
        T.AUDIT_SEGMENTS: ",".join(str(s.index) for s in result.drawn),
    })
    with derived.opened(tracker, run.experiment, tags, f"audit-of-{run.run_name}") as audit_id:
        result.audit_id = audit_id
        report = render(result)
        tracker.set_tags(audit_id, {T.MLFLOW_RUN_NOTE: report})
        tracker.log_text(audit_id, report, T.ARTIFACT_AUDIT)
        doc = {**{k: v for k, v in asdict(result).items() if k != "drawn"},
               "segments": [asdict(s) for s in result.drawn], "step_fraction": result.step_fraction,
               "catch_probability": result.catch_probability}
        tracker.log_text(audit_id, json.dumps(doc, indent=2), T.ARTIFACT_AUDIT_JSON)
    return audit_id


def render(result: AuditResult) -> str:
    lines = [
        f"# Audit verdict: {result.verdict}",
        "",
        f"**{result.summary()}**",
        "",
        f"- Audited run: `{result.run_id}`",
        f"- Segments drawn: {len(result.drawn)} of {result.segments_total} (seed {result.seed}, "
        f"`harness audit {result.run_id} --segments {len(result.drawn)} --seed {result.seed}` redraws them)",
        f"- Probability that one bad segment is among them: {result.catch_probability:.2f}",
        f"- Compute: {result.step_fraction:.1%} of the run's {result.steps_total} steps",
        "",
        *markdown_table(["segment", "steps", "result", "seconds", "detail"],
                        [[str(s.index), f"{s.start}-{s.end}", "ok" if s.ok else "FAILED", f"{s.seconds:.1f}", s.detail or "-"]
                         for s in result.drawn]),
    ]
    return "\n".join(lines) + "\n"
