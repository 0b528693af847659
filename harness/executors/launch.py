"""Start one process per rank (executors/procs.py: the launcher never imports torch) and supervise them to the end."""

from __future__ import annotations

import contextlib
import datetime
import functools
import gc
import inspect
import json
import os
import re
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import harness
from harness import scratch
from harness.config import Level, load_module_function
from harness.errors import ExperimentError, HarnessError, Interrupted, RunFailed
from harness.executors import procs
from harness.messages import Determinism, Message, RankFacts
from harness.record.provenance import device_facts, env_vars, nccl_conf
from harness.runtime import perturb, usermlflow, userseed
from harness.runtime.refusals import refusal_line, refused_op

if TYPE_CHECKING:  # torch loads only in the processes that run ranks
    import torch

    from harness.runtime.plan import CheckpointPlan, ProfilePlan

MASTER_ADDR = "127.0.0.1"
RANKS_PREFIX = "ranks/"  # the ranks' keys in the job's store; the launchers' own keys live beside them
_GRACE_S = 5.0  # how long ranks get to exit after SIGTERM before SIGKILL
# The process group's own timeout is timeout_s plus this margin, so that the launcher's progress check,
# which can name the silent rank, fires before a waiting rank's collective gives up with a peer error.
_PG_MARGIN_S = 30.0
_STACK_WAIT_S = 1.0  # how long a rank gets to write its stacks when the job is stopped for no progress
# Signals that come from outside a rank (the OOM killer's SIGKILL, a user's kill), unlike a fault of its own code
# (SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL): a rank they killed says nothing of what the code does.
_FROM_OUTSIDE = frozenset({"SIGKILL", "SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT"})
_SIGNAL_WAIT_S = 2.0  # a rank killed by SIGTERM: how long to wait for the launcher's own signal
# Errors a rank raises only because a peer died or hung: they are consequences, never the cause. An NCCL error
# is one only where it says so (ncclRemoteError's "remote process exited", a connection the peer closed, a
# communicator aborted on another rank): "ProcessGroupNCCL" names the layer, not who failed, and a rank's own
# ncclInternalError, invalid usage or watchdog timeout is the cause of its job's failure.
_PEER_ERROR = re.compile(
    r"Connection (closed|reset) by (remote )?peer|Broken pipe|Connection refused|ProcessGroupGloo|"
    r"remote process exited|ncclRemoteError|NCCL communicator was aborted|Socket Timeout|Timed out waiting|"
    r"recvBytes|sendBytes|DistNetworkError",
    re.I,
)
# "NCCL communicator was aborted on rank N": on another rank, a consequence; on this one, its own abort, which the
# rest of the message (torch adds "Original reason for failure was: ...") judges.
_ABORTED_ON = re.compile(r"NCCL communicator was aborted on rank (\d+)", re.I)


@dataclass
class LaunchSpec:
    """Everything a rank needs, as plain values (it is pickled into each spawned process)."""

    code_dir: str  # the experiment folder: entry file lives here, ranks run with it as cwd
    entry_file: str
    entry_func: str
    world_size: int
    device: str  # effective: cpu | cuda
    backend: str  # effective: gloo | nccl
    seed: int
    rank_seeds: list[int]
    threads_per_rank: int
    determinism: str
    fingerprint_every: int
    train_cfg: dict[str, Any]
    log_dir: str
    port: int = 0
    env: dict[str, str] = field(default_factory=dict)
    checkpoints: CheckpointPlan | None = None
    invariant_shards: int = 0  # > 0: world-size-invariant mode with this many shards
    timeout_s: float = 1800.0  # no progress from a rank for this long ends the job (its teardown included)
    launcher: str = "forkserver"  # how this node's ranks start: procs.Method
    output_dir: str = ""  # ctx.output_dir: files there become the run's artifacts
    data: dict[str, str] = field(default_factory=dict)  # ctx.data: declared name -> absolute path
    profile: ProfilePlan | None = None  # step times and torch.profiler (experiment.yaml's profile:)
    run_id: str = ""  # ctx.run_id: the MLflow run this job records ("" for a re-execution: audit, trace)
    # Audit: run the entry once per plan in the same ranks (start-up is paid once, not per segment).
    segments: list[Any] = field(default_factory=list)
    # Topology: this launcher spawns `nproc` ranks (0: all of world_size), global ranks from
    # node_rank * nproc. Every rank meets the others through the TCPStore at master_addr:port, which
    # this launcher hosts on a single node, and node 0's launcher hosts across nodes.
    node_rank: int = 0
    nproc: int = 0
    master_addr: str = MASTER_ADDR

    @property
    def local_ranks(self) -> int:
        return self.nproc or self.world_size

    def global_rank(self, local_rank: int) -> int:
        return self.node_rank * self.local_ranks + local_rank


def no_gpu_here() -> bool:
    """No GPU driver on this machine (no NVIDIA or ROCm device node), so torch can see no GPU: a cpu job is
    checked without importing torch (a second or more before anything can be said)."""
    return not any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd"))


def resolve_device(device: str, backend: str, world_size: int) -> tuple[str, str]:
    """auto -> concrete device and backend; refuse what this machine cannot run."""
    if no_gpu_here():  # torch could see none either: answered without importing it (seconds of a core)
        cuda, count = False, 0
    else:
        import torch

        cuda = torch.cuda.is_available()
        count = torch.cuda.device_count() if cuda else 0
    if device == "auto":
        device = "cuda" if cuda else "cpu"
    if device == "cuda":
        if not cuda:
            raise HarnessError("device cuda requested but no GPU is visible here. Set device=cpu (or auto).")
        if count < world_size:
            raise HarnessError(
                f"world_size {world_size} needs {world_size} GPUs, {count} visible. Lower world_size or set device=cpu."
            )
    if backend == "auto":
        backend = "nccl" if device == "cuda" else "gloo"
    if backend == "nccl" and device != "cuda":
        raise HarnessError("backend nccl needs device cuda. Use backend gloo on cpu.")
    return device, backend


