"""What every backend whose ranks run elsewhere (a container, a batch job) shares: the base Docker and Slurm subclass.

Such a backend records the run on this side first (so that where it was sent lands on it), has the code run there
as `harness _execute RUN_ID` (which runs the ranks with `Backend.executes` and closes the run into the same store),
follows the job until it ends, and closes the run itself only when the job vanished without closing it (killed by
the engine or the scheduler, out of time). A new remote backend (Kubernetes, a cloud queue) writes `launch` (start
the job, return its handle) and, on the handle, `poll`, `stop` and `follow`; the rest is here.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from harness import events, tags as T
from harness.configschema import ExperimentConfig
from harness.errors import EXIT_FAILED, EXIT_OK, Interrupted
from harness.executors.base import Executor, Handle, Job, JobEvent, Outcome
from harness.executors.local import LocalExecutor
from harness.messages import Message
from harness.record import closing


def execute_command(job: Job, code_dir: str, python: list[str] | None = None) -> list[str]:
    """`harness _execute RUN_ID --code-dir DIR [--resume-step N]`: what runs the recorded job where it lands.
    `python`: how harness is started there (default: the `harness` on its PATH)."""
    command = [*(python or ["harness"]), "_execute", job.run_id, "--code-dir", code_dir]
    if job.resume_step is not None:
        command += ["--resume-step", str(job.resume_step)]
    return command


def this_python() -> list[str]:
    """harness under this very interpreter: a node that shares this machine's filesystem runs the same install."""
    return [sys.executable, "-m", "harness"]


@dataclass(frozen=True)
class Ended:
    """How a remote job ended, as its backend saw it (RemoteHandle.follow)."""

    exit_code: int  # its exit status (EXIT_OK: it ran to its end); what the outcome says when the run failed
    message: str  # what the outcome says when the run ended unfinished and holds no reason of its own
    vanished: str | None = None  # the reason recorded when the job ended without closing its run (None: record none)
    killed: bool = False  # the engine or the scheduler stopped it (a run it left open ends KILLED, not FAILED)


class RemoteExecutor(Executor):
    """Records the run, launches the job elsewhere; a launch that fails closes the run FAILED with its reason."""

    def start(self, job: Job, on_event: Callable[[JobEvent], None]) -> Handle:
        if job.record is not None:
            job.run_id = job.record(job.placement)
        code = contextlib.ExitStack()  # what the job needs until it ends (a checkout of its code); closed by wait()
        try:
            return self.launch(job, on_event, code)
        except BaseException as err:
            code.close()
            closing.close(job.tracker, job.run_id, T.FAILED, str(err), reason_may_fail=True)
            raise

    @abstractmethod
    def launch(self, job: Job, on_event: Callable[[JobEvent], None], code: contextlib.ExitStack) -> RemoteHandle:
        """Start the recorded job `job.run_id` elsewhere, running `execute_command`; `code` holds what it needs
        until it ends."""

    # A remote run's segments (audit, trace) re-execute on this machine's ranks, as the local backend runs them:
    # what audit and trace have always done with one.
    def check_segments(self, cfg: ExperimentConfig) -> None:
        LocalExecutor().check_segments(cfg)

    def run_segments(self, job: Job, plans: list[Any], on_message: Callable[[Message], None]) -> None:
        LocalExecutor().run_segments(job, plans, on_message)


class RemoteHandle(Handle):
    """A job started elsewhere: followed until it ends, and its run closed here only if the job left it open."""

    def __init__(self, job: Job, code: contextlib.ExitStack | None = None) -> None:
        self.job = job
        self.code = code or contextlib.ExitStack()
        self.interrupted: list[int] = []
        self.ended: str | None = None

    @abstractmethod
    def poll(self) -> str:
        """PENDING, RUNNING, FINISHED, FAILED or KILLED, asked of the engine or the scheduler once."""

    @abstractmethod
    def stop(self) -> None:
        """Stop the job (blocking is fine: it runs in a thread of its own); the harness inside closes the run KILLED."""

    @abstractmethod
    def follow(self) -> Ended:
        """Stream the job's output until it has ended (and its run had a moment to close); how it ended."""

    def status(self) -> str:
        return self.ended if self.ended is not None else self.poll()

    def cancel(self, signum: int) -> None:
        self.interrupted.append(signum)
        threading.Thread(target=events.carry(self.stop), daemon=True).start()

    def wait(self) -> Outcome:
        with self.code:  # e.g. the code's worktree, removed once the job has ended
            outcome = self._close(self.follow())
        self.ended = outcome.status
        return outcome

    def _close(self, ended: Ended) -> Outcome:
        tracker, run_id = self.job.tracker, self.job.run_id
        status = tracker.get_run(run_id).status
        if status == T.RUNNING:  # the job ended without closing the run: closed here
            status = T.KILLED if (self.interrupted or ended.killed) else T.FAILED
            closing.close(tracker, run_id, status, ended.vanished)
            if not self.interrupted:
                return Outcome(run_id, status, EXIT_FAILED, ended.vanished or ended.message)
        if self.interrupted:
            signum = self.interrupted[0]
            return Outcome(run_id, status, 128 + signum, str(Interrupted(signum)))
        if status == T.FINISHED and ended.exit_code == EXIT_OK:
            return Outcome(run_id, status, EXIT_OK, "")
        message = tracker.get_run(run_id).tags.get(T.STATUS_REASON, ended.message)
        return Outcome(run_id, status, ended.exit_code or EXIT_FAILED, message)
