"""Scratch folders of harness processes, named for the process that made them (harness-KIND-<pid>-...): a process
killed before its cleanup leaves a folder that the next harness process of that kind sees is stale, and removes.
Also where harness keeps what it may rebuild at any time (cache_dir), and a process named so that another process
can tell, on the same machine, whether it has ended (process_identity, ended)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

ENV_CACHE_DIR = "HARNESS_CACHE_DIR"  # where harness keeps what it can rebuild (default ~/.cache/harness)


def cache_dir() -> Path:
    """The folder of harness's caches (declared data's hashes, an empty store's schema): $HARNESS_CACHE_DIR, else
    ~/.cache/harness. Nothing in it is a record: any of it may be deleted at any time, and is rebuilt."""
    return Path(os.environ.get(ENV_CACHE_DIR) or os.path.join(os.path.expanduser("~"), ".cache", "harness"))


def alive(pid: int) -> bool:
    """Is process `pid` still running (another user's process counts as running)?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _stat(pid: int | str) -> tuple[str, str] | None:
    """A process's state letter and start time (clock ticks after boot), from /proc/<pid>/stat."""
    text = _read(f"/proc/{pid}/stat")
    if text is None:
        return None
    fields = text.rsplit(")", 1)[-1].split()  # after the command name, which may hold spaces and parentheses
    return (fields[0], fields[19]) if len(fields) > 19 else None


def process_identity() -> str:
    """This process as another can find it again on this machine: `boot=<boot id> pidns=<pid namespace> pid=<pid>
    start=<start time>` (a part /proc does not give is left out). The pid alone is not enough: pids are reused, and
    a container numbers its processes in a namespace of its own."""
    parts = {"boot": _read("/proc/sys/kernel/random/boot_id"), "pid": str(os.getpid())}
    with contextlib.suppress(OSError):
        parts["pidns"] = os.readlink("/proc/self/ns/pid")
    stat = _stat("self")
    if stat is not None:
        parts["start"] = stat[1]
    return " ".join(f"{k}={v}" for k, v in parts.items() if v)


def ended(identity: str | None) -> int | None:
    """The pid of the process `identity` (process_identity's) names when it has ended for sure: it ran on this
    machine since its last boot, in this pid namespace, and its pid is free, a zombie, or another process's (a later
    start time). None where that cannot be known here (another machine or container, an old record without it)."""
    parts = dict(p.partition("=")[::2] for p in (identity or "").split())
    here = process_identity()
    mine = dict(p.partition("=")[::2] for p in here.split())
    if not parts.get("pid", "").isdigit() or any(
            not parts.get(k) or parts.get(k) != mine.get(k) for k in ("boot", "pidns")):
        return None
    pid = int(parts["pid"])
    if pid == os.getpid():
        return None
    stat = _stat(pid)
    if stat is None:
        return pid if not alive(pid) else None  # no /proc entry to read, yet it may still run (hidepid)
    state, start = stat
    return pid if state in ("Z", "X") or (parts.get("start") and start != parts["start"]) else None


def remove_stale(folder: Path, prefix: str) -> list[Path]:
    """Remove what a killed process left in `folder` under PREFIX<pid>-...; returns what was removed."""
    removed = []
    for entry in folder.glob(f"{prefix}*"):
        pid = entry.name[len(prefix):].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid() or alive(int(pid)):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry)
    return removed


def make(kind: str, base: Path | None = None) -> Path:
    """A new scratch folder harness-KIND-<pid>-... in `base` (default: the system's temporary folder), once the
    stale ones of that kind are gone. The caller removes it."""
    folder = Path(base) if base is not None else Path(tempfile.gettempdir())
    prefix = f"harness-{kind}-"
    remove_stale(folder, prefix)
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=folder))


@contextlib.contextmanager
def folder(kind: str, base: Path | None = None) -> Iterator[Path]:
    """make(kind, base), removed when the block ends."""
    path = make(kind, base)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
