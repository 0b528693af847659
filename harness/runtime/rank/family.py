"""A rank's own processes - DataLoader workers, `multiprocessing` children, user subprocesses and theirs - end with it.

Three holds, each for a way a rank can end (Linux, no root needed):
- the rank leads a process group of its own (`lead_group`): everything it starts stays in it unless it makes a
  session of its own, so the launcher ends the whole group once the rank is gone, whatever killed it
  (executors/leftovers.py), and a guardian process does the same when the launcher itself was SIGKILLed;
- every process the rank forks from its main thread dies with it (PR_SET_PDEATHSIG, set in the child by the fork
  hook of runtime/forkgate.py): a DataLoader worker does not outlive a rank that was SIGKILLed. Only for forks of the
  main thread: the kernel sends the signal when the forking *thread* ends, and a helper thread of the training code
  may end long before the workers it started;
- the rank is a child subreaper (PR_SET_CHILD_SUBREAPER): a grandchild whose parent died is re-parented to the rank,
  not to init, so `end_descendants` finds it at the rank's end, even in a session of its own.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading
import time
from typing import TYPE_CHECKING

from harness.runtime import forkgate

if TYPE_CHECKING:
    import psutil

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_GRACE_S = 2.0  # SIGTERM, then SIGKILL


def _prctl(option: int, value: int) -> bool:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):  # not Linux
        return False


def die_with_parent() -> bool:
    """This process gets SIGKILL when the thread that started it ends."""
    return _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))


def lead_group() -> None:
    """Make this rank the leader of a process group of its own (its children join it), and their subreaper."""
    with contextlib.suppress(OSError):  # already a group or session leader: torchrun's worker, a test's process
        os.setpgid(0, 0)
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def hold_children() -> None:
    """Every process this one forks from its main thread from now on dies with it (idempotent)."""
    global _holding
    if not _holding:
        _holding = True
        forkgate.in_child(_child_started)


_holding = False


def _child_started() -> None:
    if forkgate.forked_by_main_thread():
        die_with_parent()
        if os.getppid() != forkgate.parent_pid():  # the rank died before the line above: no signal will come now
            os._exit(1)


def end_descendants(since: float = 0.0, grace_s: float = _GRACE_S) -> list[int]:
    """End every process under this one started at or after `since` (time.time(); 0: all): SIGTERM, up to `grace_s`
    for them to go, then SIGKILL. Returns the pids it had to end."""
    import psutil

    me = psutil.Process()
    try:
        found = [p for p in me.children(recursive=True) if not since or p.create_time() >= since - 1.0]
    except (psutil.Error, OSError):
        return []
    if not found:
        return []
    # torch's DataLoader answers a worker's death with an error raised in the main thread (its SIGCHLD handler):
    # these deaths are harness's doing, at the rank's end, and must not fail a rank that succeeded.
    quiet = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGCHLD, signal.SIG_DFL) if quiet else None
    try:
        _end(found, grace_s)
    finally:
        if quiet:
            signal.signal(signal.SIGCHLD, previous)
    return [p.pid for p in found]


def _end(found: list[psutil.Process], grace_s: float) -> None:
    import psutil

    for p in found:
        with contextlib.suppress(psutil.Error, OSError):
            p.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(found, timeout=grace_s)
    for p in alive:
        with contextlib.suppress(psutil.Error, OSError):
            p.kill()
    psutil.wait_procs(alive, timeout=grace_s)
    _reap(found)


def _reap(processes: list[psutil.Process]) -> None:
    """Collect the exit status of those that were this process's children (re-parented orphans among them)."""
    deadline = time.monotonic() + 1.0
    for p in processes:
        while time.monotonic() < deadline:
            try:
                pid, _ = os.waitpid(p.pid, os.WNOHANG)
            except ChildProcessError:
                break  # not ours, or reaped already (multiprocessing's own join)
            if pid:
                break
            time.sleep(0.01)
