"""Leaving a process whose work is done without Python's teardown of its modules.

Freeing MLflow's, SQLAlchemy's and pandas' modules one by one took 0.6 s of a core at the end of every `harness
run` (measured), and torch's 0.3-0.6 s at the end of every rank, which the launcher waits for: work a bare training
script does not pay in the launcher, and nothing depends on once everything written is closed. The exit handlers
still run (temporary folders, logging) and the standard streams are flushed first.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from collections.abc import Callable


def leave(code: int, first: Callable[[], None] | None = None) -> None:
    """End the process now with `code`, after `first` (a caller's own last step), the exit handlers and a flush of
    the standard streams. Returns, doing nothing, while a thread other than the main one is still alive and not a
    daemon (a pool's worker writing a file, a user's saver): the caller then exits as Python does, which waits for it.
    """
    if any(t is not threading.main_thread() and not t.daemon and t.is_alive() for t in threading.enumerate()):
        return
    if first is not None:
        first()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a reader that went away (`| head`) has nothing left to read
            stream.flush()
    os._exit(code)
