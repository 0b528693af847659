"""What recording step times costs a training step, and what a profiled step costs the steps after it.

One process, one thread, a small CNN on 8x8 images (digits_cnn's model, batch 32): a step of about a millisecond,
a worst case for a per-step overhead (a real step is longer, the overhead the same). One loop alternates "timed"
steps (with harness's StepTimer calls a ctx.loader step makes: starting, fetched, begin, end) and "bare" ones
(forward, backward, optimizer step alone); per round the ratio of their median step times, and the median ratio over
rounds is the overhead. Also the timer's own cost per step in a tight loop (no training), and a run of
steps with step K profiled: the steps after it are timed as the steps before it.

    python benchmarks/perf_bench.py [--steps 400] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing


def model_and_data():  # type: ignore[no-untyped-def]
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                          nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 16, 64), nn.ReLU(), nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(32, 1, 8, 8), torch.randint(0, 10, (32,))
    return model, optimizer, x, y


def loop(steps: int, timer, every: int = 1, clock=time.perf_counter) -> list[float]:  # type: ignore[no-untyped-def]
    """`steps` training steps, every `every`-th one with the timer's calls; per step its seconds by `clock`
    (wall time, or this thread's CPU time), measured outside the timer."""
    import torch.nn.functional as F

    model, optimizer, x, y = model_and_data()
    out = []
    for k in range(steps):
        t0 = clock()
        on = timer is not None and k % every == 0
        if on:
            timer.starting(k)
            timer.fetched(0.0, 32)
            timer.begin(k)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        if on:
            timer.end(k)
        out.append(clock() - t0)
    return out


def main() -> None:
    import torch

    from harness.runtime.perf import StepTimer
    from harness.runtime.plan import ProfilePlan

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cpu = torch.device("cpu")

    loop(50, None)  # warm-up: allocator, kernels
    # Interleaved step by step: even steps timed, odd steps bare, in one loop over one model, so that the machine's
    # load at any moment weighs on both alike; per round the ratio of the two medians.
    ratios, bare, timed = [], [], []
    for _ in range(args.rounds):
        # This thread's CPU time per step: the timer's cost is CPU work, and on a loaded machine wall time mostly
        # measures when the scheduler let the process run.
        seconds = loop(args.steps, StepTimer(0, cpu, None), every=2, clock=time.thread_time)
        t, b = statistics.median(seconds[0::2]), statistics.median(seconds[1::2])
        bare.append(b)
        timed.append(t)
        ratios.append(t / b)
    b, t, ratio = statistics.median(bare), statistics.median(timed), statistics.median(ratios)

    timer = StepTimer(0, cpu, None)
    n = 200_000
    t0 = time.perf_counter()
    for k in range(n):
        timer.starting(k)
        timer.fetched(0.0, 32)
        timer.begin(k)
        timer.end(k)
    per_step_ns = (time.perf_counter() - t0) / n * 1e9

    print(f"{'':28s} {'median step (CPU time of the loop thread)':>12s}")
    print(f"{'bare loop':28s} {b * 1e6:10.1f} us")
    print(f"{'with step times recorded':28s} {t * 1e6:10.1f} us")
    print(f"ratio timed/bare: {ratio:.4f} ({(ratio - 1) * 100:+.2f}%; median of {args.rounds} rounds of {args.steps} "
          f"steps interleaved step by step; rounds ranged {min(ratios):.4f}-{max(ratios):.4f})")
    print(f"the timer's own cost: {per_step_ns:.0f} ns per step = {per_step_ns / (b * 1e9) * 100:.3f}% of this "
          f"{b * 1e3:.2f} ms step")

    # Profiling costs only the profiled step: the steps after it, against the same steps of an unprofiled loop.
    k = args.steps // 2
    after_profiled, after_plain, profiled_ms = [], [], []
    with tempfile.TemporaryDirectory() as folder:
        for r in range(3):
            for profiled in ((True, False) if r % 2 == 0 else (False, True)):
                plan = ProfilePlan(folder, (k,), (0,)) if profiled else None
                seconds = loop(args.steps, StepTimer(0, cpu, plan), clock=time.thread_time)
                (after_profiled if profiled else after_plain).append(statistics.median(seconds[k + 1:]))
                if profiled:
                    profiled_ms.append(seconds[k] * 1e3)
        written = sorted(p.name for p in Path(folder).iterdir())
    pa, pp = statistics.median(after_profiled), statistics.median(after_plain)
    print(f"profiled step {k}: {statistics.median(profiled_ms):.1f} ms CPU; the steps after it {pa * 1e3:.2f} ms against "
          f"{pp * 1e3:.2f} ms unprofiled ({pa / pp:.3f}x, 3 interleaved pairs); files {', '.join(written)}")


if __name__ == "__main__":
    main()