def capacity_warning(device: str, world_size: int, threads_per_rank: int) -> str | None:
    """More rank threads than CPU cores: the job still runs and results do not change, only its speed."""
    if device != "cpu":
        return None
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    threads = world_size * threads_per_rank
    if threads <= cores:
        return None
    return (
        f"world_size {world_size} x threads_per_rank {threads_per_rank} = {threads} threads on {cores} CPU "
        f"core{'s' if cores != 1 else ''}: the ranks will share cores (results are unaffected, speed is not)."
    )


def rank_env(spec: LaunchSpec, local_rank: int) -> dict[str, str]:
    """The standard rendezvous variables (user code may read them) and the per-rank thread settings."""
    env = {
        "MASTER_ADDR": spec.master_addr,
        "MASTER_PORT": str(spec.port),
        "RANK": str(spec.global_rank(local_rank)),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(spec.world_size),
        "LOCAL_WORLD_SIZE": str(spec.local_ranks),
        "OMP_NUM_THREADS": str(spec.threads_per_rank),
    }
    if spec.backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ:
        # gloo binds to the address the hostname resolves to unless told: on one node the loopback,
        # across nodes the interface that reaches the master.
        env["GLOO_SOCKET_IFNAME"] = "lo" if spec.master_addr == MASTER_ADDR else interface_to(spec.master_addr)
    env.update(spec.env)
    return env


def interface_to(host: str) -> str:
    """The name of this host's network interface that routes to `host` (no packet is sent)."""
    import psutil

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((host, 9))
            address = sock.getsockname()[0]
        except OSError as err:
            raise HarnessError(f"no route from this host to the master {host}: {err}. Check --master-addr.") from err
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == address for a in addrs):
            return name
    raise HarnessError(
        f"no interface of this host holds {address}, the address that reaches {host}. "
        "Set GLOO_SOCKET_IFNAME to the interface the nodes talk over."
    )


def _die_with_parent() -> None:
    # If the launcher is SIGKILLed it cannot clean up; the kernel then ends the ranks for it.
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _redirect_output(path: Path) -> None:
    # fd-level, so C++ warnings (gloo, NCCL) and tracebacks land in the rank's log too.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)


def _worker(local_rank: int, start: _Start, inboxes: list[Any], channel: Any, progress: Any) -> None:
    """One spawned rank: tied to its launcher, output to its log file, stacks on demand; its heavy imports
    while the launcher records the run; then, once its spec arrives, the rank's body."""
    parent = os.getppid()  # the launcher, or the rank server this rank was forked from (which dies with it)
    _die_with_parent()
    if os.getppid() != parent or (start.launcher_pid and not scratch.alive(start.launcher_pid)):
        # The launcher (or the server) died while this process was still starting, before the death signal was
        # armed: the kernel will not send it now, so nothing would end this rank.
        os._exit(1)
    rank = start.node_rank * start.nproc + local_rank
    # Ctrl-C reaches every process in the terminal's group; the launcher alone decides what stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _redirect_output(Path(start.log_dir) / f"rank{rank}.log")
    _beat(progress, local_rank, -1)
    import faulthandler

    # The launcher asks a silent rank where it is stuck: every thread's stack, into a file of its own
    # (not the log, which the terminal shows). The file object must live as long as the process.
    global _STACKS
    _STACKS = open(Path(start.log_dir) / f"rank{rank}.stacks.txt", "w")
    faulthandler.register(signal.SIGUSR1, file=_STACKS, all_threads=True)
    inbox = inboxes[local_rank]
    for other in inboxes:
        if other is not inbox:
            other.close()
    _preload()
    if local_rank == 0:
        _write_torch_facts(Path(start.log_dir))
    try:
        spec = inbox.recv()
    except (EOFError, OSError):
        return  # the launcher gave up before the run existed (bad input, store down, Ctrl-C): nothing to run
    finally:
        inbox.close()
    run_rank(spec, local_rank, channel, progress)


_TORCH_FACTS = "torch-facts.json"


def _write_torch_facts(log_dir: Path) -> None:
    """What the record says about torch and the GPUs, measured by this node's first rank while the launcher
    (which never imports torch) records the run; written whole (a rename) so that a reader never sees half."""
    from harness.record.provenance import torch_facts

    tmp = log_dir / f".{_TORCH_FACTS}.tmp"
    with contextlib.suppress(OSError):
        tmp.write_text(json.dumps(torch_facts()))
        tmp.replace(log_dir / _TORCH_FACTS)


def _preload() -> None:
    """What every rank's body imports, loaded while the launcher is still recording the run."""
    # Imported for their side effect (the modules load now), never used by name.
    import torch._dynamo.utils  # DDP's constructor imports it (with inductor: 2-3 s of a core) - now, not after the spec
    import torch.distributed
    import torch.nn.parallel
    import torch.utils.data  # noqa: F401
    from omegaconf import OmegaConf  # noqa: F401

    from harness.runtime import context, determinism  # noqa: F401


@dataclass(frozen=True)
class _Start:
    """What a rank needs before its spec: where its log goes and its place on this node."""

    log_dir: str
    node_rank: int
    nproc: int
    launcher_pid: int = 0  # the process that spawned this rank: if it is gone already, so is the rank


