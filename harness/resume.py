"""`harness resume`: continue a FAILED or KILLED run from its last complete checkpoint, in the same run.

A resume must be the uninterrupted run's continuation bit for bit, and harness cannot see everything a
loop depends on (a batch drawn before the optimizer step, randomness outside the step, state of the
user's own). So before it continues, a resume proves itself: it re-executes the last checkpoint segment
(from the checkpoint before it) and checks that it lands on the tensors the run recorded there. If it
does not, the resume is refused, naming the first tensor that differs.
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path
from typing import Any

from harness import checkpoint_store, executors, seal
from harness import tags as T
from harness.errors import HarnessError, RunFailed
from harness.executors import Outcome
from harness.recorded import RecordedRun, refuse_non_training
from harness.tracking import RunRecord, Tracker

LIKELY_CAUSES = (
    "a batch drawn before the optimizer step (a prefetch such as `X, Y = get_batch()` between forward and "
    "optimizer.step()), randomness drawn outside the step, or state the checkpoint does not hold (a second model, "
    "an EMA, a generator or buffer of your own)"
)


def resume(run_id: str, *, tracking_uri: str | None = None, repo: Path | None = None) -> Outcome:
    tracker = Tracker(tracking_uri)
    run = tracker.harness_run(run_id)
    refuse_non_training(run, "resume")
    # A FAILED or KILLED run was sealed when it closed; the resumed run is sealed again when it closes.
    seal.check(tracker, run_id)
    if run.status not in T.INCOMPLETE:
        hint = (
            f" If its launcher itself was SIGKILLed, nothing could mark it; check no rank still runs, then "
            f"close it: `harness mark {run_id} --status FAILED`."
            if run.status == T.RUNNING else ""
        )
        raise HarnessError(f"run {run_id} is {run.status}; only FAILED or KILLED runs are resumed.{hint}")
    recorded = RecordedRun.load(tracker, run)
    cfg = recorded.cfg
    store = checkpoint_store.open_for(tracker, run_id)
    step = store.latest(cfg.world_size)  # fetched into the store's local folder when a server holds it
    if step is None:
        raise HarnessError(
            f"run {run_id} has no complete checkpoint in its artifacts (checkpoint_every was 0, its loop gave harness "
            f"no step boundary to save at, or it died before the first), so it cannot be resumed. Rerun it from the "
            f"start, judged on the steps it reached: `harness replay {run_id} --allow-incomplete`; or run it again with "
            "checkpoint_every=N to make it resumable."
        )
    record = tracker.load_record(run_id)
    earlier = max((s for s in record.checkpoints if s < step), default=None)
    if earlier is not None and not store.fetch(earlier, cfg.world_size):
        earlier = None

    def reopen(tags: dict[str, str]) -> str:
        previous = run.tags.get(T.RESUMES)
        tracker.reopen(run_id)
        tracker.set_tags(run_id, {T.RESUMES: f"{previous},{step}" if previous else str(step)})
        print(f"Resuming run {run_id} from the checkpoint of step {step}.", file=sys.stderr, flush=True)
        return run_id

    data = recorded.check_data(repo)  # the rest of the run must read the bytes its first part read
    with recorded.code(repo) as (tree, exp_dir):
        if earlier is None:
            print(f"The checkpoint of step {step} is the run's first: there is no earlier one to re-execute it from, "
                  "so the resume continues unproven.", file=sys.stderr, flush=True)
        else:
            prove(record, cfg, exp_dir, Path(store.directory), earlier, step, data.paths)
        return executors.run(
            recorded.job(tree, exp_dir, record=reopen, run_id=run_id, resume_step=step, data=data.paths)
        )


def prove(record: RunRecord, cfg: Any, exp_dir: Path, directory: Path, start: int, end: int,
          data: dict[str, str] | None) -> None:
    """Re-execute steps [start, end) from the checkpoint of `start` and hold the result to what the run recorded at
    `end` (every tensor's digest, and the values it logged on the way); HarnessError (exit 2) when it differs."""
    from harness.context import CheckpointPlan
    from harness.executors.local import SegmentMessages, run_segments

    print(f"Proving the resume: re-executing steps {start}-{end} from the checkpoint of step {start}.",
          file=sys.stderr, flush=True)
    messages = SegmentMessages(1)
    refused = (f"resume refused: re-executing steps {start}-{end} of run {record.run_id} from its checkpoint of step "
               f"{start}")
    how = (f"Likely causes: {LIKELY_CAUSES}. Draw each step's batches inside the step (`for it in ctx.steps(n):`), "
           f"register what the step depends on (ctx.track), or rerun it: harness replay {record.run_id} --allow-incomplete.")
    try:
        run_segments(cfg, exp_dir, [CheckpointPlan(str(directory), 0, resume_step=start, stop_at=end)], messages, data)
    except RunFailed as err:
        raise HarnessError(f"{refused} failed ({err}). Fix the failure, or rerun it: harness replay {record.run_id} "
                           "--allow-incomplete.") from None
    report = messages.reports[0]
    if report.end is None:
        raise HarnessError(f"{refused} never reached step {end}: the loop gave harness no step boundary to stop at. {how}")
    at, sha = report.end
    recorded_tensors = (record.checkpoint_tensors or {}).get(end, {}).get("tensors") or {}
    if at != end:
        raise HarnessError(f"{refused} stopped at step {at}, not {end} (the run ended there). {how}")
    differing = [name for name in recorded_tensors if report.tensors.get(name) != recorded_tensors[name]]
    differing += sorted(name for name in report.tensors if name not in recorded_tensors)
    if differing:
        more = f" (and {len(differing) - 1} more of {len(recorded_tensors)} tensors)" if len(differing) > 1 else ""
        raise HarnessError(f"{refused} did not land on the tensors it recorded at step {end}: '{differing[0]}' "
                           f"differs{more}. {how}")
    if sha != record.checkpoints.get(end):
        raise HarnessError(f"{refused} ended with weights {str(sha)[:12]}, the run recorded "
                           f"{str(record.checkpoints.get(end))[:12]} at step {end}. {how}")
    mismatch = _first_logged_mismatch(report.logged, record, start, end)
    if mismatch:
        raise HarnessError(f"{refused} logged other values: {mismatch}. {how}")
    print(f"Proved: steps {start}-{end} re-executed land on the {len(recorded_tensors) or 'recorded'} tensors the run "
          f"recorded at step {end}.", file=sys.stderr, flush=True)


def _first_logged_mismatch(logged: dict[tuple[str, int], float], record: RunRecord, start: int, end: int) -> str:
    lookup = {key: dict(zip(steps.tolist(), values.tolist())) for key, (steps, values) in record.metrics.items()}
    for (key, step), value in sorted(logged.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        if not start <= step < end:
            continue
        original = lookup.get(key, {}).get(step)
        if original is not None and struct.pack("<d", original) != struct.pack("<d", value):
            return f"{key} at step {step}: {value!r}, the run recorded {original!r}"
    return ""
