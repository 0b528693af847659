"""Loading a recorded run for a command: the one table of which statuses and kinds each command accepts.

Every command that reads a run back (replay, resume, audit, trace, verify, compare, export, mark, the
recorded run a batch job executes, a study replay) loads it here, so "may this command use this run" is
decided once: the run must be harness's, of a kind the command applies to, as it was sealed (where the
command reads a closed record), and in a status the command accepts. Each refusal is one line saying
what to do instead; its text and exit code are the ones the commands have always given.

Order, the same for every command: made by harness -> kind -> seal -> status. What the command then
needs (the stored record, the recorded config and code) is read on first use, so a refusal that comes
later in a command (no checkpoint chain, a step out of range) still comes before the config is read.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property

from harness import tags as T
from harness.errors import RunRefused
from harness.record import liveness, seal
from harness.record.rerun import RecordedRun
from harness.rundata import RunRecord, RunSummary
from harness.store.tracking import Tracker

# The commands, as the table names them.
REPLAY = "replay"
RESUME = "resume"
AUDIT = "audit"
TRACE = "trace"
VERIFY = "verify"  # a claim resting on one run (a study's members are the study's)
COMPARE = "compare"
EXPORT = "export"
MARK = "mark"
EXECUTE = "execute"  # the recorded run a container or batch job executes (harness run's inner side)
STUDY_REPLAY = "study_replay"  # a study replayed as a whole
CALIBRATE = "calibrate"  # a run whose first steps are re-executed with nudged weights (harness calibrate)

STATUSES = (T.RUNNING, T.FINISHED, T.FAILED, T.KILLED)
KINDS = (T.KIND_RUN, T.KIND_REPLAY, T.KIND_AUDIT, T.KIND_STUDY, T.KIND_STUDY_REPLAY, T.KIND_VERIFY, T.KIND_TRACE,
         T.KIND_BISECT, T.KIND_CALIBRATION)

# A refusal: a template formatted with {rid} (the run id), {run} (the run as the caller names it: a claim's
# source, an imported run's original id), {status}, {kind}; or a function of the run, where the line depends on
# more than its fields (a RUNNING run's heartbeat, an incomplete run's checkpoints: read from the store when the
# caller gives it).
Refusal = str | Callable[[RunSummary, Tracker | None], str]


@dataclass(frozen=True)
class Rule:
    """What one command accepts. `statuses`: every status, None where it is accepted, else its refusal."""

    statuses: Mapping[str, Refusal | None]
    kinds: Mapping[str, Refusal] = field(default_factory=dict)  # the kinds it refuses (every other is accepted)
    sealed: bool = True  # the record is checked against its seal before anything is read from it
    lifted: tuple[str, ...] = ()  # statuses whose refusal `allow_incomplete` (replay --allow-incomplete) lifts
    harness_only: bool = True  # a run harness did not make is refused (it lacks what the command reads)


def _replay_running(run: RunSummary, tracker: Tracker | None = None) -> str:
    rid, now = run.run_id, time.time()
    gone = liveness.launcher_gone(run.tags, now)
    if gone is not None:
        return (f"run {rid} is RUNNING but its launcher is gone ({gone}). Close it with "
                f"`harness mark {rid} --status FAILED`, then replay it with --allow-incomplete.")
    interval = liveness.heartbeat_interval(run.tags)
    elsewhere = "" if interval is None else (
        f" If its launcher was killed on another machine, `harness mark {rid} --status FAILED` closes it once its "
        f"heartbeat is {T.STALE_FACTOR * interval:g} s old.")
    return f"run {rid} is still RUNNING; its record is not complete. Wait until it ends, then replay it." + elsewhere


def _saved_checkpoint(run: RunSummary, tracker: Tracker | None) -> bool | None:
    """Did the run leave a complete checkpoint (a COMPLETE marker in its artifacts)? None: not known here."""
    try:  # the flattened config is in the params
        if int(run.params.get("checkpoint_every", "0")) <= 0:
            return False
    except ValueError:
        return False
    if tracker is None:
        return None
    return any(path.rsplit("/", 1)[-1] == "COMPLETE" for path, _ in tracker.artifact_files(run.run_id, T.ARTIFACT_CHECKPOINTS))


def _replay_incomplete(run: RunSummary, tracker: Tracker | None = None) -> str:
    rid = run.run_id
    saved = _saved_checkpoint(run, tracker)  # a run that saves checkpoints may have stopped before its first
    resume = ("Pass" if saved is False else f"Resume it with `harness resume {rid}` (it has checkpoints), or pass" if saved
              else f"Resume it with `harness resume {rid}` if it saved a checkpoint, or pass")
    return (f"run {rid} is {run.status}: it stopped before its end, so a full replay cannot be judged against it. "
            f"{resume} --allow-incomplete to replay it and compare only the steps it reached.")


# Runs that record a group or a check rather than one training job: there is nothing of their own to rerun.
NOT_TRAINING: dict[str, Refusal] = {
    kind: f"run {{rid}} is {why}; `harness {{command}}` applies to a training run."
    for kind, why in {
        T.KIND_STUDY: "a study (its members are the runs): replay it with `harness replay {rid}`, or one member by its id",
        T.KIND_STUDY_REPLAY: "a study replay: replay the study it was made from (harness.replay_of), or one of its members",
        T.KIND_VERIFY: "a claims check (harness verify): rerun it with `harness verify CLAIMS_FILE --replay`",
        T.KIND_TRACE: "a trace of one step (harness trace); trace or replay the run it traced (harness.trace_of) instead",
        T.KIND_BISECT: "a bisection (harness bisect): its probes are the runs; rerun it with `harness bisect GOOD BAD`",
        T.KIND_CALIBRATION: "a calibration (harness calibrate) of run {calibration_of}; use that run instead",
    }.items()
}
_RESUMED = "run {rid} is {status}; only FAILED or KILLED runs are resumed."
_ONLY_RUNNING = {s: None if s == T.RUNNING else "run {rid} is {status}, not RUNNING; " for s in STATUSES}


def _running_only(then: str) -> dict[str, Refusal | None]:
    return {s: None if r is None else r + then for s, r in _ONLY_RUNNING.items()}


def _finished_only(refusal: str) -> dict[str, Refusal | None]:
    return {s: None if s == T.FINISHED else refusal for s in STATUSES}


RULES: dict[str, Rule] = {
    REPLAY: Rule(
        {T.RUNNING: _replay_running, T.FINISHED: None, T.FAILED: _replay_incomplete, T.KILLED: _replay_incomplete},
        NOT_TRAINING, lifted=T.INCOMPLETE,
    ),
    RESUME: Rule(
        {T.RUNNING: _RESUMED + " If its launcher itself was SIGKILLed, nothing could mark it; check no rank still runs, "
                               "then close it: `harness mark {rid} --status FAILED`.",
         T.FINISHED: _RESUMED, T.FAILED: None, T.KILLED: None},
        NOT_TRAINING,
    ),
    AUDIT: Rule(_finished_only("run {rid} is {status}; only a FINISHED run has an end to verify. Resume it first."),
                NOT_TRAINING),
    # Any status: a trace re-executes steps the run completed (the command checks its step count).
    TRACE: Rule(dict.fromkeys(STATUSES),
                {**NOT_TRAINING, T.KIND_TRACE: "run {rid} is a trace; trace the run it traced ({trace_of})."}),
    VERIFY: Rule(_finished_only("run {run} is {status}; a claim rests on a FINISHED run.")),
    # Its first steps are re-executed and held to the record: only a finished run is a reference.
    CALIBRATE: Rule(_finished_only("run {rid} is {status}; only a FINISHED run can be calibrated (its steps are the "
                                   "reference). Resume it first."), NOT_TRAINING),
    # Two records side by side: any run, also one harness did not make.
    COMPARE: Rule(dict.fromkeys(STATUSES), harness_only=False),
    EXPORT: Rule({**dict.fromkeys(STATUSES), T.RUNNING: "run {rid} is still RUNNING; its record is not complete. "
                                                        "Export it when it has ended."}),
    MARK: Rule(_running_only("only a RUNNING run can be marked. Nothing to do."), sealed=False),
    EXECUTE: Rule(_running_only("it was already executed."), sealed=False),
    STUDY_REPLAY: Rule(
        _finished_only("study {rid} is {status}: only a study whose every member finished can be replayed as a whole. "
                       "Replay its finished members one by one with `harness replay MEMBER`."),
        # load_study (record/study.py) refuses a run that is not a study before this table is read.
        sealed=False,
    ),
}


def _say(refusal: Refusal, run: RunSummary, command: str, name: str | None, tracker: Tracker | None = None) -> str:
    if callable(refusal):
        return refusal(run, tracker)
    return refusal.format(rid=run.run_id, run=name or run.run_id, status=run.status, kind=run.tags.get(T.KIND, "run"),
                          command=command, trace_of=run.tags.get(T.TRACE_OF),
                          calibration_of=run.tags.get(T.CALIBRATION_OF))


def refusal(command: str, run: RunSummary, *, allow_incomplete: bool = False, name: str | None = None,
            tracker: Tracker | None = None) -> str | None:
    """The one line `command` refuses `run` with for its kind or status (not its seal), or None if it accepts it.
    `tracker`: the run's store, where the line depends on more than the run's fields (its checkpoints)."""
    rule = RULES[command]
    kind = rule.kinds.get(run.tags.get(T.KIND, ""))
    if kind is not None:
        return _say(kind, run, command, name)
    said = rule.statuses.get(run.status)
    if said is None or (allow_incomplete and run.status in rule.lifted):
        return None
    return _say(said, run, command, name, tracker)


def refuse(command: str, run: RunSummary, *, allow_incomplete: bool = False, name: str | None = None,
           tracker: Tracker | None = None) -> None:
    """RunRefused (exit 2) with `refusal`'s line, if there is one."""
    why = refusal(command, run, allow_incomplete=allow_incomplete, name=name, tracker=tracker)
    if why is not None:
        raise RunRefused(why)


