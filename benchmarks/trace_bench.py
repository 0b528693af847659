"""Cost of an op trace: a digits_cnn training step traced (harness.optrace.tracer.OpTracer) vs untraced.

    python benchmarks/trace_bench.py [--rounds 30]

One process, one thread, interleaved rounds (untraced step, step under a dispatch mode that does
nothing, traced step, ...), medians; the table
reports the ratio and the size of one step's trace file (harness.optrace.tracefile.dumps).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from harness.optrace.diff import localize
from harness.optrace.tracefile import dumps
from harness.optrace.tracer import OpTracer

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENT = ROOT / "experiments/digits_cnn"


class PassThrough(TorchDispatchMode):
    """The floor of any dispatcher-level tracer: a Python dispatch mode that only calls the op."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=30)
    rounds = parser.parse_args().rounds
    spec = importlib.util.spec_from_file_location("digits_train", EXPERIMENT / "train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = module.make_model(0.25)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = torch.rand(32, 1, 8, 8), torch.randint(0, 10, (32,))
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> None:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

    for _ in range(3):  # warm-up: allocator, momentum buffers
        step()
    plain, passthrough, traced, sizes, ops = [], [], [], [], 0
    for _ in range(rounds):
        start = time.perf_counter()
        step()
        plain.append(time.perf_counter() - start)
        start = time.perf_counter()
        with PassThrough():
            step()
        passthrough.append(time.perf_counter() - start)
        start = time.perf_counter()
        with OpTracer(str(EXPERIMENT), model, {"step": 0}) as tracer:
            step()
        traced.append(time.perf_counter() - start)
        trace = tracer.result()
        ops = len(trace.ops)
        sizes.append(len(dumps(trace)))
    localize(trace, trace)  # warm-up: imports the rules module
    start = time.perf_counter()
    loc = localize(trace, trace)
    diff_s = time.perf_counter() - start
    assert loc.status == "IDENTICAL"
    p, t = statistics.median(plain), statistics.median(traced)
    print(f"op trace cost, digits_cnn step (batch 32, 1 thread), median of {rounds} interleaved rounds; "
          f"load average {os.getloadavg()[0]:.1f}\n")
    print("| what | median | ratio to one untraced step |")
    print("| --- | --- | --- |")
    print(f"| training step, untraced | {p * 1e3:.2f} ms | 1.00 |")
    m = statistics.median(passthrough)
    print(f"| training step under a pass-through dispatch mode | {m * 1e3:.2f} ms | {m / p:.1f} |")
    print(f"| training step, traced ({ops} ops) | {t * 1e3:.2f} ms | {t / p:.1f} |")
    print(f"| localize() of two such traces | {diff_s * 1e3:.2f} ms | {diff_s / p:.2f} |")
    print(f"| trace file (gzip'd JSON lines) | {statistics.median(sizes) / 1024:.1f} KiB | - |")


if __name__ == "__main__":
    main()
