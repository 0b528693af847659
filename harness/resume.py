"""`harness resume`: continue a FAILED or KILLED run from its last complete checkpoint, in the same run."""

from __future__ import annotations

import sys
from pathlib import Path

from harness import checkpoint, runner
from harness import tags as T
from harness.config import Executor
from harness.errors import HarnessError
from harness.recorded import RecordedRun
from harness.tracking import Tracker


def resume(run_id: str, *, tracking_uri: str | None = None, repo: Path | None = None) -> runner.Outcome:
    from harness import container
    from harness.launch import resolve_device

    tracker = Tracker(tracking_uri)
    run = tracker.harness_run(run_id)
    if run.status not in T.INCOMPLETE:
        hint = (
            " If its launcher itself was SIGKILLed, nothing could mark it; check no rank still runs, then "
            "mark it: `mlflow runs` or MlflowClient().set_terminated(id, 'FAILED')."
            if run.status == T.RUNNING else ""
        )
        raise HarnessError(f"run {run_id} is {run.status}; only FAILED or KILLED runs are resumed.{hint}")
    recorded = RecordedRun.load(tracker, run)
    cfg = recorded.cfg
    directory = tracker.local_artifact_dir(run_id) / T.ARTIFACT_CHECKPOINTS
    step = checkpoint.latest_complete(directory, cfg.world_size)
    if step is None:
        raise HarnessError(
            f"run {run_id} has no complete checkpoint in {directory} (checkpoint_every was 0, or it died "
            f"before the first). Rerun it instead: harness replay {run_id}"
        )
    with recorded.code(repo) as (tree, exp_dir):
        if cfg.executor == Executor.docker:
            digest = run.tags[T.IMAGE_DIGEST]
            pinned = container.pin(run.tags[T.IMAGE], digest=digest)
        else:
            resolve_device(cfg.device.value, cfg.backend.value, cfg.world_size)
        previous = run.tags.get(T.RESUMES)
        tracker.reopen(run_id)
        tracker.set_tags(run_id, {T.RESUMES: f"{previous},{step}" if previous else str(step)})
        print(f"Resuming run {run_id} from the checkpoint of step {step}.", file=sys.stderr, flush=True)
        if cfg.executor == Executor.docker:
            status, code, message = container.run_in_container(
                tracker, run_id, pinned, tree, run.tags[T.EXPERIMENT_PATH],
                container.wants_gpus(cfg.device.value), extra_args=["--resume-step", str(step)],
            )
            return runner.Outcome(run_id, status, code, message)
        return runner.execute(tracker, run_id, cfg, exp_dir, resume_step=step)
