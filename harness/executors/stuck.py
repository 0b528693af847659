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

from harness.executors.failures import CHILD, DATALOADER, SUBPROCESS

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


def look(rank_pid: int, stacks: Path, waits: str | None) -> str:
    """Append what every process under the rank is doing to its stacks file; return the process the rank waits for
    ("DataLoader worker pid 4242", "subprocess pid 4243 (sleep 600)"), or "" when it waits for none of them."""
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
    for child in children:
        _append(stacks, child.pid, forked=child in forks)
    direct = {c.pid for c in rank.children()} if children else set()
    # The rank's main thread waits for one process; the stack does not say which, so the newest of the kind it waits
    # for is named (the call it is in started it last): the others are in the stacks file all the same.
    if waits == DATALOADER and forks:
        pids = ", ".join(str(c.pid) for c in forks if c.pid in direct) or str(forks[0].pid)
        return f"its DataLoader worker{'s' if ',' in pids else ''} pid {pids}"
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


def _append(stacks: Path, pid: int, forked: bool) -> None:
    status = _status(pid)
    header = (f"\n--- process {pid} under the rank ({'a fork of the rank' if forked else _shown(_cmdline(pid))}): "
              f"{status.get('State', '?')}, waiting in {_read(f'/proc/{pid}/wchan') or '?'} ---\n")
    kernel = _read(f"/proc/{pid}/stack")  # root only; where it sleeps in the kernel
    with contextlib.suppress(OSError):
        with open(stacks, "a") as fh:
            fh.write(header + (f"kernel stack:\n{kernel}" if kernel else ""))
    if not (forked and _dumps_stacks(status)):
        return
    before = _size(stacks)
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + _DUMP_WAIT_S
    while time.monotonic() < deadline:
        time.sleep(0.05)
        size = _size(stacks)
        if size > before:  # written; give the rest of the dump a moment
            time.sleep(0.1)
            return


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
