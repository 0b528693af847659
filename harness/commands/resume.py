"""`harness resume`: continue a FAILED or KILLED run from its last complete checkpoint, in the same run.

A resume must be the uninterrupted run's continuation bit for bit, and harness cannot see everything a
loop depends on (a batch drawn before the optimizer step, randomness outside the step, state of the
user's own). So before it continues, a resume proves itself: it re-executes the last checkpoint segment
(from the checkpoint before it) and checks that it lands on the tensors the run recorded there. If it
does not, the resume is refused, naming the first tensor that differs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness import events, executors, tags as T
from harness.commands.options import ResumeOptions
from harness.errors import HarnessError, RunFailed, RunRefused
from harness.executors import Job, Outcome
from harness.executors.base import SegmentMessages
from harness.judge import reproduced
from harness.judge.undetermined import looks_like_clock
from harness.record import checkpoints as checkpoint_store, closing, loading, wholeness
from harness.rundata import same_value, series
from harness.runtime import boundaries, states
from harness.runtime.plan import LaunchPlan
from harness.store.tracking import RunRecord, Tracker

LIKELY_CAUSES = (
    "a batch drawn before the optimizer step (a prefetch such as `X, Y = get_batch()` between forward and "
    "optimizer.step()), randomness drawn outside the step, or state the checkpoint does not hold (a second model, "
    "an EMA, a generator or buffer of your own)"
)


def resume(options: ResumeOptions) -> Outcome:
    run_id, tracking_uri, repo = options.run_id, options.tracking_uri, options.repo
    tracker = Tracker(tracking_uri)
    # A FAILED or KILLED run was sealed when it closed; the resumed run is sealed again when it closes.
    loaded = loading.load(tracker, run_id, loading.RESUME)
    run, recorded = loaded.summary, loaded.recorded
    recorded.restore_secrets([])  # from the environment variables they were read from
    cfg = recorded.cfg
    store = checkpoint_store.open_for(tracker, run_id)
    step = store.latest(cfg.world_size)  # fetched into the store's local folder when a server holds it
    if step is None:
        cause, fix = boundaries.no_checkpoint(int(cfg.checkpoint_every), run.tags.get(T.LOOP),
                                              run.tags.get(T.NOTICES, ""))
        raise RunRefused(
            f"run {run_id} has no complete checkpoint in its artifacts ({cause}), so it cannot be resumed. Rerun it "
            f"from the start, judged on the steps it reached: `harness replay {run_id} --allow-incomplete`. {fix}"
        )
    record = loaded.record
    step = _provable_step(record, store, step, cfg.world_size)
    step = _recorded_up_to(record, store, step, cfg.world_size)
    _refuse_untracked(record.run_id, store.saved(cfg.world_size).get(step, {}).get(states.UNTRACKED), step)
    earlier = max((s for s in record.checkpoints if s < step), default=None)
    if earlier is not None and not store.fetch(earlier, cfg.world_size):
        earlier = None

    def reopen(tags: dict[str, str]) -> str:
        previous = run.tags.get(T.RESUMES)
        closing.reopen(tracker, run_id)
        tracker.set_tags(run_id, {T.RESUMES: f"{previous},{step}" if previous else str(step)})
        events.emit(events.Notice(f"Resuming run {run_id} from the checkpoint of step {step}."))
        return run_id

    data = recorded.check_data(repo)  # the rest of the run must read the bytes its first part read
    with recorded.code(repo) as (tree, exp_dir):
        job = recorded.job(tree, exp_dir, record=reopen, run_id=run_id, resume_step=step, data=data.paths)
        prove(record, job, Path(store.directory), earlier, step)
        return executors.run(job)


def _provable_step(record: RunRecord, store: checkpoint_store.CheckpointStore, step: int, world_size: int) -> int:
    """The step to resume from: `step` (the last complete on disk) when its digests are known, else the last one
    whose digests are.

    The digests of a step the record lacks (its launcher was killed before closing the run, or a harness before
    markers held them closed it) are taken from its COMPLETE marker into `record`, as the run's close would have
    recorded them. A step with none anywhere cannot be proven: the last recorded one before it is resumed
    instead, and said."""
    tensors = record.checkpoint_tensors if record.checkpoint_tensors is not None else {}
    for saved, digests in store.saved(world_size).items():
        if saved not in record.checkpoints:
            record.checkpoints[saved] = digests["sha256"]
            tensors[saved] = {"tensors": digests["tensors"], "ranks": digests["ranks"]}
    record.checkpoint_tensors = tensors or record.checkpoint_tensors
    if step in record.checkpoints or not record.checkpoints:
        return step  # no digests for any step (a run from before they were recorded): proven on its logged values
    recorded = max((s for s in record.checkpoints if s < step and store.fetch(s, world_size)), default=None)
    if recorded is None:
        return step
    events.emit(events.Notice(
        f"The checkpoint of step {step} holds no digests and run {record.run_id} recorded none for it (it was written "
        f"by an older harness and never announced), so a resume from it cannot be proven: resuming from step "
        f"{recorded}, the last checkpoint the run recorded."))
    return recorded


def _recorded_up_to(record: RunRecord, store: checkpoint_store.CheckpointStore, step: int, world_size: int) -> int:
    """The step to resume from so that the record stays whole: `step` when the record holds every step before it,
    else the last checkpoint at or before the first step it lacks (wholeness.first_missing), whose re-execution logs
    the steps the record lost; refused (exit 2) when there is none.

    The ranks save checkpoints on their own: a launcher killed while they ran on recorded less than the checkpoint
    after its record's end holds, and continuing from that checkpoint would leave the steps between unrecorded."""
    missing = wholeness.first_missing(series(record.metrics), wholeness.evaluation_keys(record.facts))
    if step <= missing:
        return step
    lost = f"steps {missing}-{step - 1}" if step - 1 > missing else f"step {missing}"
    earlier = max((s for s in record.checkpoints if s <= missing and store.fetch(s, world_size)), default=None)
    if earlier is None:
        raise RunRefused(
            f"run {record.run_id}'s record ends before step {missing}, and its checkpoint of step {step} is past it "
            f"(its launcher was killed before it recorded {lost}): no checkpoint at or before step {missing} is left to "
            f"re-execute them from. Rerun it from the start: harness replay {record.run_id} --allow-incomplete.")
    events.emit(events.Notice(
        f"The record of run {record.run_id} ends before step {missing} and the checkpoint of step {step} is past it "
        f"(its launcher was killed before it recorded {lost}): resuming from step {earlier}, the last checkpoint at or "
        "before the first step the record lacks, so that those steps are re-executed and recorded."))
    return earlier


