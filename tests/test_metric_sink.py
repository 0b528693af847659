"""The bulk metric path into a local SQLite store (fastpath.SqliteMetricSink) against MLflow's own log_batch.

The same points go into two runs of one real store, one through MLflow's client and one through the sink; MLflow's
client then reads both back (metric history, the run's latest values, a search on them) and must answer the same.
No training run: the writer is driven directly, as the launcher drives it.
"""

from __future__ import annotations

import math
import random
import sqlite3
from pathlib import Path

import pytest

from harness import tags as T
from harness.store.fastpath import SqliteMetricSink
from harness.store.tracking import Tracker
from harness.store.writers import MetricWriter

pytestmark = pytest.mark.unit

INF = float("inf")


def _points(n: int, seed: int) -> list[tuple[str, float, int, int]]:
    """Awkward points: NaN, +-inf, -0.0, a step logged twice with two values, steps out of order, equal
    (step, timestamp) with different values, and an exact duplicate point."""
    rng = random.Random(seed)
    pts = [(k, rng.uniform(-5, 5), 1_700_000_000_000 + i, i) for i in range(n) for k in ("loss", "acc")]
    pts += [("loss", float("nan"), 1_700_000_100_000, n + 1), ("acc", INF, 1_700_000_000_005, 3),
            ("acc", -INF, 1_700_000_000_006, 4), ("zero", -0.0, 1, 0), ("zero", 0.0, 1, 0),
            ("loss", 2.5, 1_700_000_000_007, 7), ("loss", 2.5, 1_700_000_000_007, 7),  # exact duplicate
            ("late", 1.0, 5, 9), ("late", 3.0, 5, 9), ("late", 2.0, 9, 2), ("only_nan", float("nan"), 3, 1)]
    rng.shuffle(pts)
    return pts


def _history(client, run_id: str, key: str) -> list[tuple[int, int, float]]:
    return sorted((m.step, m.timestamp, m.value) for m in client.get_metric_history(run_id, key))


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))


def test_the_bulk_path_writes_what_log_batch_writes_as_mlflow_reads_it(tmp_path: Path) -> None:
    from mlflow.entities import Metric

    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}")
    via_mlflow = tracker.create_run("sink", {T.VERSION: "0.1.0"}, run_name="mlflow")
    via_sink = tracker.create_run("sink", {T.VERSION: "0.1.0"}, run_name="sink")
    points = _points(1500, seed=3)
    client = tracker.client
    for i in range(0, len(points), 1000):  # MLflow's own request limit
        client.log_batch(via_mlflow, metrics=[Metric(k, v, ts, s) for k, v, ts, s in points[i:i + 1000]])
    sink = SqliteMetricSink.open(tracker.uri)
    assert sink is not None, "a current local SQLite store must take the bulk path"
    try:
        half = len(points) // 2  # two transactions: the second updates latest_metrics the first wrote
        sink.write(via_sink, points[:half])
        sink.write(via_sink, points[half:])
        sink.write(via_sink, points[:10])  # written again: deduplicated as MLflow does
    finally:
        sink.close()
    keys = {"loss", "acc", "zero", "late", "only_nan"}
    for key in keys:
        want, got = _history(client, via_mlflow, key), _history(client, via_sink, key)
        assert len(want) == len(got), key
        assert all(w[:2] == g[:2] and _same(w[2], g[2]) for w, g in zip(want, got)), key
    want_latest, got_latest = client.get_run(via_mlflow).data.metrics, client.get_run(via_sink).data.metrics
    assert set(want_latest) == set(got_latest) == keys
    for key in keys:
        assert _same(want_latest[key], got_latest[key]), (key, want_latest[key], got_latest[key])
    assert got_latest["late"] == 3.0 and got_latest["acc"] == want_latest["acc"]
    # The UI's and search's view of the latest values (a filter on a metric) finds the run as it finds the other.
    found = {r.info.run_id for r in client.search_runs([r.info.experiment_id for r in [client.get_run(via_sink)]],
                                                         "metrics.late = 3")}
    assert found == {via_mlflow, via_sink}


def test_a_writer_on_a_local_store_keeps_every_point_and_an_invalid_key_is_refused_as_mlflow_refuses_it(
        tmp_path: Path) -> None:
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = tracker.create_run("sink", {T.VERSION: "0.1.0"}, run_name="w")
    writer = MetricWriter(tracker, run_id, 3600.0)  # flushed by the test and by close() only
    for step in range(30_000):
        writer.add(step, {"loss": step * 0.5, "lr": 0.1}, 1_700_000_000_000 + step)
    writer.flush()
    assert writer._sink is not None, "the local store took the bulk path"
    assert writer.written == 60_000 and writer.pending == 0
    writer.add(30_000, {"bad key!": 1.0}, 0)  # MLflow's name rule: letters, digits, _ - . space / only
    writer.flush()
    assert writer.pending == 1 and writer.error is not None and "Invalid value" in str(writer.error)
    with pytest.raises(Exception, match="could not write 1 metrics"):
        writer.close()
    with sqlite3.connect(tmp_path / "mlflow.db") as db:
        assert db.execute("SELECT COUNT(*) FROM metrics WHERE run_uuid = ?", (run_id,)).fetchone()[0] == 60_000
    history = tracker.client.get_metric_history(run_id, "loss")
    assert sorted(m.step for m in history) == list(range(30_000))
    assert tracker.client.get_run(run_id).data.metrics == {"loss": 29_999 * 0.5, "lr": 0.1}


def test_a_store_of_another_schema_keeps_mlflow_s_path(tmp_path: Path) -> None:
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}")
    tracker.create_run("sink", {T.VERSION: "0.1.0"}, run_name="w")
    with sqlite3.connect(tmp_path / "mlflow.db") as db:
        db.execute("UPDATE alembic_version SET version_num = 'not_a_revision'")
    assert SqliteMetricSink.open(tracker.uri) is None
    assert SqliteMetricSink.open("http://127.0.0.1:9/") is None
