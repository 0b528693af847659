"""A store that goes away while a job runs: its writes retried for up to HARNESS_STORE_OUTAGE_S, counted and recorded
with the run (Outages), and a Tracker whose every call retries so (Patient)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from harness import tags as T
from harness.store.failures import transient
from harness.store.probe import env_seconds

if TYPE_CHECKING:
    from harness.store.tracking import Tracker


_R = TypeVar("_R")
OUTAGE_ENV = "HARNESS_STORE_OUTAGE_S"
DEFAULT_OUTAGE_S = 300.0


def outage_limit() -> float:
    """Seconds a running job's writes wait for a store that went away: $HARNESS_STORE_OUTAGE_S, else 300."""
    return env_seconds(OUTAGE_ENV, DEFAULT_OUTAGE_S, allow_zero=True)


class Outages:
    """One job's write failures while the store was away: counted, timed, and recorded with the run.

    Every background writer (metrics, heartbeat, checkpoint uploads) and the end-of-run writes report here.
    """

    def __init__(self, limit_s: float | None = None) -> None:
        self.limit_s = outage_limit() if limit_s is None else limit_s
        self.failures = 0
        self.spooled = 0  # most metrics held back at once
        self.longest_s = 0.0
        self._since: float | None = None
        self._deadline: float | None = None
        self._lock = threading.Lock()

    def closing(self) -> None:
        """The run is being closed: from now on every write shares one deadline, limit_s from now (not
        limit_s each, which would multiply the wait by the number of writes left)."""
        self._deadline = time.monotonic() + self.limit_s

    def deadline(self) -> float:
        """Until when a write that starts now may be retried."""
        return self._deadline if self._deadline is not None else time.monotonic() + self.limit_s

    def failed(self, spooled: int = 0) -> None:
        with self._lock:
            self.failures += 1
            self.spooled = max(self.spooled, spooled)
            if self._since is None:
                self._since = time.monotonic()

    def answered(self) -> None:
        with self._lock:
            if self._since is not None:
                self.longest_s = max(self.longest_s, time.monotonic() - self._since)
                self._since = None

    def retry(self, call: Callable[[], _R]) -> _R:
        """call() until it succeeds, retrying transient store failures for up to limit_s seconds."""
        deadline = self.deadline()
        while True:
            try:
                result = call()
            except Exception as err:
                if not transient(err) or time.monotonic() >= deadline:
                    raise
                self.failed()
                time.sleep(max(0.0, min(1.0, deadline - time.monotonic())))
                continue
            self.answered()
            return result

    def tags(self) -> dict[str, str]:
        """The outage as the run records it; nothing when every write went through at once."""
        self.answered()
        if not self.failures:
            return {}
        return {T.STORE_WRITE_FAILURES: str(self.failures), T.STORE_METRICS_SPOOLED: str(self.spooled),
                T.STORE_LONGEST_OUTAGE_S: f"{self.longest_s:.1f}"}


class Patient:
    """A Tracker whose every call retries through store outages (Outages.retry): for a job's end-of-run writes."""

    def __init__(self, tracker: Tracker, outages: Outages) -> None:
        self._tracker = tracker
        self._outages = outages
        self.uri = tracker.uri

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._tracker, name)
        if not callable(method):
            return method

        def patiently(*args: Any, **kwargs: Any) -> Any:
            return self._outages.retry(lambda: method(*args, **kwargs))

        return patiently
