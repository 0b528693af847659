"""The training API: what `train(ctx)` receives in every rank."""

from __future__ import annotations

import multiprocessing as mp
import time
from multiprocessing.connection import Connection
from typing import Any, Iterator, Mapping

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from harness.fingerprint import fingerprint

# Messages rank 0 sends to the launcher, as tuples whose first item is one of these.
MSG_METRICS = "metrics"  # (MSG_METRICS, step, {key: float}, unix_ms)
MSG_FINGERPRINT = "fingerprint"  # (MSG_FINGERPRINT, step, sha256)
MSG_FINAL = "final"  # (MSG_FINAL, sha256 or None)
MSG_DETERMINISM = "determinism"  # (MSG_DETERMINISM, {setting: value}, {ENV_VAR: value}) as in rank 0
MSG_TOTAL = "total"  # (MSG_TOTAL, expected number of steps) for the progress bar


def _seed_worker(worker_id: int) -> None:
    # torch already gives each DataLoader worker seed = loader generator draw + worker_id;
    # numpy and random must follow it or augmentations repeat across workers and epochs.
    import random

    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)


class Context:
    """Rank identity, the experiment's `train:` config, and the few calls that keep a run reproducible."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        local_rank: int,
        device: torch.device,
        cfg: Any,
        seed: int,
        rank_seed: int,
        fingerprint_every: int,
        channel: Connection | None,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.device = device
        self.cfg = cfg
        self.seed = seed
        self.rank_seed = rank_seed
        self._every = fingerprint_every
        self._channel = channel  # only rank 0 holds one
        self._model: torch.nn.Module | None = None
        self._samplers: list[DistributedSampler] = []
        self._steps_per_epoch: int | None = None
        self._next_fingerprint = 0
        self._last_step: int | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def print(self, *args: Any, **kwargs: Any) -> None:
        """print() on rank 0 only."""
        if self.is_main:
            print(*args, **kwargs, flush=True)

    # -- model and data -------------------------------------------------------------------------
    def ddp(self, model: torch.nn.Module, **ddp_kwargs: Any) -> torch.nn.Module:
        """Move `model` to this rank's device, wrap it in DDP, and fingerprint its parameters."""
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = model.to(self.device)
        self._model = model
        if self.device.type == "cuda":
            ddp_kwargs.setdefault("device_ids", [self.device.index])
        return DDP(model, **ddp_kwargs)

    def loader(
        self,
        dataset: Dataset,
        batch_size: int,
        *,
        shuffle: bool = True,
        num_workers: int = 0,
        drop_last: bool = False,
        **loader_kwargs: Any,
    ) -> DataLoader:
        """A DataLoader over this rank's shard: seeded DistributedSampler, seeded generator, seeded workers."""
        sampler = DistributedSampler(
            dataset,
            num_replicas=self.world_size,
            rank=self.rank,
            shuffle=shuffle,
            seed=self.seed,  # same on every rank: the shards must partition one permutation
            drop_last=drop_last,
        )
        self._samplers.append(sampler)
        if num_workers > 0 and "fork" in mp.get_all_start_methods():
            # Ranks are spawned, and workers would inherit that: spawning a worker re-imports
            # torch every epoch (seconds); fork is PyTorch's own default on Linux.
            loader_kwargs.setdefault("multiprocessing_context", "fork")
        generator = torch.Generator()
        generator.manual_seed(self.rank_seed)
        dl = DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            num_workers=num_workers,
            drop_last=drop_last,
            generator=generator,
            worker_init_fn=_seed_worker,
            pin_memory=self.device.type == "cuda",
            **loader_kwargs,
        )
        if self._steps_per_epoch is None and shuffle:
            self._steps_per_epoch = len(dl)
        return dl

    def epochs(self, n: int, steps_per_epoch: int | None = None) -> Iterator[int]:
        """range(n) that calls set_epoch on every sampler made by ctx.loader (reshuffles each epoch)."""
        per_epoch = steps_per_epoch or self._steps_per_epoch
        if per_epoch:
            self._send((MSG_TOTAL, n * per_epoch))
        for epoch in range(n):
            for sampler in self._samplers:
                sampler.set_epoch(epoch)
            yield epoch

    # -- recording ------------------------------------------------------------------------------
    def log(self, metrics: Mapping[str, float | torch.Tensor], step: int) -> None:
        """Record rank 0's values at `step` (other ranks' calls are ignored). Never blocks on MLflow."""
        if not self.is_main:
            return
        values = {k: float(v.item() if isinstance(v, torch.Tensor) else v) for k, v in metrics.items()}
        step = int(step)
        self._last_step = step if self._last_step is None else max(self._last_step, step)
        if self._model is not None and step >= self._next_fingerprint:
            # Taken at the first log() of a step on or past each multiple of fingerprint_every.
            self._send((MSG_FINGERPRINT, step, fingerprint(self._model)))
            self._next_fingerprint = (step // self._every + 1) * self._every
        self._send((MSG_METRICS, step, values, int(time.time() * 1000)))

    def barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    # -- used by the launcher ---------------------------------------------------------------------
    def _send(self, message: tuple) -> None:
        if self._channel is not None:
            self._channel.send(message)

    def _finish(self) -> None:
        if self.is_main:
            self._send((MSG_FINAL, fingerprint(self._model) if self._model is not None else None))
