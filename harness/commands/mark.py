"""Whether a RUNNING run still has a launcher (its heartbeat), and `harness mark` for runs that lost it."""

from __future__ import annotations

import time
from collections.abc import Mapping

from harness import tags as T
from harness.errors import HarnessError
from harness.store.tracking import Tracker


def _float(tags: Mapping[str, str], name: str) -> float | None:
    try:
        return float(tags[name])
    except (KeyError, ValueError):
        return None


def heartbeat_age(tags: Mapping[str, str], now: float) -> float | None:
    """Seconds since the launcher last wrote its heartbeat; None when the run has no (readable) heartbeat."""
    beat = _float(tags, T.HEARTBEAT)
    return None if beat is None else max(0.0, now - beat)


def heartbeat_interval(tags: Mapping[str, str]) -> float | None:
    interval = _float(tags, T.HEARTBEAT_S)
    return interval if interval is not None and interval > 0 else None


def is_stale(tags: Mapping[str, str], now: float) -> bool:
    """The heartbeat is older than STALE_FACTOR intervals: the launcher is gone.

    Only the heartbeat is judged (callers check that the run is RUNNING). A run without both
    heartbeat tags is never stale: it may come from a launcher that predates heartbeats, and
    nothing proves it dead.
    """
    age, interval = heartbeat_age(tags, now), heartbeat_interval(tags)
    return age is not None and interval is not None and age > T.STALE_FACTOR * interval


def mark(run_id: str, status: str, *, force: bool = False, tracking_uri: str | None = None) -> str:
    """Close a RUNNING run whose launcher is gone as FAILED or KILLED; returns the reason recorded."""
    if status not in T.INCOMPLETE:
        raise HarnessError(f"--status must be one of {', '.join(T.INCOMPLETE)}, not '{status}'.")
    tracker = Tracker(tracking_uri)
    run = tracker.harness_run(run_id)
    if run.status != T.RUNNING:
        raise HarnessError(
            f"run {run_id} is {run.status}, not {T.RUNNING}; only a RUNNING run can be marked. Nothing to do."
        )
    now = time.time()
    age, interval = heartbeat_age(run.tags, now), heartbeat_interval(run.tags)
    if age is None or interval is None:
        if not force:
            raise HarnessError(
                f"run {run_id} has no heartbeat tags ({T.HEARTBEAT}, {T.HEARTBEAT_S}), so nothing shows whether its "
                f"launcher is still running. If you know it is gone, pass --force: harness mark {run_id} "
                f"--status {status} --force"
            )
        reason = f"marked {status} by harness mark --force: no heartbeat recorded"
    elif not is_stale(run.tags, now):
        raise HarnessError(
            f"run {run_id} is live: its heartbeat is {age:.0f} s old (written every {interval:g} s), so its launcher "
            "is still running. Stop it with Ctrl-C or SIGTERM to its launcher; it closes the run itself."
        )
    else:
        reason = f"marked {status} by harness mark: no heartbeat for {age:.0f} s (launcher gone)"
    tracker.set_tags(run_id, {T.STATUS_REASON: reason})
    tracker.end_run(run_id, status)
    return reason
