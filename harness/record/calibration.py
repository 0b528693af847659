"""A run's calibration as recorded: its latest FINISHED calibration run (`harness calibrate`, commands/calibrate.py)
and the rounding envelope it holds, checked against its seal. A replay of the run is judged against that envelope
(commands/replay.py), so the replay reads it here rather than from the calibrate verb.
"""

from __future__ import annotations

import json

from harness import tags as T
from harness.errors import HarnessError
from harness.judge import rounding
from harness.judge.weightdistance import Distance, Sketch, distance
from harness.record import seal
from harness.store.tracking import RunSummary, Tracker


def calibration_of(tracker: Tracker, run_id: str) -> RunSummary | None:
    """The run's latest FINISHED calibration, if it has one."""
    found = [r for r in tracker.children(run_id)
             if r.tags.get(T.KIND) == T.KIND_CALIBRATION and r.tags.get(T.CALIBRATION_OF) == run_id
             and r.status == T.FINISHED]
    return max(found, key=lambda r: r.start_time or 0) if found else None


def envelope_of(tracker: Tracker, run_id: str) -> rounding.Envelope | None:
    """The envelope of the run's latest calibration, checked against its seal (an edited envelope would pass any
    replay: it is refused, in one line naming what changed)."""
    found = calibration_of(tracker, run_id)
    if found is None:
        return None
    seal.check(tracker, found.run_id)
    text = tracker.read_text(found.run_id, T.ARTIFACT_ENVELOPE)
    try:
        envelope = rounding.Envelope.from_dict(json.loads(text or ""))
    except (ValueError, KeyError, TypeError) as err:
        raise HarnessError(f"calibration {found.run_id} of run {run_id} has no readable {T.ARTIFACT_ENVELOPE} "
                           f"({err}). Calibrate the run again: harness calibrate {run_id}.") from None
    # The ids as this store has them (an imported calibration's file names the ids of the store it came from).
    envelope.run_id, envelope.calibration_id = run_id, found.run_id
    return envelope


def weights_distance(tracker: Tracker, envelope: rounding.Envelope, run_id: str) -> Distance | None:
    """How far run `run_id`'s weights after the calibration's M steps lie from the run's own (the calibration's
    reference sketch, under its seal): None when either was not sketched (a calibration made before sketches, a
    replay that stopped before step M) or at another step."""
    if envelope.weights is None:
        return None
    reference, replay = (tracker.read_bytes(i, T.ARTIFACT_WEIGHTS_SKETCH) for i in (envelope.calibration_id, run_id))
    if reference is None or replay is None:
        return None
    ref, rep = Sketch.load(reference), Sketch.load(replay)
    return distance(rep, ref) if ref.step == rep.step == envelope.weights.step else None


def left_behind(tracker: Tracker, calibration_id: str, run_id: str) -> str:
    """What a calibration that a store failure ended left in the store, as the store has it now: the calibration
    run and each member replay with its status, and the command that closes each one left RUNNING. Read back rather
    than assumed: a full disk may take a status update when it takes no new row, or neither."""
    try:
        calibration = tracker.get_run(calibration_id)
        members = sorted((r for r in tracker.children(calibration_id) if r.tags.get(T.CALIBRATION) == calibration_id),
                         key=lambda r: (r.start_time or 0, r.run_id))
    except Exception as err:  # the store that failed may not even answer a read
        return (f"The store could not be read back ({err}): calibration {calibration_id} of run {run_id} and its "
                f"member replays (tag {T.CALIBRATION}) may be left {T.RUNNING}; once its disk takes writes again, "
                f"`harness runs` shows them and `harness mark ID --status {T.FAILED}` closes each one left RUNNING. "
                f"Then calibrate again: harness calibrate {run_id}.")

    held = ", ".join(f"{r.run_id} {r.status}" for r in members) or "none"
    running = [r.run_id for r in [calibration, *members] if r.status == T.RUNNING]
    one = len(running) == 1
    close = "" if not running else (
        f" Once its disk takes writes again and `harness runs --status STALE` shows {'it' if one else 'them'}, close "
        f"{'it' if one else 'each'}: " + "; ".join(f"harness mark {i} --status {T.FAILED}" for i in running) + ".")
    return (f"It left calibration {calibration_id} {calibration.status}, with no envelope, and its member replays: "
            f"{held}.{close} Then calibrate again: harness calibrate {run_id}.")
