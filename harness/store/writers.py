"""The background writers of a running job: metric points buffered and flushed in batches (MetricWriter), and the
heartbeat that marks the run alive (Heartbeat)."""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from harness import scratch, tags as T
from harness.errors import StoreUnavailable
from harness.rundata import same_value, series
from harness.store.failures import transient, unwritable
from harness.store.fastpath import SINK_CHUNK, SqliteMetricSink
from harness.store.outages import Outages
from harness.store.probe import reason_of
from harness.store.uris import display_uri

if TYPE_CHECKING:
    from harness.store.tracking import Tracker

MLFLOW_BATCH = 1000  # MLflow's per-request limit for metrics in log_batch
_SINK_WAKE = 20_000  # points pending that a bulk store takes at once instead of at the next flush interval


class MetricWriter:
    """Buffers metrics and writes them with log_batch from a background thread.

    A per-call log_metric costs a store round trip (~11 ms on SQLite); the training loop
    must never pay that, so add() only appends to a deque.
    """

    def __init__(self, tracker: Tracker, run_id: str, flush_interval_s: float, outages: Outages | None = None) -> None:
        self._tracker = tracker
        self._run_id = run_id
        self._interval = flush_interval_s
        # A store that went away: the values wait here, in memory (see Outages and docs/tracking-server.md).
        self._outages = outages or Outages()
        self._pending: deque[tuple[str, float, int, int]] = deque()
        self._stop = threading.Event()
        # Set by stop, and by a backlog a bulk store should take now rather than at the next interval.
        self._wake = threading.Event()
        self._lock = threading.Lock()  # one flush at a time
        self.written = 0
        self.error: Exception | None = None
        # Every value as logged, for series.npz: reading 100k steps back through MLflow's
        # metric history takes seconds per metric, the comparison needs them in milliseconds.
        self.series: dict[str, dict[int, float]] = {}
        self._known: dict[str, dict[int, float]] = {}
        # A resume that logs another value at a step the run already holds is not the run's continuation.
        self.conflict: tuple[str, int, float, float] | None = None  # the first (key, step, recorded, now)
        # A local SQLite store takes the points in bulk (SqliteMetricSink); None: MLflow's log_batch, for every other store.
        self._sink: SqliteMetricSink | None = SqliteMetricSink.open(tracker.uri)
        self._thread = threading.Thread(target=self._loop, name="harness-metrics", daemon=True)
        self._thread.start()

    def prime(self, metrics: dict[str, tuple[Any, Any]]) -> None:
        """Values already in the run (a resume): logged again with the same bits (rundata.same_value, the rule
        harness/judge/reproduced.py holds re-executions to) they are not rewritten; with other bits they are the
        conflict; a value the run lacks is the continuation's own, and is written."""
        self._known = series(metrics)
        self.series = {key: dict(known) for key, known in self._known.items()}

    def add(self, step: int, values: dict[str, float], timestamp_ms: int) -> None:
        for key, value in values.items():
            known = self._known.get(key, {}).get(step)
            self.series.setdefault(key, {})[step] = value  # last write wins, as in MLflow
            if known is not None:
                if same_value(known, value):
                    continue
                self.conflict = self.conflict or (key, step, known, value)
            self._pending.append((key, value, timestamp_ms, step))
        self._backlog()

    def add_batch(self, batch: Any) -> None:
        """Every point of a messages.MetricsBatch, in its order: as add() per point, in one pass."""
        series, known_all, pending = self.series, self._known, self._pending
        for key, step, value, unix_ms in batch.points():
            series.setdefault(key, {})[step] = value  # last write wins, as in MLflow
            known = known_all.get(key)
            if known is not None:
                old = known.get(step)
                if old is not None:
                    if same_value(old, value):
                        continue
                    self.conflict = self.conflict or (key, step, old, value)
            pending.append((key, value, unix_ms, step))
        self._backlog()

    def _backlog(self) -> None:
        """Wake the writer now when a bulk store has a backlog (a loop logging faster than the store ingests), so that
        the end of the run finds little left to write; a store that just failed is retried at the interval."""
        if self._sink is not None and self.error is None and len(self._pending) >= _SINK_WAKE and not self._wake.is_set():
            self._wake.set()

    def _loop(self) -> None:
        while True:
            self._wake.wait(self._interval)
            self._wake.clear()
            if self._stop.is_set():
                return
            if unwritable(self.error):  # a full or read-only store: the values stay in series for the close
                return
            self.flush()

    def flush(self) -> None:
        with self._lock:
            if self._sink is not None:
                self._flush_bulk(self._sink)
            else:
                self._flush_mlflow()

    def _flush_bulk(self, sink: SqliteMetricSink) -> None:
        pending = self._pending
        while pending:
            batch = [pending.popleft() for _ in range(min(len(pending), SINK_CHUNK))]
            try:
                sink.write(self._run_id, batch)
            except Exception as err:  # keep the data; retried at the next flush
                self.error = err
                pending.extendleft(reversed(batch))
                self._outages.failed(spooled=len(pending))
                return
            self.written += len(batch)
            self.error = None
            self._outages.answered()

    def _flush_mlflow(self) -> None:
        from mlflow.entities import Metric

        while self._pending:
            batch: list[Metric] = []
            while self._pending and len(batch) < MLFLOW_BATCH:
                key, value, ts, step = self._pending.popleft()
                batch.append(Metric(key, value, ts, step))
            try:
                self._tracker.client.log_batch(self._run_id, metrics=batch, synchronous=True)
                self.written += len(batch)
                self.error = None
                self._outages.answered()
            except Exception as err:  # keep the data; retried at the next flush
                self.error = err
                self._pending.extendleft(
                    reversed([(m.key, m.value, m.timestamp, m.step) for m in batch])
                )
                self._outages.failed(spooled=len(self._pending))
                return

    @property
    def pending(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        """Stop the thread and write everything still buffered, waiting up to the outage limit for a store
        that is away (also after a failure)."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=30)
        deadline = self._outages.deadline()
        self.flush()
        while self._pending and transient(self.error) and time.monotonic() < deadline:
            time.sleep(1.0)
            self.flush()
        if self._sink is not None:
            self._sink.close()
        if self._pending and self.error is not None:
            raise StoreUnavailable(
                f"could not write {len(self._pending)} metrics to the tracking store "
                f"{display_uri(self._tracker.uri)}: {reason_of(self.error)}. Check that it is reachable and writable."
            ) from self.error


class Heartbeat:
    """Marks a run alive (tag HEARTBEAT = unix seconds) every `interval_s` from a background thread.

    A RUNNING run whose launcher was SIGKILLed cannot mark itself ended; its heartbeat going stale is
    how `harness runs` and `harness mark` tell it from a live one.
    """

    def __init__(self, tracker: Tracker, run_id: str, interval_s: float, outages: Outages | None = None) -> None:
        self._tracker = tracker
        self._run_id = run_id
        self._interval = interval_s
        self._outages = outages
        self._stop = threading.Event()
        tracker.set_tags(run_id, {T.HEARTBEAT_S: f"{interval_s:g}", T.HEARTBEAT: f"{time.time():.3f}",
                                  T.HEARTBEAT_BY: scratch.process_identity()})
        self._thread = threading.Thread(target=self._loop, name="harness-heartbeat", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._tracker.set_tags(self._run_id, {T.HEARTBEAT: f"{time.time():.3f}"})
            except Exception:  # a store hiccup: the next beat tries again; the run goes on
                if self._outages is not None:
                    self._outages.failed()
            else:
                if self._outages is not None:
                    self._outages.answered()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
