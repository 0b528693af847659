"""`harness calibrate RUN_ID`: measure how far rounding alone carries a run's first steps (harness/judge/rounding.py).

K members replay the run's first M steps as recorded - its commit, config, seed, data, image and executor - each with
its weights nudged (harness/runtime/perturb.py: each element by up to 256 float32 ulps, the seed i of member i) and on
its share of the machine's other CPU kernels (oneDNN off, another thread count, both, or the run's own: perturb.KERNELS,
tagged harness.calibration.kernels), so that the envelope holds what another convolution library or reduction split does
to the run, not only a nudged start (docs/verdicts.md measures why). One launch runs them all, one segment each in the
same ranks (where the run's backend can: executors.Backend.runs_members; else each is a launch of its own), and each is
recorded as an ordinary replay run, nested under one run of kind `calibration` (itself nested under the run), tagged
`harness.calibration`, and judged by nobody: what they are is the reference. The calibration run holds the envelope
(calibration/envelope.json) and is sealed when it closes; a replay of the run finds it (record/calibration.py
`envelope_of`) and is judged against it.

The id given may be a replay's (or an audit's): the run it was made from is calibrated, as replay follows it. Secrets
the record hides are given again as replay takes them (KEY=VALUE, or the environment variable the run read); no other
override is taken. The calibration run has a heartbeat while it runs, so a launcher killed outright leaves a run
`harness runs` shows STALE and `harness mark` closes; a store that fails once it is recorded (a full disk) is said
with what it left there (record/calibration.py `left_behind`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from signal import SIGINT, SIGTERM, Signals
from typing import Any

import numpy as np

from harness import events, executors, seeds, tags as T
from harness.commands.options import CalibrateOptions, ReplayContext, ReplayOptions
from harness.errors import EXIT_FAILED, HarnessError, Interrupted, RunRefused, StoreUnavailable, UsageError
from harness.executors import Outcome, Topology
from harness.fmt import fmt_short, json_safe, text_table
from harness.judge import reproduced, rounding
from harness.judge.compare import original_steps
from harness.judge.weightdistance import Sketch, distance
from harness.record import derived, loading, redaction
from harness.record.calibration import left_behind
from harness.runtime.perturb import (
    NUDGE,
    NUDGE_ULPS,
    REFERENCE,
    kernels_of,
    member_seeds,
    other_threads,
    threads_vary,
)
from harness.store.failures import unwritable
from harness.store.tracking import RunRecord, Tracker

DEFAULT_MEMBERS = 8
# The steps after M are judged as without a calibration - by default bit for bit, where another machine's one-ulp
# difference is DIVERGED - so M covers all of a short run (the bundled examples' 25 and 48 steps) and the first 50 of
# a long one: (K + 1) x 50 steps, minutes where the run itself takes hours; --steps judges more.
DEFAULT_STEPS = 50
MAX_MEMBERS = 32


@dataclass
class Calibration:
    run_id: str  # the calibrated run
    calibration_id: str
    envelope: rounding.Envelope
    member_ids: list[str]
    steps_of_run: int
    reference_id: str = ""  # the run re-executed once, not nudged (perturb.REFERENCE)

    def summary(self) -> str:
        env = self.envelope
        widest = {name: max(m.deviation, default=0.0) for name, m in env.metrics.items()}
        spread = ", ".join(f"{name} up to {value:.3g}" for name, value in widest.items()) or "no metric logged"
        weights = "" if env.weights is None else (
            f" (relative distance up to {max(env.weights.distances, default=0.0):.3g}, farthest tensor "
            f"{env.weights.widest_tensor or 'none'})")
        again = {True: "re-executed bit for bit", False: "did NOT re-execute bit for bit (in the envelope)",
                 None: "not re-executed"}[env.reference_bitwise]
        return (f"calibrated run {self.run_id}: {env.describe()} ({env.members + 1} x {env.steps} = "
                f"{(env.members + 1) * env.steps} training steps, the run itself once as the reference); the members' "
                f"largest distance from the run: {spread}; {env.weights_differed} of {env.members} members' weights "
                f"differed after step {env.steps}{weights}; the run's first {env.steps} steps {again} here")


    def table(self, columns: int = 4) -> str:
        """What the calibration measured, for the terminal: the envelope's half-width (what a replay's value may lie
        from the run's) at `columns` steps spread over the M, per metric; the weights' after step M; what a replay of
        the run is held to."""
        env = self.envelope
        m = env.steps
        again = {True: "re-executed bit for bit here", False: "did NOT re-execute bit for bit here (in the envelope)",
                 None: "not re-executed"}[env.reference_bitwise]
        lines = [f"calibration {self.calibration_id} of run {self.run_id}: {env.members} members x {m} steps; the run "
                 f"itself {again}"]
        at = sorted({round(i * (m - 1) / max(columns - 1, 1)) for i in range(columns)})
        rows = [["half-width", *(f"step {step}" for step in at)]]
        for name, metric in sorted(env.metrics.items()):
            widths = metric.half_widths()
            # A value logged less often (once an epoch): its latest at or before the column's step.
            held = [int(np.searchsorted(metric.steps, step, side="right")) - 1 for step in at]
            rows.append([name, *(f"±{fmt_short(float(widths[i]))}" if i >= 0 else "-" for i in held)])
        if len(rows) > 1:
            lines.append(text_table(rows))
        weights = ""
        if env.weights is not None:
            w = env.weights
            lines.append(f"weights after step {w.step}: ±{fmt_short(w.half_width())} relative (members up to "
                         f"{fmt_short(max(w.distances, default=0.0))}, farthest tensor {w.widest_tensor or 'none'}; "
                         f"{env.weights_differed} of {env.members} differed)")
            weights = f" and its weights after step {w.step} within ±{fmt_short(w.half_width())}"
        tail = (f"; steps {m}-{self.steps_of_run - 1} by the tolerance" if m < self.steps_of_run - 1 else
                f"; step {m} by the tolerance" if m == self.steps_of_run - 1 else "")
        lines.append(f"a replay of run {self.run_id} is WITHIN_ROUNDING where every logged value of steps 0-{m - 1} "
                     f"lies within the half-width{weights}, else DIVERGED at the first step outside{tail}")
        return "\n".join(lines)


def check_options(members: int | None, steps: int | None) -> None:
    """What can be refused before the store is read (nothing is recorded)."""
    if members is not None and not 2 <= members <= MAX_MEMBERS:
        raise UsageError(f"--members {members}: a calibration takes 2 to {MAX_MEMBERS} members. Pass e.g. --members "
                           f"{DEFAULT_MEMBERS}.")
    if steps is not None and steps < 1:
        raise UsageError(f"--steps {steps}: a calibration re-executes at least 1 step. Pass --steps 1 or more.")


# The replay verb as calibrate calls it: commands/replay.py's replay, handed in by the API.
Replay = Callable[[ReplayOptions, ReplayContext], Any]


def calibrate(options: CalibrateOptions, *, replay: Replay, tracker: Tracker | None = None) -> Calibration:
    """Re-execute the first `steps` steps of `run_id` `members` times with nudged weights; record the envelope.

    `replay`: commands/replay.py's replay, handed in by the API. A calibration's members are replays, so this verb
    composes that one; it is given it rather than importing it, so that no verb imports another (pyproject.toml's
    independence contract) and a member is recorded exactly as `harness replay --steps M` records one (replay's
    `then`: the members after the reference, run by the same ranks)."""
    check_options(options.members, options.steps)
    tracker = tracker or Tracker(options.tracking_uri)
    # A replay's (or audit's) id means the run it re-executed: its own first steps are no reference of their own.
    loaded = loading.load(tracker, derived.followed(tracker, tracker.harness_run(options.run_id), "calibrating"),
                          loading.CALIBRATE)
    original = loaded.summary
    _warm(loaded)
    record = tracker.load_record(original.run_id)
    total = original_steps(record)
    if total < 1:
        raise RunRefused(f"run {original.run_id} logged no step: there is nothing to calibrate.")
    k = options.members or DEFAULT_MEMBERS
    if options.steps is not None and options.steps > total:
        raise UsageError(f"--steps {options.steps}: run {original.run_id} took {total} steps. Pass --steps {total} "
                         "or fewer.")
    m = options.steps or min(DEFAULT_STEPS, total)
    secrets = secrets_given(loaded, list(options.overrides))
    seeds_, threads_note = _member_seeds(loaded, k)
    kernels = ", ".join(dict.fromkeys(kernels_of(i).describe() for i in seeds_))
    events.emit(events.Notice(f"calibrate {original.run_id}: {k} members x {m} steps = {k * m} training steps "
                              f"(the run took {total}), each member one replay of its first {m} steps, nudged by up to "
                              f"{NUDGE_ULPS} float32 ulps, in turn on {kernels}; and the run itself once more ({m} steps), the reference "
                              "the members' weights are measured from"
                              + threads_note + _tail_said(m, total)))
    run_tags = derived.tags(T.KIND_CALIBRATION, original, version=original.tags.get(T.VERSION),
                            extra={T.CALIBRATION_MEMBERS: str(k), T.CALIBRATION_STEPS: str(m),
                                   T.CALIBRATION_NUDGE: repr(NUDGE)})
    calibrating = _Calibrating(tracker, original.run_id, float(loaded.recorded.cfg.heartbeat_s))
    # Outside the calibration run, the store's failure said with what it left (a failing close of the calibration too).
    with calibrating, derived.opened(tracker, original.experiment, run_tags, f"calibration-of-{original.run_name}",
                                     heartbeat_s=calibrating.heartbeat_s) as opened_id:
        cal_id = calibrating.holds(opened_id)
        member = ReplayOptions(original.run_id, overrides=tuple(secrets), follow=False, steps=m, localize=False)
        outcomes = _run_members(replay, member, ReplayContext(tracker=tracker, sketch_at=m), cal_id,
                                seeds_, one_launch(loaded, record))
        records = _finished(tracker, outcomes, cal_id, original.run_id, m)
        envelope = _envelope(tracker, record, records, cal_id, m, total)
        envelope.members, envelope.nudge = k, NUDGE
        tracker.log_text(cal_id, json.dumps(json_safe(envelope.to_dict()), indent=2), T.ARTIFACT_ENVELOPE)
        done = Calibration(original.run_id, cal_id, envelope, [o.run_id for o in outcomes[1:]], total,
                           records[0].run_id)
        tracker.set_tags(cal_id, {T.MLFLOW_RUN_NOTE: done.summary()})
    return done


def _run_members(replay: Replay, member: ReplayOptions, context: ReplayContext, cal_id: str, seeds_: list[int],
                 together: bool) -> list[Outcome]:
    """The reference (the run itself, not nudged) and the nudged members of perturb seeds `seeds_`, each recorded as
    a replay nested under the calibration: in one set of ranks, one segment each (`together`), else one replay each,
    the reference first (a run that does not re-execute fails there)."""
    def tagged(i: int) -> dict[str, str]:
        return {T.CALIBRATION: cal_id, T.MLFLOW_PARENT_RUN_ID: cal_id, T.CALIBRATION_KERNELS: kernels_of(i).describe()}

    if together:
        result = replay(member, replace(context, perturb_seed=REFERENCE, extra_tags=tagged(REFERENCE),
                                        then=[(i, tagged(i)) for i in seeds_]))
        return [result.outcome, *result.members]
    outcomes = []
    k = len(seeds_)
    for n, i in enumerate([REFERENCE, *seeds_]):
        events.emit(events.Progress(f"calibration {cal_id}: member {n} of {k}" if i != REFERENCE else
                                    f"calibration {cal_id}: the run itself (the reference)", n, k))
        outcome = replay(member, replace(context, perturb_seed=i, extra_tags=tagged(i))).outcome
        outcomes.append(outcome)
        if outcome.status != T.FINISHED:
            break
    return outcomes


def _finished(tracker: Tracker, outcomes: list[Outcome], cal_id: str, run_id: str, m: int) -> list[RunRecord]:
    """The members' records, the reference first; a member that did not finish ends the calibration, in words."""
    records = []
    for i, outcome in enumerate(outcomes):
        which = "its reference (the run itself)" if i == REFERENCE else f"member {i}"
        if outcome.status == T.KILLED and outcome.exit_code in (128 + SIGINT, 128 + SIGTERM):
            signum = outcome.exit_code - 128
            raise Interrupted(signum, f"calibration {cal_id} interrupted by {Signals(signum).name} while "
                                      f"{which} ran: it is marked KILLED and records no envelope. Run harness "
                                      f"calibrate {run_id} again.")
        if outcome.status != T.FINISHED:
            raise HarnessError(f"calibration {which} (run {outcome.run_id}) {outcome.status}: "
                               f"{outcome.message or 'see its logs'}. The run's first {m} steps do not "
                               "re-execute here; replay it to see why.", EXIT_FAILED)
        records.append(tracker.load_record(outcome.run_id))
    return records