def _refuse_untracked(run_id: str, untracked: list[dict[str, str]] | None, step: int) -> None:
    """A checkpoint written while a live copy of the model went untracked (states.Copies) is no state to continue
    from: the resumed process would make the copy anew."""
    if not untracked:
        return
    entry = untracked[0]
    more = f" (and {len(untracked) - 1} more)" if len(untracked) > 1 else ""
    raise RunRefused(
        f"resume refused: the checkpoint of step {step} of run {run_id} does not hold {states.described(entry)}{more}, "
        f"which the steps update: a resumed process would start it anew. Add `{states.track_line(entry)}` to train() "
        f"after the line that makes it and run the experiment again; or rerun this run from its start: "
        f"harness replay {run_id} --allow-incomplete.")


def prove(record: RunRecord, job: Job, directory: Path, earlier: int | None, step: int) -> None:
    """Hold a resume from `step` to what the run recorded, before it continues; HarnessError (exit 2) if it differs.

    Two re-executions, in one set of fresh ranks: from the checkpoint before (`earlier`), which must land on every
    tensor digest recorded at `step` and log what the run logged; and from `step` (as the resume will run it: a fresh
    process, then the checkpoint), which must log again what the run logged after `step` before it died. Both run on
    through the next value of every logged metric (`_next_unrecorded`): a value that depends on state the checkpoint
    does not hold (an EMA, a loader's position) differs there between the one that ran through `step` and the one
    that started at it, though the run died before logging it.
    """
    logged_after = [int(s) for steps, _ in record.metrics.values() for s in steps.tolist() if s >= step]
    until = max(logged_after) + 1 if logged_after else None
    unrecorded = _next_unrecorded(record, step)
    through = max(until or 0, unrecorded) or None
    plans, what = [], []
    if earlier is not None:
        # On through `step` without stopping where a metric's next value lies past the record: its tensors reported
        # at `step`, its values after it the ones the re-execution from `step` must log.
        stop = unrecorded if unrecorded > max(until or 0, step) else step
        plans.append(LaunchPlan(str(directory), 0, resume_step=earlier, stop_at=stop,
                                    digest_at=step if stop > step else None))
        what.append(f"steps {earlier}-{stop} from the checkpoint of step {earlier}")
    if through is not None:
        plans.append(LaunchPlan(str(directory), 0, resume_step=step, stop_at=through))
        span = f"step {step}" if through - 1 == step else f"steps {step}-{through - 1}"
        what.append(f"{span} from the checkpoint of step {step}")
    if not plans:
        events.emit(events.Notice(f"The checkpoint of step {step} is the run's first and nothing was logged after it: "
                                  "there is nothing to re-execute it against, so the resume continues unproven."))
        return
    events.emit(events.Notice(f"Proving the resume: re-executing {' and '.join(what)}."))
    refused = f"resume refused: re-executing {{what}} of run {record.run_id}"
    how = (f"Likely causes: {LIKELY_CAUSES}. Draw each step's batches inside the step (`for it in ctx.steps(n):`), "
           f"register what the step depends on (ctx.track(name=obj) takes anything with state_dict()), or rerun it: "
           f"harness replay {record.run_id} --allow-incomplete.")
    messages = SegmentMessages(len(plans))
    try:
        executors.run_segments(job, plans, messages, "resume")  # on the run's backend, as audit and trace do
    except RunFailed as err:
        raise HarnessError(f"{refused.format(what=' and '.join(what))} failed ({err}). Fix the failure, or rerun it: "
                           f"harness replay {record.run_id} --allow-incomplete.") from None
    reports = list(messages.reports)
    first = None
    if earlier is not None:
        first = reports.pop(0)
        _hold_to_checkpoint(first, record, earlier, step, refused.format(what=what[0]), how)
    if through is not None:
        report = reports.pop(0)
        mismatch = _first_logged_mismatch(report.logged, record, step, until or step)
        if mismatch:
            raise HarnessError(f"{refused.format(what=what[-1])} logged other values than the run did before it died: "
                               f"{mismatch}. {how}")
        if first is not None:
            _hold_to_continuous(report.logged, first.logged, step, refused.format(what=what[-1]), earlier, how)
    events.emit(events.Notice(f"Proved: {' and '.join(what)} re-executed land on what the run recorded."))


