"""Closing a harness run: the one door every close goes through, from every layer (recorder, derived runs, backends,
studies, `harness mark`, imports), so that none can skip the seal or cut its reason differently.

A close writes the status reason (cut to REASON_LIMIT characters, here only), seals the run's record as it is
about to close (record/seal.py), then ends it in the store (Tracker.terminate_run, the store's plain primitive, which
nothing else calls: a close made elsewhere could skip the seal). The recorder's close, whose closing writes may meet a full or
vanished store, goes through `close_or_keep`, which keeps the outcome on disk when the store cannot take it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

from harness import tags as T
from harness.errors import EXIT_FAILED, StoreUnavailable
from harness.record import seal
from harness.store.failures import transient, unwritable
from harness.store.outages import Outages, Patient
from harness.store.probe import reason_of
from harness.store.tracking import Tracker

REASON_LIMIT = 500  # characters of a reason kept as harness.status_reason


def cut(reason: str) -> str:
    """A reason as the run keeps it: its first REASON_LIMIT characters."""
    return reason[:REASON_LIMIT]


def error_reason(err: BaseException) -> str:
    """What an error says, as a status reason (its type's name when it says nothing), cut."""
    return cut(str(err) or type(err).__name__)


def close(tracker: Tracker | Patient, run_id: str, status: str, reason: str | None = None, *,
          tags: dict[str, str] | None = None, end_time: int | None = None, reason_may_fail: bool = False) -> None:
    """End the run as `status`, with `reason` (cut) and `tags` written first, then sealed, then ended (at `end_time`,
    ms since the epoch, when given: a copied run keeps its original's).

    `reason_may_fail`: a store that refuses the reason still gets the close (a close on an error path, whose own
    error is the one the caller raises); otherwise a refused reason is raised and the run is left as it was."""
    written = dict(tags or {})
    if reason is not None:
        written[T.STATUS_REASON] = cut(reason)
    if written:
        if reason_may_fail:
            with contextlib.suppress(Exception):
                tracker.set_tags(run_id, written)
        else:
            tracker.set_tags(run_id, written)
    seal.seal(tracker, run_id, status)  # sealed first: a kill in between leaves it RUNNING, never closed unsealed
    tracker.terminate_run(run_id, status, end_time)


def close_copy(tracker: Tracker, run_id: str, status: str, end_time: int | None) -> None:
    """End a copied run (an import) with its original's status and end time; a RUNNING one stays open."""
    if status != T.RUNNING:
        close(tracker, run_id, status, end_time=end_time)


def reopen(tracker: Tracker, run_id: str) -> None:
    """Make an ended run RUNNING again (a resume continues it): its seal says so first, so that a launcher killed from
    here on leaves a run `harness mark` closes, not one that reads as edited."""
    seal.open_for_resume(tracker, run_id)
    tracker.reopen_run(run_id)


def close_or_keep(patient: Patient, run_id: str, status: str, message: str, failed_write: Exception | None, *,
                  outages: Outages, keep: Callable[[str, str], Path]) -> None:
    """A recorded run's close once its closing writes ran: ended as `status` when every write went through. When one
    failed the record is incomplete: the run is FAILED with the reason (if the store still takes that), else it stays
    RUNNING; either way `keep(status, message)` keeps its outcome on disk and one line says which, as the store has
    it."""
    shown = patient.display_uri
    if failed_write is None:
        try:
            close(patient, run_id, status)
            return
        except Exception as end_err:
            failed_write = end_err
    err = failed_write
    root: BaseException = err
    while root.__cause__ is not None:  # the store's own words, not a wrapper's
        root = root.__cause__
    full = unwritable(err)
    if full:
        cause = f"the tracking store {shown} {full} ({reason_of(root)})"
        fix = ("Free space on its disk" if full == "is full" else "Make it writable") + \
            " (or use another store with --tracking-uri), then rerun"
    elif transient(err):
        cause = (f"the tracking store {shown} stayed unreachable for over {outages.limit_s:g} s "
                 f"(HARNESS_STORE_OUTAGE_S): {reason_of(err)}")
        fix = "Check the store, then rerun"
    else:
        cause = f"recording run {run_id} failed: {reason_of(err)}"
        fix = "Check the store and the message above, then rerun"
    # What ended the training (a checkpoint the same full disk refused) is said first: the close only failed after.
    ended_by = f"{message}; then " if status != T.FINISHED and message and shown not in message else ""
    reason = f"{ended_by}{cause} while the run was being closed ({status}): its record is incomplete"
    try:  # tried even when the reason did not fit: a full disk may take an update when it takes no new rows
        close(patient, run_id, T.FAILED, reason, reason_may_fail=True)
        ended = True
    except Exception:
        ended = False
    try:
        kept: str = f"kept in {keep(status, message)}"
    except OSError as keep_err:
        kept = f"not kept either ({keep_err.strerror})"
    state = (f"so it is {T.FAILED} in the store" + ("" if status == T.FAILED else f", not {status}") if ended else
             f"and the store took no status either: run {run_id} stays {T.RUNNING} in the store until "
             f"`harness mark {run_id} --status {T.FAILED}` (once its heartbeat is stale)")
    raise StoreUnavailable(f"{ended_by}{cause} while run {run_id} was being closed, {state}. Its outcome, metrics and logs are "
                       f"{kept}. {fix}.", exit_code=EXIT_FAILED) from err
