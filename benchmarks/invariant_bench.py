"""Step time of world-size invariant training against standard DDP: a small CNN, 2 gloo ranks on CPU."""

from __future__ import annotations

import hashlib
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from harness.invariant import (  # noqa: E402
    InvariantStep,
    allgather_reduce,
    broadcast_parameters,
    bytes_per_step,
    canonical_allreduce,
)

WORLD = 2
GLOBAL_BATCH = 256
SHARDS = 8
SHARD_SIZE = GLOBAL_BATCH // SHARDS
ROUNDS = 15
STEPS_PER_ROUND = 15
WARMUP = 5
TARGET = 1.15
SEED = 0


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(), nn.Dropout(0.25),
        nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Dropout(0.25),
        nn.Linear(64, 10),
    )


def sha(model: nn.Module) -> str:
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def rank_main(rank: int, port: int) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, init_method=f"tcp://127.0.0.1:{port}")
    generator = torch.Generator().manual_seed(SEED)
    # Every rank draws the same global batches and takes its contiguous half, as both samplers would.
    data = [
        (torch.rand(GLOBAL_BATCH, 1, 8, 8, generator=generator), torch.randint(0, 10, (GLOBAL_BATCH,), generator=generator))
        for _ in range(4)
    ]
    local = GLOBAL_BATCH // WORLD
    batches = [(x[rank * local : (rank + 1) * local], y[rank * local : (rank + 1) * local]) for x, y in data]
    loss_fn = nn.CrossEntropyLoss()

    torch.manual_seed(SEED)
    ddp_model = DDP(make_model())
    torch.manual_seed(SEED)
    canonical_model = make_model()
    torch.manual_seed(SEED)
    gather_model = make_model()
    broadcast_parameters(canonical_model)
    broadcast_parameters(gather_model)
    steppers = {
        "canonical": InvariantStep(SHARDS, WORLD, rank, SEED, reduce=canonical_allreduce),
        "allgather": InvariantStep(SHARDS, WORLD, rank, SEED, reduce=allgather_reduce),
    }
    optimizers = {
        name: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
        for name, m in (("ddp", ddp_model), ("canonical", canonical_model), ("allgather", gather_model))
    }
    counters = {"ddp": 0, "canonical": 0, "allgather": 0}

    def ddp_step() -> None:
        x, y = batches[counters["ddp"] % len(batches)]
        counters["ddp"] += 1
        optimizers["ddp"].zero_grad()
        loss_fn(ddp_model(x), y).backward()
        optimizers["ddp"].step()

    def invariant_step(name: str, model: nn.Module) -> Callable[[], None]:
        def run() -> None:
            step = counters[name]
            x, y = batches[step % len(batches)]
            counters[name] += 1
            optimizers[name].zero_grad()
            steppers[name].backward(model, (x, y), lambda a, b: loss_fn(model(a), b), step)
            optimizers[name].step()

        return run

    variants: dict[str, Callable[[], None]] = {
        "ddp": ddp_step,
        "canonical": invariant_step("canonical", canonical_model),
        "allgather": invariant_step("allgather", gather_model),
    }
    for run in variants.values():
        for _ in range(WARMUP):
            run()

    samples: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for round_no in range(ROUNDS):
        # Rotate the order each round so no variant always runs first (or right after another).
        order = names[round_no % len(names) :] + names[: round_no % len(names)]
        for name in order:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(STEPS_PER_ROUND):
                variants[name]()
            samples[name].append((time.perf_counter() - start) / STEPS_PER_ROUND)

    # Both invariant variants took the same steps from the same weights: they must agree bit for bit.
    same = sha(canonical_model) == sha(gather_model)
    if rank == 0:
        report(samples, sum(p.numel() for p in canonical_model.parameters()), same)
    dist.destroy_process_group()


def report(samples: dict[str, list[float]], numel: int, same: bool) -> None:
    medians = {name: statistics.median(times) for name, times in samples.items()}
    # The invariant reduction carries K loss slots after the gradient.
    sent = {
        "ddp": bytes_per_step(numel, WORLD)["ddp_ring"],
        "canonical": bytes_per_step(numel + SHARDS, WORLD)["canonical"],
        "allgather": bytes_per_step(numel + SHARDS, WORLD)["allgather"],
    }
    labels = {
        "ddp": f"DDP, per-rank batch {GLOBAL_BATCH // WORLD}",
        "canonical": f"invariant K={SHARDS} s={SHARD_SIZE}, canonical",
        "allgather": f"invariant K={SHARDS} s={SHARD_SIZE}, all-gather",
    }
    print(f"world size {WORLD} (gloo, CPU, 1 thread/rank), global batch {GLOBAL_BATCH}, {numel} parameters, "
          f"{ROUNDS} rounds x {STEPS_PER_ROUND} steps, interleaved")
    print()
    print(f"| {'variant':<36} | {'median ms/step':>14} | {'vs DDP':>6} | {'bytes sent/rank/step':>20} |")
    print(f"|{'-' * 38}|{'-' * 16}|{'-' * 8}|{'-' * 22}|")
    for name in ("ddp", "canonical", "allgather"):
        ratio = medians[name] / medians["ddp"]
        print(f"| {labels[name]:<36} | {medians[name] * 1e3:>14.2f} | {ratio:>5.2f}x | {sent[name]:>20,} |")
    print()
    ratio = medians["canonical"] / medians["ddp"]
    verdict = "met" if ratio <= TARGET else "NOT met"
    print(f"goal invariant <= {TARGET:.2f}x DDP: {verdict} ({ratio:.2f}x)")
    print(f"canonical and all-gather invariant weights bitwise equal: {same}")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    start = time.perf_counter()
    mp.spawn(rank_main, args=(free_port(),), nprocs=WORLD, join=True)
    print(f"total {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
