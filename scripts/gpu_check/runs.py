"""scripts/gpu-check.sh's reads of the recorded runs (through harness's own store module): the determinism settings
a strict CUDA run recorded, the strict-vs-off step time, and how far a replay drifted against the rounding envelope.

usage: python scripts/gpu_check/runs.py tags RUN_ID
       python scripts/gpu_check/runs.py steptime STRICT_RUN_ID OFF_RUN_ID
       python scripts/gpu_check/runs.py drift RUN_ID REPLAY_ID [REPLAY_ID ...]
Prints one line; exit 0 as expected, 1 not.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from harness import tags as T  # noqa: E402  (after the path above)
from harness.store.tracking import Tracker  # noqa: E402

# What strict must have read back in rank 0 on a GPU (harness/runtime/determinism.py read_determinism): tags that
# exist today. Keys for the new fp32_precision API and NCCL_NVLS_ENABLE are checked where the run recorded them.
STRICT = {
    "level": "strict", "deterministic_algorithms": "True", "deterministic_warn_only": "False",
    "cudnn_deterministic": "True", "cudnn_benchmark": "False", "cuda_matmul_tf32": "False", "cudnn_tf32": "False",
    "float32_matmul_precision": "highest", "cublas_workspace_config": ":4096:8",
}
# Values of an fp32_precision setting that keep full fp32 (torch >= 2.9: "ieee"; "none" leaves the default, fp32).
FULL_FP32 = {"ieee", "none", "highest"}


def _precision(tags: dict[str, str]) -> dict[str, str]:
    return {k[len(T.DETERMINISM_PREFIX):]: v for k, v in tags.items()
            if k.startswith(T.DETERMINISM_PREFIX) and "fp32_precision" in k}


def wrong_settings(tags: dict[str, str]) -> list[str]:
    """What a strict run's tags say that strict must not: a setting off its value, TF32 by the new API, a change."""
    wrong = [f"{k}={tags.get(T.DETERMINISM_PREFIX + k)!r} (want {v!r})" for k, v in STRICT.items()
             if tags.get(T.DETERMINISM_PREFIX + k) != v]
    wrong += [f"{k}={v!r} (want full fp32)" for k, v in _precision(tags).items() if v not in FULL_FP32]
    changes = tags.get(T.DETERMINISM_CHANGES, "none")
    if changes not in ("", "none"):
        wrong.append(f"{T.DETERMINISM_CHANGES}={changes!r}")
    return wrong


def check_tags(run_id: str) -> int:
    tags = Tracker(writable=False).get_run(run_id).tags
    wrong, precision = wrong_settings(tags), _precision(tags)
    nvls = {k: v for k, v in tags.items() if "NCCL_NVLS_ENABLE" in k}
    extra = (f"; fp32_precision {precision}" if precision else "; no fp32_precision tags") + \
            (f"; {nvls}" if nvls else "; NCCL_NVLS_ENABLE not recorded")
    if wrong:
        print("wrong: " + ", ".join(wrong) + extra)
        return 1
    print(f"{len(STRICT)} strict settings as expected{extra}")
    return 0


def step_time(strict_id: str, off_id: str) -> int:
    tracker = Tracker(writable=False)
    times = []
    for run_id in (strict_id, off_id):
        stamps = sorted(ts for _, ts, _ in tracker.metric_entries(run_id, "train_loss"))
        if len(stamps) < 3:
            print(f"run {run_id} logged {len(stamps)} train_loss points: no step time")
            return 1
        times.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
    ratio = times[0] / times[1] if times[1] > 0 else float("inf")
    print(f"strict {times[0]:.2f} ms/step, off {times[1]:.2f} ms/step, strict/off {ratio:.2f}x")
    return 0


def drift(run_id: str, replay_ids: list[str]) -> int:
    """The machine's own run-to-run variation beside the envelope: at a few steps, the envelope's relative half-width
    and each replay's relative distance from the run (train_loss). Exit 1 when the run has no envelope."""
    import numpy as np

    from harness.record.calibration import envelope_of

    tracker = Tracker(writable=False)
    envelope = envelope_of(tracker, run_id)
    if envelope is None or "train_loss" not in envelope.metrics:
        print(f"run {run_id} has no calibration with train_loss")
        return 1
    env = envelope.metrics["train_loss"]
    widths, original = env.half_widths(), np.abs(np.asarray(env.original))
    picks = sorted({i for i in (0, 1, 2, len(env.steps) // 2, len(env.steps) - 1) if 0 <= i < len(env.steps)})
    parts = []
    for i in picks:
        cell = f"step {env.steps[i]}: envelope {widths[i] / original[i]:.1e}"
        for n, rid in enumerate(replay_ids, 1):
            steps, values = tracker.metric_history(rid, "train_loss")
            found = dict(zip(steps, values))
            if env.steps[i] in found:
                cell += f" r{n} {abs(found[env.steps[i]] - env.original[i]) / original[i]:.1e}"
        parts.append(cell)
    print(f"{envelope.members} members x {envelope.steps} steps, relative train_loss: " + "; ".join(parts))
    return 0


def main() -> int:
    if len(sys.argv) >= 4 and sys.argv[1] == "drift":
        return drift(sys.argv[2], sys.argv[3:])
    if len(sys.argv) == 3 and sys.argv[1] == "tags":
        return check_tags(sys.argv[2])
    if len(sys.argv) == 4 and sys.argv[1] == "steptime":
        return step_time(sys.argv[2], sys.argv[3])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
