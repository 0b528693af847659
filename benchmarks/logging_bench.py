"""Metric logging throughput from one rank: today's buffered ctx.log against the per-call pipe message it replaced.

A rank process logs N points in a tight loop ({"loss": float} per call, one point each); this process
plays the launcher: a thread drains the pipe into a real MetricWriter on a real SQLite MLflow store,
exactly as executors/local.py does. Per variant and round it measures the loop (per-call cost
percentiles, worst stall, points/s), when the launcher held every point (what series.npz is made
from) and when MLflow held every point (writer.close()). Rounds alternate the variants.

    python benchmarks/logging_bench.py [--points 200000] [--rounds 3]

Baseline "per-call message": the path before batching, kept here as it was - _number per value, one
messages.Metrics per call, pickled and written to the pipe by the loop itself.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing


def rank(variant: str, channel, points: int, results, outputs: str) -> None:
    import numpy as np
    import torch

    from harness.runtime.context import Context, _number
    from harness.messages import Metrics

    ctx = Context(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), cfg={}, seed=0,
                  rank_seed=0, fingerprint_every=10**9, channel=channel, output_dir=outputs)

    def per_call(metrics: dict, step: int) -> None:  # the baseline: one message per call
        values = {str(k): _number(k, v) for k, v in metrics.items()}
        channel.send(Metrics(int(step), values, int(time.time() * 1000)))

    log = ctx.log if variant == "buffered" else per_call
    cost = np.empty(points, dtype=np.int64)
    clock = time.perf_counter_ns
    started = time.time()
    cpu0 = time.thread_time()  # the loop thread's own CPU time: what it costs, whatever else runs on the cores
    t0 = clock()
    for step in range(points):
        a = clock()
        log({"loss": step * 0.001}, step)
        cost[step] = clock() - a
    loop_s = (clock() - t0) / 1e9
    loop_cpu_s = time.thread_time() - cpu0
    ctx.close()
    channel.close()
    results.put((started, loop_s, loop_cpu_s, np.percentile(cost, [50, 99, 99.9]).tolist(), int(cost.max())))


def one_round(variant: str, tracker, points: int, outputs: str) -> dict[str, float]:
    from harness.messages import Metrics, MetricsBatch

    run_id = tracker.create_run("bench", {})
    writer = tracker.metric_writer(run_id, flush_interval_s=1.0)
    spawn = mp.get_context("spawn")
    reader, writer_end = spawn.Pipe(duplex=False)
    results = spawn.Queue()
    received = {"n": 0, "at": 0.0}

    def drain() -> None:  # launch._read_channel + the sink of executors/local.py
        while True:
            try:
                msg = reader.recv()
            except EOFError:
                return
            match msg:
                case Metrics(step, values, unix_ms):
                    writer.add(step, values, unix_ms)
                    received["n"] += len(values)
                case MetricsBatch():
                    writer.add_batch(msg)
                    received["n"] += len(msg)
            if received["n"] == points:
                received["at"] = time.time()

    proc = spawn.Process(target=rank, args=(variant, writer_end, points, results, outputs))
    proc.start()
    writer_end.close()
    thread = threading.Thread(target=drain, daemon=True)
    thread.start()
    started, loop_s, loop_cpu_s, (p50, p99, p999), worst = results.get(timeout=600)
    proc.join(600)
    thread.join(600)
    writer.close()
    stored = time.time()
    assert received["n"] == points and len(writer.series["loss"]) == points
    assert writer.written == points, (writer.written, points)
    return {
        "loop_pps": points / loop_s, "cpu_us": loop_cpu_s / points * 1e6, "p50_us": p50 / 1e3, "p99_us": p99 / 1e3, "p999_us": p999 / 1e3,
        "max_ms": worst / 1e6, "launcher_pps": points / (received["at"] - started),
        "store_pps": points / (stored - started),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from harness.store.tracking import Tracker

    variants = {"per-call": "per-call message (baseline, before)", "buffered": "ctx.log, buffered (now)"}
    got: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        tracker = Tracker(f"sqlite:///{Path(tmp) / 'mlflow.db'}")
        for round_no in range(args.rounds):
            order = list(variants) if round_no % 2 == 0 else list(reversed(variants))
            for variant in order:
                got[variant].append(one_round(variant, tracker, args.points, str(Path(tmp) / "outputs")))
    load_after = os.getloadavg()

    med = {v: {k: statistics.median(r[k] for r in rows) for k in rows[0]} for v, rows in got.items()}
    base = med["per-call"]
    print(f"{args.points:,} points from one rank, {args.rounds} alternating rounds, medians, SQLite store; "
          f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after\n")
    print("| path | loop points/s | loop CPU per point | per call p50 | p99 | p99.9 | worst stall | to launcher, points/s | "
          "into MLflow, points/s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for v, label in variants.items():
        m = med[v]
        print(f"| {label} | {m['loop_pps']:,.0f} ({m['loop_pps'] / base['loop_pps']:.1f}x) | {m['cpu_us']:.2f} us ({m['cpu_us'] / base['cpu_us']:.2f}x) | {m['p50_us']:.1f} us | "
              f"{m['p99_us']:.1f} us | {m['p999_us']:.1f} us | {m['max_ms']:.1f} ms | "
              f"{m['launcher_pps']:,.0f} ({m['launcher_pps'] / base['launcher_pps']:.1f}x) | "
              f"{m['store_pps']:,.0f} ({m['store_pps'] / base['store_pps']:.2f}x) |")
    now = med["buffered"]
    cpu_pps = 1e6 / now["cpu_us"]
    print(f"\ngoal: >= 100,000 points/s from one rank without the loop waiting: the loop's own CPU time allows "
          f"{cpu_pps:,.0f} points/s ({'met' if cpu_pps >= 100_000 else 'NOT met'}); wall clock in the loop "
          f"{now['loop_pps']:,.0f}/s, to the launcher {now['launcher_pps']:,.0f}/s, into MLflow {now['store_pps']:,.0f}/s "
          "(wall clock includes the time the OS gives other processes on these cores)")

if __name__ == "__main__":
    main()
