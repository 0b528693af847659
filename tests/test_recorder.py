"""The recorder on its own: a real SQLite store and a real sequence of rank 0's messages, no ranks.

What the recorder writes for a message sequence is the whole record of a run, whichever backend ran
the ranks: these tests feed it the messages a run sends and check the closed, sealed run holds exactly
those values (or, for a failing sequence, FAILED with the failure's message).
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import numpy as np
import pytest

import harness
from harness import tags as T
from harness.config import Experiment, compose
from harness.executors import schema
from harness.errors import EXIT_FAILED, EXIT_OK, HarnessError
from harness.messages import Checkpoint, Final, Fingerprint, Initial, Metrics, MetricsBatch, Notice, Total
from harness.record import seal
from harness.record.recorder import Failed, Killed, Line, Recorder, Shown
from harness.store.tracking import Tracker

DIGEST = {step: f"{step:064x}" for step in range(8)}  # a fingerprint per step, all different


def batch(points: list[tuple[str, int, float]]) -> MetricsBatch:
    """Points as the rank's ctx.log buffers them (see MetricsBatch)."""
    keys = tuple(dict.fromkeys(key for key, _, _ in points))
    return MetricsBatch(
        keys,
        np.array([keys.index(key) for key, _, _ in points], dtype=np.int32),
        np.array([step for _, step, _ in points], dtype=np.int64),
        np.array([value for _, _, value in points], dtype=np.float64),
        np.array([1_700_000_000_000 + step for _, step, _ in points], dtype=np.int64),
    )


class Started:
    """A recorder over a fresh run in a real store, started as a launcher starts it before the ranks run."""

    def __init__(self, tmp_path: Path, **overrides: object) -> None:
        self.tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}")
        self.run_id = self.tracker.create_run("recorder", {T.VERSION: harness.__version__, T.EXECUTOR: "local"})
        self.cfg = Experiment.of(compose([("test", {"image": "none", "entry": "train.py:train", "world_size": 2,
                                                   **overrides})], schema())).config
        self.work = tmp_path / "work"
        (self.work / "logs").mkdir(parents=True)
        (self.work / "logs" / "rank0.log").write_text("step 0\nstep 1\n")
        self.shown: list[Shown] = []
        self.recorder = Recorder(self.tracker, self.run_id, self.cfg, self.work, self.shown.append)
        self.recorder.start("cpu", "gloo")

    def feed(self, *messages: object) -> None:
        for msg in messages:
            self.recorder.feed(msg)  # type: ignore[arg-type]

    def run(self):  # the run as the store has it now
        return self.tracker.get_run(self.run_id)


def test_a_finished_sequence_is_a_sealed_finished_run_with_exactly_its_values(tmp_path: Path) -> None:
    job = Started(tmp_path, checkpoint_every=2)
    losses = [0.5, 0.25, 0.125, 1 / 3]  # 1/3: float64's bits must survive the store
    job.feed(
        Total(4),
        Initial(DIGEST[7]),
        batch([("loss", 0, losses[0]), ("acc", 0, 0.1), ("loss", 1, losses[1])]),
        Fingerprint(1, DIGEST[1]),
        Checkpoint(2, DIGEST[2], {"model.weight": DIGEST[3]}, (DIGEST[4], DIGEST[5])),
        Metrics(2, {"loss": losses[2]}, 1_700_000_000_002),
        Notice("data", "the loader reshuffled"),
        batch([("loss", 3, losses[3])]),
        Final(DIGEST[6], 4, "model"),
    )
    assert job.recorder.ranks_done() is None
    outcome = job.recorder.end()

    assert (outcome.status, outcome.exit_code, outcome.message) == (T.FINISHED, EXIT_OK, "")
    assert outcome.fingerprints == {1: DIGEST[1]}
    seal.check(job.tracker, job.run_id)  # closed through the seal, and nothing changed since
    run = job.run()
    assert run.status == T.FINISHED
    assert run.tags[T.FINGERPRINT] == DIGEST[6]
    assert run.tags[T.FINGERPRINT_OF] == "model"
    assert run.tags[T.INITIAL_FINGERPRINT] == DIGEST[7]
    assert run.tags[T.WEIGHTS_CHANGED] == "true"
    assert run.tags[T.NOTICES] == "the loader reshuffled"
    assert (run.tags[T.DEVICE], run.tags[T.BACKEND]) == ("cpu", "gloo")
    record = job.tracker.load_record(job.run_id)
    steps, values = record.metrics["loss"]
    assert steps.tolist() == [0, 1, 2, 3]
    assert [float(v).hex() for v in values] == [v.hex() for v in losses]
    assert record.metrics["acc"][1].tolist() == [0.1]
    assert record.fingerprints == {1: DIGEST[1]}
    assert record.final_fingerprint == DIGEST[6]
    assert record.steps_total == 4
    assert record.checkpoints == {2: DIGEST[2]}
    assert record.checkpoint_tensors == {2: {"tensors": {"model.weight": DIGEST[3]}, "ranks": [DIGEST[4], DIGEST[5]]}}
    assert job.tracker.read_text(job.run_id, f"{T.ARTIFACT_LOGS_DIR}/rank0.log") == "step 0\nstep 1\n"
    assert job.tracker.read_text(job.run_id, T.ARTIFACT_LOCK)  # every installed distribution, written meanwhile
    # What the person watching sees goes to the caller's view, nothing to a terminal of the recorder's choosing.
    assert job.shown == [Total(4), Line("Warning: the loader reshuffled")]


