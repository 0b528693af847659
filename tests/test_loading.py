"""The one loader of recorded runs (its table: every command x status x kind), the one derived-run creator and
the one reproduced-check (harness/record/loading.py, harness/record/derived.py, harness/judge/reproduced.py).

The refusal texts below are the ones the commands said before the table existed: a change to one is a change
of what a user reads, so each is written out here rather than read back from the table.
"""

from __future__ import annotations

import math
import struct
import time
from pathlib import Path

import numpy as np
import pytest

from harness import tags as T
from harness.errors import EXIT_USAGE, HarnessError, RunNotFound, RunRefused
from harness.judge import reproduced
from harness.record import closing, derived, loading, seal
from harness.rundata import RunSummary, same_value
from harness.store.tracking import Tracker

RID = "abc123"
RESUMED = f"run {RID} is {{status}}; only FAILED or KILLED runs are resumed."
AUDITED = f"run {RID} is {{status}}; only a FINISHED run has an end to verify. Resume it first."
CALIBRATED = (f"run {RID} is {{status}}; only a FINISHED run can be calibrated (its steps are the reference). "
              "Resume it first.")
CLAIMED = "run claimed-id is {status}; a claim rests on a FINISHED run."
MARKED = f"run {RID} is {{status}}, not RUNNING; only a RUNNING run can be marked. Nothing to do."
EXECUTED = f"run {RID} is {{status}}, not RUNNING; it was already executed."
STUDIED = (f"study {RID} is {{status}}: only a study whose every member finished can be replayed as a whole. "
           "Replay its finished members one by one with `harness replay MEMBER`.")
INCOMPLETE = (f"run {RID} is {{status}}: it stopped before its end, so a full replay cannot be judged against it. "
              "Pass --allow-incomplete to replay it and compare only the steps it reached.")

# command -> status -> the exact refusal, or None where the command accepts it (a run of kind `run`).
EXPECTED: dict[str, dict[str, str | None]] = {
    loading.REPLAY: {
        T.RUNNING: f"run {RID} is still RUNNING; its record is not complete. Wait until it ends, then replay it.",
        T.FINISHED: None, T.FAILED: INCOMPLETE, T.KILLED: INCOMPLETE,
    },
    loading.RESUME: {
        T.RUNNING: RESUMED + " If its launcher itself was SIGKILLed, nothing could mark it; check no rank still runs, "
                             f"then close it: `harness mark {RID} --status FAILED`.",
        T.FINISHED: RESUMED, T.FAILED: None, T.KILLED: None,
    },
    loading.AUDIT: {T.RUNNING: AUDITED, T.FINISHED: None, T.FAILED: AUDITED, T.KILLED: AUDITED},
    loading.TRACE: dict.fromkeys(loading.STATUSES),
    loading.CALIBRATE: {T.RUNNING: CALIBRATED, T.FINISHED: None, T.FAILED: CALIBRATED, T.KILLED: CALIBRATED},
    loading.VERIFY: {T.RUNNING: CLAIMED, T.FINISHED: None, T.FAILED: CLAIMED, T.KILLED: CLAIMED},
    loading.COMPARE: dict.fromkeys(loading.STATUSES),
    loading.EXPORT: {
        T.RUNNING: f"run {RID} is still RUNNING; its record is not complete. Export it when it has ended.",
        T.FINISHED: None, T.FAILED: None, T.KILLED: None,
    },
    loading.MARK: {T.RUNNING: None, T.FINISHED: MARKED, T.FAILED: MARKED, T.KILLED: MARKED},
    loading.EXECUTE: {T.RUNNING: None, T.FINISHED: EXECUTED, T.FAILED: EXECUTED, T.KILLED: EXECUTED},
    loading.STUDY_REPLAY: {T.RUNNING: STUDIED, T.FINISHED: None, T.FAILED: STUDIED, T.KILLED: STUDIED},
}

