"""A rank's process, from its start to its spec: tied to its launcher, its output in its log file, its stacks on
demand; its heavy imports and rank 0's torch facts while the launcher records the run; then the rank's body
(harness/runtime/rank/body.py). harness/executors/launch.py starts these processes (start_ranks)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import scratch
from harness.runtime.rank import family
from harness.runtime.rank.body import run_rank
from harness.runtime.rank.facts import torch_facts
from harness.runtime.rank.progress import beat


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


def rank_main(local_rank: int, start: Start, inboxes: list[Any], channel: Any, progress: Any) -> None:
    """One spawned rank: tied to its launcher, output to its log file, stacks on demand; its heavy imports
    while the launcher records the run; then, once its spec arrives, the rank's body."""
    parent = os.getppid()  # the launcher, or the rank server this rank was forked from (which dies with it)
    # If the launcher is SIGKILLed it cannot clean up; the kernel then ends the ranks for it.
    family.die_with_parent()
    if os.getppid() != parent or (start.launcher_pid and not scratch.alive(start.launcher_pid)):
        # The launcher (or the server) died while this process was still starting, before the death signal was
        # armed: the kernel will not send it now, so nothing would end this rank.
        os._exit(1)
    rank = start.node_rank * start.nproc + local_rank
    # Ctrl-C reaches every process in the terminal's group; the launcher alone decides what stops. The rank's own
    # group (its DataLoader workers, its subprocesses) is ended by the launcher once the rank is gone.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    family.lead_group()
    _redirect_output(Path(start.log_dir) / f"rank{rank}.log")
    beat(progress, local_rank, -1)
    import faulthandler

    # The launcher asks a silent rank where it is stuck: every thread's stack, into a file of its own
    # (not the log, which the terminal shows). The file object must live as long as the process.
    global _STACKS
    # Appended to: the launcher adds its stuck children's stacks after the rank's own (executors/stall.py).
    _STACKS = open(Path(start.log_dir) / f"rank{rank}.stacks.txt", "a")
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


TORCH_FACTS = "torch-facts.json"


def _write_torch_facts(log_dir: Path) -> None:
    """What the record says about torch and the GPUs, measured by this node's first rank while the launcher
    (which never imports torch) records the run; written whole (a rename) so that a reader never sees half."""
    tmp = log_dir / f".{TORCH_FACTS}.tmp"
    with contextlib.suppress(OSError):
        tmp.write_text(json.dumps(torch_facts()))
        tmp.replace(log_dir / TORCH_FACTS)


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
class Start:
    """What a rank needs before its spec: where its log goes and its place on this node."""

    log_dir: str
    node_rank: int
    nproc: int
    launcher_pid: int = 0  # the process that spawned this rank: if it is gone already, so is the rank


_STACKS: Any = None  # a rank's stack-dump file, kept open for faulthandler

