"""The ranks held against each other: a value of every rank gathered in rank order, and the end's check that data
parallelism kept its promise of one model."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from harness.errors import ExperimentError
from harness.runtime import sharding
from harness.runtime.fingerprint import fingerprint


def gather(value: str, world_size: int) -> list[str]:
    """`value` of every rank, in rank order (a collective: it waits for all ranks, like a barrier)."""
    if world_size == 1 or not dist.is_initialized():
        return [value]
    every: list[Any] = [None] * world_size
    dist.all_gather_object(every, value)
    return [str(v) for v in every]


def check_equal(target: torch.nn.Module | None, world_size: int, registered: bool) -> str | None:
    """Data parallelism promises one model: ranks whose parameters differ at the end trained apart (`registered`: the
    target is a model given to ctx.ddp or ctx.register). A sharded model's sharded parameters differ by design: only
    its replicated ones are held alike, and the fingerprint of the whole (every rank's, combined) is returned; None
    for a model every rank holds whole."""
    sharded = sharding.holds_sharded(target)
    if not sharded and (world_size == 1 or not dist.is_initialized()):
        return None
    # Parameters only: buffers such as BatchNorm statistics may legitimately differ between DDP ranks.
    mine = _replicated_fingerprint(target) if target is not None else None
    if sharded:
        assert target is not None
        every, whole = _gather_pairs(mine, fingerprint(target), world_size)
    else:
        every, whole = [None] * world_size, None
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
            f"the ranks ended with different {'replicated ' if sharded else ''}parameters ({shown}): their gradients "
            f"were not synchronised. {what}"
        )
    return whole


def _replicated_fingerprint(module: torch.nn.Module) -> str:
    """sha256 of the parameters every rank holds whole (all of them unless the model is sharded)."""
    sharded = sharding.sharded_parameters(module)
    if not sharded:
        return fingerprint(module, buffers=False)
    kept = torch.nn.ParameterDict({n.replace(".", "/"): p for n, p in module.named_parameters() if n not in sharded})
    return fingerprint(kept, buffers=False)


def _gather_pairs(replica: str | None, sha: str, world_size: int) -> tuple[list[Any], str]:
    """Every rank's replica digest, and the fingerprint of the whole (each rank's, combined in rank order)."""
    pairs: list[Any] = [(replica, sha)]
    if world_size > 1 and dist.is_initialized():
        pairs = [None] * world_size
        dist.all_gather_object(pairs, (replica, sha))
    return [p[0] for p in pairs], sharding.combine([p[1] for p in pairs])
