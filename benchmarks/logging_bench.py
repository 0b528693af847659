"""Cost of logging a metric from the training loop: MLflow's log_metric per step vs ctx.log.

Both write to a real SQLite MLflow store. ctx.log sends the value to the launcher over a pipe; the
launcher's MetricWriter batches it into MLflow from a background thread. Rounds are interleaved
in one process so that machine noise hits both alike. Prints a table; the ratio is what counts.

    python benchmarks/logging_bench.py [--steps 300] [--rounds 3]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch


def naive(client, run_id: str, steps: int) -> float:
    start = time.perf_counter()
    for step in range(steps):
        client.log_metric(run_id, "loss", 1.0 / (step + 1), step=step)
    return (time.perf_counter() - start) / steps


def harness_path(tracker, run_id: str, steps: int) -> tuple[float, float]:
    """Per-call cost inside the loop, and the one-off cost of the final flush."""
    from harness.context import Context
    from harness.messages import Metrics

    reader, writer_end = mp.Pipe(duplex=False)
    metrics = tracker.metric_writer(run_id, flush_interval_s=2.0)

    def drain() -> None:
        while True:
            try:
                msg = reader.recv()
            except EOFError:
                return
            match msg:
                case Metrics(step, values, unix_ms):
                    metrics.add(step, values, unix_ms)

    thread = threading.Thread(target=drain, daemon=True)
    thread.start()
    ctx = Context(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), cfg={}, seed=0,
                  rank_seed=0, fingerprint_every=10**9, channel=writer_end)
    loss = torch.tensor(0.5)
    start = time.perf_counter()
    for step in range(steps):
        ctx.log({"loss": loss}, step)
    per_call = (time.perf_counter() - start) / steps
    writer_end.close()
    thread.join()
    start = time.perf_counter()
    metrics.close()
    flush = time.perf_counter() - start
    assert metrics.written == steps, (metrics.written, steps)
    return per_call, flush


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from harness.tracking import Tracker

    with tempfile.TemporaryDirectory() as tmp:
        tracker = Tracker(f"sqlite:///{Path(tmp) / 'mlflow.db'}")
        naive_s, harness_s, flush_s = [], [], []
        for _ in range(args.rounds):  # interleaved
            run_a = tracker.create_run("bench", {})
            naive_s.append(naive(tracker.client, run_a, args.steps))
            run_b = tracker.create_run("bench", {})
            per_call, flush = harness_path(tracker, run_b, args.steps)
            harness_s.append(per_call)
            flush_s.append(flush)
            assert len(tracker.client.get_metric_history(run_b, "loss")) == args.steps

    n, h = statistics.median(naive_s), statistics.median(harness_s)
    print(f"metric logging, {args.steps} steps x {args.rounds} interleaved rounds, SQLite store\n")
    print(f"| {'path':44} | {'per call (median)':>17} | {'ratio':>8} |")
    print(f"| {'-' * 44} | {'-' * 17} | {'-' * 8} |")
    print(f"| {'mlflow log_metric per step (baseline)':44} | {n * 1e6:14.0f} us | {1.0:8.1f} |")
    print(f"| {'ctx.log (pipe to launcher, batched writes)':44} | {h * 1e6:14.0f} us | {h / n:8.4f} |")
    print(f"\nctx.log is {n / h:.0f}x cheaper per call; the final flush of {args.steps} values takes "
          f"{statistics.median(flush_s) / (n * args.steps):.3f}x the baseline's total loop time, once, "
          "off the training loop.")


if __name__ == "__main__":
    main()
