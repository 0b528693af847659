"""`harness calibrate RUN` against `harness run` itself: what a calibration costs, in multiples of the run's wall time.

Each round runs, per job, `harness run experiments/JOB` from this tree, then `harness calibrate` of that run with the
defaults (8 members, the first 50 steps or all of a shorter run) from this tree and, with --before TREE, from another
checkout of harness (e.g. main, whose members are one launch each), in a rotating order (interleaved, so a change in
the machine's load hits them alike). Every command runs in one throwaway git repository holding copies of the
experiments, with one SQLite store. Prints a markdown table: per job and variant the median wall time and the median
of each round's calibrate / run ratio (paired with that round's run), and the load average.

Usage: python benchmarks/calibrate_bench.py [--rounds N] [--jobs linear_ddp,digits_cnn] [--before /work/main]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchrepo import project  # benchmarks/, on sys.path when run as a script

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 1800.0


def _harness(tree: Path, args: list[str], cwd: Path, uri: str) -> tuple[float, str]:
    """(wall seconds, the last line of stdout) of `harness ARGS` run from `tree`; a failure ends the benchmark."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MLFLOW_TRACKING_URI")}
    env.update(PYTHONPATH=str(tree), MLFLOW_TRACKING_URI=uri, PYTHONUNBUFFERED="1")
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "harness", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    wall = time.monotonic() - start
    if done.returncode != 0:
        raise SystemExit(f"harness {' '.join(args)} ({tree}) exited {done.returncode}:\n{done.stderr[-3000:]}")
    return wall, done.stdout.strip().splitlines()[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--jobs", default="linear_ddp,digits_cnn")
    ap.add_argument("--before", type=Path, default=None, help="another harness checkout whose calibrate is timed too")
    args = ap.parse_args()
    jobs = args.jobs.split(",")
    base = Path(tempfile.mkdtemp(prefix="calibrate-bench-"))
    trees = {"this tree": ROOT} | ({"before": args.before.resolve()} if args.before else {})
    runs: dict[str, list[float]] = {job: [] for job in jobs}
    cals: dict[tuple[str, str], list[float]] = {}
    ratios: dict[tuple[str, str], list[float]] = {}
    try:
        repo = project(base, tuple(jobs))
        uri = f"sqlite:///{base / 'mlflow.db'}"
        for rnd in range(args.rounds):
            for job in jobs:
                run_s, run_id = _harness(ROOT, ["run", f"experiments/{job}"], repo, uri)
                runs[job].append(run_s)
                print(f"round {rnd + 1} {job:<10} run {run_s:6.1f} s", file=sys.stderr, flush=True)
                names = list(trees)
                for name in names[rnd % len(names):] + names[:rnd % len(names)]:  # rotate who goes first
                    cal_s, _ = _harness(trees[name], ["calibrate", run_id], repo, uri)
                    cals.setdefault((job, name), []).append(cal_s)
                    ratios.setdefault((job, name), []).append(cal_s / run_s)
                    print(f"round {rnd + 1} {job:<10} calibrate ({name}) {cal_s:6.1f} s = {cal_s / run_s:.2f}x the run",
                          file=sys.stderr, flush=True)
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
        print(f"\n{args.rounds} interleaved rounds, medians; load average {load}\n")
        print("| job | command | wall s | ratio to the run (paired per round) |")
        print("| --- | --- | --- | --- |")
        for job in jobs:
            print(f"| {job} | `harness run` | {statistics.median(runs[job]):.1f} | 1.00 |")
            for name in trees:
                print(f"| {job} | `harness calibrate` ({name}) | {statistics.median(cals[(job, name)]):.1f} | "
                      f"{statistics.median(ratios[(job, name)]):.2f} |")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