# The kinds replay, resume, audit and trace refuse: runs that hold no training job of their own.
NOT_TRAINING = {
    T.KIND_STUDY: f"run {RID} is a study (its members are the runs): replay it with `harness replay {RID}`, or one "
                  "member by its id; `harness {command}` applies to a training run.",
    T.KIND_STUDY_REPLAY: f"run {RID} is a study replay: replay the study it was made from (harness.replay_of), or one "
                         "of its members; `harness {command}` applies to a training run.",
    T.KIND_VERIFY: f"run {RID} is a claims check (harness verify): rerun it with `harness verify CLAIMS_FILE --replay`; "
                   "`harness {command}` applies to a training run.",
    T.KIND_TRACE: f"run {RID} is a trace of one step (harness trace); trace or replay the run it traced "
                  "(harness.trace_of) instead; `harness {command}` applies to a training run.",
    T.KIND_BISECT: f"run {RID} is a bisection (harness bisect): its probes are the runs; rerun it with "
                   "`harness bisect GOOD BAD`; `harness {command}` applies to a training run.",
    T.KIND_CALIBRATION: f"run {RID} is a calibration (harness calibrate) of run calibrated1; use that run instead; "
                        "`harness {command}` applies to a training run.",
}


def summary(status: str, kind: str = T.KIND_RUN, **tags: str) -> RunSummary:
    return RunSummary(RID, "exp", "1", "name", status, 0, None, {T.VERSION: "0.1.0", T.KIND: kind, **tags},
                      {}, [], "file:///nowhere")


def test_the_table_names_every_command_and_every_status() -> None:
    assert set(loading.RULES) == set(EXPECTED)
    for command, rule in loading.RULES.items():
        assert set(rule.statuses) == set(loading.STATUSES), command


@pytest.mark.parametrize("command", sorted(EXPECTED))
@pytest.mark.parametrize("status", loading.STATUSES)
def test_each_command_accepts_or_refuses_each_status_in_its_own_words(command: str, status: str) -> None:
    want = EXPECTED[command][status]
    kind = T.KIND_STUDY if command == loading.STUDY_REPLAY else T.KIND_RUN
    got = loading.refusal(command, summary(status, kind), name="claimed-id")
    assert got == (None if want is None else want.format(status=status))


@pytest.mark.parametrize("command", [loading.REPLAY, loading.RESUME, loading.AUDIT, loading.TRACE, loading.CALIBRATE])
@pytest.mark.parametrize("kind", loading.KINDS)
def test_the_training_commands_refuse_what_holds_no_training_job(command: str, kind: str) -> None:
    got = loading.refusal(command, summary(T.FINISHED if command != loading.RESUME else T.FAILED, kind,
                                           **{T.TRACE_OF: "traced1", T.CALIBRATION_OF: "calibrated1"}))
    if command == loading.TRACE and kind == T.KIND_TRACE:  # trace says which run to trace instead
        assert got == f"run {RID} is a trace; trace the run it traced (traced1)."
    elif kind in NOT_TRAINING:
        assert got == NOT_TRAINING[kind].format(command=command)
    else:  # a run, a replay, an audit: each holds a training job
        assert got is None


@pytest.mark.parametrize("command", [loading.VERIFY, loading.COMPARE, loading.EXPORT, loading.MARK, loading.EXECUTE])
@pytest.mark.parametrize("kind", loading.KINDS)
def test_the_other_commands_refuse_no_kind(command: str, kind: str) -> None:
    status = T.RUNNING if command in (loading.MARK, loading.EXECUTE) else T.FINISHED
    assert loading.refusal(command, summary(status, kind)) is None


def test_allow_incomplete_lifts_only_replays_refusal_of_a_run_that_stopped() -> None:
    for status in T.INCOMPLETE:
        assert loading.refusal(loading.REPLAY, summary(status), allow_incomplete=True) is None
        assert loading.refusal(loading.AUDIT, summary(status), allow_incomplete=True) == AUDITED.format(status=status)
    assert loading.refusal(loading.REPLAY, summary(T.RUNNING), allow_incomplete=True) == EXPECTED[loading.REPLAY][T.RUNNING]


