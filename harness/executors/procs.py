"""This node's rank processes: forked from a warm rank server (the default), or spawned afresh (`launcher: spawn`).

The launcher supervises ranks; it never trains, so it does not import torch (about 3 s of one core and 200 MiB on a
2-core machine, which the ranks need at the same moment). A spawned rank imports torch itself, every rank of every
launch. The rank server is the standard library's forkserver with harness's rank-side modules preloaded
(harness/executors/warm.py: torch, DDP, the data loader, omegaconf, harness's runtime - nothing of MLflow, no store,
no CUDA): one import per launch, then each rank is a fork of it, ready in milliseconds. Measured on two cores: 15 s
of user CPU per `harness run experiments/linear_ddp` instead of 25 s (benchmarks/startup_bench.py).

Why the standard library's server and not a fork of the launcher: a rank forked from the launcher inherits every
descriptor the launcher holds (its store's connections, the write end of the rank's own inbox, which then never
sees EOF) and whatever locks its threads held. A forkserver child gets only the descriptors passed to it, the
server's signal handlers put back, and the launcher's sys.path and working directory (multiprocessing's spawn
preparation); what the fork carries over besides - the server's environment, numpy's global RNG - the rank's entry
(runtime/rank/child.py) resets to what a spawned rank would have, so a rank's arithmetic does not depend on how it
was started.

torch's `mp.spawn` is an import plus a little bookkeeping; this module is the bookkeeping: each process runs
`fn(index, *args)`, an exception in it is written to the process's error file as its formatted traceback, and
`join()` raises RankRaised or RankExited for the first process that failed, after stopping the others.
"""

from __future__ import annotations

import ast
import atexit
import contextlib
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import multiprocessing.process
import multiprocessing.util
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import events
from harness.configschema import Launcher as Method
from harness.errors import HarnessError
from harness.executors import leftovers, rankserver
from harness.runtime.rank.child import child

SPAWN = multiprocessing.get_context("spawn")
FORKSERVER = multiprocessing.get_context("forkserver")
_ERROR_PREFIX = "harness-rank-error-"
# What the rank server imports once, for every rank it forks (a module of its own: importing it is the preload).
_PRELOAD = "harness.executors.warm"


def check_main_guarded() -> None:
    """Refuse (HarnessError, exit 2) to start ranks from a script that calls harness at its top level unguarded.

    A spawned or forkserver rank is a fresh Python process: multiprocessing imports the launcher's main script
    into it again (as __mp_main__), so a script whose harness call is not under `if __name__ == "__main__":`
    makes every rank run that call again - the ranks die in multiprocessing's bootstrapping error and the run
    is recorded FAILED with their tracebacks. Said here, in one line, before any rank starts or anything is
    recorded. Only a call made while the main script's top level is running is looked at: a notebook, `-c`,
    `python -m package` (never imported again) and any call under the guard pass.
    """
    main = sys.modules.get("__main__")
    spec_name = getattr(getattr(main, "__spec__", None), "name", None) or ""
    path = getattr(main, "__file__", None)
    if main is None or not path or spec_name.endswith(".__main__"):
        return
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_globals is vars(main) and frame.f_code.co_name == "<module>"):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return
    line = frame.f_lineno
    try:
        tree = ast.parse(Path(frame.f_code.co_filename).read_text(), frame.f_code.co_filename)
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return  # not a readable Python source (a frozen program): nothing to point at
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_main_test(node.test) and node.body and \
                node.body[0].lineno <= line <= (node.body[-1].end_lineno or node.body[-1].lineno):
            return
    shown = os.path.relpath(path) if not os.path.relpath(path).startswith("..") else path
    raise HarnessError(
        f"{shown} calls harness at its top level (line {line}), outside an `if __name__ == \"__main__\":` block: "
        "every rank starts as a fresh Python process that imports the script again and would run that call again. "
        "Put the script's calls under `if __name__ == \"__main__\":` (docs/python-api.md shows it)."
    )


