"""A rank process's entry, in the rank: what `harness.executors.procs` starts each rank's process with, spawned or
forked from the rank server.

Here rather than beside the launcher's process bookkeeping (executors/procs.py), so that the rank server's preload
(executors/warm.py) loads the entry without loading the launcher's side, and the contract that code in a rank never
reaches the store covers it.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import multiprocessing.process
import multiprocessing.util
import os
import signal
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import shutdown
from harness.errors import HarnessError


def child(fn: Callable[..., None], index: int, args: tuple[Any, ...], error_file: str,
           env: dict[str, str] | None) -> None:
    """The rank process's body: a raised exception becomes the error file, then exit status 1. `env`: the launcher's
    environment when this process was forked from the rank server (a spawned one inherited it already)."""
    try:
        if env is not None:
            _as_if_spawned(env)
            _watch_launcher()
        fn(index, *args)
    except KeyboardInterrupt:
        return  # the launcher stopped the job: it says why
    except Exception:
        with contextlib.suppress(OSError):
            Path(error_file).write_text(traceback.format_exc())
        # multiprocessing ends a forked rank with os._exit too: what the failed code left in its files' buffers (a log
        # of its own, often the lines that say why) is written as a spawned rank's teardown would.
        shutdown.flush_open_files()
        sys.exit(1)
    _leave()


def _as_if_spawned(env: dict[str, str]) -> None:
    """Undo what a fork of the rank server carries over that a spawned rank would not have."""
    # The server lives while anyone holds its "alive" pipe, which every fork inherits: a rank holding it would keep
    # the server alive after its launcher died, and the server's death is what ends the rank (PR_SET_PDEATHSIG).
    # Dropped, and the server forgotten: a forkserver this rank starts itself (a loader's) is its own.
    server: Any = multiprocessing.forkserver._forkserver  # its private state: the standard library has no call for it
    if server._forkserver_alive_fd is not None:
        with contextlib.suppress(OSError):
            os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = server._forkserver_pid = server._forkserver_address = None
    # The launcher's environment at start(), as spawn passes it (the server kept the one it was started with).
    os.environ.clear()
    os.environ.update(env)
    # Folders the server looked up under its own environment (TMPDIR), looked up again under the launcher's.
    tempfile.tempdir = None
    multiprocessing.process.current_process()._config.pop("tempdir", None)  # type: ignore[attr-defined]
    # torch's CPU generator and numpy's global one were seeded from the OS once, in the server: every fork would draw
    # the same numbers where spawned ranks draw different ones (Python's `random` reseeds itself after a fork). A
    # GPU's generators are seeded when CUDA initialises, in the rank.
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        if torch.cuda._is_in_bad_fork():
            raise HarnessError("the rank server initialised CUDA before forking this rank, which CUDA cannot survive. "
                               "Set launcher: spawn, and report it: the server must never touch CUDA.")
        torch.random.default_generator.seed()


def _watch_launcher() -> None:
    """Die with the launcher. A rank's death signal (PR_SET_PDEATHSIG, runtime/rank/process.py) follows its parent, the rank
    server; a server of the launcher's own dies with it, a kept one does not. The launcher holds the write end of the
    pipe multiprocessing gives the rank as its parent's sentinel: its end of file is the launcher's death."""
    parent = multiprocessing.parent_process()
    sentinel = getattr(parent, "sentinel", None)
    if sentinel is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([sentinel])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="harness-launcher-watch", daemon=True).start()


def _leave() -> None:
    """Out of a rank whose work is done without Python's teardown of torch (harness/shutdown.py), multiprocessing's
    finalizers first (what Process._bootstrap runs last); with a thread of the user's still running, the usual exit."""
    shutdown.leave(0, first=multiprocessing.util._exit_function)  # type: ignore[attr-defined]
