"""What the processes a stalled rank started are doing: which one it waits for, in words for the stall's line, and
each one's state, kernel stack and (for a fork of the rank that can dump them) Python stacks, appended to the rank's
stacks file, which goes into the record with the rank logs."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import psutil

from harness.executors.failures import CHILD, DATALOADER, FRAME, SUBPROCESS

_DUMP_WAIT_S = 1.0  # how long a child gets to write its stacks
_CMD_CHARS = 60


def _read(path: str) -> str:
    try:
        with open(path, "rb") as fh:
            return fh.read().decode(errors="replace")
    except OSError:
        return ""


def _cmdline(pid: int) -> list[str]:
    return [a for a in _read(f"/proc/{pid}/cmdline").split("\0") if a]


def _status(pid: int) -> dict[str, str]:
    fields = {}
    for line in _read(f"/proc/{pid}/status").splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    return fields


def _dumps_stacks(status: dict[str, str]) -> bool:
    """Catches SIGUSR1 (faulthandler's stack dump, inherited from the rank): a signal that would kill anything else."""
    try:
        return bool(int(status.get("SigCgt", "0"), 16) >> (signal.SIGUSR1 - 1) & 1)
    except ValueError:
        return False


def _shown(cmd: list[str]) -> str:
    text = " ".join(cmd) or "?"
    return text if len(text) <= _CMD_CHARS else text[:_CMD_CHARS - 3] + "..."


def look(rank_pid: int, stacks: Path, waits: str | None, code_dir: str) -> str:
    """Append what every process under the rank is doing to its stacks file; return the process the rank waits for
    ("its DataLoader worker pid 4242, which never started (...)", "its subprocess pid 4243 (sleep 600)"), or "" when
    it waits for none of them."""
    import psutil

    try:
        rank = psutil.Process(rank_pid)
        children = rank.children(recursive=True)
    except (psutil.Error, OSError):
        return ""
    own_cmd = _cmdline(rank_pid)
    forks: list[psutil.Process] = []
    others: list[psutil.Process] = []
    for child in children:
        (forks if _cmdline(child.pid) == own_cmd else others).append(child)
    where = {child.pid: _append(stacks, child.pid, child in forks, code_dir) for child in children}
    try:
        direct = {c.pid for c in rank.children()} if children else set()
    except (psutil.Error, OSError):  # the rank ended meanwhile
        direct = set()
    if waits == DATALOADER and forks:
        workers = [c.pid for c in forks if c.pid in direct] or [c.pid for c in forks]
        # The one it waits for: a fork stuck in the fork itself, else one stuck in the experiment's code.
        stuck = [c.pid for c in forks if where[c.pid] == _IN_FORK] or [c.pid for c in forks if where[c.pid]]
        if stuck:
            return f"its DataLoader worker pid {stuck[0]} " + (
                "(it never got back from the fork: another thread held an interpreter lock as the rank forked, "
                "CPython gh-112275)" if where[stuck[0]] == _IN_FORK else f"(in {where[stuck[0]]})")
        return f"its DataLoader worker{'s' if len(workers) > 1 else ''} pid {', '.join(map(str, workers))}"
    # The rank's main thread waits for one process; the stack does not say which, so the newest of the kind it waits
    # for is named (the call it is in started it last): the others are in the stacks file all the same.
    if waits == SUBPROCESS and others:
        newest = _newest([c for c in others if c.pid in direct] or others)
        return f"its subprocess pid {newest.pid} ({_shown(_cmdline(newest.pid))})"
    if waits in (CHILD, SUBPROCESS, DATALOADER) and children:
        newest = _newest([c for c in children if c.pid in direct] or children)
        return f"its child process pid {newest.pid} ({_shown(_cmdline(newest.pid))})"
    return ""


def _newest(processes: list[psutil.Process]) -> psutil.Process:
    import psutil

    def started(p: psutil.Process) -> float:
        try:
            return float(p.create_time())
        except (psutil.Error, OSError):
            return 0.0

    return max(processes, key=started)


_IN_FORK = "in the fork"  # a fork of the rank whose Python never resumed: its innermost frame is the os.fork() call


def _append(stacks: Path, pid: int, forked: bool, code_dir: str) -> str:
    """Append what process `pid` is doing to the stacks file. For a fork of the rank that dumps its stacks: _IN_FORK,
    or its frame in the experiment's code ("train.py:8 (init)"); otherwise ""."""
    status, wchan = _status(pid), _read(f"/proc/{pid}/wchan")
    header = (f"\n--- process {pid} under the rank, child of {status.get('PPid', '?')} "
              f"({'a fork of the rank' if forked else _shown(_cmdline(pid))}): "
              f"{status.get('State', '?')}, waiting in {wchan or '?'} ---\n")
    kernel = _read(f"/proc/{pid}/stack")  # root only; where it sleeps in the kernel
    with contextlib.suppress(OSError):
        with open(stacks, "a") as fh:
            fh.write(header + (f"kernel stack:\n{kernel}" if kernel else ""))
    if not (forked and _dumps_stacks(status)):
        return ""
    before = _size(stacks)
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGUSR1)
    # Written once the file has grown and then stayed the same size for a moment (the next process's dump must not
    # start while this one's is still coming).
    deadline, last = time.monotonic() + _DUMP_WAIT_S, before
    while time.monotonic() < deadline:
        time.sleep(0.1)
        size = _size(stacks)
        if size > before and size == last:
            break
        last = size
    try:
        with open(stacks, "rb") as fh:
            fh.seek(before)
            dump = fh.read().decode(errors="replace")
    except OSError:
        return ""
    if "Current thread" not in dump and "futex" in wchan:
        # Its dump stops before the thread that forked (it walks thread states a fork left half-copied), and it
        # waits on a lock: the child of a fork made while another thread held the interpreter's lock.
        return _IN_FORK
    return _current_frame(dump, code_dir)


def _current_frame(dump: str, code_dir: str) -> str:
    """_IN_FORK when the dumping thread's innermost frame is multiprocessing's os.fork() call (the child never got
    back to Python: it hangs in the interpreter's after-fork code); else its innermost frame in the experiment's code."""
    block = dump.split("Current thread", 1)[1] if "Current thread" in dump else ""
    frames = list(FRAME.finditer(block.split("\n\n", 1)[0]))
    if not frames:
        return ""
    # A forked child keeps its parent's stack below the fork: only the frames above os.fork() are the child's own.
    fork = next((i for i, f in enumerate(frames)
                 if f["file"].endswith(os.path.join("multiprocessing", "popen_fork.py")) and f["func"] == "_launch"), None)
    if fork == 0:
        return _IN_FORK
    root = os.path.realpath(code_dir) + os.sep
    for f in frames[:fork]:
        if os.path.realpath(f["file"]).startswith(root):
            return f"{os.path.relpath(f['file'], code_dir)}:{f['line']} ({f['func']})"
    return ""


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
