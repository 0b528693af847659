"""This node's rank processes, started with the standard library's spawn context.

The launcher supervises ranks; it never trains, so it does not import torch (about 3 s of one core and 200 MiB
on a 2-core machine, which the ranks need for their own torch import at the same moment). torch's
`mp.spawn` is that import plus a little bookkeeping; this module is the bookkeeping: each process runs
`fn(index, *args)`, an exception in it is written to the process's error file as its formatted traceback, and
`join()` raises RankRaised or RankExited for the first process that failed, after stopping the others.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import multiprocessing.util
import os
import signal
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import shutdown

SPAWN = multiprocessing.get_context("spawn")
_ERROR_PREFIX = "harness-rank-error-"


class RankFailed(Exception):
    """A rank process ended badly: `error_index` is its place in the node's processes, `pid` its process id."""

    def __init__(self, message: str, error_index: int, pid: int | None) -> None:
        super().__init__(message)
        self.error_index = error_index
        self.pid = pid


class RankRaised(RankFailed):
    """The rank's function raised: `traceback_text` is its formatted traceback."""

    def __init__(self, message: str, error_index: int, pid: int | None, traceback_text: str) -> None:
        super().__init__(message, error_index, pid)
        self.traceback_text = traceback_text


class RankExited(RankFailed):
    """The rank died without raising (a signal, os._exit, a C++ abort)."""

    def __init__(self, message: str, error_index: int, pid: int | None, exit_code: int) -> None:
        super().__init__(message, error_index, pid)
        self.exit_code = exit_code
        self.signal_name = signal.Signals(-exit_code).name if exit_code < 0 else None


def _child(fn: Callable[..., None], index: int, args: tuple[Any, ...], error_file: str) -> None:
    """The spawned process's body: a raised exception becomes the error file, then exit status 1."""
    try:
        fn(index, *args)
    except KeyboardInterrupt:
        return  # the launcher stopped the job: it says why
    except Exception:
        with contextlib.suppress(OSError):
            Path(error_file).write_text(traceback.format_exc())
        sys.exit(1)
    _leave()


def _leave() -> None:
    """Out of a rank whose work is done without Python's teardown of torch (harness/shutdown.py), multiprocessing's
    finalizers first (what Process._bootstrap runs last); with a thread of the user's still running, the usual exit."""
    shutdown.leave(0, first=multiprocessing.util._exit_function)  # type: ignore[attr-defined]


class Processes:
    """The spawned processes of one node, in local-rank order, and the file each writes its error to."""

    def __init__(self, processes: list[Any], error_files: list[str]) -> None:
        self.processes = processes
        self.error_files = error_files

    def pids(self) -> list[int | None]:
        return [p.pid for p in self.processes]

    def join(self, timeout: float | None = None, grace_period: float = 5.0) -> bool:
        """True once every process ended with status 0; False while some still run after `timeout`. The first
        failure stops the others (SIGTERM, `grace_period`, SIGKILL) and is raised: RankRaised when its function
        raised, RankExited otherwise."""
        waiting = {p.sentinel: i for i, p in enumerate(self.processes) if p.exitcode is None}
        if waiting:
            multiprocessing.connection.wait(list(waiting), timeout=timeout)
        failed = next((i for i, p in enumerate(self.processes) if p.exitcode not in (None, 0)), None)
        if failed is None:
            return all(p.exitcode == 0 for p in self.processes)
        stop(self.processes, grace_period)
        process = self.processes[failed]
        text = _read(self.error_files[failed])
        if text is not None:
            raise RankRaised(f"process {failed} terminated with the following error:\n{text}", failed, process.pid, text)
        code = int(process.exitcode)
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        raise RankExited(f"process {failed} terminated with {how}", failed, process.pid, code)

    def remove_error_files(self) -> None:
        for path in self.error_files:
            with contextlib.suppress(OSError):
                os.unlink(path)


def _read(path: str) -> str | None:
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return None
    return text or None


def start(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int) -> Processes:
    """`nprocs` processes running fn(i, *args), i = 0..nprocs-1, started now (they import what `fn`'s module
    imports, never the launcher's modules)."""
    processes: list[Any] = []
    error_files: list[str] = []
    try:
        for index in range(nprocs):
            fd, error_file = tempfile.mkstemp(prefix=_ERROR_PREFIX, suffix=".txt")
            os.close(fd)
            os.unlink(error_file)  # its existence is the news: a process that raised creates it
            error_files.append(error_file)
            process = SPAWN.Process(target=_child, args=(fn, index, args, error_file), daemon=False)
            process.start()
            processes.append(process)
    except BaseException:
        stop(processes, 0.0)
        raise
    return Processes(processes, error_files)


def stop(processes: list[Any], grace_period: float) -> None:
    """SIGTERM, up to `grace_period` for them to exit, then SIGKILL: no rank outlives its launcher."""
    alive = [p for p in processes if p.is_alive()]
    for p in alive:
        with contextlib.suppress(Exception):
            p.terminate()
    for p in alive:
        p.join(timeout=grace_period)
    for p in alive:
        if p.is_alive():
            with contextlib.suppress(Exception):
                p.kill()
            p.join(timeout=grace_period)