def test_a_replay_refusal_says_how_to_go_on() -> None:
    # A run that saves checkpoints may be resumed instead (whether it saved one is read from its store, which this
    # summary lacks: tests/test_adversarial_verdicts.py has both); a RUNNING run whose heartbeat stopped is closed first.
    checkpointed = RunSummary(RID, "exp", "1", "n", T.KILLED, 0, None, {T.VERSION: "0.1.0"}, {"checkpoint_every": "5"},
                              [], "")
    assert loading.refusal(loading.REPLAY, checkpointed) == (
        f"run {RID} is KILLED: it stopped before its end, so a full replay cannot be judged against it. Resume it "
        f"with `harness resume {RID}` if it saved a checkpoint, or pass --allow-incomplete to replay it and compare "
        "only the steps it reached.")
    gone = summary(T.RUNNING, **{T.HEARTBEAT: str(time.time() - 1000), T.HEARTBEAT_S: "10"})
    assert loading.refusal(loading.REPLAY, gone) == (
        f"run {RID} is RUNNING but its launcher is gone (no heartbeat for 1000 s). Close it with `harness mark {RID} "
        "--status FAILED`, then replay it with --allow-incomplete.")


# --- load(): against a real SQLite store ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tracker(tmp_path_factory: pytest.TempPathFactory) -> Tracker:
    return Tracker(f"sqlite:///{tmp_path_factory.mktemp('store') / 'mlflow.db'}")


def _run(tracker: Tracker, status: str, kind: str = T.KIND_RUN) -> str:
    run_id = tracker.create_run("loading", {T.VERSION: "0.1.0", T.KIND: kind}, run_name="r")
    tracker.log_metric_entries(run_id, [("loss", 0.5, 0, 0)])
    if status != T.RUNNING:
        closing.close(tracker, run_id, status)  # sealed as it closes
    return run_id


def test_load_refuses_a_run_harness_did_not_make_except_to_compare(tracker: Tracker) -> None:
    foreign = tracker.create_run("loading", {}, run_name="foreign")
    with pytest.raises(RunRefused, match=f"^run '{foreign}' was not made by harness") as err:
        loading.load(tracker, foreign, loading.REPLAY)
    assert err.value.exit_code == EXIT_USAGE
    assert loading.load(tracker, foreign, loading.COMPARE).summary.run_id == foreign


def test_load_checks_the_seal_before_the_status_and_reads_the_record_when_asked(tracker: Tracker) -> None:
    run_id = _run(tracker, T.FINISHED)
    loaded = loading.load(tracker, run_id, loading.AUDIT)
    assert (loaded.run_id, loaded.incomplete) == (run_id, False)
    assert loaded.record.metrics["loss"][1].tolist() == [0.5]
    tracker.set_tags(run_id, {T.SEED: "7"})  # an edit after the seal
    for command in (loading.REPLAY, loading.RESUME, loading.AUDIT, loading.TRACE, loading.COMPARE, loading.EXPORT):
        with pytest.raises(RunRefused, match=f"^run {run_id} was changed after it was sealed: "):
            loading.load(tracker, run_id, command)  # the resume's status refusal would come after it
    with pytest.raises(RunRefused, match=f"^run {run_id} is FINISHED, not RUNNING; only a RUNNING run can be marked"):
        loading.load(tracker, run_id, loading.MARK)  # mark reads no closed record: no seal check


def test_load_refuses_by_kind_before_the_seal(tracker: Tracker) -> None:
    study = _run(tracker, T.FINISHED, T.KIND_STUDY)
    tracker.set_tags(study, {T.SEED: "7"})  # edited too: the kind is said first
    with pytest.raises(RunRefused, match=f"^run {study} is a study .*`harness resume` applies to a training run.$"):
        loading.load(tracker, study, loading.RESUME)


