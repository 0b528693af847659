"""The executor seam: what every backend that runs a recorded job provides.

run, replay and resume build a `Job` and hand it to `run_job` (audit and trace to `run_segments`); they never
learn which backend runs the ranks. A backend is one module declaring `BACKEND`, whose `Executor` provides:

- `warm(cfg, topology)`, `check_here(cfg, topology)` and `start_here(cfg, topology, here)`: what happens on this
  machine before anything is recorded (the rank server's imports, the device, the main guard, the warm ranks), the
  decision returned as a `Here` that the `Job` carries; the defaults do nothing, for ranks that run elsewhere;
- `prepare(job)` (one instance per job) refuses, before anything is recorded, what cannot run there (no GPU, no image
  digest, no Slurm), and returns the tags that say where the job runs;
- `start(job, on_event)` records the run when `job.record` asks for it (node 0 only: a job is exactly
  one MLflow run), starts the ranks and returns a `Handle`;
- `Handle.wait()` streams the job's events to `on_event` until it ends and returns its `Outcome`;
  `Handle.status()` says where the job stands without waiting; `Handle.cancel(signum)` stops it (Ctrl-C,
  SIGTERM), and the run ends KILLED;
- `run_segments(job, plans, on_message)` (only a backend whose `Backend.runs_segments` says so) runs the
  entry once per checkpoint plan and records nothing: audit and trace judge the segments from the messages.

Which backends exist, their config sections and their command-line options is `Backend`, declared by
each backend module and collected by the registry in `harness/executors/__init__.py`.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

from harness import events
from harness.configschema import ExperimentConfig
from harness.events import Output, Submitted
from harness.messages import Final, Message, Metrics, MetricsBatch, SegmentEnd, SegmentStart
from harness.runtime.plan import UNSTEERED, LaunchPlan
from harness.store.tracking import RunSummary, Tracker


@dataclass
class Outcome:
    run_id: str
    status: str  # FINISHED | FAILED | KILLED
    exit_code: int
    message: str = ""
    fingerprints: dict[int, str] = field(default_factory=dict)


# What a job reports while it runs (rank 0's messages, output a backend relays, a submission): not harness.events.Event,
# which is what the library says to whoever listens.
JobEvent = Message | Output | Submitted


@dataclass(frozen=True)
class TorchrunEnv:
    """What torchrun told a rank process it started: where it sits in the job and where the job's store is."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    group_rank: int  # this node's rank among torchrun's agents
    master_addr: str
    master_port: int
    agent_store: bool  # the agent hosts the store at master_addr:master_port; every rank is a client
    run_id: str = ""  # TORCHELASTIC_RUN_ID
    restart: int = 0  # TORCHELASTIC_RESTART_COUNT: a restarted attempt must not read the last one's keys

    @property
    def nnodes(self) -> int:
        return self.world_size // self.local_world_size


@dataclass(frozen=True)
class Topology:
    """Where this process sits in a job that may span several nodes (one launcher per node), torchrun's ranks
    included: decided once, by the API (harness/commands/api.py), and handed down to the job and its backend."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None  # where node 0's rendezvous store listens; None on a single node
    master_port: int = 0
    launcher: str = "spawn"  # spawn | slurm | torchrun: who started this process
    # The tags the backend that placed this process gives the run (Backend.place: Slurm's job id and node list).
    scheduler: dict[str, str] = field(default_factory=dict)
    torchrun: TorchrunEnv | None = None  # what torchrun told this process, when it started it as one of the ranks

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1

    @property
    def speaks_for_job(self) -> bool:
        """Whether this process says the job's run id: torchrun gathers every rank's stdout on one terminal, so only
        its rank 0 does; any other launcher is the job's one voice on its node."""
        return self.torchrun is None or self.torchrun.rank == 0