def test_a_failing_sequence_is_a_sealed_failed_run_with_the_failure(tmp_path: Path) -> None:
    job = Started(tmp_path)
    job.feed(batch([("loss", 0, 0.5)]), Fingerprint(0, DIGEST[0]))
    traceback_text = 'Traceback (most recent call last):\n  File "train.py", line 9\nValueError: diverged\n'
    outcome = job.recorder.end(Failed("rank 1 raised: ValueError: diverged (train.py:9)", 1, traceback_text, False))

    assert (outcome.status, outcome.exit_code) == (T.FAILED, EXIT_FAILED)
    assert outcome.message == "rank 1 raised: ValueError: diverged (train.py:9)"
    seal.check(job.tracker, job.run_id)
    run = job.run()
    assert run.status == T.FAILED
    assert run.tags[T.STATUS_REASON] == outcome.message
    assert run.tags[T.FAILED_RANK] == "1"
    assert job.tracker.read_text(job.run_id, T.ARTIFACT_FAILURE) == f"rank: 1\n\n{traceback_text}"
    assert job.tracker.load_record(job.run_id).metrics["loss"][1].tolist() == [0.5]
    assert json.loads(job.tracker.read_text(job.run_id, T.ARTIFACT_FINGERPRINTS) or "{}")["steps"] == {"0": DIGEST[0]}
    assert job.shown == [Line(traceback_text.rstrip())]  # the traceback, for the terminal, once the ranks ended


def test_an_interrupted_sequence_is_killed(tmp_path: Path) -> None:
    job = Started(tmp_path)
    job.feed(Metrics(0, {"loss": 0.5}, 1_700_000_000_000))
    outcome = job.recorder.end(Killed("interrupted by SIGTERM", 128 + signal.SIGTERM))

    assert (outcome.status, outcome.exit_code) == (T.KILLED, 128 + signal.SIGTERM)
    seal.check(job.tracker, job.run_id)
    assert job.run().status == T.KILLED
    assert job.run().tags[T.STATUS_REASON] == outcome.message == "interrupted by SIGTERM"


def test_an_error_of_the_launcher_fails_the_run_and_is_raised_once_it_is_closed(tmp_path: Path) -> None:
    job = Started(tmp_path)
    with pytest.raises(HarnessError, match="^the rendezvous went away$"):
        job.recorder.end(HarnessError("the rendezvous went away"))
    seal.check(job.tracker, job.run_id)
    assert job.run().status == T.FAILED
    assert job.run().tags[T.STATUS_REASON] == "the rendezvous went away"


def test_a_sequence_with_steps_no_series_holds_is_not_finished(tmp_path: Path) -> None:
    """harness.lr is logged at every optimizer step: steps 2-3 that neither it nor any other series holds are a hole in
    the record, and a run with one is FAILED with the steps named, not FINISHED; a hole a GradScaler explains (it
    skipped the step, its scale backed off) and sparse logging of the code's own are no hole."""
    job = Started(tmp_path)
    job.feed(batch([(T.METRIC_LR, s, 0.1) for s in (0, 1, 4, 5)] + [("loss", 0, 0.5), ("loss", 4, 0.25)]),
             Final(DIGEST[6], 6, "model"))
    ended = job.recorder.ranks_done()
    assert ended is not None and "holds no value at steps 2-3" in ended.message, ended
    outcome = job.recorder.end(ended)
    assert outcome.status == T.FAILED and job.run().status == T.FAILED

    from harness.record import wholeness

    scaled = {T.METRIC_LR: {0: 0.1, 2: 0.1}, T.METRIC_GRAD_SCALE: {0: 65536.0, 2: 32768.0}}
    assert wholeness.holes(scaled, {}) == [] and wholeness.first_missing(scaled, {}) == 3
    assert wholeness.holes({T.METRIC_LR: {0: 0.1, 1: 0.1, 2: 0.1}, "val": {2: 1.0}}, {}) == []
    assert wholeness.holes({T.METRIC_LR: {2: 0.1, 3: 0.1}}, {}) == []  # first steps that stepped no optimizer
    # Where the record of a killed launcher ends: its first hole, or the step after its last value without a witness.
    assert wholeness.first_missing({T.METRIC_LR: {0: 0.1, 1: 0.1, 3: 0.1}}, {}) == 2
    assert wholeness.first_missing({"loss": {0: 1.0, 10: 1.0}}, {}) == 11
    assert wholeness.first_missing({}, {}) == 0


def test_a_resumed_run_reads_the_values_its_killed_launcher_wrote_past_its_series(tmp_path: Path) -> None:
    """A resume whose launcher was SIGKILLed wrote values to MLflow's history but no series.npz (the file is the one the
    run's earlier close wrote): the record read back holds them, so that the next resume knows where it ends."""
    job = Started(tmp_path)
    job.feed(batch([(T.METRIC_LR, s, 0.1) for s in range(4)] + [("loss", s, s / 8) for s in range(4)]),
             Final(DIGEST[6], 4, "model"))
    job.recorder.end(job.recorder.ranks_done())
    job.tracker.set_tags(job.run_id, {T.RESUMES: "2"})
    job.tracker.log_metric_entries(job.run_id, [(key, value, 1_700_000_000_100 + s, s) for s in (4, 5)
                                                for key, value in ((T.METRIC_LR, 0.1), ("loss", s / 8))])
    record = job.tracker.load_record(job.run_id)
    assert record.metrics["loss"][0].tolist() == list(range(6))
    assert record.metrics["loss"][1].tolist() == [s / 8 for s in range(6)]
