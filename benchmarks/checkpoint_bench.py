"""Checkpoint cost per save, and audit cost for K segments vs a full replay. Prints tables.

    python benchmarks/checkpoint_bench.py [--rounds 2] [--skip-cli]

Part 1, in one process, interleaved: a training step vs one checkpoint save (build + atomic write)
of the same model and optimizer vs the per-tensor fingerprints of that checkpoint (digits_cnn, and an
MLP of 32 MiB where hashing's per-byte cost dominates). Part 2, the real CLI on a temporary git repository:
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
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]


def _digits() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor, torch.nn.Module]:
    spec = importlib.util.spec_from_file_location("digits_train", ROOT / "experiments/digits_cnn/train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_model(0.25), torch.rand(32, 1, 8, 8), torch.randint(0, 10, (32,)), torch.nn.CrossEntropyLoss()


def _mlp() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor, torch.nn.Module]:
    # 8 x Linear(1024, 1024): 8.4 M parameters, 32 MiB, where hashing's per-byte cost shows over per-tensor costs.
    layers = [m for _ in range(8) for m in (torch.nn.Linear(1024, 1024), torch.nn.ReLU())]
    return torch.nn.Sequential(*layers), torch.rand(32, 1024), torch.rand(32, 1024), torch.nn.MSELoss()


def _measure(name: str, make: Any, rounds: int) -> list[str]:
    from harness.runtime import checkpoint as ckpt

    model, x, y, loss_fn = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def step() -> None:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

    step()  # momentum buffers exist from here on, as in every checkpoint after step 0
    tmp = Path(tempfile.mkdtemp())
    steps, saves, hashes = [], [], []
    for r in range(rounds * 10):
        start = time.perf_counter()
        for _ in range(5):
            step()
        steps.append((time.perf_counter() - start) / 5)
        start = time.perf_counter()
        position = ckpt.TrainingPosition(r, 0, r, ckpt.generator_state(torch.Generator()))
        state = ckpt.build(model=model, optimizer=opt, position=position)
        ckpt.save_atomic(state, tmp / "rank0.pt")
        saves.append(time.perf_counter() - start)
        # What CheckpointSteps.save adds on top of the save: a digest per tensor and one over the set.
        start = time.perf_counter()
        tensors = ckpt.tensor_fingerprints(state, model, opt)
        ckpt.replica_sha256(tensors, model)
        hashes.append(time.perf_counter() - start)
    size = (tmp / "rank0.pt").stat().st_size
    shutil.rmtree(tmp)
    s, c, h = statistics.median(steps), statistics.median(saves), statistics.median(hashes)
    return [
        f"| {name} | training step (batch 32) | {s * 1e3:.2f} ms | 1.0 | - |",
        f"| {name} | checkpoint save (build + fsync'd atomic write, {size / 1024:.0f} KiB) | {c * 1e3:.2f} ms "
        f"| {c / s:.2f} | 1.0 |",
        f"| {name} | per-tensor fingerprints ({len(tensors)} tensors) | {h * 1e3:.2f} ms | {h / s:.2f} | {h / c:.2f} |",
    ]


def part1(rounds: int) -> None:
    torch.set_num_threads(1)
    rows = _measure("digits_cnn", _digits, rounds) + _measure("MLP 8x1024^2", _mlp, rounds)
    print(f"checkpoint cost (1 thread), median of interleaved rounds; load average {os.getloadavg()[0]:.1f}\n")
    print("| model | what | median | ratio to one training step | ratio to the save |")
    print("| --- | --- | --- | --- | --- |")
    print("\n".join(rows))
    print("\nWith checkpoint_every=N the overhead per rank is (save + fingerprints)/N of a step's time.\n")


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