def test_load_says_the_status_refusal_with_its_exit_code(tracker: Tracker) -> None:
    run_id = _run(tracker, T.FAILED)
    with pytest.raises(RunRefused) as err:
        loading.load(tracker, run_id, loading.AUDIT)
    assert str(err.value) == f"run {run_id} is FAILED; only a FINISHED run has an end to verify. Resume it first."
    assert err.value.exit_code == EXIT_USAGE
    assert loading.load(tracker, run_id, loading.REPLAY, allow_incomplete=True).incomplete


def test_load_of_an_id_no_run_has_raises_run_not_found_not_a_refusal(tracker: Tracker) -> None:
    for command in (loading.REPLAY, loading.COMPARE, loading.MARK):
        with pytest.raises(RunNotFound, match=f"^no run '{'0' * 32}' in the tracking store ") as err:
            loading.load(tracker, "0" * 32, command)
        assert err.value.exit_code == EXIT_USAGE and not isinstance(err.value, RunRefused)
    with pytest.raises(RunNotFound, match="^run id 'abc' is too short"):
        loading.load(tracker, "abc", loading.REPLAY)
    assert issubclass(RunNotFound, HarnessError) and issubclass(RunRefused, HarnessError)  # the one catch-all holds


# --- the derived-run creator ------------------------------------------------------------------------------


def test_derived_tags_name_the_source_the_parent_and_what_is_carried() -> None:
    source = summary(T.FINISHED, **{T.CONFIG_REDACTED: "token=env:TOKEN"})
    assert derived.tags(T.KIND_REPLAY, source, copy=(T.CONFIG_REDACTED, T.SEED), extra={T.STUDY_REPLAY: "s1"}) == {
        T.KIND: T.KIND_REPLAY, T.REPLAY_OF: RID, T.MLFLOW_PARENT_RUN_ID: RID, T.CONFIG_REDACTED: "token=env:TOKEN",
        T.STUDY_REPLAY: "s1"}  # no harness.version: the recorder writes its own; a tag the source lacks is not made
    trace = derived.tags(T.KIND_TRACE, source, parent="replay9", version="0.1.0", runtime=True)
    assert (trace[T.TRACE_OF], trace[T.MLFLOW_PARENT_RUN_ID], trace[T.VERSION]) == (RID, "replay9", "0.1.0")
    assert trace[T.ENV_PREFIX + "torch"]  # the machine the trace re-executed on
    assert derived.tags(T.KIND_VERIFY, version="0.1.0") == {T.VERSION: "0.1.0", T.KIND: T.KIND_VERIFY}
    assert derived.tags(T.KIND_AUDIT, source)[T.AUDIT_OF] == RID
    assert derived.tags(T.KIND_STUDY_REPLAY, source)[T.REPLAY_OF] == RID


def test_a_derived_run_ends_finished_or_failed_with_the_error_or_killed(tracker: Tracker) -> None:
    tags = derived.tags(T.KIND_AUDIT, summary(T.FINISHED), version="0.1.0")
    with derived.opened(tracker, "loading", tags, "audit-of-x") as ok:
        assert tracker.get_run(ok).status == T.RUNNING
    done = tracker.get_run(ok)
    assert (done.status, done.run_name, done.tags[T.AUDIT_OF], done.tags[T.MLFLOW_PARENT_RUN_ID]) == (
        T.FINISHED, "audit-of-x", RID, RID)
    assert T.SEAL in done.tags

    with pytest.raises(OSError, match="disk full"), derived.opened(tracker, "loading", tags, "audit-of-y") as bad:
        raise OSError("disk full")
    failed = tracker.get_run(bad)
    assert (failed.status, failed.tags[T.STATUS_REASON], failed.tags[T.KIND]) == (T.FAILED, "disk full", T.KIND_AUDIT)
    assert T.SEAL in failed.tags  # closed through record/closing.py: sealed like every close

    with pytest.raises(KeyboardInterrupt), derived.opened(tracker, "loading", tags, "audit-of-z") as stopped:
        raise KeyboardInterrupt
    assert tracker.get_run(stopped).status == T.KILLED


