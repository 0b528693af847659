"""Step time of world-size invariant training against standard DDP: a small CNN, 2 gloo ranks on CPU."""

from __future__ import annotations

import hashlib
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from harness.runtime.invariant import (  # noqa: E402
    _TAG_SHARD,
    GATHER_BELOW_BYTES,
    InvariantStep,
    _derive,
    _preserved_global_rng,
    _seed_globals,
    _split,
    allgather_reduce,
    broadcast_parameters,
    bytes_per_step,
    canonical_allreduce,
)

WORLD = 2
GLOBAL_BATCH = 256
SHARDS = 8
SHARD_SIZE = GLOBAL_BATCH // SHARDS
ROUNDS = 40
STEPS_PER_ROUND = 4
WARMUP = 5
TARGETS = {"default": 1.10, "big_shards": 1.05}  # issue 12: K=8 at most 1.10x DDP, K=4 at most 1.05x
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


class Variant:
    """One way of taking a training step, with its own model and optimizer so the variants never interfere."""

    def __init__(self, label: str, model: nn.Module, sent: Callable[[int], int],
                 stepper: InvariantStep | None = None) -> None:
        self.label = label
        self.model = model
        self.sent = sent  # bytes each rank sends per step, given the parameter count
        self.stepper = stepper
        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        self.steps = 0
        self.times: list[float] = []

    def step(self, batches: list[tuple[torch.Tensor, torch.Tensor]], loss_fn: nn.Module) -> None:
        x, y = batches[self.steps % len(batches)]
        self.optimizer.zero_grad()
        if self.stepper is None:
            loss_fn(self.model(x), y).backward()
        else:
            model = self.model
            self.stepper.backward(model, (x, y), lambda a, b: loss_fn(model(a), b), self.steps)
        self.optimizer.step()
        self.steps += 1