@dataclass(frozen=True)
class JobInputs:
    """How the code and the data reach a backend: folders on this machine, and what names them everywhere."""

    root: Path  # the repository root, or the replay's worktree
    exp_dir: Path  # the experiment folder inside it
    code_id: str = ""  # commit[+patch sha256]: every node of a job must run the same code
    data: Mapping[str, str] = field(default_factory=dict)  # declared data: name -> absolute path (ctx.data)


@dataclass(frozen=True)
class JobOptions:
    """Choices for one job that are not part of its config (so not recorded, not replayed).

    A backend that takes more subclasses it (docker: `allow_unpinned`) and names the subclass in its `Backend`.
    """

    quiet: bool = False  # no progress view (a study running several members at once)


class Ranks(Protocol):
    """This node's ranks, started before the run is recorded (launch.Ranks)."""

    log_dir: str

    def stop(self) -> None: ...

    def torch_facts(self) -> dict[str, str] | None: ...


@dataclass
class Here:
    """What a backend decided and prepared on this machine before the job is recorded: decided once (Executor.check_here,
    then Executor.start_here) and handed down in Job.here, so that nothing after it asks again."""

    device: str | None = None  # the device this node's ranks compute on, checked here; None: they run elsewhere
    backend: str | None = None  # their process group's backend (gloo | nccl)
    warnings: tuple[str, ...] = ()  # what does not stop the job (more rank threads than CPU cores)
    starts_all: bool = False  # this process starts every rank of the job, here (one node, torchrun's ranks aside)
    ranks: Ranks | None = None  # this node's ranks, started before the record (warm ranks): stop() ends them

    def stop(self) -> None:
        """End the ranks started early (if any) and remove their work folder: the job that adopted them has ended."""
        if self.ranks is not None:
            self.ranks.stop()
            shutil.rmtree(Path(self.ranks.log_dir).parent, ignore_errors=True)


@dataclass
class Job:
    """A job as every backend sees it: the resolved config, its code and data, and the run that records it."""

    tracker: Tracker
    cfg: ExperimentConfig  # the typed experiment (config.Experiment.config): never changed in place
    inputs: JobInputs
    run_id: str = ""  # set once recorded
    # Creates (run, replay) or reopens (resume) the job's one MLflow run with the backend's tags and
    # returns its id; called once, by whoever is node 0. None: the run exists (inside a container or batch job).
    record: Callable[[dict[str, str]], str] | None = None
    recorded: RunSummary | None = None  # replay/resume: the run whose image digest is reused
    resume_step: int | None = None
    steering: LaunchPlan = UNSTEERED  # its recorded part: replay --steps K, a calibration member's nudge, the weights' sketch
    topology: Topology = field(default_factory=Topology)
    placement: dict[str, str] = field(default_factory=dict)  # the backend's tags, from prepare()
    options: JobOptions = field(default_factory=JobOptions)  # the backend's own options type (Backend.options)
    # This node's ranks, started before the run is recorded (local, one node); the local backend adopts
    # them (and their log folder), any other leaves them to whoever started them to stop.
    ranks: Ranks | None = None
    # What the backend decided on this machine before the record (the device its ranks use): None, it decides in
    # prepare() and keeps it here, so that the device is resolved once per job.
    here: Here | None = None
    # Called once this node's ranks have ended well, before the run is closed: a line naming what of the code or data
    # they read the record no longer holds (the run closes FAILED with it), or None.
    verify: Callable[[], str | None] | None = None
    # harness calibrate: further members run by the same ranks after this job's own, each recorded as a run of its
    # own - (its steering, what creates its run as `record` does). Only a backend whose `Backend.runs_members` says
    # so takes them; its wait() sets `member_outcomes` (in order) beside the job's own outcome.
    members: list[tuple[LaunchPlan, Callable[[dict[str, str]], str]]] = field(default_factory=list)
    member_ids: list[str] = field(default_factory=list)
    member_outcomes: list[Outcome] = field(default_factory=list)
    # Called with the run's id, status and message once its closing writes went through, before it is sealed and
    # ended: what it writes (a replay's verdict) is sealed with the run, once. Only a backend that closes the run in
    # this process calls it (its `judged` then says so); elsewhere the caller writes after the close.
    judge: Callable[[str, str, str], None] | None = None
    judged: bool = False

    @property
    def code_root(self) -> Path:
        return self.inputs.root

    @property
    def exp_dir(self) -> Path:
        return self.inputs.exp_dir

    @property
    def code_id(self) -> str:
        return self.inputs.code_id

    @property
    def data(self) -> dict[str, str]:
        return dict(self.inputs.data)

    @property
    def exp_rel(self) -> str:
        return Path(self.exp_dir).resolve().relative_to(Path(self.code_root).resolve()).as_posix()

    @property
    def executor(self) -> str:
        return str(self.cfg.executor)