@dataclass
class Ranks:
    """This node's rank processes, started before the run is recorded so that they import torch meanwhile.

    Each waits for its LaunchSpec (launch() sends it); stop() ends them when there will be none.
    """

    log_dir: str
    node_rank: int
    nproc: int
    context: procs.Processes
    inboxes: list[Any]  # the launcher's write end of each rank's spec pipe
    reader: Any  # rank 0's message channel, the launcher's end
    progress: Any  # per local rank: (step, monotonic time of its last progress)

    def torch_facts(self, timeout_s: float = 120.0) -> dict[str, str] | None:
        """The torch and GPU facts this node's first rank measured once torch was imported there; None if it
        ended, or took longer than `timeout_s`, before it said (the caller then measures them itself)."""
        path = Path(self.log_dir) / _TORCH_FACTS
        deadline = time.monotonic() + timeout_s
        started = self.context.started()
        if not started:
            return None
        first = started[0]
        while time.monotonic() < deadline:
            try:
                return dict(json.loads(path.read_text()))
            except (OSError, ValueError):
                pass
            if not first.is_alive():
                return None
            first.join(0.02)
        return None

    def send(self, spec: LaunchSpec) -> None:
        for inbox in self.inboxes:
            with contextlib.suppress(OSError):  # a rank that already died is found by the join that follows
                inbox.send(spec)
            inbox.close()

    def stop(self) -> None:
        """End the ranks (idempotent): no rank outlives a launcher that will not launch them."""
        for inbox in self.inboxes:
            with contextlib.suppress(OSError):
                inbox.close()
        self.context.stop(_GRACE_S)
        with contextlib.suppress(OSError):
            self.reader.close()
        self.context.remove_error_files()


def start_ranks(nproc: int, log_dir: str | Path, node_rank: int = 0,
                method: procs.Method = procs.Method.forkserver) -> Ranks:
    """Start this node's `nproc` ranks now (forked from the warm rank server, or spawned); they load what they need
    and wait for launch() to send their spec."""
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    ctx = procs.SPAWN  # pipes and shared memory are the same for either start method
    reader, writer = ctx.Pipe(duplex=False)
    pipes = [ctx.Pipe(duplex=False) for _ in range(nproc)]
    # Per local rank: the step it is at and when it last made progress (time.monotonic()); then the port of
    # the job's store once the first rank hosts it (0 until then).
    progress = ctx.Array("d", 2 * nproc + 1, lock=False)
    for rank in range(nproc):
        _beat(progress, rank, -1)
    start = _Start(str(log_dir), node_rank, nproc, os.getpid())

    def close_theirs() -> None:
        # Once every rank holds its own copies: the ranks hold the only write end of the channel (EOF once they
        # are gone), and the read ends of their inboxes.
        writer.close()
        for r, _ in pipes:
            r.close()

    try:
        processes = procs.start(_worker, (start, [r for r, _ in pipes], writer, progress), nproc, method,
                                after=close_theirs)
    except BaseException:
        close_theirs()
        for _, w in pipes:
            w.close()
        reader.close()
        raise
    return Ranks(str(log_dir), node_rank, nproc, processes, [w for _, w in pipes], reader, progress)


