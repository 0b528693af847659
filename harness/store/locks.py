"""Taking turns on a local SQLite store: the processes that open it at once, and the writes that must not interleave.
Other stores need no lock here: their servers order their own writes."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

from harness.errors import StoreUnavailable
from harness.store.probe import TIMEOUT_ENV, store_timeout
from harness.store.uris import scheme, sqlite_path


@contextlib.contextmanager
def opening(uri: str) -> Iterator[None]:
    """Held while a process opens the store: the processes of one job (torchrun's ranks) open it at once,
    and two that create a fresh SQLite schema together collide. Other stores migrate on their own."""
    path = sqlite_path(uri) if scheme(uri) == "sqlite" else None
    if path is None:
        yield
        return
    import fcntl

    try:  # the folder, not a file beside the database: nothing is left behind in the store
        fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        yield
        return
    try:
        # The processes of one job, or many jobs on one store, take turns: each opening takes a second or two, more
        # on a loaded machine. Waiting is bounded per holder, not in all, and a holder that makes progress is not
        # waited out: the one that builds a new store's schema (MLflow's migrations, minutes of a loaded core) burns
        # CPU and writes the database as it goes. Only a holder that keeps the lock for longer than HOLD_LIMIT with
        # neither is a problem, and it is named.
        limit = hold_limit()
        holder, since, seen = None, time.monotonic(), None
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                now = time.monotonic()
                who = flock_holder(fd)
                progress = _progress(who, path)
                if who != holder or progress != seen:
                    holder, since, seen = who, now, progress
                elif now - since > limit:
                    raise StoreUnavailable(_held_message(holder, path.parent, limit)) from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def exclusive(uri: str) -> Iterator[None]:
    """Held by one process at a time per local SQLite store, for writes that must not interleave (an import): a
    flock on the database file itself, which SQLite's own (fcntl) locks do not see, and which a killed holder
    releases. Nothing for other stores."""
    path = sqlite_path(uri) if scheme(uri) == "sqlite" else None
    if path is None or not path.is_file():
        yield
        return
    import fcntl

    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def hold_limit() -> float:
    """Seconds one process may hold a store's opening lock without progress (no CPU time, no write to the store)
    before the next one gives up: six store timeouts (60 s)."""
    return 6 * store_timeout()


def _progress(pid: int | None, db: Path) -> tuple[object, ...]:
    """What changes while the opening lock's holder works: its CPU time (utime and stime of /proc/PID/stat), and
    the size and modification time of the store's files (the database, its journal, the one being created)."""
    cpu: object = None
    if pid is not None:
        with contextlib.suppress(OSError, IndexError):
            # The command name (field 2) may hold spaces and parentheses: count from the last ')'.
            fields = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()
            cpu = (fields[11], fields[12])  # utime, stime (fields 14 and 15)
    files = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(db.parent):
            if entry.name.startswith((db.name, f".{db.name}.creating-")):
                with contextlib.suppress(OSError):
                    st = entry.stat(follow_symlinks=False)
                    files.append((entry.name, st.st_size, st.st_mtime_ns))
    return cpu, tuple(sorted(files))


def flock_holder(fd: int) -> int | None:
    """The pid holding a flock on the file open as `fd`, from /proc/locks; None when it cannot be told."""
    st = os.fstat(fd)
    ident = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as fh:
            for line in fh:
                fields = line.split()
                if "->" in fields or len(fields) < 6 or fields[1] != "FLOCK":
                    continue
                if fields[5] == ident and fields[4].isdigit():
                    return int(fields[4])
    except OSError:
        pass
    return None


def _held_message(pid: int | None, folder: Path, limit: float) -> str:
    if pid is None:
        return (f"a process has held the opening lock of the store in {folder} for more than {limit:g} s without "
                f"letting go; check for a hung harness process (raise {TIMEOUT_ENV} to wait longer).")
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        command = "command unknown"
    return (f"process {pid} ({command[:200]}) has held the opening lock of the store in {folder} for more than "
            f"{limit:g} s without letting go. If it is hung, stop it (kill {pid}); else raise {TIMEOUT_ENV} to "
            "wait longer.")