@dataclass
class SegmentReport:
    """What rank 0 said during one plan of run_segments."""

    logged: dict[tuple[str, int], float] = field(default_factory=dict)  # (key, step) -> value
    end: tuple[int, str | None] | None = None  # (step, fingerprint) where the segment stopped
    tensors: dict[str, str] = field(default_factory=dict)  # per-tensor digests at a segment's stop
    # step -> (fingerprint, per-tensor digests) of every SegmentEnd: a plan's digest_at as well as its stop
    marks: dict[int, tuple[str | None, dict[str, str]]] = field(default_factory=dict)
    started: float | None = None  # time.monotonic() when it began


class SegmentMessages:
    """run_segments' on_message (audit, trace, resume's proof): rank 0's messages sorted into one SegmentReport per plan."""

    def __init__(self, count: int) -> None:
        self.reports = [SegmentReport() for _ in range(count)]
        self.current: int | None = None  # the segment running now

    def __call__(self, msg: Message) -> None:
        if isinstance(msg, SegmentStart):
            self.current = msg.index
            self.reports[msg.index].started = time.monotonic()
            return
        if self.current is None:
            return
        report = self.reports[self.current]
        match msg:
            case Metrics(step, values):
                report.logged.update({(key, step): value for key, value in values.items()})
            case MetricsBatch():
                report.logged.update({(key, step): value for key, step, value, _ in msg.points()})
            case SegmentEnd(step, sha256, digests):
                report.end, report.tensors = (step, sha256), digests
                report.marks[step] = (sha256, digests)
            case Final(sha256, steps):
                report.end = (steps, sha256)


# What Handle.status() answers: the run's own statuses, and where a job is before and after it runs.
PENDING, RUNNING = "PENDING", "RUNNING"  # waiting for a scheduler (or starting); its ranks running
FINISHED, FAILED, KILLED = "FINISHED", "FAILED", "KILLED"


class Handle(ABC):
    """A started job."""

    @abstractmethod
    def status(self) -> str:
        """PENDING, RUNNING, FINISHED, FAILED or KILLED, as known now; never waits for the job."""

    @abstractmethod
    def wait(self) -> Outcome:
        """Stream events until the job ends; the run is closed (FINISHED, FAILED or KILLED) on return."""

    @abstractmethod
    def cancel(self, signum: int) -> None:
        """Stop the job; called from a signal handler, so it must not block."""