def run_rank(spec: LaunchSpec, local_rank: int, channel: Any, progress: Any = None, store: Any = None) -> None:
    """The body of one rank, in whatever process it was given (spawned here, or started by torchrun):
    rendezvous, seeds, determinism, then the experiment's entry function.

    `channel` (global rank 0 only; others get None) takes rank 0's messages with send() and close().
    `store` is the job's TCPStore when this process already holds it; otherwise the rank connects
    to spec.master_addr:spec.port as a client, or, for ranks this node's launcher spawned with port 0, the first
    of them hosts it (local_store).
    """
    import torch
    rank = spec.global_rank(local_rank)
    hosts = store is None and not spec.port and progress is not None
    if hosts:
        store = local_store(spec, local_rank, progress)
    if rank != 0 and channel is not None:
        channel.close()
        channel = None
    os.environ.update(rank_env(spec, local_rank))
    run_id = usermlflow.route(os.environ, rank, spec.log_dir, spec.env)
    if run_id:
        usermlflow.keep_run_open(run_id)
    seeds_seen = None
    kept = None

    import torch.distributed as dist
    from omegaconf import OmegaConf

    from harness.runtime.context import Context, StopSegment
    from harness.runtime.determinism import seed_everything, set_determinism, start_watch
    from harness.runtime.groupkeep import keep_default_group

    try:
        torch.set_num_threads(spec.threads_per_rank)
        with contextlib.suppress(RuntimeError):  # only settable before the first parallel op
            torch.set_num_interop_threads(1)
        if spec.checkpoints is not None and spec.checkpoints.perturb_seed is not None:
            # A calibration member: on its share of the machine's other kernels, before the settings are read.
            perturb.use_kernels(spec.checkpoints.perturb_seed)
        settings = set_determinism(Level(spec.determinism))
        start_watch(Level(spec.determinism), settings)  # read back again during training; setters name the user's line
        settings["world_size_invariant"] = str(spec.invariant_shards > 0)
        settings["shards"] = str(spec.invariant_shards or "none")
        seed_everything(spec.rank_seeds[rank])
        if spec.device == "cuda":
            torch.cuda.set_device(local_rank)
            device = torch.device("cuda", local_rank)
        else:
            device = torch.device("cpu")
        timeout = datetime.timedelta(seconds=spec.timeout_s + _PG_MARGIN_S)
        if store is None:  # every rank is a client of the launcher's store (node 0's across nodes): one port per job
            store = dist.TCPStore(spec.master_addr, spec.port, is_master=False, timeout=timeout)
        dist.init_process_group(
            spec.backend, store=dist.PrefixStore(RANKS_PREFIX, store), rank=rank, world_size=spec.world_size,
            timeout=timeout, **device_id(device),
        )
        kept = keep_default_group()  # the training code's destroy_process_group() waits for harness's end
        _beat(progress, local_rank, -1)
        os.chdir(spec.code_dir)
        sys.path.insert(0, spec.code_dir)  # the entry may import its sibling modules
        # After harness's seeding, before the entry's import (which may bind `from torch import manual_seed`).
        seeds_seen = userseed.watch(spec.code_dir)
        fn = _import_entry(spec)
        _beat(progress, local_rank, -1)

        def make_context(plan: Any) -> Context:
            return Context(
                rank=rank,
                world_size=spec.world_size,
                local_rank=local_rank,
                device=device,
                cfg=OmegaConf.create(spec.train_cfg),
                seed=spec.seed,
                rank_seed=spec.rank_seeds[rank],
                fingerprint_every=spec.fingerprint_every,
                channel=channel,
                checkpoints=plan,
                invariant_shards=spec.invariant_shards,
                progress=functools.partial(_beat, progress, local_rank),
                output_dir=spec.output_dir,
                data=spec.data,
                run_id=spec.run_id,
                code_dir=spec.code_dir,
                profile=spec.profile,
            )

        if channel is not None:
            channel.send(Determinism(settings, env_vars()))
            channel.send(RankFacts(device_facts(device), nccl_conf()))
        for index, plan in enumerate(spec.segments or [spec.checkpoints]):
            if index:
                # Each segment starts as a fresh rank does: what train() draws before the checkpoint is loaded
                # (nanoGPT's first batch) must come out as in the process that will resume from it.
                seed_everything(spec.rank_seeds[rank])
            ctx = make_context(plan)
            if spec.segments:
                ctx.announce_segment(index)
            try:
                _train(fn, ctx)
                regroup(spec, rank, store, timeout, device)
                ctx.finish()
            except StopSegment:  # an audit segment (or replay --steps K) ended: every rank stops at the same step
                if not spec.segments:  # replay --steps K: the run itself ends there, and is wrapped up as at an end
                    ctx.finish_stopped()
            finally:
                ctx.close()  # rank 0's buffered metrics reach the launcher, also when fn raised
        _beat(progress, local_rank, _TEARDOWN)  # trained: tearing down, which must end within timeout_s too
        userseed.send_once(seeds_seen, channel.send if channel is not None else None)
        kept.stop()
        # A DDP model in a reference cycle would otherwise be freed by a later collection, after the group below is
        # destroyed: its Reducer then frees the group, joining gloo's threads with the GIL held (groupkeep.py).
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()
        if hosts:
            _leave_store(spec, local_rank, progress)
    except BaseException as err:
        _write_failure(spec, rank, err)
        raise
    finally:
        if kept is not None:
            kept.stop()
        if seeds_seen is not None:
            seeds_seen.stop()  # torchrun runs the body in its launcher's process, which lives on
        if channel is not None:
            channel.close()


def _train(fn: Callable[[Any], Any], ctx: Any) -> None:
    """The experiment's entry function. sys.exit(0) (or sys.exit()) in it ends it as a return does: SystemExit
    unwinds like one, and Python calls that status a success; the rank then finishes as a rank that returned (its
    metrics flushed, its end-of-run checks and final fingerprint). Any other status is raised: the rank failed."""
    try:
        fn(ctx)
    except SystemExit as err:
        if err.code not in (None, 0):
            raise


_DONE = -3.0  # a rank's step in the progress array once it no longer needs the job's store


