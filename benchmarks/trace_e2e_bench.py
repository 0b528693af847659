"""End to end: what `harness trace` and a localization cost next to the run and its replay.

Each round, in a fresh git repository and SQLite store: `harness run` (linear_ddp, 2 epochs = 10 steps,
a checkpoint every 5), then `harness replay` of it (the whole run again), then `harness trace --step 7`
(restore the checkpoint of step 5, re-execute steps 5-7, trace step 7 on rank 0). Interleaved rounds,
medians; the table gives the ratios to the run. Usage: python benchmarks/trace_e2e_bench.py [ROUNDS]
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchrepo import project  # benchmarks/, on sys.path when run as a script

ROOT = Path(__file__).resolve().parents[1]
OVERRIDES = ["train.epochs=2", "checkpoint_every=5"]




def _harness(repo: Path, store: Path, *args: str) -> tuple[float, str]:
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{store / 'mlflow.db'}",
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "harness", *args], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=1800)
    took = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"harness {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return took, proc.stdout.strip().splitlines()[-1]


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    times: dict[str, list[float]] = {"`harness run` (10 steps, baseline)": [], "`harness replay` (10 steps)": [],
                                     "`harness trace --step 7` (3 steps, 1 traced)": []}
    names = list(times)
    for i in range(rounds):
        with tempfile.TemporaryDirectory(prefix="trace-bench-") as tmp:
            store = Path(tmp) / "store"
            store.mkdir()
            repo = project(Path(tmp))
            took, run_id = _harness(repo, store, "run", "experiments/linear_ddp", *OVERRIDES)
            times[names[0]].append(took)
            times[names[1]].append(_harness(repo, store, "replay", run_id)[0])
            times[names[2]].append(_harness(repo, store, "trace", run_id, "--step", "7")[0])
        print(f"round {i + 1}/{rounds}: " + ", ".join(f"{v[-1]:.1f} s" for v in times.values()), file=sys.stderr, flush=True)
    baseline = statistics.median(times[names[0]])
    print(f"\nlinear_ddp ({', '.join(OVERRIDES)}), world_size 2, {rounds} interleaved rounds, {os.cpu_count()} CPU cores, "
          f"load average {os.getloadavg()[0]:.1f}\n")
    print("| command | median s | vs the run |")
    print("| --- | --- | --- |")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.1f} | {median / baseline:.2f}x |")


if __name__ == "__main__":
    main()