def test_a_run_its_launcher_closes_stays_open_unless_its_creation_fails(tracker: Tracker) -> None:
    tags = derived.tags(T.KIND_REPLAY, summary(T.FINISHED), version="0.1.0")
    with derived.opened(tracker, "loading", tags, None, close=False) as open_run:
        pass
    assert tracker.get_run(open_run).status == T.RUNNING
    closing.close(tracker, open_run, T.FINISHED)
    with pytest.raises(ValueError), derived.opened(tracker, "loading", tags, None, close=False) as broken:
        raise ValueError("bad param")
    assert tracker.get_run(broken).status == T.FAILED


# --- the reproduced-check ---------------------------------------------------------------------------------

NAN = float("nan")
OTHER_NAN = struct.unpack("<d", struct.pack("<Q", 0x7FF8000000000001))[0]  # a NaN of other bits


def test_the_same_value_is_the_same_bits() -> None:
    assert same_value(NAN, NAN) and same_value(-0.0, -0.0) and same_value(0.1 + 0.2, 0.30000000000000004)
    assert not same_value(0.0, -0.0) and not same_value(-0.0, 0.0)  # == says they are equal
    assert math.isnan(OTHER_NAN) and not same_value(NAN, OTHER_NAN)
    assert not same_value(1.0, 1.0 + 2**-52)


def test_a_nan_logged_again_reproduces_and_a_signed_zero_does_not() -> None:
    recorded = {"loss": {0: NAN, 1: -0.0}}
    assert reproduced.values(recorded, {("loss", 0): NAN, ("loss", 1): -0.0}, complete=True).reproduced is True
    got = reproduced.values(recorded, {("loss", 0): NAN, ("loss", 1): 0.0}, complete=True)
    assert (got.reproduced, got.mismatch) == (False, "loss at step 1: 0.0, the run recorded -0.0")


def test_a_value_the_record_lacks_differs_only_where_the_record_is_complete() -> None:
    recorded = {"loss": {0: 1.0}}
    logged = {("loss", 0): 1.0, ("acc", 0): 0.5}
    complete = reproduced.values(recorded, logged, complete=True)
    assert (complete.reproduced, complete.mismatch) == (False, "acc at step 0: 0.5, the run recorded None")
    stopped = reproduced.values(recorded, logged, complete=False)  # a run that died may not have written it
    assert (stopped.reproduced, stopped.checked) == (True, 1)
    assert reproduced.values(recorded, {("acc", 3): 0.5}, complete=False).reproduced is None  # nothing to hold it to


def test_only_the_steps_asked_for_are_held_and_the_first_difference_is_the_earliest() -> None:
    recorded = {"a": {1: 1.0, 2: 2.0, 3: 3.0}, "b": {2: 5.0}}
    logged = {("a", 1): 9.0, ("b", 2): 6.0, ("a", 2): 7.0, ("a", 3): 3.0}
    assert reproduced.values(recorded, logged, complete=True, first=2, end=3).mismatch == \
        "a at step 2: 7.0, the run recorded 2.0"  # step 1 is before the range; a before b at one step
    assert reproduced.values(recorded, logged, complete=True, first=3).reproduced is True