def local_store(spec: LaunchSpec, local_rank: int, progress: Any) -> Any:
    """The job's store on a single node: the first rank hosts it on a free port (as torch's env:// rendezvous
    has rank 0 do) and publishes the port in the shared progress array; the others wait for it and connect.
    MASTER_PORT, set from spec.port, is then the store's."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=spec.timeout_s + _PG_MARGIN_S)
    slot = 2 * spec.local_ranks
    if local_rank == 0:
        try:
            store = dist.TCPStore(spec.master_addr, 0, is_master=True, wait_for_workers=False, timeout=timeout)
        except Exception as err:  # torch raises DistNetworkError / RuntimeError with a C++ message
            raise HarnessError(f"cannot listen on {spec.master_addr} for the job's rendezvous "
                               f"({_last_line(str(err))}). Check that the loopback interface is up.") from err
        progress[slot] = store.port
    else:
        # The launcher ends every rank if the first one dies before it publishes: this wait needs no deadline of
        # its own beyond the job's.
        deadline = time.monotonic() + timeout.total_seconds()
        while not progress[slot]:
            if time.monotonic() > deadline:
                raise HarnessError(f"rank 0 did not host the job's store within {timeout.total_seconds():g} s. "
                                   "Raise timeout_s if its start-up can take longer.")
            time.sleep(0.005)
        store = dist.TCPStore(spec.master_addr, int(progress[slot]), is_master=False, timeout=timeout)
    spec.port = int(progress[slot])
    return store


def _leave_store(spec: LaunchSpec, local_rank: int, progress: Any) -> None:
    """The rank that hosts the store exits only once every other rank has finished with it (or the margin passed:
    a rank that failed is the launcher's to report)."""
    progress[2 * local_rank] = _DONE
    if local_rank != 0:
        return
    deadline = time.monotonic() + _PG_MARGIN_S
    while time.monotonic() < deadline and any(progress[2 * r] != _DONE for r in range(1, spec.local_ranks)):
        progress[1] = time.monotonic()  # a bounded wait of its own: the others' progress is judged on theirs
        time.sleep(0.005)


_REGROUPS = "regroup-"  # the ranks' keys for a re-created default group: ranks/regroup-<n>/...
_regrouped = 0  # default groups re-created in this process so far


def device_id(device: torch.device) -> dict[str, Any]:
    """init_process_group's `device_id` for a rank on a GPU ({} on the CPU, or where torch lacks it): NCCL then
    binds the communicator to that device and forms it at once, so a bad GPU or NCCL set-up fails at start-up,
    not at the first collective, and the invariant mode's first batch_isend_irecv comes after a formed
    communicator."""
    import torch.distributed as dist

    if device.type != "cuda" or "device_id" not in inspect.signature(dist.init_process_group).parameters:
        return {}
    return {"device_id": device}


def regroup(spec: LaunchSpec, rank: int, store: Any, timeout: datetime.timedelta, device: torch.device) -> None:
    """A default process group for harness's end-of-run collectives (the replica check) when the training code
    destroyed harness's own past the deferring wrapper (harness.runtime.groupkeep), e.g. through a reference to
    torch's function taken before the wrap.

    Every rank re-creates it on the job's store under a prefix no earlier group used (each rank counts alike:
    they all ran the same code), so no key of the destroyed group is read again.
    """
    import torch.distributed as dist

    global _regrouped
    if dist.is_initialized() or spec.world_size == 1:
        return
    _regrouped += 1
    prefix = f"{RANKS_PREFIX}{_REGROUPS}{_regrouped}/"
    dist.init_process_group(
        spec.backend, store=dist.PrefixStore(prefix, store), rank=rank, world_size=spec.world_size, timeout=timeout,
        **device_id(device),
    )


_TEARDOWN = -2  # a rank's step once its training is over: it is tearing down (the process group, the interpreter)


def _beat(progress: Any, rank: int, step: int) -> None:
    """This rank is alive and at `step` (-1: before the first one; _TEARDOWN: its training is over); read by the
    launcher's progress check. A teardown is judged as a step is: a rank stuck in it (a collective a finalizer
    started, a group's destructor) ends the job after timeout_s like a rank stuck in training."""
    if progress is not None:
        progress[2 * rank] = step
        progress[2 * rank + 1] = time.monotonic()  # CLOCK_MONOTONIC is one clock for every process


def _import_entry(spec: LaunchSpec) -> Any:
    """The entry function; an import error becomes one line naming the file and line, not a wall of traceback."""
    path = Path(spec.code_dir) / spec.entry_file
    try:
        fn = load_module_function(path, spec.entry_func)
    except Exception as err:
        where = _user_frame(err, spec.code_dir) or spec.entry_file
        if isinstance(err, SyntaxError) and err.filename:
            where = f"{os.path.relpath(err.filename, spec.code_dir)}, line {err.lineno}"
        raise ExperimentError(f"entry import failed: {type(err).__name__}: {err} ({where})") from err
    if not callable(fn):
        raise ExperimentError(f"entry {spec.entry_file}:{spec.entry_func} is not a function. Fix 'entry' in experiment.yaml.")
    return fn


def _user_frame(err: BaseException, code_dir: str) -> str | None:
    """'train.py, line 12' for the innermost frame of the traceback that lies in the experiment's code."""
    root = os.path.realpath(code_dir) + os.sep
    found = None
    for frame in traceback.extract_tb(err.__traceback__):
        if os.path.realpath(frame.filename).startswith(root):
            found = f"{os.path.relpath(frame.filename, code_dir)}, line {frame.lineno}"
    return found


def _from_user_code(tb: Any) -> Any:
    """The traceback without harness's own outer frames (the rank's set-up): it starts where the user's code does."""
    own = os.path.dirname(os.path.abspath(harness.__file__)) + os.sep  # the whole package, not this layer's folder
    start = tb
    while start is not None and start.tb_frame.f_code.co_filename.startswith(own):
        start = start.tb_next
    return start or tb


def is_peer_error(err: BaseException, rank: int) -> bool:
    """Whether rank `rank` raised `err` only because a peer died, hung or broke the connection (a consequence)."""
    import torch.distributed as dist

    dist_error = getattr(dist, "DistNetworkError", ())
    if isinstance(err, dist_error):
        return True
    text = f"{type(err).__name__}: {err}"
    for own in [m for m in _ABORTED_ON.finditer(text) if int(m.group(1)) == rank][::-1]:
        text = text[: own.start()] + text[own.end() :]
    return bool(_PEER_ERROR.search(text))


def failure_record(spec: LaunchSpec, rank: int, err: BaseException) -> dict[str, Any]:
    """What this rank died of: one line (with the user's file and line), whether that says it all, whether
    it is only a peer's consequence, and the traceback from the user's code on."""
    message = str(err).strip()
    first = message.splitlines()[0] if message else ""
    expected = isinstance(err, HarnessError)
    op = None if expected else refused_op(message)
    if expected:
        line = first
    elif op is not None:  # strict mode's refusal says all there is to say: the op, the line, the way out
        line = refusal_line(op, _user_frame(err, spec.code_dir))
        expected = True
    else:
        where = _user_frame(err, spec.code_dir)
        line = f"{type(err).__name__}: {first}" + (f" ({where})" if where else "")
    return {
        "rank": rank,
        "time": time.time(),
        "line": line,
        "expected": expected,
        "peer": is_peer_error(err, rank),
        "traceback": "".join(traceback.format_exception(type(err), err, _from_user_code(err.__traceback__))),
    }


def rank_failed(record: dict[str, Any]) -> RunFailed:
    """The job's failure for a rank's failure record (see failure_record)."""
    rank, line = record["rank"], record["line"]
    err = RunFailed(f"rank {rank}: {line}" if record["expected"] else f"rank {rank} raised: {line}")
    err.__cause__ = _RankError(rank, record["traceback"], bool(record["expected"]), bool(record["peer"]))
    return err


def _write_failure(spec: LaunchSpec, rank: int, err: BaseException) -> None:
    """What this rank died of, for the launcher to tell cause from consequence; the traceback stays out of the log."""
    record = failure_record(spec, rank, err)
    path = Path(spec.log_dir) / f"rank{rank}.error.json"
    with contextlib.suppress(OSError):
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)  # whole or absent: the launcher may read it while this rank is being stopped