def _envelope(tracker: Tracker, record: RunRecord, records: list[RunRecord], cal_id: str, m: int,
              total: int) -> rounding.Envelope:
    """The rounding envelope the members span around the run's first m steps, and whether the reference
    re-executed them bit for bit (else its own values widen the envelope); each surprise said as a warning."""
    reference, members = records[0], records[1:]
    held = record.checkpoints.get(m) if m < total else record.final_fingerprint
    logged = {(key, step): value for key, by_step in reproduced.series(reference.metrics).items()
              for step, value in by_step.items()}
    again = reproduced.values(reproduced.series(record.metrics), logged, complete=True, end=m)
    bitwise = again.reproduced is not False and (held is None or reference.final_fingerprint == held)
    if not bitwise:
        what = again.mismatch or f"its weights after step {m}"
        events.emit(events.Warning(
            f"the run's first {m} steps did not re-execute bit for bit here (its reference, run {reference.run_id}: "
            f"{what}): the envelope holds this machine's run-to-run variation too, or another machine's kernels"))
    held = held or reference.final_fingerprint  # the run's own weights after M steps
    differed = sum(1 for r in members if held is None or r.final_fingerprint != held)
    weights = weights_spread(tracker, cal_id, reference.run_id, [r.run_id for r in members], m)
    envelope = rounding.measure(record.run_id, cal_id, record.metrics,
                                [r.metrics for r in members] + ([] if bitwise else [reference.metrics]), m,
                                differed, weights)
    envelope.reference_bitwise = bitwise
    if differed == 0:
        events.emit(events.Warning(
            f"no member's weights differed from the run's after step {m}: nothing the members' nudge moved reached "
            "the weights (the run trains no floating-point parameter, or training washed the nudge out), so this "
            "calibration judges no replay whose weights differ"))
    blown = envelope.blown_up()
    if blown is not None:
        events.emit(events.Warning(
            f"a member went to NaN or inf in {blown[0]} at step {blown[1]} where the run did not: rounding alone "
            f"breaks this run there, so its replays are held to the envelope over the first {blown[1]} steps only "
            "(a smaller learning rate, or gradient clipping, keeps a run off that edge)"))
    return envelope


