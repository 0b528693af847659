"""The executor seam: what every backend that runs a recorded job provides.

run, replay, resume and audit build a `Job` and hand it to `run_job`; they never learn which backend
runs the ranks. A backend is one module in this package exposing `EXECUTOR`, an `Executor`:

- `prepare(job)` (one instance per job) refuses, before anything is recorded, what cannot run there (no GPU, no image
  digest, no Slurm), and returns the tags that say where the job runs;
- `start(job, on_event)` records the run when `job.record` asks for it (node 0 only: a job is exactly
  one MLflow run), starts the ranks and returns a `Handle`;
- `Handle.wait()` streams the job's events to `on_event` until it ends and returns its `Outcome`;
  `Handle.cancel(signum)` stops it (Ctrl-C, SIGTERM), and the run ends KILLED.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from omegaconf import DictConfig

from harness import events
from harness.events import Output, Submitted
from harness.messages import Message
from harness.store.tracking import RunSummary, Tracker


@dataclass
class Outcome:
    run_id: str
    status: str  # FINISHED | FAILED | KILLED
    exit_code: int
    message: str = ""
    fingerprints: dict[int, str] = field(default_factory=dict)


Event = Message | Output | Submitted


@dataclass(frozen=True)
class Topology:
    """Where this process sits in a job that may span several nodes (one launcher per node)."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None  # where node 0's rendezvous store listens; None on a single node
    master_port: int = 0
    launcher: str = "spawn"  # spawn | slurm | torchrun: who started this process
    scheduler: dict[str, str] = field(default_factory=dict)  # e.g. the Slurm job id and node list

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1


@dataclass
class Job:
    """A job as every backend sees it: the resolved config, its code, and the run that records it."""

    tracker: Tracker
    cfg: DictConfig
    code_root: Path  # the repository root, or the replay's worktree
    exp_dir: Path  # the experiment folder inside it
    run_id: str = ""  # set once recorded
    # Creates (run, replay) or reopens (resume) the job's one MLflow run with the backend's tags and
    # returns its id; called once, by whoever is node 0. None: the run exists (inside a container or batch job).
    record: Callable[[dict[str, str]], str] | None = None
    recorded: RunSummary | None = None  # replay/resume: the run whose image digest is reused
    resume_step: int | None = None
    topology: Topology = field(default_factory=Topology)
    code_id: str = ""  # commit[+patch sha256]: every node of a job must run the same code
    placement: dict[str, str] = field(default_factory=dict)  # the backend's tags, from prepare()
    options: dict[str, Any] = field(default_factory=dict)  # backend-specific choices (docker: allow_unpinned)
    data: dict[str, str] = field(default_factory=dict)  # declared data: name -> absolute path (ctx.data)
    # launch.Ranks: this node's ranks, started before the run is recorded (local, one node); the local
    # backend adopts them (and their log folder), any other leaves them to whoever started them to stop.
    ranks: Any = None

    @property
    def exp_rel(self) -> str:
        return Path(self.exp_dir).resolve().relative_to(Path(self.code_root).resolve()).as_posix()

    @property
    def executor(self) -> str:
        return self.cfg.executor.value


class Handle(ABC):
    """A started job."""

    @abstractmethod
    def wait(self) -> Outcome:
        """Stream events until the job ends; the run is closed (FINISHED, FAILED or KILLED) on return."""

    @abstractmethod
    def cancel(self, signum: int) -> None:
        """Stop the job; called from a signal handler, so it must not block."""


class Executor(ABC):
    name: ClassVar[str]

    def prepare(self, job: Job) -> dict[str, str]:
        """Refuse what cannot run on this backend; the tags that record where the job runs."""
        return {}

    @abstractmethod
    def start(self, job: Job, on_event: Callable[[Event], None]) -> Handle:
        """Record the run if `job.record` says so, start the ranks, return without waiting."""


def run_job(
    executor: Executor, job: Job, on_event: Callable[[Event], None] | None = None,
    on_start: Callable[[Handle], None] | None = None,
) -> Outcome:
    """Prepare, start, stream, wait; SIGINT and SIGTERM cancel the job instead of killing this process.

    `prepare` has run when this returns or raises: a job it refuses records nothing. `on_start` gets the
    handle once the run is recorded and started: outside the main thread no signal reaches this
    function, so whoever runs jobs in threads (a study) cancels them through it.
    """
    job.placement = executor.prepare(job)
    handle: list[Handle] = []
    pending: list[int] = []

    def on_signal(signum: int, frame: Any) -> None:
        if handle:
            handle[0].cancel(signum)
        else:  # still starting: cancelled as soon as there is something to cancel
            pending.append(signum)

    with signals_to(on_signal):
        handle.append(executor.start(job, on_event or _emit_output))
        if on_start is not None:
            on_start(handle[0])
        for signum in pending:
            handle[0].cancel(signum)
        return handle[0].wait()


def _emit_output(event: Event) -> None:
    # What a backend says of its job (a container's output, a batch job's id) goes to whoever listens.
    if isinstance(event, Output | Submitted):
        events.emit(event)


@contextlib.contextmanager
def signals_to(handler: Callable[[int, Any], None]) -> Iterator[None]:
    """SIGINT and SIGTERM go to `handler` while inside (only the main thread can take signals; elsewhere
    nothing changes), and back to what they were after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