_STACKS: Any = None  # a rank's stack-dump file, kept open for faulthandler


class _Terminate(BaseException):
    """Raised in the launcher's main thread by the SIGTERM handler."""


def _read_channel(conn: Any, on_message: Callable[[Message], None]) -> None:
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return  # rank 0 closed its end or died
        try:
            on_message(message)
        except Exception:  # a sink error must not stop draining rank 0's messages
            traceback.print_exc()


def host_store(addr: str, port: int, timeout_s: float) -> Any:
    """A TCPStore served by this process (port 0: any free one); the job's ranks are its clients."""
    import torch.distributed as dist

    try:
        return dist.TCPStore(
            addr, port, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s),
        )
    except Exception as err:  # torch raises DistNetworkError / RuntimeError with a C++ message
        raise HarnessError(f"cannot listen on {addr}:{port} for the job's rendezvous ({_last_line(str(err))}). "
                           "Choose another --master-port, or check --master-addr is this host's.") from err


def launch(
    spec: LaunchSpec,
    on_message: Callable[[Message], None],
    *,
    store: Any = None,
    cancelled: Callable[[], int | None] | None = None,
    check: Callable[[], None] | None = None,
    ranks: Ranks | None = None,
    on_ranks: Callable[[Ranks], None] | None = None,
) -> None:
    """Run this node's ranks to completion. Raises RunFailed (a rank failed or made no progress) or Interrupted.

    `on_message` is called from a background thread with every message rank 0 sends. `store` is the
    job's rendezvous store when another launcher hosts it (multi-node); otherwise one is hosted here.
    `cancelled` is polled: a signal number stops the ranks (Interrupted). `check` is polled too and
    raises RunFailed when the job failed elsewhere (another node). `ranks`: this node's ranks when
    start_ranks() started them already (they wait for `spec`); otherwise they are started here.
    `on_ranks` is told the ranks once they exist (their progress array shows each one's step).
    """
    own_store = None
    if store is None and spec.port:  # a port of its own on one node: hosted here; port 0: by the first rank
        own_store = host_store(spec.master_addr, spec.port, spec.timeout_s + _PG_MARGIN_S)
    if ranks is not None and (ranks.log_dir != str(spec.log_dir) or ranks.nproc != spec.local_ranks
                              or ranks.node_rank != spec.node_rank):
        ranks.stop()
        raise ValueError("the started ranks do not match the spec (log_dir, nproc, node_rank)")

    def on_term(signum: int, frame: Any) -> None:
        raise _Terminate()

    previous = None
    if cancelled is None and threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, on_term)
    context: procs.Processes | None = None
    drain: threading.Thread | None = None
    try:
        if ranks is None:
            ranks = start_ranks(spec.local_ranks, spec.log_dir, spec.node_rank, procs.Method(spec.launcher))
        context, progress = ranks.context, ranks.progress
        if on_ranks is not None:
            on_ranks(ranks)
        # The ranks' time without progress counts from now: waiting for the record was not theirs.
        for rank in range(spec.local_ranks):
            _beat(progress, rank, -1)
        drain = threading.Thread(target=_read_channel, args=(ranks.reader, on_message), name="harness-channel",
                                 daemon=True)
        drain.start()
        ranks.send(spec)
        try:
            while not context.join(timeout=0.5, grace_period=_GRACE_S):
                signum = cancelled() if cancelled is not None else None
                if signum:
                    raise Interrupted(signum)
                if check is not None:
                    check()
                if _left(context.processes, progress):
                    break  # the others are stopped below: they would only wait for it, or lose their peer
                silent = _silent_ranks(progress, context.processes, spec.timeout_s)
                if silent:
                    raise _stalled(spec, context.processes, progress, silent)
            left = _left(context.processes, progress)
            if left:
                context.stop(_GRACE_S)
                raise _left_failure(spec, progress, left)
        except procs.RankFailed as err:
            signum = _signalled_too(err, cancelled)
            if signum:  # a scheduler signals every process of the job: the ranks died of the launcher's signal
                raise Interrupted(signum) from None
            context.stop(_GRACE_S)  # every rank's error record is final before it is read
            left = _left(context.processes, progress)
            if left:  # the others' failures (a peer's connection reset, a store gone) follow from its leaving
                raise _left_failure(spec, progress, left) from None
            rank, line, text, expected, peer = _diagnose(spec, err)
            killed = (err.signal_name if isinstance(err, procs.RankExited) and err.signal_name in _FROM_OUTSIDE
                      and line.startswith(f"rank {rank} was killed") else None)
            raise RunFailed(line) from _RankError(rank, text, expected, peer, killed)
    except KeyboardInterrupt:
        raise Interrupted(signal.SIGINT) from None
    except _Terminate:
        raise Interrupted(signal.SIGTERM) from None
    finally:
        if context is not None:
            context.stop(_GRACE_S)
        for stacks in Path(spec.log_dir).glob("rank*.stacks.txt"):
            if stacks.stat().st_size == 0:  # nobody asked for this rank's stacks
                stacks.unlink()
        if drain is not None:
            drain.join(timeout=10)
        if ranks is not None:
            ranks.stop()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        del own_store  # the store's server stops with its last reference