def _member_seeds(loaded: loading.Loaded, k: int) -> tuple[list[int], str]:
    """The members' perturb seeds, and what the notice adds where the thread count is not varied: a backend whose
    ranks run on this machine varies it only where its cores hold the ranks on the other count (perturb.threads_vary);
    one whose ranks run elsewhere always does."""
    import os

    cfg = loaded.recorded.cfg
    threads = int(cfg.threads_per_rank)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    here = executors.backend(str(cfg.executor)).ranks_here
    vary = not here or threads_vary(int(cfg.world_size), threads, cores)
    note = "" if vary else (
        f"; the thread count is not varied: {cfg.world_size} ranks x {other_threads(threads)} threads would "
        f"oversubscribe this machine's {cores} cores, which slows every step many times over")
    return member_seeds(k, vary), note


def one_launch(loaded: loading.Loaded, record: RunRecord) -> bool:
    """Whether the members run in one set of ranks (one segment each), else one replay each: the run's backend runs
    members (executors.Backend.runs_members), and its training logged nothing through MLflow itself - such values
    go to the run its ranks were started for, not to each member's."""
    return (executors.backend(str(loaded.recorded.cfg.executor)).runs_members
            and not record.facts.get(T.USER_MLFLOW_METRICS))


def _warm(loaded: loading.Loaded) -> None:
    """Start the rank server now, under the run's string-hash seed as its ranks will take it, so that its torch
    import overlaps the reads and records before the members' ranks start (as `harness run` does)."""
    cfg = loaded.recorded.cfg
    executors.get(str(cfg.executor)).warm(
        cfg, Topology(), before=lambda: seeds.apply_recorded_hash_seed(loaded.summary.tags, loaded.summary.run_id))