def test_a_clock_differing_is_not_held_and_named_apart_but_a_running_mean_is_held() -> None:
    # Two executions of one step never time alike: a re-execution (a resume's proof) is not refused for nanoGPT's
    # mfu or a Trainer's train_runtime; a value of the training's own (a running mean of the loss) still is.
    recorded = {"loss": {0: 1.0}, "mfu": {0: 0.31}, "train_runtime": {0: 12.5}, "loss_mean": {0: 1.0}}
    logged = {("loss", 0): 1.0, ("mfu", 0): 0.29, ("train_runtime", 0): 11.0}
    got = reproduced.values(recorded, logged, complete=True)
    assert (got.reproduced, got.checked, got.unheld) == (True, 1, ("mfu", "train_runtime"))
    assert got.unheld_line.startswith("mfu, train_runtime differed as re-executed and are not held")
    mean = reproduced.values(recorded, {**logged, ("loss_mean", 0): 0.9}, complete=True)
    assert (mean.reproduced, mean.mismatch) == (False, "loss_mean at step 0: 0.9, the run recorded 1.0")
    assert reproduced.values(recorded, {("mfu", 0): 0.31}, complete=True).unheld_line == ""


def test_the_record_series_reads_as_the_check_reads_it() -> None:
    metrics = {"loss": (np.array([0, 5]), np.array([0.5, -0.0]))}
    lookup = reproduced.series(metrics)
    assert lookup == {"loss": {0: 0.5, 5: 0.0}} and math.copysign(1, lookup["loss"][5]) == -1


def test_the_store_holds_a_resume_to_the_same_bit_rule(tmp_path: Path) -> None:
    # MetricWriter.prime: a value logged again with the same bits is not rewritten; -0.0 for 0.0 is the conflict.
    from harness.store.writers import MetricWriter

    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = tracker.create_run("loading", {T.VERSION: "0.1.0"}, run_name="w")
    writer = MetricWriter(tracker, run_id, 3600.0)  # no flush while the test looks
    try:
        writer.prime({"loss": (np.array([0, 1]), np.array([NAN, 0.0]))})
        writer.add(0, {"loss": NAN}, 0)
        assert writer.conflict is None and not writer._pending  # NaN of the same bits: the same value
        writer.add(1, {"loss": -0.0}, 0)
        assert writer.conflict is not None and writer.conflict[:2] == ("loss", 1)
        writer.add(2, {"loss": 0.25}, 0)  # a step the run lacks: the continuation's own, written
        assert [p[3] for p in writer._pending] == [1, 2]
    finally:
        writer.close()


def test_a_close_cuts_its_reason_once_seals_and_keeps_a_copied_end_time(tracker: Tracker) -> None:
    """record/closing.py, the one door every close goes through: the reason cut to REASON_LIMIT, the tags written with
    it, the record sealed as it closes (and intact by the seal's own check); a copied run keeps its original's end
    time, a RUNNING one stays open; a reopened run is RUNNING with its seal saying so and the old reason gone."""
    run_id = _run(tracker, T.RUNNING)
    closing.close(tracker, run_id, T.FAILED, "x" * (closing.REASON_LIMIT + 200), tags={T.FAILED_RANK: "1"})
    closed = tracker.get_run(run_id)
    assert (closed.status, closed.tags[T.STATUS_REASON], closed.tags[T.FAILED_RANK]) == (
        T.FAILED, "x" * closing.REASON_LIMIT, "1")
    seal.check(tracker, run_id)

    closing.reopen(tracker, run_id)
    reopened = tracker.get_run(run_id)
    assert reopened.status == T.RUNNING and reopened.tags[T.SEAL].endswith(seal.REOPENED)
    assert T.STATUS_REASON not in reopened.tags and T.FAILED_RANK not in reopened.tags

    copy = _run(tracker, T.RUNNING)
    closing.close_copy(tracker, copy, T.RUNNING, 1_700_000_000_000)
    assert tracker.get_run(copy).status == T.RUNNING and T.SEAL not in tracker.get_run(copy).tags
    closing.close_copy(tracker, copy, T.KILLED, 1_700_000_000_000)
    ended = tracker.get_run(copy)
    assert (ended.status, ended.end_time) == (T.KILLED, 1_700_000_000_000)
    seal.check(tracker, copy)
