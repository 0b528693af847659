"""What the library has to say while it works, as typed events: the CLI draws them, embedding code may listen.

Library code never prints: it calls `emit(event)`, and the listener of the innermost `listening(...)` block
gets it. Outside any block, and inside `listening(None)`, nothing is said: code that embeds harness and passes no
callback gets nothing on stderr. The listener is held in a context variable: two API calls in two threads each
hear their own events only, and a thread harness starts for a command (a study's member, the reader of rank 0's
messages) runs in a copy of its starter's context (`carry`), so it speaks through its command's listener.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import ParamSpec, TypeVar


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


@dataclass(frozen=True)
class RankOutput:
    """A line rank 0 printed while it ran here (its log, `logs/rank0.log`, keeps it whoever listens)."""

    text: str

    def line(self) -> str:
        return self.text


@dataclass(frozen=True)
class Steps:
    """The training steps of the ranks running here: `done` of `total` (None until rank 0 says how many), under
    `label` (the experiment and its world size). The first has done=0; the last has `ended` set: the ranks are done (when
    they ended well, `done` and `total` are the steps they ran: the bar ends full).
    Said when the count moves, at most five times a second."""

    label: str
    done: int = 0
    total: int | None = None
    ended: bool = False

    def line(self) -> str:
        of = "" if self.total is None else f" of {self.total}"
        return f"{self.label}: {self.done}{of} steps{' (ranks ended)' if self.ended else ''}"


Event = Notice | Warning | Progress | Output | Submitted | RankOutput | Steps
Listener = Callable[[Event], None]

_listener: contextvars.ContextVar[Listener | None] = contextvars.ContextVar("harness_listener", default=None)

P = ParamSpec("P")
R = TypeVar("R")


def emit(event: Event) -> None:
    """Deliver `event` to the innermost listener of this context, if there is one."""
    listener = _listener.get()
    if listener is not None:
        listener(event)


def heard() -> bool:
    """Whether anyone listens here: work done only to be shown (following rank 0's log) is skipped otherwise."""
    return _listener.get() is not None


@contextlib.contextmanager
def listening(listener: Listener | None) -> Iterator[None]:
    """Events emitted inside (in this context, and in the threads it starts through `carry`) go to `listener`
    (None: to no one, whoever listens outside)."""
    token = _listener.set(listener)
    try:
        yield
    finally:
        _listener.reset(token)


def carry(fn: Callable[P, R]) -> Callable[P, R]:
    """`fn`, to be run in another thread with the caller's listener: each call runs in a copy of the context
    `carry` was called in (a context cannot be entered by two threads at once)."""
    context = contextvars.copy_context()

    def carried(*args: P.args, **kwargs: P.kwargs) -> R:
        return context.copy().run(fn, *args, **kwargs)

    return carried
