"""`harness mark`: close a RUNNING run whose launcher is gone (its heartbeat, harness/record/liveness.py)."""

from __future__ import annotations

import time

from harness import tags as T
from harness.commands.options import MarkOptions
from harness.errors import RunRefused, UsageError
from harness.record import closing, loading

# The heartbeat rule lives with the record (the loader refuses a live RUNNING run by it); still importable from here.
from harness.record.liveness import heartbeat_age, heartbeat_interval, is_stale, launcher_gone
from harness.store.tracking import Tracker

__all__ = ["heartbeat_age", "heartbeat_interval", "is_stale", "mark"]


def mark(options: MarkOptions) -> str:
    """Close a RUNNING run whose launcher is gone as FAILED or KILLED; returns the reason recorded."""
    run_id, status, force, tracking_uri = options.run_id, options.status, options.force, options.tracking_uri
    if status not in T.INCOMPLETE:
        raise UsageError(f"--status must be one of {', '.join(T.INCOMPLETE)}, not '{status}'.")
    tracker = Tracker(tracking_uri)
    run_id = tracker.resolve_id(run_id)
    run = loading.load(tracker, run_id, loading.MARK).summary
    now = time.time()
    age, interval = heartbeat_age(run.tags, now), heartbeat_interval(run.tags)
    gone = launcher_gone(run.tags, now)
    if gone is not None:
        reason = f"marked {status} by harness mark: {gone} (launcher gone)"
    elif age is None or interval is None:
        if not force:
            raise RunRefused(
                f"run {run_id} has no heartbeat tags ({T.HEARTBEAT}, {T.HEARTBEAT_S}), so nothing shows whether its "
                f"launcher is still running. If you know it is gone, pass --force: harness mark {run_id} "
                f"--status {status} --force"
            )
        reason = f"marked {status} by harness mark --force: no heartbeat recorded"
    else:
        raise RunRefused(
            f"run {run_id} is live: its heartbeat is {age:.0f} s old (written every {interval:g} s), so its launcher "
            "is still running. Stop it with Ctrl-C or SIGTERM to its launcher; it closes the run itself."
        )
    closing.close(tracker, run_id, status, reason)
    return reason
