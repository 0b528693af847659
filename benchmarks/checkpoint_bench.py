"""Checkpoint cost per save, and audit cost for K segments vs a full replay. Prints tables.

    python benchmarks/checkpoint_bench.py [--rounds 2] [--skip-cli]

Part 1, in one process, interleaved: a digits_cnn training step vs one checkpoint save (build +
atomic write) of the same model and optimizer. Part 2, the real CLI on a temporary git repository:
`harness replay` of a digits_cnn run vs `harness audit --segments K`, interleaved rounds.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def part1(rounds: int) -> None:
    from harness import checkpoint as ckpt

    spec = importlib.util.spec_from_file_location("digits_train", ROOT / "experiments/digits_cnn/train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.set_num_threads(1)
    model = module.make_model(0.25)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = torch.rand(32, 1, 8, 8), torch.randint(0, 10, (32,))
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> None:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

    tmp = Path(tempfile.mkdtemp())
    steps, saves = [], []
    for r in range(rounds * 10):
        start = time.perf_counter()
        for _ in range(10):
            step()
        steps.append((time.perf_counter() - start) / 10)
        start = time.perf_counter()
        position = ckpt.TrainingPosition(r, 0, r, ckpt.generator_state(torch.Generator()))
        ckpt.save_atomic(ckpt.build(model=model, optimizer=opt, position=position), tmp / "rank0.pt")
        saves.append(time.perf_counter() - start)
    size = (tmp / "rank0.pt").stat().st_size
    shutil.rmtree(tmp)
    s, c = statistics.median(steps), statistics.median(saves)
    print("checkpoint cost, digits_cnn (1 thread), median of interleaved rounds\n")
    print("| what | median | ratio to one training step |")
    print("| --- | --- | --- |")
    print(f"| training step (batch 32) | {s * 1e3:.2f} ms | 1.0 |")
    print(f"| checkpoint save (build + fsync'd atomic write, {size / 1024:.0f} KiB) | {c * 1e3:.2f} ms | {c / s:.1f} |")
    print(f"\nWith checkpoint_every=N the overhead is {c / s:.1f}/N of the training time per rank.\n")


def harness(args: list[str], cwd: Path, env: dict[str, str]) -> tuple[float, str]:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "harness", *args], cwd=cwd, env=env, capture_output=True, text=True)
    elapsed = time.monotonic() - start
    if proc.returncode not in (0,):
        raise SystemExit(f"harness {' '.join(args)} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return elapsed, proc.stdout.strip().splitlines()[-1]


def part2(rounds: int) -> None:
    base = Path(tempfile.mkdtemp(prefix="harness-bench-"))
    repo = base / "repo"
    shutil.copytree(ROOT / "experiments/digits_cnn", repo / "experiments/digits_cnn")
    (repo / ".gitignore").write_text("mlruns/\n")
    git_env = {**os.environ, "GIT_AUTHOR_NAME": "b", "GIT_AUTHOR_EMAIL": "b@example.invalid",
               "GIT_COMMITTER_NAME": "b", "GIT_COMMITTER_EMAIL": "b@example.invalid"}
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "bench"]):
        subprocess.run(["git", *cmd], cwd=repo, env=git_env, check=True)
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{base / 'mlflow.db'}"}
    # 4 epochs x 23 steps, a checkpoint every epoch: 4 segments.
    run_s, run_id = harness(["run", "experiments/digits_cnn", "train.epochs=4", "checkpoint_every=23"], repo, env)
    times: dict[str, list[float]] = {"replay (full)": [], "audit --segments 1": [], "audit --segments 2": []}
    for r in range(rounds):
        times["replay (full)"].append(harness(["replay", run_id], repo, env)[0])
        times["audit --segments 1"].append(harness(["audit", run_id, "--segments", "1", "--seed", str(r)], repo, env)[0])
        times["audit --segments 2"].append(harness(["audit", run_id, "--segments", "2", "--seed", str(r)], repo, env)[0])
    full = statistics.median(times["replay (full)"])
    print(f"audit vs full replay, digits_cnn 4 epochs x 23 steps, 4 segments, world size 2, {rounds} interleaved rounds\n")
    print("| command | steps replayed | median wall | ratio to full replay |")
    print("| --- | --- | --- | --- |")
    for name, fraction in (("replay (full)", 1.0), ("audit --segments 1", 0.25), ("audit --segments 2", 0.5)):
        m = statistics.median(times[name])
        print(f"| harness {name} | {fraction:.0%} | {m:.1f} s | {m / full:.2f} |")
    print("\nWall time includes the fixed start-up (MLflow, git worktree, spawning ranks, importing torch),"
          " which dominates a run this short; the replayed steps scale as K/N.")
    shutil.rmtree(base, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--skip-cli", action="store_true", help="only part 1")
    args = parser.parse_args()
    part1(args.rounds)
    if not args.skip_cli:
        part2(args.rounds)


if __name__ == "__main__":
    main()
