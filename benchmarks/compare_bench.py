"""Time compare_runs and render_markdown on 100,000-step runs against a pure-Python baseline."""

from __future__ import annotations

import math
import shutil
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from harness.judge.compare import Comparison, RunRecord, compare_runs  # noqa: E402
from harness.judge.report import plot_metrics, render_markdown  # noqa: E402

STEPS = 100_000
REPEATS = 5
TOLERANCE = {"default": {"rtol": 1e-6, "atol": 1e-9}, "metrics": {}}


def make_pair(steps: int = STEPS) -> tuple[RunRecord, RunRecord]:
    """identical: the same curve; noisy: replay off by ~1e-12; late: replay drifts from 90% of the run."""
    rng = np.random.default_rng(0)
    s = np.arange(steps, dtype=np.int64)
    base = {
        "identical": np.exp(-s / 2e4) + 0.01 * rng.standard_normal(steps),
        "noisy": 1.0 + 0.1 * np.sin(s / 500.0),
        "late": np.log1p(s.astype(np.float64)),
    }
    replay = {k: v.copy() for k, v in base.items()}
    replay["noisy"] += 1e-12 * rng.standard_normal(steps)
    late = int(steps * 0.9)
    replay["late"][late:] *= 1.0 + 1e-3 * np.arange(1, steps - late + 1) / (steps - late)
    fps = {i: f"{i:064x}" for i in range(0, steps, 100)}

    def record(run_id: str, values: dict[str, np.ndarray]) -> RunRecord:
        return RunRecord(
            run_id=run_id, experiment="bench", status="FINISHED", facts={"harness.world_size": "2"},
            lock=["torch==2.13.0"], metrics={k: (s.copy(), v) for k, v in values.items()},
            fingerprints=dict(fps), final_fingerprint="f" * 64,
            config={"replay": {"tolerance": TOLERANCE}},
        )

    return record("original", base), record("replay", replay)


def naive_compare(a: RunRecord, b: RunRecord, tolerance: dict) -> tuple[int, str] | None:
    """The same per-step rules, one Python loop iteration per step: first (step, metric) out of tolerance."""
    first: tuple[int, str] | None = None
    for name in sorted(a.metrics.keys() | b.metrics.keys()):
        t = tolerance["metrics"].get(name, tolerance["default"])
        da = dict(zip(a.metrics[name][0].tolist(), a.metrics[name][1].tolist())) if name in a.metrics else {}
        db = dict(zip(b.metrics[name][0].tolist(), b.metrics[name][1].tolist())) if name in b.metrics else {}
        for step in sorted(da.keys() | db.keys()):
            x, y = da.get(step), db.get(step)
            if x is None or y is None:
                bad = True
            elif struct.pack("<d", x) == struct.pack("<d", y) or x == y or (math.isnan(x) and math.isnan(y)):
                bad = False
            else:
                diff = abs(y - x)
                bad = not (math.isfinite(diff) and diff <= t["atol"] + t["rtol"] * abs(x))
            if bad:
                if first is None or (step, name) < first:
                    first = (step, name)
                break
    return first


