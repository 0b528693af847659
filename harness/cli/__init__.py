"""The command line: click only. Parse the arguments, call harness.commands, print what comes back."""

from __future__ import annotations

import sys

from harness import shutdown
from harness.cli.main import main

__all__ = ["entry", "main"]


def entry() -> None:
    """The `harness` command: `main`, then out of the process without tearing the interpreter down (shutdown.leave:
    once a command has returned, everything it wrote is closed and committed)."""
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
    shutdown.leave(code)
    sys.exit(code)  # a thread is still working: Python's own exit waits for it
