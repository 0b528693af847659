"""When a job has stalled: its ranks are alive, no rank has made progress for many times the run's slowest step, and
neither the ranks nor anything they started used a CPU or moved data meanwhile.

`timeout_s` (no progress for that long, whatever the CPU does) stays the hard limit. This is the quick one: a
deadlocked DataLoader worker, a sleep, a subprocess that never returns, a collective only one rank entered all leave
every process of the job idle, and are named after `stall_s` (60 s by default) instead of 30 minutes. Anything that
works - a long evaluation outside the step loop, data being prepared or downloaded, a compile - keeps a CPU busy or
reads and writes, and is never cut: the window restarts whenever the job did work in it, or had a process running or
waiting for a core (a job starved by others on a loaded machine is not idle).

The threshold grows with what the run has shown: STEP_FACTOR times its slowest interval between two steps so far,
never less than `stall_s`. Before the first step only `stall_s` applies (start-up does its work on a CPU).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

STEP_FACTOR = 20.0  # a stall is this many times the slowest step so far, at least
IDLE_CPU = 0.05  # below this many cores, summed over the job's processes, the job does no work
IDLE_IO = 64 * 1024  # ... and below this many bytes read or written a second (a download at a crawl is work)


@dataclass
class Activity:
    """CPU seconds and bytes read and written, summed over processes, at `at` (time.monotonic()); how many of them
    were running or waiting for a core or a disk then (a job starved of CPU by others is not idle)."""

    at: float
    cpu_s: float
    io_bytes: int
    running: int = 0


def activity(pids: list[int]) -> Activity:
    """The work done so far by these processes and every process under them, living or already reaped."""
    import psutil

    cpu, io, running = 0.0, 0, 0
    seen: set[int] = set()
    for pid in pids:
        with contextlib.suppress(psutil.Error, OSError):
            top = psutil.Process(pid)
            for p in [top, *top.children(recursive=True)]:
                if p.pid in seen:
                    continue
                seen.add(p.pid)
                with contextlib.suppress(psutil.Error, OSError):
                    t = p.cpu_times()
                    # children_*: the CPU of its children already reaped (a worker that ended within the window).
                    cpu += t.user + t.system + t.children_user + t.children_system
                    c = p.io_counters()
                    io += int(getattr(c, "read_chars", c.read_bytes)) + int(getattr(c, "write_chars", c.write_bytes))
                    running += p.status() in (psutil.STATUS_RUNNING, psutil.STATUS_DISK_SLEEP)
    return Activity(time.monotonic(), cpu, io, running)


@dataclass
class Verdict:
    """A stall: how long the job made no progress, the threshold it passed, and what the job did meanwhile."""

    silent_s: float
    threshold_s: float
    slowest_step_s: float | None
    cpu_cores: float
    io_per_s: float


@dataclass
class StallWatch:
    """Fed the ranks' progress array at every poll of the launcher; says when the job has stalled."""

    nproc: int
    floor_s: float  # stall_s; 0: never
    _last: list[float] = field(default_factory=list)  # per rank: the time of its last beat seen
    _step: list[float] = field(default_factory=list)  # per rank: the step of that beat
    slowest: float | None = None  # the longest interval between two steps of one rank so far
    _window: Activity | None = None

    def __post_init__(self) -> None:
        self._last = [0.0] * self.nproc
        self._step = [-1.0] * self.nproc

    def threshold(self) -> float:
        return max(self.floor_s, STEP_FACTOR * (self.slowest or 0.0))

    def observe(self, progress: Any) -> float:
        """Read the ranks' beats; returns how long the job has gone without any rank's progress."""
        for r in range(self.nproc):
            step, at = progress[2 * r], progress[2 * r + 1]
            if at != self._last[r]:
                if step >= 0 and self._step[r] >= 0 and step != self._step[r] and self._last[r]:
                    # Beats seen at polls: an interval may span several steps, which only makes the threshold safer.
                    self.slowest = max(self.slowest or 0.0, at - self._last[r])
                self._last[r], self._step[r] = at, step
                self._window = None  # progress: a new window starts at the next silence
        return time.monotonic() - max(self._last)

    def check(self, progress: Any, pids: list[int]) -> Verdict | None:
        """A Verdict once the job has had no progress for the threshold and did no work in its second half."""
        silent = self.observe(progress)
        if not self.floor_s:
            return None
        limit = self.threshold()
        if silent < limit / 2:
            return None
        now = time.monotonic()
        if self._window is None:
            self._window = activity(pids)
            return None
        if silent < limit or now - self._window.at < limit / 2:
            return None
        later = activity(pids)
        span = max(later.at - self._window.at, 1e-6)
        cores, io = (later.cpu_s - self._window.cpu_s) / span, (later.io_bytes - self._window.io_bytes) / span
        if cores < IDLE_CPU and io < IDLE_IO and not later.running:
            return Verdict(silent, limit, self.slowest, cores, io)
        self._window = later  # it works: judge the next half-threshold of silence afresh
        return None
