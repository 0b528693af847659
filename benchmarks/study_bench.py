"""Time a 5-seed study (sequential and --parallel 2) against 5 separate `harness run` calls of the same seeds.

Each round runs the three ways one after another (interleaved, so a change in the machine's load hits
all three alike) in a fresh git repository and SQLite store; the table gives each way's median and its
ratio to the separate runs. Usage: python benchmarks/study_bench.py [ROUNDS] [SEEDS]
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
OVERRIDES = ["train.epochs=1"]




def _harness(repo: Path, store: Path, *args: str) -> float:
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{store / 'mlflow.db'}",
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "harness", *args], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=1800)
    took = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"harness {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return took


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    seeds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    ways = {
        f"{seeds} x `harness run seed=S` (baseline)": lambda r, s: sum(
            _harness(r, s, "run", "experiments/linear_ddp", f"seed={k}", *OVERRIDES) for k in range(seeds)),
        f"`harness run --seeds {seeds}`": lambda r, s: _harness(
            r, s, "run", "experiments/linear_ddp", "--seeds", str(seeds), *OVERRIDES),
        f"`harness run --seeds {seeds} --parallel 2`": lambda r, s: _harness(
            r, s, "run", "experiments/linear_ddp", "--seeds", str(seeds), "--parallel", "2", *OVERRIDES),
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    for i in range(rounds):
        for name, way in ways.items():
            with tempfile.TemporaryDirectory(prefix="study-bench-") as tmp:
                store = Path(tmp) / "store"
                store.mkdir()
                times[name].append(way(project(Path(tmp)), store))
            print(f"round {i + 1}/{rounds}: {name} {times[name][-1]:.1f} s", file=sys.stderr, flush=True)
    baseline = statistics.median(next(iter(times.values())))
    print(f"\nlinear_ddp ({', '.join(OVERRIDES)}), world_size 2, {seeds} seeds, {rounds} interleaved rounds, "
          f"{os.cpu_count()} CPU cores\n")
    print("| way | median s | per seed s | vs separate runs |")
    print("| --- | --- | --- | --- |")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.1f} | {median / seeds:.1f} | {median / baseline:.2f}x |")


if __name__ == "__main__":
    main()
