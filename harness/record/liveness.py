"""Whether a RUNNING run still has a launcher: its heartbeat, read from the run's tags, and the process that wrote
it when that ran on this machine (the STALE rule).

Shared by `harness runs` (the STALE status), the loader's refusal of a RUNNING run (replay) and `harness mark`.
"""

from __future__ import annotations

from collections.abc import Mapping

from harness import scratch, tags as T


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


def launcher_gone(tags: Mapping[str, str], now: float) -> str | None:
    """Why a RUNNING run's launcher is known to be gone - its heartbeat is stale (is_stale), or the process that
    wrote it ran on this machine and has ended (a run or resume killed here: known at once, not after
    STALE_FACTOR heartbeats) - or None. `harness runs` (STALE), `harness mark` and the loader all ask here."""
    if is_stale(tags, now):
        return f"no heartbeat for {heartbeat_age(tags, now):.0f} s"
    pid = scratch.ended(tags.get(T.HEARTBEAT_BY))
    return None if pid is None else f"its process {pid} on this machine has ended"
