"""Start one process per rank with torch.multiprocessing.spawn and supervise them to the end."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import sys
import threading
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

from harness.errors import Interrupted, RunFailed, HarnessError

MASTER_ADDR = "127.0.0.1"
_GRACE_S = 5.0  # how long ranks get to exit after SIGTERM before SIGKILL


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
    checkpoints: Any = None  # context.CheckpointPlan | None
    invariant_shards: int = 0  # > 0: world-size-invariant mode with this many shards
    # Audit: run the entry once per plan in the same ranks (start-up is paid once, not per segment).
    segments: list[Any] = field(default_factory=list)


def resolve_device(device: str, backend: str, world_size: int) -> tuple[str, str]:
    """auto -> concrete device and backend; refuse what this machine cannot run."""
    cuda = torch.cuda.is_available()
    if device == "auto":
        device = "cuda" if cuda else "cpu"
    if device == "cuda":
        if not cuda:
            raise HarnessError("device cuda requested but no GPU is visible here. Set device=cpu (or auto).")
        if torch.cuda.device_count() < world_size:
            raise HarnessError(
                f"world_size {world_size} needs {world_size} GPUs, {torch.cuda.device_count()} visible. "
                "Lower world_size or set device=cpu."
            )
    if backend == "auto":
        backend = "nccl" if device == "cuda" else "gloo"
    if backend == "nccl" and device != "cuda":
        raise HarnessError("backend nccl needs device cuda. Use backend gloo on cpu.")
    return device, backend


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((MASTER_ADDR, 0))
        return sock.getsockname()[1]


def rank_env(spec: LaunchSpec, rank: int) -> dict[str, str]:
    """The env:// rendezvous variables and the per-rank thread settings."""
    env = {
        "MASTER_ADDR": MASTER_ADDR,
        "MASTER_PORT": str(spec.port),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(spec.world_size),
        "OMP_NUM_THREADS": str(spec.threads_per_rank),
    }
    if spec.backend == "gloo":
        env.setdefault("GLOO_SOCKET_IFNAME", os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
    env.update(spec.env)
    return env


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


def _worker(rank: int, spec: LaunchSpec, channel: Any) -> None:
    """One rank: rendezvous, seeds, determinism, then the experiment's entry function."""
    _die_with_parent()
    # Ctrl-C reaches every process in the terminal's group; the launcher alone decides what stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _redirect_output(Path(spec.log_dir) / f"rank{rank}.log")
    if rank != 0 and channel is not None:
        channel.close()
        channel = None
    os.environ.update(rank_env(spec, rank))

    import torch.distributed as dist
    from omegaconf import OmegaConf

    from harness.config import Level, load_module_function
    from harness.context import MSG_DETERMINISM, MSG_SEGMENT_START, Context, StopSegment
    from harness.determinism import seed_everything, set_determinism
    from harness.provenance import env_vars

    try:
        torch.set_num_threads(spec.threads_per_rank)
        with contextlib.suppress(RuntimeError):  # only settable before the first parallel op
            torch.set_num_interop_threads(1)
        settings = set_determinism(Level(spec.determinism))
        settings["world_size_invariant"] = str(spec.invariant_shards > 0)
        settings["shards"] = str(spec.invariant_shards or "none")
        seed_everything(spec.rank_seeds[rank])
        if spec.device == "cuda":
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
        else:
            device = torch.device("cpu")
        dist.init_process_group(spec.backend, rank=rank, world_size=spec.world_size, init_method="env://")
        os.chdir(spec.code_dir)
        sys.path.insert(0, spec.code_dir)  # the entry may import its sibling modules
        fn = load_module_function(Path(spec.code_dir) / spec.entry_file, spec.entry_func)

        def make_context(plan: Any) -> Context:
            return Context(
                rank=rank,
                world_size=spec.world_size,
                local_rank=rank,
                device=device,
                cfg=OmegaConf.create(spec.train_cfg),
                seed=spec.seed,
                rank_seed=spec.rank_seeds[rank],
                fingerprint_every=spec.fingerprint_every,
                channel=channel,
                checkpoints=plan,
                invariant_shards=spec.invariant_shards,
            )

        if channel is not None:
            channel.send((MSG_DETERMINISM, settings, env_vars()))
        for index, plan in enumerate(spec.segments or [spec.checkpoints]):
            ctx = make_context(plan)
            if spec.segments:
                ctx._send((MSG_SEGMENT_START, index))
            try:
                fn(ctx)
                ctx._finish()
            except StopSegment:  # an audit segment ended: every rank stops at the same step
                pass
        dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()  # into the rank's log; spawn also hands it to the launcher
        raise
    finally:
        if channel is not None:
            channel.close()


class _Terminate(BaseException):
    """Raised in the launcher's main thread by the SIGTERM handler."""


def _read_channel(conn: Any, on_message: Callable[[tuple], None]) -> None:
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return  # rank 0 closed its end or died
        try:
            on_message(message)
        except Exception:  # a sink error must not stop draining rank 0's messages
            traceback.print_exc()


_RAISED = re.compile(r"-- Process (\d+) terminated with the following error:\n", re.M)


def launch(spec: LaunchSpec, on_message: Callable[[tuple], None]) -> None:
    """Run all ranks to completion. Raises RunFailed (a rank failed) or Interrupted (SIGINT/SIGTERM).

    `on_message` is called from a background thread with every message rank 0 sends.
    """
    if spec.port == 0:
        spec.port = free_port()
    Path(spec.log_dir).mkdir(parents=True, exist_ok=True)
    spawn_ctx = mp.get_context("spawn")
    reader, writer = spawn_ctx.Pipe(duplex=False)

    def on_term(signum: int, frame: Any) -> None:
        raise _Terminate()

    previous = signal.signal(signal.SIGTERM, on_term) if threading.current_thread() is threading.main_thread() else None
    procs: Any = None
    drain: threading.Thread | None = None
    try:
        procs = mp.spawn(_worker, args=(spec, writer), nprocs=spec.world_size, join=False, start_method="spawn")
        writer.close()  # the ranks hold the only write ends now: EOF once they are gone
        drain = threading.Thread(target=_read_channel, args=(reader, on_message), name="harness-channel", daemon=True)
        drain.start()
        try:
            while not procs.join(timeout=0.5, grace_period=_GRACE_S):
                pass
        except mp.ProcessRaisedException as err:
            message = str(err)
            match = _RAISED.search(message)
            tb = message[match.end():] if match else message
            raise RunFailed(f"rank {err.error_index} raised: {_last_line(tb)}", ) from _RankError(err.error_index, tb)
        except mp.ProcessExitedException as err:
            how = f"was killed by {err.signal_name}" if err.signal_name else f"exited with code {err.exit_code}"
            raise RunFailed(f"rank {err.error_index} {how}") from _RankError(err.error_index, str(err))
    except KeyboardInterrupt:
        raise Interrupted(signal.SIGINT) from None
    except _Terminate:
        raise Interrupted(signal.SIGTERM) from None
    finally:
        if procs is not None:
            _stop_all(procs.processes)
        with contextlib.suppress(Exception):
            writer.close()
        if drain is not None:
            drain.join(timeout=10)
        reader.close()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


class _RankError(Exception):
    """Carries the failing rank and its traceback from launch() to whoever records the failure."""

    def __init__(self, rank: int, traceback_text: str) -> None:
        super().__init__(traceback_text)
        self.rank = rank
        self.traceback_text = traceback_text


def failure_details(err: BaseException) -> tuple[int | None, str]:
    cause = err.__cause__
    if isinstance(cause, _RankError):
        return cause.rank, cause.traceback_text
    return None, "".join(traceback.format_exception(err))


def _last_line(text: str) -> str:
    lines = [l for l in text.strip().splitlines() if l.strip()]
    return lines[-1].strip() if lines else "unknown error"


def _stop_all(processes: list[Any]) -> None:
    """SIGTERM, a grace period, then SIGKILL: no rank outlives its launcher."""
    alive = [p for p in processes if p.is_alive()]
    for p in alive:
        with contextlib.suppress(Exception):
            p.terminate()
    for p in alive:
        p.join(timeout=_GRACE_S)
    for p in alive:
        if p.is_alive():
            with contextlib.suppress(Exception):
                p.kill()
            p.join(timeout=_GRACE_S)