def secrets_given(loaded: loading.Loaded, overrides: list[str]) -> list[str]:
    """The KEY=VALUE overrides that give back secrets the run's record hides, checked as replay checks them (record/
    rerun.py restore_secrets: a missing or wrong one refused here, before anything is recorded); any other override
    is refused: a calibration re-executes the run as recorded."""
    rest = loaded.recorded.restore_secrets(overrides, "calibrate")
    if rest:
        shown = " ".join(redaction.redact_override(item, redaction.store_key(loaded.tracker.uri)) for item in rest)
        raise UsageError(f"calibrate re-executes run {loaded.run_id} as recorded and takes KEY=VALUE only for a secret "
                         f"its record hides; {shown} would change it. Drop {'it' if len(rest) == 1 else 'them'} (to "
                         "calibrate another config, run it and calibrate that run).")
    return overrides


class _Calibrating:
    """The calibration run while it is recorded: its heartbeat every `heartbeat_s` is the calibrated run's (derived.py
    opened writes it); a store that fails once it holds the run (a full disk) is said with what it holds now
    (record/calibration.py left_behind), exit 1 - never as a refusal that recorded nothing."""

    def __init__(self, tracker: Tracker, run_id: str, heartbeat_s: float) -> None:
        self.tracker, self.run_id, self.heartbeat_s = tracker, run_id, heartbeat_s
        self.calibration_id: str | None = None

    def holds(self, calibration_id: str) -> str:
        self.calibration_id = calibration_id
        return calibration_id

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, err: BaseException | None, tb: Any) -> None:
        if self.calibration_id is None or not isinstance(err, Exception) or unwritable(err) is None:
            return
        raise StoreUnavailable(f"{err} {left_behind(self.tracker, self.calibration_id, self.run_id)}",
                               exit_code=EXIT_FAILED) from err


