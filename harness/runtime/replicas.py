"""The ranks held against each other: a value of every rank gathered in rank order, and the end's check that data
parallelism kept its promise of one model."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from harness.errors import ExperimentError
from harness.runtime.fingerprint import fingerprint


def gather(value: str, world_size: int) -> list[str]:
    """`value` of every rank, in rank order (a collective: it waits for all ranks, like a barrier)."""
    if world_size == 1 or not dist.is_initialized():
        return [value]
    every: list[Any] = [None] * world_size
    dist.all_gather_object(every, value)
    return [str(v) for v in every]


def check_equal(target: torch.nn.Module | None, world_size: int, registered: bool) -> None:
    """Data parallelism promises one model: ranks whose parameters differ at the end trained apart (`registered`: the
    target is a model given to ctx.ddp or ctx.register)."""
    if world_size == 1 or not dist.is_initialized():
        return
    # Parameters only: buffers such as BatchNorm statistics may legitimately differ between DDP ranks.
    mine = fingerprint(target, buffers=False) if target is not None else None
    every: list[Any] = [None] * world_size
    dist.all_gather_object(every, mine)
    if mine is not None and len(set(every)) > 1:
        groups: dict[str, list[int]] = {}
        for rank, sha in enumerate(every):
            groups.setdefault(str(sha)[:12], []).append(rank)
        shown = "; ".join(
            f"{'rank' if len(ranks) == 1 else 'ranks'} {','.join(map(str, ranks))}: {sha}" for sha, ranks in groups.items()
        )
        what = ("Train the model ctx.ddp returned (not model.module) and call optimizer.step() on every rank."
                if registered else
                "No model was given to ctx.ddp, so nothing synchronised them: wrap it with model = ctx.ddp(model).")
        raise ExperimentError(
            f"the ranks ended with different parameters ({shown}): their gradients were not synchronised. {what}"
        )
