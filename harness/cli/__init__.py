"""The command line: click only. Parse the arguments, call harness.commands, print what comes back."""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading

from harness.cli.main import main

__all__ = ["entry", "main"]


def entry() -> None:
    """The `harness` command: `main`, then out of the process without tearing the interpreter down.

    Once a command has returned, everything it wrote is closed and committed; what is left is Python freeing
    MLflow's, SQLAlchemy's and pandas' modules one by one - 0.6 s of a core at the end of every `harness run`
    (measured), against a bare training script that has none of it. The exit handlers still run (temporary
    folders, logging), the standard streams are flushed, then the process ends with the command's exit code. A
    thread that is still alive (a pool's worker writing a file) gets Python's usual exit, which waits for it.
    """
    try:
        main()
        code: int = 0
    except SystemExit as done:
        if done.code is None:
            code = 0
        elif isinstance(done.code, int):
            code = done.code
        else:  # sys.exit("message"), as Python itself prints it
            print(done.code, file=sys.stderr)
            code = 1
    if any(t is not threading.main_thread() and not t.daemon and t.is_alive() for t in threading.enumerate()):
        sys.exit(code)  # a thread still working (a pool's worker): Python's own exit waits for it
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a reader that went away (`| head`) has nothing left to read
            stream.flush()
    os._exit(code)