def _is_main_test(test: ast.expr) -> bool:
    """`__name__ == "__main__"`, either way round."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    names = [s for s in sides if isinstance(s, ast.Name) and s.id == "__name__"]
    values = [s for s in sides if isinstance(s, ast.Constant) and s.value == "__main__"]
    return len(names) == 1 and len(values) == 1


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


# --- the rank server ------------------------------------------------------------------------------------------

_server_lock = threading.Lock()
_server_env: dict[str, str] | None = None  # the environment the running server was started with
_lease: rankserver.Lease | None = None  # this command's hold on a server kept between commands
_unkept: set[str] = set()  # keys whose kept server could not be had in this process


def warm() -> None:
    """Start the rank server now, if it is not running, so that its torch import overlaps the launcher's own work
    (MLflow, the record). Returns at once; the first fork waits for the import to finish. With
    HARNESS_RANK_SERVER_IDLE_S set, a server kept warm between commands (executors/rankserver.py) instead."""
    global _server_env
    with _server_lock:
        env = dict(os.environ)
        if _kept(env):
            return
        if _server_env is not None and _server_env != env:
            # Variables read at import (OMP_*, MKL_*, ATEN_CPU_CAPABILITY, ...) decided how the server's torch loaded:
            # a rank that must see other values is forked from a server that loaded under them.
            _stop_server()
        if _server_env is None:
            FORKSERVER.set_forkserver_preload([_PRELOAD])
            _short_socket_dir()
            multiprocessing.forkserver.ensure_running()
            _server_env = env
            # Gone with the command, not a moment later: the server would otherwise notice its launcher's exit only
            # when the pipe it watches closes, after the process that ran the command has already been reaped.
            atexit.register(stop_server)


def _kept(env: dict[str, str]) -> bool:
    """Hold the kept server for this environment (starting it if none runs); False: this command starts its own."""
    global _lease
    wanted = rankserver.idle_s(env) > 0 and rankserver.supported()
    if _lease is not None:
        if wanted and _lease.key == rankserver.key(env) and rankserver.alive(_lease.server_pid):
            return True
        _release()
    if not wanted:
        return False
    key = rankserver.key(env)
    if key in _unkept:  # said once; this command's own server serves it
        return False
    _stop_server()  # one of this command's own, started under other settings
    try:
        _lease = rankserver.lease(env)
    except (OSError, HarnessError) as err:
        _unkept.add(key)
        events.emit(events.Warning(f"the rank server is not kept between commands ({err}); this launch starts its own."))
        return False
    rankserver.adopt(_lease)
    atexit.register(_release)
    return True


def _release() -> None:
    global _lease
    if _lease is not None:
        rankserver.forget()
        _lease.release()
        _lease = None


# A Unix socket's path holds 107 bytes: the server listens at <multiprocessing's temp dir>/listener-XXXXXXXX.
_SOCKET_DIR_ROOM = 80


def _short_socket_dir() -> None:
    """Under a long TMPDIR the server's socket path would not fit ("AF_UNIX path too long"): multiprocessing's temp
    folder for this process moves to a short one of its own under /tmp, removed at exit."""
    if len(os.fsencode(multiprocessing.util.get_temp_dir())) <= _SOCKET_DIR_ROOM:
        return
    short = tempfile.mkdtemp(prefix="harness-mp-", dir="/tmp")
    atexit.register(shutil.rmtree, short, True)
    multiprocessing.process.current_process()._config["tempdir"] = short  # type: ignore[attr-defined]


def stop_server() -> None:
    """Stop the rank server (idempotent; a kept one is only let go); the next start starts another."""
    with _server_lock:
        _release()
        _stop_server()


def _stop_server() -> None:
    global _server_env
    stop = getattr(multiprocessing.forkserver._forkserver, "_stop", None)
    if stop is None:  # a Python without it: the old server stays; its ranks get the new environment from the rank's entry
        return
    server: Any = multiprocessing.forkserver._forkserver
    if server._forkserver_pid is not None:
        # It may still be importing torch (a command refused after warm()): it would notice the closed pipe only
        # once that is done, seconds later. Nothing runs in it but the preload; its ranks have ended.
        with contextlib.suppress(OSError):
            os.kill(server._forkserver_pid, signal.SIGKILL)
    with contextlib.suppress(OSError, ChildProcessError):
        stop()
    _server_env = None


# --- one rank ---------------------------------------------------------------------------------------------------

# --- a node's ranks ---------------------------------------------------------------------------------------------

class Processes:
    """The processes of one node, in local-rank order, and the file each writes its error to.

    They are started in the background (a fork waits for the rank server's imports): `processes` waits until every
    one exists, and raises HarnessError if they could not be started.
    """

    def __init__(self, method: Method, error_files: list[str]) -> None:
        self.method = method
        self.error_files = error_files
        self._processes: list[Any] = []
        self._done = threading.Event()
        self._error: BaseException | None = None
        # Each rank leads a process group of its own (runtime/rank/family.py): ended with the ranks, by the guardian if
        # this process dies first.
        self._guardian = leftovers.Guardian()

    @property
    def processes(self) -> list[Any]:
        self._done.wait()
        if self._error is not None:
            raise HarnessError(f"could not start the ranks ({self.method.value}): {self._error}. "
                               "Set launcher: spawn to start them without the rank server.") from self._error
        return self._processes

    def started(self) -> list[Any]:
        """The processes started so far (after waiting for the starts to end), without raising."""
        self._done.wait()
        return list(self._processes)

    def pids(self) -> list[int | None]:
        return [p.pid for p in self.processes]

    def join(self, timeout: float | None = None, grace_period: float = 5.0) -> bool:
        """True once every process ended with status 0; False while some still run after `timeout`. The first
        failure stops the others (SIGTERM, `grace_period`, SIGKILL) and is raised: RankRaised when its function
        raised, RankExited otherwise."""
        processes = self.processes
        waiting = {p.sentinel: i for i, p in enumerate(processes) if p.exitcode is None}
        if waiting:
            multiprocessing.connection.wait(list(waiting), timeout=timeout)
        failed = next((i for i, p in enumerate(processes) if p.exitcode not in (None, 0)), None)
        if failed is None:
            return all(p.exitcode == 0 for p in processes)
        _settle(processes)
        stop(processes, grace_period)
        process = processes[failed]
        text = _read(self.error_files[failed])
        if text is not None:
            raise RankRaised(f"process {failed} terminated with the following error:\n{text}", failed, process.pid, text)
        code = int(process.exitcode)
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        raise RankExited(f"process {failed} terminated with {how}", failed, process.pid, code)

    def stop(self, grace_period: float) -> None:
        """End the ranks, then whatever is left of their process groups (idempotent)."""
        processes = self.started()
        stop(processes, grace_period)
        leftovers.end_groups(p.pid for p in processes if p.pid)
        self._guardian.close()

    def remove_error_files(self) -> None:
        for path in self.error_files:
            with contextlib.suppress(OSError):
                os.unlink(path)

    def _start(self, fn: Callable[..., None], args: tuple[Any, ...], after: Callable[[], None] | None) -> None:
        try:
            forked = self.method is Method.forkserver
            if forked:
                warm()
            context = FORKSERVER if forked else SPAWN
            env = dict(os.environ) if forked else None
            for index, error_file in enumerate(self.error_files):
                process = context.Process(target=child, args=(fn, index, args, error_file, env), daemon=False)
                process.start()
                self._processes.append(process)
                if process.pid:
                    self._guardian.watch(process.pid)
        except BaseException as err:  # noqa: B036 - handed to whoever reads `processes`
            self._error = err
            stop(self._processes, 0.0)
        finally:
            if after is not None:
                with contextlib.suppress(Exception):
                    after()
            self._done.set()


def _read(path: str) -> str | None:
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return None
    return text or None


def start(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int, method: Method = Method.forkserver,
          after: Callable[[], None] | None = None) -> Processes:
    """`nprocs` processes running fn(i, *args), i = 0..nprocs-1, started in the background from now; `after` runs
    once every start is over (the launcher closes its copies of the descriptors the processes were given)."""
    check_main_guarded()
    error_files: list[str] = []
    for _ in range(nprocs):
        fd, error_file = tempfile.mkstemp(prefix=_ERROR_PREFIX, suffix=".txt")
        os.close(fd)
        os.unlink(error_file)  # its existence is the news: a process that raised creates it
        error_files.append(error_file)
    processes = Processes(Method(method), error_files)
    threading.Thread(target=events.carry(processes._start), args=(fn, args, after), name="harness-rank-start", daemon=True).start()
    return processes


# Ranks that fail alike (a refused op, an entry that cannot be imported) fail within moments of each other, in an
# order the scheduler picks: stopping the others at once would let a chance ordering decide which rank the failure
# names, and lose the others' own reports. Those still running get this long to end by themselves first.
SETTLE_S = 2.0


def _settle(processes: list[Any]) -> None:
    deadline = time.monotonic() + SETTLE_S
    while (running := [p.sentinel for p in processes if p.exitcode is None]) and time.monotonic() < deadline:
        multiprocessing.connection.wait(running, timeout=max(0.0, deadline - time.monotonic()))


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
