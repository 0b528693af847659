"""Expected failures and the exit codes the CLI maps them to."""

from __future__ import annotations

from harness.secrets import scrub

# Documented exit codes (docs/troubleshooting.md, "Exit codes").
EXIT_OK = 0
EXIT_FAILED = 1  # the training failed, or a replay/compare diverged
EXIT_USAGE = 2  # bad input: config, run id, repository state, missing engine
EXIT_SIGINT = 130
EXIT_SIGTERM = 143


class HarnessError(Exception):
    """An expected failure: one line that says what is wrong and how to fix it."""

    exit_code = EXIT_USAGE

    def __init__(self, message: str, exit_code: int | None = None) -> None:
        # Messages embed outside text (an exception's, a URL, a file's line): a credential in it never goes further.
        super().__init__(scrub(message))
        if exit_code is not None:
            self.exit_code = exit_code


class ConfigError(HarnessError):
    """The experiment's YAML or an override is invalid."""


class ExperimentError(HarnessError):
    """Raised inside a rank when the experiment's code misuses the training API (or cannot be imported).

    The launcher reports its message as the one line of the failure, without a traceback.
    """

    exit_code = EXIT_FAILED


class RunFailed(HarnessError):
    """A rank raised or died; the run is recorded as FAILED."""

    exit_code = EXIT_FAILED


class Interrupted(HarnessError):
    """The launcher got SIGINT or SIGTERM; the run is recorded as KILLED."""

    def __init__(self, signum: int) -> None:
        import signal

        name = signal.Signals(signum).name
        super().__init__(f"interrupted by {name}; the run is marked KILLED", 128 + signum)
        self.signum = signum
