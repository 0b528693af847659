"""A second backend from outside harness, for the tests, written from harness/executors/base.py alone: `child` runs
the recorded job as `harness _execute RUN_ID` in a child process on this machine, the way a backend that sends the
job elsewhere (a container, a cluster) does, and follows it. Unlike `inline` (tests/toy_backend/__init__.py) it
subclasses nothing of a built-in backend: what it needs of harness is the seam (Executor, Handle, Job, Outcome,
Backend) and the command line, so it proves that base.py suffices for a new backend."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable

from harness.errors import HarnessError
from harness.executors.base import FAILED, FINISHED, KILLED, RUNNING, Backend, Executor, Handle, Job, JobEvent, Outcome

EXECUTOR_TAG = "harness.executor"  # the tag that says where the run ran (harness.tags.EXECUTOR)


class ChildExecutor(Executor):
    name = "child"

    def prepare(self, job: Job) -> dict[str, str]:
        if job.topology.multi_node:
            raise HarnessError("the child backend runs one node; drop --nnodes.")
        return {EXECUTOR_TAG: self.name}

    def start(self, job: Job, on_event: Callable[[JobEvent], None]) -> Handle:
        if job.record is not None:
            job.run_id = job.record(job.placement)
        command = [sys.executable, "-m", "harness", "_execute", job.run_id, "--code-dir", str(job.exp_dir)]
        if job.resume_step is not None:
            command += ["--resume-step", str(job.resume_step)]
        env = {**os.environ, "MLFLOW_TRACKING_URI": job.tracker.uri}
        return ChildHandle(job, subprocess.Popen(command, env=env))


class ChildHandle(Handle):
    def __init__(self, job: Job, proc: subprocess.Popen) -> None:
        self.job, self.proc = job, proc
        self.signals: list[int] = []

    def status(self) -> str:
        if self.proc.poll() is None:
            return RUNNING
        return self.job.tracker.get_run(self.job.run_id).status

    def cancel(self, signum: int) -> None:
        self.signals.append(signum)
        self.proc.send_signal(signal.SIGTERM)  # the harness inside stops its ranks and closes the run KILLED

    def wait(self) -> Outcome:
        code = self.proc.wait()
        tracker, run_id = self.job.tracker, self.job.run_id
        status = tracker.get_run(run_id).status
        if status == RUNNING:  # the child died without closing its run
            status = KILLED if self.signals else FAILED
            tracker.end_run(run_id, status)
        if self.signals:
            return Outcome(run_id, status, 128 + self.signals[0], "interrupted")
        return Outcome(run_id, status, 0 if status == FINISHED else (code or 1), "" if status == FINISHED else
                       f"the child process exited with code {code}")


BACKEND = Backend(
    name="child", executor=ChildExecutor, executes="local",
    help="`harness _execute` in a child process (a test backend)",
)