def _signalled_too(err: procs.RankFailed, cancelled: Callable[[], int | None] | None) -> int | None:
    """The launcher's own SIGTERM/SIGINT when a rank died of the same signal at about the same time."""
    if cancelled is None:
        return None
    if cancelled():  # already told to stop: a rank still starting up dies of Ctrl-C in any way (abort, exit 1)
        return cancelled()
    if not isinstance(err, procs.RankExited):
        return None
    if err.signal_name not in ("SIGTERM", "SIGINT"):
        return None
    deadline = time.monotonic() + _SIGNAL_WAIT_S
    while time.monotonic() < deadline:
        signum = cancelled()
        if signum:
            return signum
        time.sleep(0.05)
    return None


def _left(processes: list[Any], progress: Any) -> list[int]:
    """This node's ranks whose process ended with status 0 although the rank never said its training was over (its
    progress reached the teardown once `train` returned): os._exit(0), or a library that ends the process. Exit
    status 0 alone says nothing: only a rank that returned has flushed its metrics and joined the end-of-run checks."""
    return [r for r, p in enumerate(processes) if p.exitcode == 0 and progress[2 * r] not in (_TEARDOWN, _DONE)]


def _left_failure(spec: LaunchSpec, progress: Any, left: list[int]) -> RunFailed:
    rank = spec.global_rank(left[0])
    others = [spec.global_rank(r) for r in left[1:]]
    line = (f"rank {rank} left without returning from train: its process ended with status 0 "
            f"{_phase(int(progress[2 * left[0]]))} (os._exit, or code that ends the process)"
            + (f" (rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} too)" if others else "")
            + ", so what it logged since its last flush and its end-of-run checks are lost. End training by returning "
            "from train (sys.exit(0) counts as a return).")
    return failed(line, rank)


def _silent_ranks(progress: Any, processes: list[Any], timeout_s: float) -> list[int]:
    now = time.monotonic()
    return [r for r, p in enumerate(processes) if p.is_alive() and now - progress[2 * r + 1] > timeout_s]


def _stalled(spec: LaunchSpec, processes: list[Any], progress: Any, silent: list[int]) -> RunFailed:
    """Ask the silent ranks for their stacks, then say which ranks stopped where, and in which collective."""
    for rank in silent:
        with contextlib.suppress(OSError, AttributeError):
            os.kill(processes[rank].pid, signal.SIGUSR1)
    time.sleep(_STACK_WAIT_S)
    found = {
        r: stack_location(Path(spec.log_dir) / f"rank{spec.global_rank(r)}.stacks.txt", spec.code_dir) for r in silent
    }
    # A rank stuck in the experiment's own code (a sleep, a loop) is the likely culprit; ranks stuck
    # inside torch are usually waiting for it in a collective. Culprits first.
    order = sorted(silent, key=lambda r: (found[r].kind != "own", progress[2 * r], r))
    parts = []
    for rank in order:
        parts.append(f"rank {spec.global_rank(rank)} {_phase(int(progress[2 * rank]))}{found[rank].describe()}")
    line = (
        f"no progress for {spec.timeout_s:g} s (timeout_s): " + ", ".join(parts)
        + ". Their stacks are in logs/rank<N>.stacks.txt; raise timeout_s if a step can take longer."
    )
    failure = RunFailed(line)
    failure.__cause__ = _RankError(spec.global_rank(order[0]), line, True)
    return failure


def _phase(step: int) -> str:
    if step == _TEARDOWN or step == _DONE:
        return "in its teardown after training"
    return "before its first step" if step < 0 else f"at step {step}"


_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)', re.M)
# torch.distributed's own wrappers (the c10d logger's, a decorator's) around the call that names the collective.
_WRAPPERS = frozenset({"wrapper", "inner", "_wrapper", "decorate_context"})
_DISTRIBUTED = os.sep + os.path.join("torch", "distributed") + os.sep
_AUTOGRAD = os.sep + os.path.join("torch", "autograd") + os.sep
_DDP = os.sep + os.path.join("torch", "nn", "parallel") + os.sep


@dataclass(frozen=True)
class StackLocation:
    """Where a rank's main thread stood when its stacks were dumped."""

    frame: str | None  # "train.py:21 (train)": the experiment's innermost frame, else the innermost one
    kind: str  # own: the stack ends in the experiment's code; call: inside a library it called; other
    collective: str | None  # the torch.distributed call (all_reduce, barrier, ...) the thread waits in, if any

    def describe(self) -> str:
        """' waiting in all_reduce called at train.py:21 (train)', or what of it is known."""
        if self.frame is None:
            return f" waiting in {self.collective}" if self.collective else ""
        if self.kind == "own":
            return f" in {self.frame}"
        if self.collective:
            return f" waiting in {self.collective} called at {self.frame}"
        return f" waiting in a call made at {self.frame}" if self.kind == "call" else f" in {self.frame}"


def _collective(frames: list[re.Match[str]]) -> str | None:
    """The collective a stack (innermost frame first) waits in: torch.distributed's innermost public call, or DDP's
    gradient all-reduce for a thread inside backward() or DDP's forward."""
    for f in frames:
        path = f["file"]
        if _DISTRIBUTED in path and f["func"] not in _WRAPPERS and not f["func"].startswith("_"):
            return str(f["func"])
    for f in frames:
        if _DDP in f["file"]:
            return f"DDP's {f['func'].strip('_')}"
        if _AUTOGRAD in f["file"]:
            return "backward (DDP's gradient all-reduce)"
    return None