@dataclass
class Loaded:
    """A run a command accepted: its summary now; its stored record and its recorded config when first asked."""

    tracker: Tracker
    summary: RunSummary
    command: str

    @property
    def run_id(self) -> str:
        return self.summary.run_id

    @property
    def incomplete(self) -> bool:
        """It stopped before its end (FAILED or KILLED): only the steps it reached can be judged."""
        return self.summary.status in T.INCOMPLETE

    @cached_property
    def record(self) -> RunRecord:
        """Everything stored for the run (metrics, fingerprints, checkpoints, facts)."""
        return self.tracker.load_record(self.run_id)

    @cached_property
    def recorded(self) -> RecordedRun:
        """Its stored config, ready to be checked out and run again (harness/record/rerun.py)."""
        return RecordedRun.load(self.tracker, self.summary)


def load(tracker: Tracker, run: str | RunSummary, command: str, *, allow_incomplete: bool = False,
         name: str | None = None) -> Loaded:
    """`run` (an id, or a summary the caller has) as `command` may use it; RunRefused with the refusal if not.

    Refused in this order: not made by harness (where the rule says so); a kind the command does not apply to; a record edited since its
    seal (where the command reads a closed record); a status the command does not accept.
    """
    rule = RULES[command]
    if isinstance(run, str):
        summary = tracker.harness_run(run) if rule.harness_only else tracker.get_run(run)
    else:
        summary = run
    kind = rule.kinds.get(summary.tags.get(T.KIND, ""))
    if kind is not None:
        raise RunRefused(_say(kind, summary, command, name))
    if rule.sealed:  # before anything is read or recorded: an edited record is not used
        seal.check(tracker, summary.run_id)
    refuse(command, summary, allow_incomplete=allow_incomplete, name=name, tracker=tracker)
    return Loaded(tracker, summary, command)
