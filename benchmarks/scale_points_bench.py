"""How harness's cost grows with the metric points a run logs: 1k / 100k / 1M points (10 metrics a step).

harness: `harness run experiments/points train.points=N` on one rank in a throwaway git repository with a SQLite
store; the job logs its points with ctx.log as fast as it can (the worst case for ingestion: nothing else in the
loop) and prints how long its loop took and the wall-clock time of its last step. Measured: the loop's cost per
point, and the time from the last step to the end of the `harness run` process (the run closed, sealed, every
point in MLflow and in metrics/series.npz).

Baseline: the same loop in a plain process that keeps the points in a list and hands them to MLflow's own batch API
at the end (`MlflowClient.log_batch`, 1000 metrics a request - its limit - into a SQLite store of its own): what a
script that wants every point in MLflow and the loop never waiting can do without harness. Its "end" is the
log_batch time. `--paced S` spreads each harness job's points over S seconds, as a real training loop does.

The table's rows are the end cost (the goal: a 1M-point run closed within 5 s of its last step) and the loop's cost
per point; a last check reads every point back through MLflow's client and the series.

Usage: python benchmarks/scale_points_bench.py [--rounds N] [--quick] [--paced S]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchrepo import git
from scaling import Axis, table

METRICS = 10
JOB_YAML = """\
image: localhost:5000/harness-cpu:0.1
entry: train.py:train
world_size: 1
seed: 0
threads_per_rank: 1
determinism:
  level: strict
train:
  points: 1000
  metrics: 10
  paced_s: 0.0
"""
JOB = '''\
"""Logs `points` metric values (`metrics` keys a step) with ctx.log; prints its loop time and its last step's time."""
import time

import torch


