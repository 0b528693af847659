"""Rank 0's metric path: every logged value reaches the launcher, MLflow and series.npz exactly and in order."""

from __future__ import annotations

import math
import multiprocessing as mp
import struct
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import Project
from harness.runtime.outbox import BATCH_POINTS, SEND_EVERY_S, Outbox
from harness.messages import Final, Fingerprint, MetricsBatch


def _bits(x: float) -> bytes:
    return struct.pack("<d", x)


class _Reader:
    """The launcher's end of a real pipe, drained by a thread as launch.py does."""

    def __init__(self) -> None:
        self.reader, self.writer = mp.Pipe(duplex=False)
        self.got: list = []
        self.thread = threading.Thread(target=self._drain, daemon=True)
        self.thread.start()

    def _drain(self) -> None:
        while True:
            try:
                self.got.append(self.reader.recv())
            except EOFError:
                return

    def finish(self) -> list:
        self.writer.close()
        self.thread.join(30)
        return self.got


# Values whose bits a decimal or float32 round trip would change, and the IEEE edge cases.
EDGES = [-0.0, math.nan, math.inf, -math.inf, 5e-324, 1.7976931348623157e308, 0.1 + 0.2, 1 / 3, 2.0**53 + 2]


def test_outbox_keeps_bits_and_order_of_points_and_messages() -> None:
    pipe = _Reader()
    outbox = Outbox(pipe.writer)
    logged = []
    n = 2 * BATCH_POINTS + 17  # several full batches and a partial one
    for i in range(n):
        values = {"a": EDGES[i % len(EDGES)], "b": float(i) * 0.1}
        if i == 5:
            values = {"a": 1.5}  # a step logged twice: both points arrive, in order (the second wins in series)
            outbox.add(4, values, 1000 + i)
            logged += [("a", 4, 1.5, 1000 + i)]
            continue
        outbox.add(i, values, 1000 + i)
        logged += [(k, i, v, 1000 + i) for k, v in values.items()]
        if i == BATCH_POINTS // 3:
            outbox.send(Fingerprint(i, "f" * 64))  # after every point logged before it
            logged.append("fingerprint")
    outbox.send(Final(None, n))
    logged.append("final")
    outbox.close()
    got = []
    for msg in pipe.finish():
        if isinstance(msg, MetricsBatch):
            got += list(msg.points())
        else:
            got.append({Fingerprint: "fingerprint", Final: "final"}[type(msg)])
    assert len(got) == len(logged)
    for mine, theirs in zip(logged, got):
        if isinstance(mine, str):
            assert mine == theirs
        else:
            assert (mine[0], mine[1], _bits(mine[2]), mine[3]) == (theirs[0], theirs[1], _bits(theirs[2]), theirs[3])


def test_outbox_sends_a_quiet_loops_points_without_another_log_call() -> None:
    pipe = _Reader()
    outbox = Outbox(pipe.writer)
    outbox.add(0, {"loss": 0.25}, 1)  # starts the sender; the loop then logs nothing for a while
    outbox.add(1, {"loss": 0.5}, 2)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and sum(len(m) for m in pipe.got if isinstance(m, MetricsBatch)) < 2:
        time.sleep(SEND_EVERY_S)
    assert [p[:3] for m in pipe.got for p in m.points()] == [("loss", 0, 0.25), ("loss", 1, 0.5)]
    outbox.close()
    pipe.finish()


def test_outbox_close_wakes_an_idle_sender(monkeypatch: pytest.MonkeyPatch) -> None:
    """A calibration closes rank 0's outbox once per member, and every run once at its end: an idle sender must hear
    the close at once, not at its next idle wake. With that wake 30 s off, a close given 5 s ends the thread."""
    from harness.runtime import outbox as outbox_module

    monkeypatch.setattr(outbox_module, "_IDLE_S", 30.0)
    pipe = _Reader()
    outbox = Outbox(pipe.writer)
    outbox.add(0, {"loss": 0.25}, 1)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not pipe.got:  # sent: the sender then waits, idle, for the next point
        time.sleep(SEND_EVERY_S)
    time.sleep(0.2)
    outbox.close(timeout_s=5.0)
    assert not outbox._thread.is_alive(), "close() left the sender asleep on its idle wake"
    assert [p[:3] for m in pipe.finish() for p in m.points()] == [("loss", 0, 0.25)]


def test_outbox_flush_returns_once_everything_before_it_is_in_the_pipe() -> None:
    """What a checkpoint relies on before it marks its step complete: a rank killed the next instant (the pipe's
    writer gone, the sender thread with it) still leaves every earlier point and message for the launcher."""
    pipe = _Reader()
    outbox = Outbox(pipe.writer)
    outbox.flush()  # nothing logged yet: returns at once
    for i in range(3 * BATCH_POINTS // 2):
        outbox.add(i, {"loss": float(i)}, i)
    outbox.send(Fingerprint(7, "f" * 64))
    outbox.add(9, {"loss": 0.5}, 9)
    outbox.flush()
    got = pipe.finish()  # the writer closed without outbox.close(): only what reached the pipe arrives
    points = [p[:3] for m in got if isinstance(m, MetricsBatch) for p in m.points()]
    assert len(points) == 3 * BATCH_POINTS // 2 + 1 and points[-1] == ("loss", 9, 0.5)
    assert any(isinstance(m, Fingerprint) for m in got)


LOGGING_CRASH = '''
import numpy as np


def train(ctx):
    rng = np.random.default_rng(ctx.cfg.seed)
    a, b = rng.standard_normal(ctx.cfg.steps), rng.standard_normal(ctx.cfg.steps) * 1e-310
    a[::97] = -0.0
    if ctx.rank == 0:
        for i in range(ctx.cfg.steps):
            ctx.log({"a": float(a[i]), "b": float(b[i])}, i)
        raise RuntimeError("rank 0 fails right after its last log")
'''
STEPS = 30_000  # x 2 keys = 60k points: 15 batches; MLflow takes ~6k points/s, which is what this test waits for


@pytest.fixture(scope="module")
def crashed_logger(project: Project) -> str:
    project.add_experiment("logging_crash", train_py=LOGGING_CRASH)
    result = project.harness("run", "experiments/logging_crash", f"train={{steps: {STEPS}, seed: 7}}")
    assert result.returncode == 1, result.stderr
    assert "rank 0 fails right after its last log" in result.stderr
    return result.last_line


def test_every_point_of_a_crashing_rank_reaches_mlflow_and_series_exactly(
    project: Project, crashed_logger: str, tmp_path: Path
) -> None:
    from harness.store.seriesfile import load_series

    rng = np.random.default_rng(7)
    a, b = rng.standard_normal(STEPS), rng.standard_normal(STEPS) * 1e-310
    a[::97] = -0.0
    expected = {"a": a, "b": b}
    client = project.client()
    assert client.get_run(crashed_logger).info.status == "FAILED"
    series = load_series(Path(client.download_artifacts(crashed_logger, "metrics/series.npz", str(tmp_path))))
    assert sorted(series) == ["a", "b"]
    for key, values in expected.items():
        steps, got = series[key]
        assert steps.tolist() == list(range(STEPS))
        assert got.tobytes() == values.tobytes()  # every bit, -0.0 and subnormals included
        history = sorted(client.get_metric_history(crashed_logger, key), key=lambda m: m.step)
        assert [m.step for m in history] == list(range(STEPS))
        # MLflow's SQL column keeps the value, not every sign bit: -0.0 comes back as 0.0 there.
        assert [m.value for m in history] == values.tolist()