def _tail_said(m: int, total: int) -> str:
    """How a replay's steps after the envelope's M are judged (judge/carried.py), said before the cost is paid."""
    if m >= total:
        return ""
    tail = f"step {m} is" if m == total - 1 else f"steps {m}-{total - 1} are"
    return (f"; a replay's {tail} held to the envelope carried forward at the members' growth rate (--steps {total} "
            "measures the whole run)")


def weights_spread(tracker: Tracker, calibration_id: str, reference_id: str, member_ids: list[str], steps: int
                   ) -> rounding.WeightsEnvelope | None:
    """Each member's weights after `steps` steps, their distance from the reference's (their sketches); the
    reference's sketch is kept with the calibration (sealed with it), for replays to be measured from. None where a
    run sketched nothing (no model: the fingerprints hash no weights either)."""
    ref_bytes = tracker.read_bytes(reference_id, T.ARTIFACT_WEIGHTS_SKETCH)
    if ref_bytes is None:
        return None
    reference = Sketch.load(ref_bytes)
    found = [tracker.read_bytes(i, T.ARTIFACT_WEIGHTS_SKETCH) for i in member_ids]
    if any(b is None for b in found):
        return None
    distances = [distance(Sketch.load(b), reference) for b in found if b is not None]
    tracker.log_bytes(calibration_id, ref_bytes, T.ARTIFACT_WEIGHTS_SKETCH)
    farthest = max(distances, key=lambda d: d.relative, default=None)
    return rounding.WeightsEnvelope(steps, reference_id, [d.relative for d in distances],
                                    farthest.widest if farthest is not None else "")