def fresh_model() -> nn.Module:
    torch.manual_seed(SEED)
    model = make_model()
    broadcast_parameters(model)
    return model


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

    def invariant(shards: int, reduce: Callable[..., torch.Tensor]) -> InvariantStep:
        return InvariantStep(shards, WORLD, rank, SEED, reduce=reduce)

    # The invariant reduction carries K loss slots after the gradient.
    variants = {
        "ddp": Variant(f"DDP, per-rank batch {local}", DDP(fresh_model()),
                       lambda n: bytes_per_step(n, WORLD)["ddp_ring"]),
        "default": Variant(f"invariant K={SHARDS} s={SHARD_SIZE}, canonical (default)", fresh_model(),
                           lambda n: default_bytes(n + SHARDS), invariant(SHARDS, canonical_allreduce)),
        "halving": Variant(f"invariant K={SHARDS} s={SHARD_SIZE}, halving/doubling", fresh_model(),
                           lambda n: bytes_per_step(n + SHARDS, WORLD)["canonical"],
                           invariant(SHARDS, partial(canonical_allreduce, gather_below_bytes=0))),
        "allgather": Variant(f"invariant K={SHARDS} s={SHARD_SIZE}, allgather_reduce", fresh_model(),
                             lambda n: bytes_per_step(n + SHARDS, WORLD)["allgather"],
                             invariant(SHARDS, allgather_reduce)),
        "big_shards": Variant(f"invariant K={SHARDS // 2} s={SHARD_SIZE * 2}, canonical (default)", fresh_model(),
                              lambda n: default_bytes(n + SHARDS // 2), invariant(SHARDS // 2, canonical_allreduce)),
    }
    for variant in variants.values():
        for _ in range(WARMUP):
            variant.step(batches, loss_fn)

    names = list(variants)
    for round_no in range(ROUNDS):
        # Rotate the order each round so no variant always runs first (or right after another).
        order = names[round_no % len(names) :] + names[: round_no % len(names)]
        for name in order:
            variant = variants[name]
            dist.barrier()
            start = time.perf_counter()
            for _ in range(STEPS_PER_ROUND):
                variant.step(batches, loss_fn)
            variant.times.append((time.perf_counter() - start) / STEPS_PER_ROUND)

    # The three K=8 variants took the same steps from the same weights: they must agree bit for bit.
    same = len({sha(variants[name].model) for name in ("default", "halving", "allgather")}) == 1
    floor = compute_floor(batches[0], loss_fn)
    parts = machinery(batches[0], sum(p.numel() for p in variants["default"].model.parameters()) + SHARDS)
    if rank == 0:
        report(variants, sum(p.numel() for p in variants["default"].model.parameters()), same, floor, parts)
    dist.destroy_process_group()


def compute_floor(batch: tuple[torch.Tensor, torch.Tensor], loss_fn: nn.Module) -> float:
    """Forward+backward of K/W shards over that of the whole local batch, with no reduction and no seeding.

    The part of the invariant overhead that belongs to the model's kernels at the smaller batch, not to
    the invariant machinery. Both ranks measure at once, under the same contention as the rounds.
    """
    model = make_model()
    params = list(model.parameters())
    x, y = batch
    local = SHARDS // WORLD
    shards = [(x[j * SHARD_SIZE : (j + 1) * SHARD_SIZE].clone(), y[j * SHARD_SIZE : (j + 1) * SHARD_SIZE].clone())
              for j in range(local)]

    def whole() -> None:
        torch.autograd.grad(loss_fn(model(x), y), params)

    def sharded() -> None:
        for a, b in shards:
            torch.autograd.grad(loss_fn(model(a), b), params)

    times: dict[str, list[float]] = {"whole": [], "sharded": []}
    for _ in range(ROUNDS):
        for name, fn in (("whole", whole), ("sharded", sharded)):
            start = time.perf_counter()
            for _ in range(STEPS_PER_ROUND):
                fn()
            times[name].append(time.perf_counter() - start)
    return statistics.median(times["sharded"]) / statistics.median(times["whole"])


def machinery(batch: tuple[torch.Tensor, torch.Tensor], numel: int) -> dict[str, float]:
    """Median seconds per step of each piece of InvariantStep that is not the model's own compute (K=8)."""
    cpu = torch.device("cpu")
    local = SHARDS // WORLD
    flat = torch.rand(numel)

    def rng() -> None:
        with _preserved_global_rng(cpu):
            pass

    def seed() -> None:
        for g in range(local):
            _seed_globals(_derive(SEED, _TAG_SHARD, 7, g), cpu)

    def split() -> None:
        _split(batch, local)

    def reduce() -> None:
        canonical_allreduce(flat)  # both ranks enter together (barrier below): the transfer, not a wait

    times: dict[str, list[float]] = {"save/restore global RNGs (once per step)": [],
                                     f"derive + seed globals ({local} shards)": [],
                                     f"split into {local} shards": [],
                                     f"canonical reduction of {numel:,} floats": []}
    for _ in range(ROUNDS):
        for name, fn in zip(times, (rng, seed, split, reduce)):
            dist.barrier()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def default_bytes(numel: int) -> int:
    # canonical_allreduce all-gathers vectors under GATHER_BELOW_BYTES.
    path = "allgather" if numel * 4 < GATHER_BELOW_BYTES else "canonical"
    return bytes_per_step(numel, WORLD)[path]


def report(variants: dict[str, Variant], numel: int, same: bool, floor: float, parts: dict[str, float]) -> None:
    medians = {name: statistics.median(v.times) for name, v in variants.items()}
    base = medians["ddp"]
    print(f"world size {WORLD} (gloo, CPU, 1 thread/rank), global batch {GLOBAL_BATCH}, {numel:,} parameters, "
          f"{ROUNDS} rounds x {STEPS_PER_ROUND} steps, interleaved; load average {load_average()}")
    print()
    print(f"| {'variant':<42} | {'median ms/step':>14} | {'vs DDP':>6} | {'bytes sent/rank/step':>20} |")
    print(f"|{'-' * 44}|{'-' * 16}|{'-' * 8}|{'-' * 22}|")
    for name, variant in variants.items():
        ratio = medians[name] / base
        print(f"| {variant.label:<42} | {medians[name] * 1e3:>14.2f} | {ratio:>5.2f}x | {variant.sent(numel):>20,} |")
    print()
    for name, target in TARGETS.items():
        ratio = medians[name] / base
        verdict = "met" if ratio <= target else f"NOT met, by {ratio - target:.2f}x"
        print(f"goal: {variants[name].label} <= {target:.2f}x DDP: {verdict} ({ratio:.2f}x)")
    print(f"compute alone, {SHARDS // WORLD} shards of {SHARD_SIZE} vs one batch of {GLOBAL_BATCH // WORLD} "
          f"(forward+backward, no reduction, no seeding): {floor:.2f}x")
    print(f"K={SHARDS} variants (default, halving/doubling, all-gather) end with bitwise-equal weights: {same}")
    print()
    print(f"| {'invariant machinery per step (K=8)':<48} | {'median ms':>9} | {'of DDP step':>11} |")
    print(f"|{'-' * 50}|{'-' * 11}|{'-' * 13}|")
    for name, seconds in parts.items():
        print(f"| {name:<48} | {seconds * 1e3:>9.3f} | {seconds / base:>10.1%} |")


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


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
