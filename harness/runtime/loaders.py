"""The DataLoaders `ctx.loader` makes: this rank's shard of one seeded permutation, seeded workers, and a loader whose
iteration the rank's context drives (step boundaries, checkpoints, resume); an epoch's first batches replayed on resume.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from harness import extensions
from harness.errors import ConfigError, ExperimentError, HarnessError
from harness.runtime.checkpoint import TrainingPosition, set_generator_state


class Loader(DataLoader):
    """A DataLoader whose iteration ctx drives: step counting, checkpoints, resume, audit stops."""

    # The rank's context (harness.runtime.context.Context), set by ctx.loader; Any, since the context imports this.
    _harness_ctx: Any = None
    _harness_raw = False

    def __iter__(self):
        ctx = self._harness_ctx
        if ctx is None or self._harness_raw:
            return super().__iter__()
        if ctx._train_loader is not self:
            return ctx._beating(super().__iter__())
        return ctx._train_iter(self)


def batch_order(loader: DataLoader) -> list[np.ndarray] | None:
    """This epoch's batches as the sampler ctx.loader made hands them out (index arrays), for the data-order
    digests. Iterating that sampler again draws nothing (its permutation is a function of seed and epoch); any
    other sampler might draw from a global RNG, so it is not read (None)."""
    batches: Any = loader.batch_sampler
    if shards_global_batches(batches):
        # World-size-invariant mode: the global batch, which every world size shares, not this rank's part of it.
        batches = batches.global_view()
    elif batches is None or not isinstance(getattr(batches, "sampler", None), DistributedSampler):
        return None
    return [np.asarray(list(b), dtype=np.int64) for b in batches]


def seed_worker(worker_id: int) -> None:
    # torch already gives each DataLoader worker seed = loader generator draw + worker_id;
    # numpy and random must follow it or augmentations repeat across workers and epochs.
    import random

    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)


class Chained:
    """Picklable (DataLoader workers may be spawned): call `first`, then `second`."""

    def __init__(self, first: Callable[[int], None], second: Callable[[int], None]) -> None:
        self.first, self.second = first, second

    def __call__(self, worker_id: int) -> None:
        self.first(worker_id)
        self.second(worker_id)


@dataclass(frozen=True)
class Shard:
    """Which part of the data this rank loads, and with which seeds."""

    world_size: int
    rank: int
    seed: int  # the run's: the same on every rank, so the shards partition one permutation
    rank_seed: int  # this rank's: its loaders' generators
    device: torch.device
    shards: int  # > 0: world-size-invariant mode, a step is this many shards


def make(
    shard: Shard, dataset: Dataset, batch_size: int, *, shuffle: bool, num_workers: int, drop_last: bool,
    **loader_kwargs: Any,
) -> tuple[Loader, Any]:
    """ctx.loader's DataLoader over this rank's shard, and its sampler (whose set_epoch ctx.epochs calls)."""
    if shard.shards:
        return _invariant(shard, dataset, batch_size, shuffle, num_workers, **loader_kwargs)
    sampler: DistributedSampler = DistributedSampler(
        dataset,
        num_replicas=shard.world_size,
        rank=shard.rank,
        shuffle=shuffle,
        seed=shard.seed,  # same on every rank: the shards must partition one permutation
        drop_last=drop_last,
    )
    dl = Loader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=num_workers,
        drop_last=drop_last,
        **_common(shard, num_workers, loader_kwargs),
    )
    return dl, sampler


def _invariant(
    shard: Shard, dataset: Dataset, batch_size: int, shuffle: bool, num_workers: int, **loader_kwargs: Any
) -> tuple[Loader, Any]:
    mode = invariant_mode()
    keyed = mode.KeyedDataset(dataset, shard.seed)
    common = _common(shard, num_workers, loader_kwargs)
    if shuffle:
        sampler: Any = mode.ShardBatchSampler(
            len(dataset), batch_size, shard.shards, shard.world_size, shard.rank, shard.seed  # type: ignore[arg-type]
        )
        dl = Loader(keyed, batch_sampler=sampler, num_workers=num_workers, **common)
        # DataLoader calls a batch sampler's loader.sampler a SequentialSampler; user code that calls
        # loader.sampler.set_epoch(epoch), as with a DistributedSampler, must keep working.
        object.__setattr__(dl, "sampler", sampler)
    else:
        sampler = mode.EvalSampler(len(dataset), shard.world_size, shard.rank, chunk=batch_size)  # type: ignore[arg-type]
        dl = Loader(keyed, batch_size=batch_size, sampler=sampler, num_workers=num_workers, **common)
    return dl, sampler


def invariant_mode() -> Any:
    """World-size-invariant mode's rank-side parts, from the invariant extra (harness/extras/invariant) through the
    registry: the runtime imports no extra."""
    make = extensions.hook(extensions.INVARIANT)
    if make is None:
        raise ConfigError("determinism.world_size_invariant=true: no extra registers world-size-invariant mode here "
                          "(harness.extras.invariant does); reinstall harness, or set it to false.")
    return make()


def shards_global_batches(batches: Any) -> bool:
    """A batch sampler of invariant mode: its global_view() is the global batch every world size shares."""
    return callable(getattr(batches, "global_view", None))


def _common(shard: Shard, num_workers: int, loader_kwargs: dict[str, Any]) -> dict[str, Any]:
    """harness's DataLoader defaults; the caller's keyword arguments win, except those that would undo the sharding."""
    for key in ("sampler", "batch_sampler"):
        if key in loader_kwargs:
            raise ExperimentError(
                f"ctx.loader(..., {key}=...): ctx.loader makes the sampler itself (this rank's shard of one "
                "seeded permutation). Remove it and use shuffle=True/False, or build a DataLoader yourself."
            )
    generator = torch.Generator()
    generator.manual_seed(shard.rank_seed)
    common: dict[str, Any] = {"generator": generator, "worker_init_fn": seed_worker, "pin_memory": shard.device.type == "cuda"}
    if num_workers > 0 and "fork" in mp.get_all_start_methods():
        # Ranks are spawned, and workers would inherit that: spawning a worker re-imports
        # torch every epoch (seconds); fork is PyTorch's own default on Linux.
        common["multiprocessing_context"] = "fork"
    user_init = loader_kwargs.pop("worker_init_fn", None)
    if user_init is not None:
        common["worker_init_fn"] = Chained(seed_worker, user_init)  # seeded first, then the user's own set-up
    common.update(loader_kwargs)
    return common


def resume_iterator(loader: DataLoader, position: TrainingPosition) -> Iterator[Any]:
    """`loader`'s iterator for `position.epoch` with `position.batch_in_epoch` batches already drawn.

    Same sample order and same worker seeds as the original epoch. The sampler's set_epoch must already
    have been called. The skipped batches are really loaded, so that workers' RNGs advance as they did.
    """
    if loader.generator is None:
        raise HarnessError("the DataLoader has no generator, so its epoch cannot be replayed. Give it one.")
    if loader.persistent_workers:
        raise HarnessError(
            "persistent_workers=True seeds workers once per run, not per epoch, so a resumed epoch cannot "
            "reproduce them. Use persistent_workers=False."
        )
    if position.epoch_start_generator is None:
        raise HarnessError("the checkpoint has no epoch-start generator state. Resume from another one.")
    set_generator_state(loader.generator, position.epoch_start_generator)
    iterator = iter(loader)
    for consumed in range(position.batch_in_epoch):
        try:
            next(iterator)
        except StopIteration:
            raise HarnessError(
                f"epoch {position.epoch} has only {consumed} batches but the checkpoint consumed "
                f"{position.batch_in_epoch}. Resume with the data and batch size of the checkpointed run."
            ) from None
    return iterator
