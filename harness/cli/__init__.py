"""The command line: click only. Parse the arguments, call harness.commands, print what comes back."""

from harness.cli.main import main

__all__ = ["main"]
