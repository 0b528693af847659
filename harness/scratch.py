"""Scratch folders of harness processes, named for the process that made them (harness-KIND-<pid>-...): a process
killed before its cleanup leaves a folder that the next harness process of that kind sees is stale, and removes.
Also where harness keeps what it may rebuild at any time (cache_dir)."""

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
