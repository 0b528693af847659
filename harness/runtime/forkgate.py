"""Harness's own threads in a rank, held still around every fork the training code makes.

A rank forks whenever the training code does: DataLoader workers every epoch, `multiprocessing`, `subprocess`. What a
fork copies is the memory of every thread at that instant, locks included, and only the forking thread goes on in
the child: a lock another thread held is held forever there. CPython 3.10 and 3.11 reinitialise their thread-state
lock only after the child has tried to take it (CPython gh-112275, fixed in 3.12), and a thread that is being created,
is exiting or reads every thread's frames holds interpreter state a child must not inherit half-changed. So harness's
threads in a rank do their work inside `working()`, and a hook run before every `os.fork()` (os.register_at_fork)
waits until none is inside, and keeps them out until the fork is over. They are started once, before the training
code runs, and never exit while it does: no thread is created or torn down at a moment the code may fork.

The wait before a fork is bounded (BEFORE_FORK_WAIT_S): a harness thread stuck in a write (a launcher that stopped
reading) must never stop the training code from forking. None of these threads takes an interpreter lock inside its
unit of work beyond the GIL, so a fork that had to go on without them is no worse than one without the gate.

What no hook can hold still: threads that are not Python's. A C++ thread that enters Python makes a thread state
without the GIL, under the very lock the child then waits for (seen with gdb in a CPU rank: gloo's worker thread
freeing a Python object as a collective's work ends). On 3.10 and 3.11 that can leave a DataLoader worker hung in its
fork; the stall watch (executors/stall.py) names it, and the job ends with nothing left behind.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

# How long a fork waits for harness's threads to finish the unit of work they are in (a metric batch pickled into
# the pipe: microseconds; a checkpoint's digests: as long as hashing the model takes, so the wait is cut here).
BEFORE_FORK_WAIT_S = 1.0


class _Gate:
    def __init__(self) -> None:
        self.cond = threading.Condition(threading.Lock())
        self.active = 0  # harness threads inside working()
        self.forking = 0  # forks between their before and after hooks (several threads may fork at once)
        self.forks = 0  # forks seen in this process: tests and the benchmark read it
        self.from_main = True  # the fork under way was made by the main thread (read in the child)
        self.parent = 0  # the pid of the process that forked (read in the child)


_gate = _Gate()
_installed = False
_child_hooks: list[Callable[[], None]] = []


def install() -> None:
    """Hook every later fork of this process (idempotent). Called in each rank before the training code runs."""
    global _installed
    if _installed:
        return
    _installed = True
    os.register_at_fork(before=_before, after_in_parent=_after_in_parent, after_in_child=_after_in_child)


def in_child(hook: Callable[[], None]) -> None:
    """Run `hook` in every process this one forks from now on, first thing after the fork (exceptions are dropped:
    the child is the training code's, and must start)."""
    install()
    _child_hooks.append(hook)


@contextlib.contextmanager
def working() -> Iterator[None]:
    """A harness thread's unit of work: never in progress while the process forks."""
    gate = _gate
    with gate.cond:
        while gate.forking:
            gate.cond.wait()
        gate.active += 1
    try:
        yield
    finally:
        with gate.cond:
            gate.active -= 1
            if not gate.active:
                gate.cond.notify_all()


def forks() -> int:
    """How many times this process has forked since install()."""
    return _gate.forks


def _before() -> None:
    gate = _gate
    deadline = time.monotonic() + BEFORE_FORK_WAIT_S
    with gate.cond:
        gate.forking += 1
        gate.from_main = threading.current_thread() is threading.main_thread()
        gate.parent = os.getpid()
        while gate.active and (left := deadline - time.monotonic()) > 0:
            gate.cond.wait(left)


def _after_in_parent() -> None:
    gate = _gate
    with gate.cond:
        gate.forking -= 1
        gate.forks += 1
        if not gate.forking:
            gate.cond.notify_all()


def forked_by_main_thread() -> bool:
    """In a hook run in the child: whether the parent's main thread made this fork."""
    return _gate.from_main


def parent_pid() -> int:
    """In a hook run in the child: the pid of the process that forked it."""
    return _gate.parent


def _after_in_child() -> None:
    # Only the forking thread lives on here: the gate's lock may have been held by a thread that no longer exists.
    global _gate
    old = _gate
    _gate = _Gate()
    _gate.from_main, _gate.parent = old.from_main, old.parent
    for hook in list(_child_hooks):
        with contextlib.suppress(Exception):
            hook()


_work: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]] | None = None


def start_worker() -> None:
    """Start the process's one worker thread for harness's work beside the training (a checkpoint's digests) now,
    before the training code runs: a thread made and joined at every checkpoint would be created and torn down at
    moments the code may fork. A daemon: it never holds up the rank's exit (harness/shutdown.py)."""
    global _work
    if _work is None:
        install()
        _work = queue.SimpleQueue()
        threading.Thread(target=_serve, args=(_work,), name="harness-beside", daemon=True).start()


def _serve(work: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]]) -> None:
    while True:
        future, fn, args = work.get()
        if not future.set_running_or_notify_cancel():
            continue
        try:
            with working():
                result = fn(*args)
        except BaseException as err:  # noqa: B036 - handed to whoever waits for the future
            future.set_exception(err)
        else:
            future.set_result(result)


def beside(fn: Callable[..., T], *args: Any) -> Future[T]:
    """`fn(*args)` on the worker thread, inside working()."""
    start_worker()
    assert _work is not None
    future: Future[T] = Future()
    _work.put((future, fn, args))
    return future