def train(ctx):
    cfg = ctx.cfg
    model = ctx.ddp(torch.nn.Linear(1, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    keys = [f"m{j}" for j in range(cfg.metrics)]
    steps = cfg.points // cfg.metrics
    pause = cfg.paced_s / steps
    t0 = time.perf_counter()
    for step in range(steps):
        ctx.log({k: step * 0.5 + j for j, k in enumerate(keys)}, step)
        if pause:
            time.sleep(pause)
    loop = time.perf_counter() - t0
    model(torch.ones(1, 1)).sum().backward()  # one step: the weights change
    opt.step()
    ctx.print(f"LOOP {loop:.6f} LAST {time.time():.6f}")
'''
BASELINE = '''\
import sys, time
from mlflow import MlflowClient
from mlflow.entities import Metric
uri, n = sys.argv[1], int(sys.argv[2])
client = MlflowClient(uri)
exp = client.get_experiment_by_name("baseline") or client.get_experiment(client.create_experiment("baseline"))
run = client.create_run(exp.experiment_id).info.run_id
keys = [f"m{j}" for j in range(10)]
points = []
t0 = time.perf_counter()
for step in range(n // 10):
    ms = int(time.time() * 1000)
    points.extend(Metric(k, step * 0.5 + j, ms, step) for j, k in enumerate(keys))
loop = time.perf_counter() - t0
t1 = time.perf_counter()
for i in range(0, len(points), 1000):
    client.log_batch(run, metrics=points[i:i + 1000])
client.set_terminated(run)
print(f"LOOP {loop:.6f} END {time.perf_counter() - t1:.6f}")
'''


def make_repo(base: Path) -> Path:
    repo = base / "repo"
    job = repo / "experiments" / "points"
    job.mkdir(parents=True)
    (job / "experiment.yaml").write_text(JOB_YAML)
    (job / "train.py").write_text(JOB)
    (repo / ".gitignore").write_text("mlruns/\n__pycache__/\n")
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "bench")
    return repo


def run_harness(repo: Path, n: int, paced: float) -> tuple[float, float, str]:
    """(loop seconds, seconds from the last step to the process's end, run id)."""
    proc = subprocess.run([sys.executable, "-m", "harness", "run", "experiments/points", f"train.points={n}",
                           f"train.paced_s={paced}"], cwd=repo, capture_output=True, text=True, timeout=3600)
    ended = time.time()
    if proc.returncode != 0:
        raise SystemExit(f"harness run failed: {proc.stderr[-2000:]}")
    run_id = proc.stdout.strip().splitlines()[-1]
    log = next((repo / "mlruns").rglob(f"{run_id}/artifacts/logs/rank0.log"))
    found = re.search(r"LOOP ([\d.]+) LAST ([\d.]+)", log.read_text())
    assert found, log.read_text()[-500:]
    return float(found.group(1)), ended - float(found.group(2)), run_id


def run_baseline(base: Path, n: int) -> tuple[float, float]:
    script = base / "baseline.py"
    script.write_text(BASELINE)
    uri = f"sqlite:///{base / 'baseline' / 'mlflow.db'}"
    (base / "baseline").mkdir(exist_ok=True)
    proc = subprocess.run([sys.executable, str(script), uri, str(n)], capture_output=True, text=True, timeout=7200)
    if proc.returncode != 0:
        raise SystemExit(f"baseline failed: {proc.stderr[-2000:]}")
    found = re.search(r"LOOP ([\d.]+) END ([\d.]+)", proc.stdout)
    assert found, proc.stdout
    return float(found.group(1)), float(found.group(2))


def check_points(repo: Path, run_id: str, n: int) -> None:
    """Every point is in MLflow (its own client reads them) and in the exact series."""
    import numpy as np
    from mlflow import MlflowClient

    db = repo / "mlruns" / "mlflow.db"
    client = MlflowClient(f"sqlite:///{db}")
    history = client.get_metric_history(run_id, "m3")
    assert len(history) == n // METRICS and {m.value - m.step * 0.5 for m in history} == {3.0}, len(history)
    series = next((repo / "mlruns").rglob(f"{run_id}/artifacts/metrics/series.npz"))
    with np.load(series) as data:
        assert sum(len(data[k]) for k in data.files if k.startswith("steps_")) == n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="1k and 10k points, one round")
    ap.add_argument("--paced", type=float, default=0.0, help="spread each harness job's points over S seconds")
    ap.add_argument("--baseline-max", type=int, default=1_000_000, help="largest size the baseline is run at")
    args = ap.parse_args()
    sizes = [1_000, 10_000] if args.quick else [1_000, 100_000, 1_000_000]
    rounds = 1 if args.quick else args.rounds
    end = Axis("metric points", f"end: last step to process end, s{f' (paced {args.paced:g} s)' if args.paced else ''}",
               "MLflow log_batch of the same points at the end")
    loop = Axis("metric points", "loop: cost per point, us", "appending an mlflow Metric to a list", unit="us")
    with tempfile.TemporaryDirectory(prefix="harness-points-bench-") as tmp:
        base = Path(tmp)
        repo = make_repo(base)
        for n in sizes:
            h_loop, h_end, b_loop, b_end = [], [], [], []
            last = ""
            for r in range(rounds):
                pair = ["harness", "baseline"] if r % 2 == 0 else ["baseline", "harness"]
                for which in pair:
                    if which == "harness":
                        lp, e, last = run_harness(repo, n, args.paced)
                        h_loop.append(lp)
                        h_end.append(e)
                    elif n <= args.baseline_max and (r == 0 or n < 1_000_000):  # 1M through MLflow: minutes, once
                        lp, e = run_baseline(base, n)
                        b_loop.append(lp)
                        b_end.append(e)
            check_points(repo, last, n)
            med = statistics.median
            end.add(n, f"{n:,}", med(h_end), med(b_end) if b_end else float("nan"))
            loop.add(n, f"{n:,}", med(h_loop) / n * 1e6, med(b_loop) / n * 1e6 if b_loop else float("nan"))
            print(f"{n:>9,} points: harness end {med(h_end):.2f} s (rounds {', '.join(f'{x:.2f}' for x in h_end)}), "
                  f"baseline end {', '.join(f'{x:.2f}' for x in b_end)} s", flush=True)
    print(table([end, loop], f"## Metric points ({rounds} interleaved rounds, medians; 1M through MLflow once)"))
    print(f"\nloop load: 1 rank; cores: {os.cpu_count()}")


if __name__ == "__main__":
    main()