def _next_unrecorded(record: RunRecord, step: int) -> int:
    """The step after the next value of every metric the run logged at training steps but never at or after `step`,
    as its cadence puts it (the gap between its last two values; one value at step k: every k + 1 steps, an epoch's
    end); 0 when every metric has a recorded value there (the record itself holds the re-executions to it)."""
    evaluation = wholeness.evaluation_keys(record.facts)
    nexts = []
    for key, (steps, _) in record.metrics.items():
        if evaluation.get(key, T.EVAL_AT_STEP) != T.EVAL_AT_STEP or not len(steps):
            continue
        known = sorted(int(s) for s in steps.tolist())
        if known[-1] >= step:
            continue
        period = known[-1] - known[-2] if len(known) > 1 else known[-1] + 1
        if period > 0:
            nexts.append(known[-1] + period * -(-(step - known[-1]) // period))
    return max(nexts) + 1 if nexts else 0


def _hold_to_continuous(resumed: dict[tuple[str, int], float], through: dict[tuple[str, int], float], step: int,
                        refused: str, earlier: int | None, how: str) -> None:
    """The re-execution that started at `step` logs what the one that ran through `step` logged after it (a value
    named like a clock excepted, as judge/reproduced.py excepts it: said, not held)."""
    clocks: set[str] = set()
    for (key, at), value in sorted(resumed.items(), key=lambda item: (item[0][1], item[0][0])):
        again = through.get((key, at))
        if again is not None and not same_value(again, value) and looks_like_clock(key):
            clocks.add(key)
        elif again is not None and not same_value(again, value):
            raise HarnessError(
                f"{refused} logged {key}={value!r} at step {at}, where the re-execution that ran through step {step} "
                f"from the checkpoint of step {earlier} logged {again!r}: the checkpoint of step {step} does not hold "
                f"everything the steps after it depend on. {how}")
    if clocks:
        said = reproduced.Reproduction(0, unheld=tuple(sorted(clocks))).unheld_line
        events.emit(events.Notice(f"resume proof after step {step}: {said}."))


def _hold_to_checkpoint(report: Any, record: RunRecord, start: int, end: int, refused: str, how: str) -> None:
    """The segment that stopped at `end` must hold every tensor (and log every value) the run recorded there."""
    if report.end is None:
        raise HarnessError(f"{refused} never reached step {end}: the loop gave harness no step boundary to stop at. {how}")
    at, sha = report.end
    if end in report.marks:  # a segment that ran on through `end` reported its tensors there
        at, (sha, report_tensors) = end, report.marks[end]
    else:
        report_tensors = report.tensors
    recorded_tensors = (record.checkpoint_tensors or {}).get(end, {}).get("tensors") or {}
    if at != end:
        raise HarnessError(f"{refused} stopped at step {at}, not {end} (the run ended there). {how}")
    if recorded_tensors:  # a run from before per-tensor digests were recorded is held to its fingerprint below
        differing = [name for name in recorded_tensors if report_tensors.get(name) != recorded_tensors[name]]
        unrecorded = sorted(name for name in report_tensors if name not in recorded_tensors)
        if differing or unrecorded:
            first = f"'{differing[0]}' differs" if differing else f"'{unrecorded[0]}' is not among them"
            count = len(differing) + len(unrecorded)
            total = len(recorded_tensors.keys() | report_tensors.keys())
            more = f" (and {count - 1} more of {total} tensors)" if count > 1 else ""
            raise HarnessError(f"{refused} did not land on the tensors it recorded at step {end}: {first}{more}. {how}")
    if sha != record.checkpoints.get(end):
        raise HarnessError(f"{refused} ended with weights {str(sha)[:12]}, the run recorded "
                           f"{str(record.checkpoints.get(end))[:12]} at step {end}. {how}")
    mismatch = _first_logged_mismatch(report.logged, record, start, end)
    if mismatch:
        raise HarnessError(f"{refused} logged other values: {mismatch}. {how}")


def _first_logged_mismatch(logged: dict[tuple[str, int], float], record: RunRecord, start: int, end: int) -> str:
    # The run stopped before its end: a value it lacks may be one it never wrote, no evidence either way.
    held = reproduced.values(reproduced.series(record.metrics), logged, complete=record.status == T.FINISHED,
                             first=start, end=end)
    if held.unheld_line:
        events.emit(events.Notice(f"resume proof, steps {start}-{end}: {held.unheld_line}."))
    return held.mismatch