class Executor(ABC):
    name: ClassVar[str]

    # -- what happens on this machine before anything is recorded: the commands call these in order, and never
    # test what kind of backend they hold (a backend whose ranks run elsewhere keeps the defaults: nothing here).
    def warm(self, cfg: ExperimentConfig, topology: Topology, before: Callable[[], object] | None = None) -> bool:
        """Start now what this node's ranks will import (the rank server), so that it overlaps the reads of the code
        and the data; whether it started. `before` is called first when it does: the string-hash seed the ranks
        take must be in the environment before the server starts."""
        return False

    def check_here(self, cfg: ExperimentConfig, topology: Topology) -> Here:
        """What this machine must hold for this node's ranks (the device, enough of them), checked before anything is
        recorded: the decision, or HarnessError."""
        return Here()

    def start_here(self, cfg: ExperimentConfig, topology: Topology, here: Here) -> Here:
        """Last before the run is recorded: refuse what this node's ranks cannot start with (an entry that runs again
        in every rank, a world size other than the launcher's) and start them early (the warm ranks), so that they
        import torch while the run is recorded. `here`: check_here's decision; returned with what this did."""
        return here

    def prepare(self, job: Job) -> dict[str, str]:
        """Refuse what cannot run on this backend; the tags that record where the job runs."""
        return {}

    @abstractmethod
    def start(self, job: Job, on_event: Callable[[JobEvent], None]) -> Handle:
        """Record the run if `job.record` says so, start the ranks, return without waiting."""

    def run_segments(self, job: Job, plans: list[Any], on_message: Callable[[Message], None]) -> None:
        """Run the entry once per checkpoint plan; only a backend whose Backend.runs_segments is true has this."""
        raise NotImplementedError(f"the {self.name} backend runs no segments")


@dataclass(frozen=True)
class CliOption:
    """A command-line option of a backend, declared as data: the CLI makes a click option of it.

    It sets `key` of the backend's config section (recorded, so a replay runs the same way) or, with no
    key, the field `dest` of the backend's JobOptions (a choice for this job only).
    """

    flag: str  # e.g. --partition
    dest: str  # the parameter's name; unique over every backend's options
    help: str
    type: type = str  # str, int or bool (bool: an on/off flag)
    min: int | None = None  # an int's lowest value
    key: str | None = None  # the config key under the backend's section it overrides
    commands: tuple[str, ...] = ("run", "replay")  # the commands that take it


@dataclass(frozen=True)
class Backend:
    """A backend as the rest of harness knows it: declared once, by the module that implements it."""

    name: str  # `executor: NAME` in experiment.yaml, --executor NAME
    executor: Callable[[], Executor]  # a fresh executor per job
    help: str = ""  # one line: where the ranks run
    section: type | None = None  # its config section, a dataclass; merged into the schema as `NAME:`
    check: Callable[[ExperimentConfig], None] | None = None  # checks of a config the schema cannot express
    options: type[JobOptions] = JobOptions
    cli: tuple[CliOption, ...] = ()
    runs_segments: bool = False  # can re-execute checkpoint segments (audit, trace)
    # What the commands need to know of the backend's jobs, declared here so that none of them tests a backend's
    # name: the commands import no backend module (an import contract), so a new backend needs no command changed.
    ranks_here: bool = False  # the ranks run on this machine, under this process (its executor checks the device and
    # the entry's __main__ guard here), and torchrun may start this process as one of them
    early_ranks: bool = False  # its executor's start_here starts a single node's ranks (which import torch) before the
    # run is recorded (warm ranks)
    parallel_members: bool = False  # a study may run several members at once (--parallel)
    runs_members: bool = False  # runs a calibration's members in one launch of one node's ranks (Job.members)
    runs_working_tree: bool = False  # the ranks run the working tree as it is, not a checkout of the recorded code
    # (--allow-secret-in-diff cuts secrets from the record only: a checkout would run code without them)
    places_nodes: bool = False  # it chooses the job's nodes itself (a scheduler): --nnodes & co do not apply, and
    # the submitting process is none of them
    # How a process this backend started learns its place in the job, from its environment (Slurm: SLURM_NODEID
    # & co); None where this backend did not start it.
    place: Callable[[Mapping[str, str]], Topology | None] | None = None
    executes: str = ""  # whose ranks run elsewhere: the backend that `harness _execute` runs them with there


def run_job(
    executor: Executor, job: Job, on_event: Callable[[JobEvent], None] | None = None,
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


def _emit_output(event: JobEvent) -> None:
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
