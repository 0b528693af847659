"""`harness resume`: continue a FAILED or KILLED run from its last complete checkpoint, in the same run."""

from __future__ import annotations

import sys
from pathlib import Path

from harness import checkpoint_store, executors
from harness import tags as T
from harness.errors import HarnessError
from harness.executors import Outcome
from harness.recorded import RecordedRun, refuse_non_training
from harness.tracking import Tracker


def resume(run_id: str, *, tracking_uri: str | None = None, repo: Path | None = None) -> Outcome:
    tracker = Tracker(tracking_uri)
    run = tracker.harness_run(run_id)
    refuse_non_training(run, "resume")
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
            f"run {run_id} has no complete checkpoint in its artifacts (checkpoint_every was 0, or it died "
            f"before the first), so it cannot be resumed. Rerun it from the start, judged on the steps it reached: "
            f"`harness replay {run_id} --allow-incomplete`; or run it again with checkpoint_every=N to make it resumable."
        )

    def reopen(tags: dict[str, str]) -> str:
        previous = run.tags.get(T.RESUMES)
        tracker.reopen(run_id)
        tracker.set_tags(run_id, {T.RESUMES: f"{previous},{step}" if previous else str(step)})
        print(f"Resuming run {run_id} from the checkpoint of step {step}.", file=sys.stderr, flush=True)
        return run_id

    data = recorded.check_data(repo)  # the rest of the run must read the bytes its first part read
    with recorded.code(repo) as (tree, exp_dir):
        return executors.run(
            recorded.job(tree, exp_dir, record=reopen, run_id=run_id, resume_step=step, data=data.paths)
        )