def stack_location(path: Path, code_dir: str) -> StackLocation:
    """Where the main thread's dumped stack is, and in which collective it waits (see StackLocation)."""
    try:
        dump = path.read_text(errors="replace")
    except OSError:
        return StackLocation(None, "other", None)
    root = os.path.realpath(code_dir) + os.sep
    # faulthandler prints one block per thread, innermost frame first; the main thread runs _worker.
    for block in re.split(r"\n(?=(?:Current thread|Thread) 0x)", dump):
        frames = list(_FRAME.finditer(block))
        if not any(f["func"] == "_worker" for f in frames):
            continue
        collective = _collective(frames)
        for i, f in enumerate(frames):
            if os.path.realpath(f["file"]).startswith(root):
                where = f"{os.path.relpath(f['file'], code_dir)}:{f['line']} ({f['func']})"
                return StackLocation(where, "own" if i == 0 else "call", collective)
        if frames:
            # Outside the experiment (harness's own teardown, a framework): the innermost frame that is not torch's.
            torch_dir = os.sep + "torch" + os.sep
            f = next((f for f in frames if torch_dir not in f["file"]), frames[0])
            return StackLocation(f"{_short(f['file'])}:{f['line']} ({f['func']})", "other", collective)
    return StackLocation(None, "other", None)


def _short(path: str) -> str:
    """A path under site-packages or harness's own folder from the package's name on (harness/executors/launch.py)."""
    own = os.path.dirname(os.path.dirname(os.path.abspath(harness.__file__))) + os.sep
    if path.startswith(own):
        return path[len(own):]
    marker = os.sep + "site-packages" + os.sep
    return path.split(marker, 1)[1] if marker in path else path


def _diagnose(spec: LaunchSpec, err: procs.RankFailed) -> tuple[int, str, str, bool, bool]:
    """(rank, one line, traceback, whether the line says it all, whether it only lost a peer) of the failure that
    caused the others: a peer's connection error never is."""
    records: list[dict[str, Any]] = []
    for path in sorted(Path(spec.log_dir).glob("rank*.error.json")):
        with contextlib.suppress(OSError, ValueError):
            records.append(json.loads(path.read_text()))
    failing = spec.global_rank(err.error_index)
    root: dict[str, Any]
    if isinstance(err, procs.RankExited) and not any(r["rank"] == failing for r in records):
        how = f"was killed by {err.signal_name}" if err.signal_name else f"exited with code {err.exit_code}"
        root = {"rank": failing, "line": how, "expected": True, "traceback": str(err)}
        line = f"rank {failing} {how}"
    else:
        causes = [r for r in records if not r["peer"]] or records
        if causes:
            first = min(causes, key=lambda r: r["time"])
            # Ranks that failed alike (every rank importing a broken entry) are one cause: name the lowest.
            root = min((r for r in causes if r["line"] == first["line"]), key=lambda r: r["rank"])
        else:  # it died before it could say why: spawn's own report is all there is
            text = err.traceback_text if isinstance(err, procs.RankRaised) else str(err)
            root = {"rank": failing, "line": _last_line(text), "expected": False, "traceback": text}
        line = f"rank {root['rank']}: {root['line']}" if root["expected"] else f"rank {root['rank']} raised: {root['line']}"
    others = [r for r in records if r["rank"] != root["rank"]]
    for words, group in (
        ("failed the same way", [r for r in others if not r["peer"] and r["line"] == root["line"]]),
        ("failed too", [r for r in others if not r["peer"] and r["line"] != root["line"]]),
        ("stopped as a consequence", [r for r in others if r["peer"]]),
    ):
        if group:
            ranks = sorted(r["rank"] for r in group)
            line += f" ({'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))} {words})"
    return root["rank"], line, root["traceback"], bool(root["expected"]), bool(root.get("peer"))


class _RankError(Exception):
    """Carries the failing rank and its traceback from launch() to whoever records the failure."""

    def __init__(self, rank: int | None, traceback_text: str, expected: bool = False, peer: bool = False,
                 signal_name: str | None = None) -> None:
        super().__init__(traceback_text)
        self.signal_name = signal_name  # the failing rank was killed by this signal (none the launcher sent)
        self.rank = rank
        self.traceback_text = traceback_text
        self.expected = expected  # the one line says it all: no traceback for the terminal
        self.peer = peer  # the failing rank only lost a peer: the cause is elsewhere (another node)


def failed(line: str, rank: int | None, cls: type[RunFailed] = RunFailed, traceback_text: str | None = None) -> RunFailed:
    """A failure blamed on `rank` when known; without `traceback_text` its one line says it all."""
    err = cls(line)
    err.__cause__ = _RankError(rank, traceback_text or line, traceback_text is None)
    return err


def is_peer_failure(err: BaseException) -> bool:
    return isinstance(err.__cause__, _RankError) and err.__cause__.peer


def killed_by(err: BaseException) -> str | None:
    """The signal that killed the failing rank (SIGKILL: the OOM killer, a user's kill -9), when that is the failure."""
    cause = err.__cause__
    return cause.signal_name if isinstance(cause, _RankError) else None


def failure_details(err: BaseException) -> tuple[int | None, str, bool]:
    """(failing rank, its traceback, whether the error's one line says it all)."""
    cause = err.__cause__
    if isinstance(cause, _RankError):
        return cause.rank, cause.traceback_text, cause.expected
    return None, "".join(traceback.format_exception(err)), False


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "unknown error"
