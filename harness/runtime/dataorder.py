"""Which samples each step trained on: per step, a digest of the sample indices of this rank's batches, and at the end
every rank's joined into one digest per step (the record's data order, which a replay compares)."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch.distributed as dist

from harness.messages import DataOrder


class SampleOrder:
    """This rank's per-step sample-index digests."""

    def __init__(self, world_size: int, rank: int, shards: int) -> None:
        self._world_size, self._is_main, self._shards = world_size, rank == 0, shards
        self._mine: dict[int, Any] = {}  # step -> sha256 over the sample indices of this rank's batches
        # step -> that digest (16 hex digits), for the steps before a resume: carried in the checkpoint resumed from.
        self._before: dict[int, str] = {}

    def add(self, step: int, indices: np.ndarray) -> None:
        self._mine.setdefault(step, hashlib.sha256()).update(indices.tobytes())

    def resumed(self, before: dict[int, str], step: int) -> None:
        """The checkpoint resumed from, at `step`, carried these digests of the steps before it."""
        self._before = {s: digest for s, digest in before.items() if s < step}

    def own(self) -> dict[int, str]:
        """This rank's per-step sample-index digests: the steps before a resume (from its checkpoint), then its own."""
        return {**self._before, **{step: h.hexdigest()[:16] for step, h in self._mine.items()}}

    def gathered(self) -> DataOrder | None:
        """Every rank's per-step sample-index digests, joined per step in rank order (rank 0; a collective)."""
        mine = self.own()
        every: list[Any] = [mine]
        if self._world_size > 1 and dist.is_initialized():
            every = [None] * self._world_size
            dist.all_gather_object(every, mine)
        steps = sorted(set().union(*(e or {} for e in every)))
        if not (self._is_main and steps):
            return None

        # Invariant mode digests the global batch on every rank: the ranks' distinct digests (one when they
        # agree) are joined, so the same samples give the same digest for any world size.
        def joined_at(step: int) -> str:
            digests = [(e or {}).get(step, "-") for e in every]
            return ",".join(sorted(set(digests)) if self._shards else digests)

        joined = (hashlib.sha256(joined_at(s).encode()).hexdigest()[:16] for s in steps)
        return DataOrder(tuple(steps), tuple(joined))
