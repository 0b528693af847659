"""What the library has to say while it works, as typed events: the CLI draws them, embedding code may listen.

Library code never prints (a rank's own output goes to its log, not through here): it calls `emit(event)`,
and the listener of the innermost `listening(...)` block gets it. Outside any block, and inside
`listening(None)`, nothing is said: code that embeds harness and passes no callback gets nothing on stderr.
The listener is process-wide, not per thread: a study's members run in threads and speak through it too.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Notice:
    """What is happening or was decided (`Resuming run X from the checkpoint of step 5.`), said as is."""

    text: str

    def line(self) -> str:
        return self.text


@dataclass(frozen=True)
class Warning:  # shadows builtins.Warning here only: callers write events.Warning
    """Something the user should know that does not stop the command (`text` without the `Warning: ` prefix)."""

    text: str

    def line(self) -> str:
        return f"Warning: {self.text}"


@dataclass(frozen=True)
class Progress:
    """A step of a long command: `done` of `total` (a study replay's members, an audit's segments)."""

    text: str
    done: int | None = None
    total: int | None = None

    def line(self) -> str:
        return self.text


@dataclass(frozen=True)
class Output:
    """A line the job printed where the launcher cannot see it (a container, a batch job)."""

    text: str

    def line(self) -> str:
        return self.text


@dataclass(frozen=True)
class Submitted:
    """A scheduler accepted the job."""

    job_id: str
    detail: str = ""

    def line(self) -> str:
        return f"Submitted job {self.job_id}{': ' + self.detail if self.detail else ''}"


Event = Notice | Warning | Progress | Output | Submitted
Listener = Callable[[Event], None]

_lock = threading.Lock()
_listeners: list[Listener | None] = []


def emit(event: Event) -> None:
    """Deliver `event` to the innermost listener, if there is one."""
    with _lock:
        listener = _listeners[-1] if _listeners else None
    if listener is not None:
        listener(event)


def quiet() -> bool:
    """Whether the innermost listener asked for quiet (its `quiet` attribute: the CLI's --quiet): the library's
    progress view then draws neither its bar nor rank 0's output."""
    with _lock:
        listener = _listeners[-1] if _listeners else None
    return bool(getattr(listener, "quiet", False))


@contextlib.contextmanager
def listening(listener: Listener | None) -> Iterator[None]:
    """Events emitted inside go to `listener` (None: to no one, whoever listens outside)."""
    with _lock:
        _listeners.append(listener)
    try:
        yield
    finally:
        with _lock:
            _listeners.pop()
