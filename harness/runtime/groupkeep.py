"""The job's default process group belongs to harness: the training code's destroy_process_group() of it - a
torchrun script's last line, accelerator.end_training(), a framework's teardown - is deferred to harness's own
teardown, after the end-of-run checks (the replica check, the data-order digests) that need it; its
init_process_group() - a torchrun script's first lines - gets harness's group when it asks for that group (the job's
backend, world size and this rank, wherever its rendezvous), and is refused in one line naming the
fix when it asks for another, which harness's group could not be without the script's noticing.

Why not let it go and re-create one: torch 2.13 deadlocks there, now and then. DDP's Reducer holds the group; a
user's destroy leaves the Reducer its last owner, so the group is destroyed when train() returns and its frame frees
the model - on the main thread, holding the GIL, joining gloo's worker threads. A worker that is at that moment
freeing the last gradient all-reduce needs the GIL too (the work holds the backward's contextvars, a Python object,
in its thread-local state): neither moves, and the rank hangs in train()'s return. Kept by harness, the group
outlives the Reducer, and harness destroys it once no work is left to free.
"""

from __future__ import annotations

import functools
import urllib.parse
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from harness.errors import ExperimentError


class Kept:
    """The wrapped destroy_process_group of one rank; stop() puts torch's back (torchrun's launcher process lives on)."""

    def __init__(self) -> None:
        self.deferred = False  # the training code destroyed the default group (harness destroys it at its end)
        self._restore: list[tuple[Any, Any]] = []

    def stop(self) -> None:
        for owner, original in reversed(self._restore):
            owner.destroy_process_group = original
        self._restore.clear()


def keep_default_group(backend: str, world_size: int, rank: int) -> Kept:
    """Defer the training code's destroy_process_group() of the default group (any other group is destroyed as
    asked), and answer its init_process_group() while the group is up (check_init). Call after init_process_group,
    before the entry is imported (so `from torch.distributed import destroy_process_group` binds the wrappers)."""
    kept = Kept()
    original = c10d.destroy_process_group
    original_init = c10d.init_process_group

    @functools.wraps(original)
    def destroy_process_group(group: Any = None) -> None:
        if group is None or (dist.is_initialized() and group is c10d._get_default_group()):
            kept.deferred = True
            return
        original(group)

    @functools.wraps(original_init)
    def init_process_group(*args: Any, **kwargs: Any) -> None:
        if not dist.is_initialized():  # harness's was destroyed past the wrapper: a group of the code's own
            original_init(*args, **kwargs)
            return
        check_init(backend, world_size, rank, *args, **kwargs)

    for owner in (dist, c10d):
        kept._restore.append((owner, owner.destroy_process_group))
        kept._restore.append((owner, owner.init_process_group))
        owner.destroy_process_group = destroy_process_group  # type: ignore[attr-defined]
        owner.init_process_group = init_process_group  # type: ignore[attr-defined]
    return kept


def check_init(job_backend: str, job_world_size: int, job_rank: int, backend: Any = None, init_method: Any = None,
               timeout: Any = None, world_size: int = -1, rank: int = -1, **_: Any) -> None:
    """The training code's init_process_group() while harness's group is up: a call that asks for that group (no
    backend or the job's, its world size and rank or -1) has it - it is already initialised, which is what the call
    was for. Its rendezvous (init_method's address, a store) is moot: the job's ranks have met already, each as the
    rank the call names; its timeout is the job's (timeout_s). Any other call is refused (ExperimentError): a group on
    another backend or of another size is not the one harness checks and records."""
    asked = str(backend).lower() if backend is not None else job_backend
    fix = ("delete the call (harness initialised the group before train(ctx)), or call it as "
           f'dist.init_process_group("{job_backend}") ')
    if asked != job_backend:
        raise ExperimentError(
            f"init_process_group(backend={str(backend)!r}): the job's process group, already initialised by harness, "
            f"is {job_backend!r}. Fix: {fix}(or set backend: in experiment.yaml).")
    query = urllib.parse.parse_qs(urllib.parse.urlparse(str(init_method or "")).query)
    for name, value in (("world_size", world_size), ("rank", rank)):
        if value == -1 and query.get(name, [""])[0].lstrip("-").isdigit():
            value = int(query[name][0])  # tcp://host:port?rank=R&world_size=N, torch's other way to give them
        job = job_world_size if name == "world_size" else job_rank
        if value in (-1, job):
            continue
        if name == "world_size":
            raise ExperimentError(
                f"init_process_group(world_size={value}): the job has {job_world_size} ranks, in a process group "
                f"harness already initialised. Fix: {fix}or pass world_size=ctx.world_size (set world_size: in "
                "experiment.yaml, or world_size=N on the command line, for another size).")
        raise ExperimentError(
            f"init_process_group(rank={value}) in the job's rank {job_rank}: harness numbers the ranks. Fix: {fix}or "
            "pass rank=ctx.rank (RANK in the environment).")
