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


# What an API caller catches, by what went wrong; each is a HarnessError, so catching that still catches all, and
# each carries its exit code. A failure none of them names stays a plain HarnessError (exit 2 unless it says).


class UsageError(HarnessError):
    """Bad input: an option, a combination of options or a value the command cannot take."""


class ConfigError(UsageError):
    """The experiment's YAML or an override is invalid."""


class RunNotFound(HarnessError):
    """No run answers to the id given: no such run or experiment in the store, or a prefix too short or ambiguous."""


class RunRefused(HarnessError):
    """The run exists, but this command may not use it: its kind, its status, a record changed since its seal or
    missing what the command reads (record/loading.py's refusal table)."""


class StoreUnavailable(HarnessError):
    """The tracking store cannot be used: unreachable, not a store, of another schema, full, read-only, or failing
    in the middle of a command (exit 1 when it failed while a run was being closed)."""


class DataChanged(HarnessError):
    """The data the run declared no longer hashes as recorded (a file changed, added or missing) and the command
    was not told to go on with the data as it is now."""


class RepositoryError(HarnessError):
    """The git repository cannot give or take the code record: not a repository, no commits, a dirty tree under
    --require-clean, a commit or submodule commit missing, code outside the repository, untracked files over the
    limit, a recorded patch that does not apply."""


class SecretRefused(HarnessError):
    """A secret would reach the store (in the diff, an untracked file named as one), or a replay was not given a
    secret the record hides."""


class BackendError(HarnessError):
    """An executor backend (Docker, Slurm, torchrun, several nodes) refuses the job or cannot run it."""


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

    def __init__(self, signum: int, message: str | None = None) -> None:
        import signal

        name = signal.Signals(signum).name
        super().__init__(message or f"interrupted by {name}; the run is marked KILLED", 128 + signum)
        self.signum = signum
