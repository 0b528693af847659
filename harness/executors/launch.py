"""Start one process per rank (executors/procs.py: the launcher never imports torch) and supervise them to the end.

What runs inside a rank is harness/runtime/rank/ (under the rank's contract: it never reaches the store); how a
failed job is read - which rank caused it, where a silent rank stands - is executors/failures.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import events
from harness.errors import BackendError, ConfigError, HarnessError, Interrupted, RunFailed
from harness.executors import procs, stall, stuck
from harness.executors.failures import FROM_OUTSIDE, RankError, diagnose, failed, phase, stack_location
from harness.messages import Message
from harness.runtime.rank.failure import last_line
from harness.runtime.rank.process import TORCH_FACTS, Start, rank_main
from harness.runtime.rank.progress import DONE, TEARDOWN, beat
from harness.runtime.rank.spec import PG_MARGIN_S, LaunchSpec

_GRACE_S = 5.0  # how long ranks get to exit after SIGTERM before SIGKILL
_STACK_WAIT_S = 1.0  # how long a rank gets to write its stacks when the job is stopped for no progress
_SIGNAL_WAIT_S = 2.0  # a rank killed by SIGTERM: how long to wait for the launcher's own signal


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
            raise ConfigError("device cuda requested but no GPU is visible here. Set device=cpu (or auto).")
        if count < world_size:
            raise ConfigError(
                f"world_size {world_size} needs {world_size} GPUs, {count} visible. Lower world_size or set device=cpu."
            )
    if backend == "auto":
        backend = "nccl" if device == "cuda" else "gloo"
    if backend == "nccl" and device != "cuda":
        raise ConfigError("backend nccl needs device cuda. Use backend gloo on cpu.")
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
        path = Path(self.log_dir) / TORCH_FACTS
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
        beat(progress, rank, -1)
    start = Start(str(log_dir), node_rank, nproc, os.getpid())

    def close_theirs() -> None:
        # Once every rank holds its own copies: the ranks hold the only write end of the channel (EOF once they
        # are gone), and the read ends of their inboxes.
        writer.close()
        for r, _ in pipes:
            r.close()

    try:
        processes = procs.start(rank_main, (start, [r for r, _ in pipes], writer, progress), nproc, method,
                                after=close_theirs)
    except BaseException:
        close_theirs()
        for _, w in pipes:
            w.close()
        reader.close()
        raise
    return Ranks(str(log_dir), node_rank, nproc, processes, [w for _, w in pipes], reader, progress)


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
        raise BackendError(f"cannot listen on {addr}:{port} for the job's rendezvous ({last_line(str(err))}). "
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
        own_store = host_store(spec.master_addr, spec.port, spec.timeout_s + PG_MARGIN_S)
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
        context = ranks.context
        if on_ranks is not None:
            on_ranks(ranks)
        # The ranks' time without progress counts from now: waiting for the record was not theirs.
        for rank in range(spec.local_ranks):
            beat(ranks.progress, rank, -1)
        drain = threading.Thread(target=events.carry(_read_channel), args=(ranks.reader, on_message), name="harness-channel",
                                 daemon=True)
        drain.start()
        ranks.send(spec)
        try:
            _supervise(spec, context, ranks.progress, cancelled, check)
        except procs.RankFailed as err:
            failure, cause = _rank_failure(spec, context, ranks.progress, err, cancelled)
            raise failure from cause
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


def _supervise(spec: LaunchSpec, context: procs.Processes, progress: Any, cancelled: Callable[[], int | None] | None,
               check: Callable[[], None] | None) -> None:
    """Poll this node's ranks until they have all ended: stop them when told (Interrupted), when the job failed
    elsewhere (`check` raises), when one left without returning, or when they make no progress (RunFailed)."""
    watch = stall.StallWatch(spec.local_ranks, spec.stall_s)
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
        try:
            verdict = watch.check(progress, [p.pid for p in context.processes if p.is_alive()])
        except Exception:  # reading /proc must never end a job: the next poll looks again
            verdict = None
        if verdict is not None:
            quiet = _silent_ranks(progress, context.processes, verdict.threshold_s / 2)
            raise _stalled(spec, context.processes, progress, quiet, verdict)
    left = _left(context.processes, progress)
    if left:
        context.stop(_GRACE_S)
        raise _left_failure(spec, progress, left)


def _rank_failure(spec: LaunchSpec, context: procs.Processes, progress: Any, err: procs.RankFailed,
                  cancelled: Callable[[], int | None] | None) -> tuple[HarnessError, RankError | None]:
    """What a rank's failure means for the job, and the cause it is raised from: the launcher's own signal, a rank
    that left (the others' failures follow from it), or the failing rank and its line (RunFailed, from its RankError)."""
    signum = _signalled_too(err, cancelled)
    if signum:  # a scheduler signals every process of the job: the ranks died of the launcher's signal
        return Interrupted(signum), None
    context.stop(_GRACE_S)  # every rank's error record is final before it is read
    left = _left(context.processes, progress)
    if left:  # the others' failures (a peer's connection reset, a store gone) follow from its leaving
        return _left_failure(spec, progress, left), None
    rank, line, text, expected, peer = diagnose(spec, err)
    killed = (err.signal_name if isinstance(err, procs.RankExited) and err.signal_name in FROM_OUTSIDE
              and line.startswith(f"rank {rank} was killed") else None)
    return RunFailed(line), RankError(rank, text, expected, peer, killed)


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
    return [r for r, p in enumerate(processes) if p.exitcode == 0 and progress[2 * r] not in (TEARDOWN, DONE)]


def _left_failure(spec: LaunchSpec, progress: Any, left: list[int]) -> RunFailed:
    rank = spec.global_rank(left[0])
    others = [spec.global_rank(r) for r in left[1:]]
    line = (f"rank {rank} left without returning from train: its process ended with status 0 "
            f"{phase(int(progress[2 * left[0]]))} (os._exit, or code that ends the process)"
            + (f" (rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} too)" if others else "")
            + ", so what it logged since its last flush and its end-of-run checks are lost. End training by returning "
            "from train (sys.exit(0) counts as a return).")
    return failed(line, rank)


def _silent_ranks(progress: Any, processes: list[Any], timeout_s: float) -> list[int]:
    now = time.monotonic()
    return [r for r, p in enumerate(processes) if p.is_alive() and now - progress[2 * r + 1] > timeout_s]


def _stalled(spec: LaunchSpec, processes: list[Any], progress: Any, silent: list[int],
             verdict: stall.Verdict | None = None) -> RunFailed:
    """Ask the silent ranks for their stacks, look at what they started, then say which ranks stopped where, in which
    collective or waiting for which of their processes. `verdict`: the job went idle (executors/stall.py); None: it
    passed timeout_s."""
    for rank in silent:
        with contextlib.suppress(OSError, AttributeError):
            os.kill(processes[rank].pid, signal.SIGUSR1)
    time.sleep(_STACK_WAIT_S)
    found = {}
    for r in silent:
        stacks = Path(spec.log_dir) / f"rank{spec.global_rank(r)}.stacks.txt"
        where = stack_location(stacks, spec.code_dir)
        try:
            on = stuck.look(processes[r].pid, stacks, where.waits, spec.code_dir)
        except Exception:  # a look at processes that may be ending must never cost the failure its line
            on = ""
        found[r] = dataclasses.replace(where, on=on)
    # A rank stuck in the experiment's own code (a sleep, a loop) or waiting for a process it started is the likely
    # culprit; ranks stuck inside torch are usually waiting for it in a collective. Culprits first.
    order = sorted(silent, key=lambda r: (found[r].kind != "own" and not found[r].on, progress[2 * r], r))
    parts = [f"rank {spec.global_rank(r)} {phase(int(progress[2 * r]))}{found[r].describe()}" for r in order]
    if verdict is None:
        line = (f"no progress for {spec.timeout_s:g} s (timeout_s): " + ", ".join(parts)
                + ". Their stacks are in logs/rank<N>.stacks.txt; raise timeout_s if a step can take longer.")
    else:
        slowest = (f"; {stall.STEP_FACTOR:g}x the slowest step ({verdict.slowest_step_s:.2g} s) is less"
                   if verdict.slowest_step_s and verdict.threshold_s == spec.stall_s else
                   f", {stall.STEP_FACTOR:g}x the slowest step" if verdict.slowest_step_s else "")
        line = (f"stalled: no progress for {verdict.silent_s:.0f} s and no process of the job working "
                f"(stall_s {spec.stall_s:g}{slowest}): " + ", ".join(parts)
                + ". Every rank's stacks are in logs/rank<N>.stacks.txt; raise stall_s (0: off) if the job can wait "
                "idle that long.")
    failure = RunFailed(line)
    failure.__cause__ = RankError(spec.global_rank(order[0]), line, True)
    return failure
