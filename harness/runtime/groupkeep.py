"""The job's default process group belongs to harness: the training code's destroy_process_group() of it - a
torchrun script's last line, accelerator.end_training(), a framework's teardown - is deferred to harness's own
teardown, after the end-of-run checks (the replica check, the data-order digests) that need it.

Why not let it go and re-create one: torch 2.13 deadlocks there, now and then. DDP's Reducer holds the group; a
user's destroy leaves the Reducer its last owner, so the group is destroyed when train() returns and its frame frees
the model - on the main thread, holding the GIL, joining gloo's worker threads. A worker that is at that moment
freeing the last gradient all-reduce needs the GIL too (the work holds the backward's contextvars, a Python object,
in its thread-local state): neither moves, and the rank hangs in train()'s return. Kept by harness, the group
outlives the Reducer, and harness destroys it once no work is left to free.
"""

from __future__ import annotations

import functools
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d


class Kept:
    """The wrapped destroy_process_group of one rank; stop() puts torch's back (torchrun's launcher process lives on)."""

    def __init__(self) -> None:
        self.deferred = False  # the training code destroyed the default group (harness destroys it at its end)
        self._restore: list[tuple[Any, Any]] = []

    def stop(self) -> None:
        for owner, original in reversed(self._restore):
            owner.destroy_process_group = original
        self._restore.clear()


def keep_default_group() -> Kept:
    """Defer the training code's destroy_process_group() of the default group (any other group is destroyed as
    asked). Call after init_process_group, before the entry is imported (so `from torch.distributed import
    destroy_process_group` binds the wrapper)."""
    kept = Kept()
    original = c10d.destroy_process_group

    @functools.wraps(original)
    def destroy_process_group(group: Any = None) -> None:
        if group is None or (dist.is_initialized() and group is c10d._get_default_group()):
            kept.deferred = True
            return
        original(group)

    for owner in (dist, c10d):
        kept._restore.append((owner, owner.destroy_process_group))
        owner.destroy_process_group = destroy_process_group  # type: ignore[attr-defined]
    return kept