def median_time(fn: Callable[[], object], repeats: int = REPEATS) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    original, replay = make_pair()
    n_metrics = len(original.metrics)

    cmp: Comparison = compare_runs(original, replay)
    first = naive_compare(original, replay, TOLERANCE)
    # The baseline is only a fair yardstick if it reaches the same answer.
    assert cmp.divergence is not None and first == (cmp.divergence.step, cmp.divergence.metric), (first, cmp.divergence)
    assert compare_runs(original, original).verdict == "BITWISE"

    # Warm caches and lazy imports so the first timed call is not an outlier.
    compare_runs(original, replay)
    plot_dir = Path(tempfile.mkdtemp(prefix="compare_bench_"))
    rows = [
        ("compare_runs, identical (BITWISE)", median_time(lambda: compare_runs(original, original))),
        ("compare_runs, noise + late drift", median_time(lambda: compare_runs(original, replay))),
        ("render_markdown", median_time(lambda: render_markdown(cmp))),
        ("plot_metrics (one PNG per metric)", median_time(lambda: plot_metrics(original, replay, cmp, plot_dir), 1)),
        ("naive Python loop (baseline)", median_time(lambda: naive_compare(original, replay, TOLERANCE), repeats=3)),
    ]

    print(f"verdict: {cmp.summary()}")
    print()
    print(f"| {'case':<36} | {'steps':>7} | {'metrics':>7} | {'median s':>9} |")
    print(f"|{'-' * 38}|{'-' * 9}|{'-' * 9}|{'-' * 11}|")
    for case, seconds in rows:
        print(f"| {case:<36} | {STEPS:>7} | {n_metrics:>7} | {seconds:>9.6f} |")
    timings = dict(rows)
    vectorised, naive = timings["compare_runs, noise + late drift"], timings["naive Python loop (baseline)"]
    print()
    print(f"speed-up, vectorised vs naive: {naive / vectorised:.0f}x")
    shutil.rmtree(plot_dir, ignore_errors=True)
    print()
    through_store(original, replay)


def through_store(original: RunRecord, replay: RunRecord) -> None:
    """What `harness compare A B` does end to end: read both records from a real SQLite store.

    Baseline: reading one 100k-step metric back through MLflow's metric history, which is what the
    comparison would cost without the exact series artifact (metrics/series.npz).
    """
    from mlflow.entities import Metric

    from harness import tags as T
    from harness.store.seriesfile import save_series
    from harness.store.tracking import Tracker

    with tempfile.TemporaryDirectory() as tmp:
        tracker = Tracker(f"sqlite:///{Path(tmp) / 'mlflow.db'}")
        ids = []
        for record in (original, replay):
            run_id = tracker.create_run("bench", {T.VERSION: "bench"})
            series = {k: dict(zip(v[0].tolist(), v[1].tolist())) for k, v in record.metrics.items()}
            save_series(series, Path(tmp) / "series.npz")
            tracker.log_file(run_id, Path(tmp) / "series.npz", "metrics")
            tracker.log_text(run_id, "replay:\n  tolerance:\n    default: {rtol: 1.0e-6, atol: 1.0e-9}\n", T.ARTIFACT_CONFIG)
            tracker.end_run(run_id, "FINISHED")
            ids.append(run_id)
        history_run = tracker.create_run("bench", {})
        for start in range(0, STEPS, 1000):
            tracker.client.log_batch(history_run, metrics=[
                Metric("loss", float(v), 0, i) for i, v in enumerate(original.metrics["late"][1][start:start + 1000], start)
            ], synchronous=True)

        def end_to_end() -> Comparison:
            a, b = tracker.load_record(ids[0]), tracker.load_record(ids[1])
            return compare_runs(a, b)

        assert end_to_end().divergence.step == cmp_step(original, replay)
        e2e = median_time(end_to_end, 3)
        history = median_time(lambda: tracker.metric_history(history_run, "loss"), 1)
    n = len(original.metrics)
    print(f"| {'through a SQLite store':<44} | {'steps':>7} | {'metrics':>7} | {'median s':>9} |")
    print(f"|{'-' * 46}|{'-' * 9}|{'-' * 9}|{'-' * 11}|")
    print(f"| {'load 2 records (series.npz) + compare_runs':<44} | {STEPS:>7} | {n:>7} | {e2e:>9.3f} |")
    print(f"| {'MLflow metric history, 1 metric of 1 run':<44} | {STEPS:>7} | {1:>7} | {history:>9.3f} |")
    print()
    print(f"end to end for 2 runs x {n} metrics costs {e2e / history:.2f}x reading ONE metric of ONE run "
          f"through MLflow's history ({2 * n} such reads would be needed without series.npz).")


def cmp_step(original: RunRecord, replay: RunRecord) -> int:
    return compare_runs(original, replay).divergence.step


if __name__ == "__main__":
    main()
