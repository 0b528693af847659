"""The training API: what `train(ctx)` receives in every rank."""

from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from harness import checkpoint as ckpt
from harness.fingerprint import fingerprint

# Messages rank 0 sends to the launcher, as tuples whose first item is one of these.
MSG_METRICS = "metrics"  # (MSG_METRICS, step, {key: float}, unix_ms)
MSG_FINGERPRINT = "fingerprint"  # (MSG_FINGERPRINT, step, sha256)
MSG_FINAL = "final"  # (MSG_FINAL, sha256 or None, training steps done)
MSG_DETERMINISM = "determinism"  # (MSG_DETERMINISM, {setting: value}, {ENV_VAR: value}) as in rank 0
MSG_TOTAL = "total"  # (MSG_TOTAL, expected number of steps) for the progress bar
MSG_CHECKPOINT = "checkpoint"  # (MSG_CHECKPOINT, step, sha256 of the weights saved)
MSG_SEGMENT_END = "segment_end"  # (MSG_SEGMENT_END, step, sha256) when an audit segment stops
MSG_SEGMENT_START = "segment_start"  # (MSG_SEGMENT_START, index) before an audit segment runs


@dataclass
class CheckpointPlan:
    """Where and how often ranks checkpoint, and what this launch resumes from or stops at."""

    directory: str
    every: int  # 0: never save (a resume or audit may still load)
    resume_step: int | None = None  # load the checkpoint of this step before the first epoch
    stop_at: int | None = None  # an audit segment ends when this many steps are done


class StopSegment(BaseException):
    """Raised out of the training loop when an audit segment reaches its end (not an error)."""


class _Loader(DataLoader):
    """A DataLoader whose iteration ctx drives: step counting, checkpoints, resume, audit stops."""

    _harness_ctx: "Context | None" = None
    _harness_raw = False

    def __iter__(self):  # type: ignore[override]
        ctx = self._harness_ctx
        if ctx is None or self._harness_raw or ctx._train_loader is not self:
            return super().__iter__()
        return ctx._train_iter(self)


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
        checkpoints: CheckpointPlan | None = None,
        invariant_shards: int = 0,
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
        self._plan = checkpoints
        self._shards = invariant_shards  # > 0: world-size-invariant mode
        self._invariant_step: Any = None
        self._tracked: dict[str, Any] = {}
        self._loaders: list[DataLoader] = []
        self._train_loader: DataLoader | None = None
        self._global_step = 0  # training batches handed out so far (= steps started)
        self._epoch = 0
        self._epoch_start_generator: torch.Tensor | None = None
        self._resume: tuple[ckpt.TrainingPosition, dict] | None = None  # until the first batch after it
        self.step = 0
        """Index of the current training step (0-based): the batch just handed out by the training loader."""

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
        if self._shards:
            # Invariant mode reduces gradients itself (ctx.backward), in one canonical order; DDP's
            # all-reduce would add them in a world-size-dependent order. Start from rank 0's weights, as DDP does.
            from harness.invariant import InvariantStep, broadcast_parameters

            broadcast_parameters(model)
            self._invariant_step = InvariantStep(self._shards, self.world_size, self.rank, self.seed)
            return model
        if self.device.type == "cuda":
            ddp_kwargs.setdefault("device_ids", [self.device.index])
        return DDP(model, **ddp_kwargs)

    def track(self, optimizer: Any = None, *, scheduler: Any = None, scaler: Any = None) -> None:
        """Register what a checkpoint must hold besides the model (optimizer, LR scheduler, GradScaler)."""
        for name, obj in (("optimizer", optimizer), ("scheduler", scheduler), ("scaler", scaler)):
            if obj is not None:
                self._tracked[name] = obj

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
        """A DataLoader over this rank's shard: seeded DistributedSampler, seeded generator, seeded workers.

        In world-size-invariant mode, `batch_size` is the shard size: a training step is
        determinism.shards shards (K/W of them on each rank, the incomplete last global batch dropped),
        validation (shuffle=False) splits the data in whole batches without padding, and every item's
        randomness is keyed by (seed, epoch, sample index).
        """
        if self._shards:
            return self._invariant_loader(dataset, batch_size, shuffle, num_workers, **loader_kwargs)
        sampler = DistributedSampler(
            dataset,
            num_replicas=self.world_size,
            rank=self.rank,
            shuffle=shuffle,
            seed=self.seed,  # same on every rank: the shards must partition one permutation
            drop_last=drop_last,
        )
        self._samplers.append(sampler)
        dl = _Loader(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            num_workers=num_workers,
            drop_last=drop_last,
            **self._loader_common(num_workers, loader_kwargs),
        )
        return self._register(dl, shuffle)

    def _invariant_loader(
        self, dataset: Dataset, batch_size: int, shuffle: bool, num_workers: int, **loader_kwargs: Any
    ) -> DataLoader:
        from harness.invariant import EvalSampler, KeyedDataset, ShardBatchSampler

        keyed = KeyedDataset(dataset, self.seed)
        common = self._loader_common(num_workers, loader_kwargs)
        if shuffle:
            sampler: Any = ShardBatchSampler(
                len(dataset), batch_size, self._shards, self.world_size, self.rank, self.seed  # type: ignore[arg-type]
            )
            dl = _Loader(keyed, batch_sampler=sampler, num_workers=num_workers, **common)
        else:
            sampler = EvalSampler(len(dataset), self.world_size, self.rank, chunk=batch_size)  # type: ignore[arg-type]
            dl = _Loader(keyed, batch_size=batch_size, sampler=sampler, num_workers=num_workers, **common)
        self._samplers.append(sampler)
        return self._register(dl, shuffle)

    def _loader_common(self, num_workers: int, loader_kwargs: dict[str, Any]) -> dict[str, Any]:
        if num_workers > 0 and "fork" in mp.get_all_start_methods():
            # Ranks are spawned, and workers would inherit that: spawning a worker re-imports
            # torch every epoch (seconds); fork is PyTorch's own default on Linux.
            loader_kwargs.setdefault("multiprocessing_context", "fork")
        generator = torch.Generator()
        generator.manual_seed(self.rank_seed)
        return dict(
            generator=generator,
            worker_init_fn=_seed_worker,
            pin_memory=self.device.type == "cuda",
            **loader_kwargs,
        )

    def _register(self, dl: "_Loader", shuffle: bool) -> DataLoader:
        dl._harness_ctx = self
        self._loaders.append(dl)
        if self._train_loader is None and shuffle:
            # The first shuffled loader is the training loader: its batches are the steps.
            self._train_loader = dl
            self._steps_per_epoch = len(dl)
        return dl

    def backward(self, batch: Any, loss_fn: Any) -> torch.Tensor:
        """Gradients of `loss_fn(*batch)` (the mean loss of a batch) in every parameter's .grad; returns the loss.

        Standard mode: loss_fn(*batch).backward() (DDP averages over ranks). World-size-invariant
        mode: the batch is split into this rank's shards, each differentiated with its own
        (seed, step, shard) randomness, and the gradients summed in one canonical order; the
        returned loss is then the global mean, the same on every rank and for every world size.
        """
        if self._invariant_step is not None:
            return self._invariant_step.backward(self._model, batch, loss_fn, self.step)
        args = tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
        loss = loss_fn(*args)
        loss.backward()
        return loss.detach()

    def epochs(self, n: int, steps_per_epoch: int | None = None) -> Iterator[int]:
        """range(n) that calls set_epoch on every sampler made by ctx.loader (reshuffles each epoch)."""
        per_epoch = steps_per_epoch or self._steps_per_epoch
        if per_epoch:
            self._send((MSG_TOTAL, n * per_epoch))
        start = 0
        if self._plan is not None and self._plan.resume_step is not None:
            start = self._load_checkpoint(self._plan.resume_step)
        for epoch in range(start, n):
            for sampler in self._samplers:
                sampler.set_epoch(epoch)
            self._epoch = epoch
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

    def _train_iter(self, loader: "_Loader") -> Iterator[Any]:
        """Hand out the training batches of one epoch; checkpoint before fetching a step's batch."""
        epoch, first = self._epoch, 0
        loader._harness_raw = True  # iter(loader) inside here must be DataLoader's own
        try:
            if self._resume is not None and self._resume[0].epoch == epoch:
                position, rng = self._resume
                iterator = ckpt.resume_iterator(loader, position)  # replays this epoch's first batches
                self._epoch_start_generator = position.epoch_start_generator
                ckpt.set_rng_state(rng)  # after the replay: it drew from the RNGs as the original did
                self._resume, first = None, position.batch_in_epoch
            else:
                self._epoch_start_generator = ckpt.generator_state(loader.generator)
                iterator = iter(loader)
        finally:
            loader._harness_raw = False
        n = len(loader)
        for i in range(first, n):
            step = self._global_step
            # Before the batch is fetched: fetching draws from the RNGs (workers, augmentation).
            self._maybe_checkpoint(epoch, i)
            if self._plan is not None and self._plan.stop_at is not None and step >= self._plan.stop_at:
                self._send((MSG_SEGMENT_END, step, fingerprint(self._model) if self._model is not None else None))
                raise StopSegment()
            try:
                batch = next(iterator)
            except StopIteration:
                return
            self.step = step
            yield batch
            self._global_step += 1

    def _maybe_checkpoint(self, epoch: int, batch_in_epoch: int) -> None:
        plan, step = self._plan, self._global_step
        if plan is None or plan.every <= 0 or step % plan.every or step == plan.resume_step:
            return
        if self._model is None:
            raise RuntimeError("checkpoint_every is set but no model was registered: call ctx.ddp(model).")
        position = ckpt.TrainingPosition(step, epoch, batch_in_epoch, self._epoch_start_generator)
        generators = {str(i): dl.generator for i, dl in enumerate(self._loaders) if dl is not self._train_loader}
        state = ckpt.build(
            model=self._model, position=position, loader_generators=generators,
            extra={"next_fingerprint": self._next_fingerprint}, **self._tracked,
        )
        directory = Path(plan.directory)
        ckpt.save_atomic(state, ckpt.path_for(directory, step, self.rank))
        self.barrier()  # every rank's file is on disk before the step is marked complete
        if self.is_main:
            ckpt.mark_complete(directory, step, self.world_size)
            self._send((MSG_CHECKPOINT, step, state["fingerprint"]))

    def _load_checkpoint(self, step: int) -> int:
        """Restore model, optimizer, ... and the other loaders' generators; returns the epoch to start."""
        assert self._plan is not None and self._model is not None, "resume needs ctx.ddp(model) first"
        state = ckpt.load(ckpt.path_for(Path(self._plan.directory), step, self.rank))
        position = ckpt.restore(state, model=self._model, **self._tracked)
        for i, dl in enumerate(self._loaders):
            key = str(i)
            if dl is not self._train_loader and key in state["loader_generators"]:
                ckpt.set_generator_state(dl.generator, state["loader_generators"][key])
        self._global_step = position.step
        self._next_fingerprint = int(state["extra"]["next_fingerprint"])
        self._resume = (position, state["rng"])
        return position.epoch

    def _finish(self) -> None:
        if self.is_main:
            self._send((MSG_FINAL, fingerprint(self._model) if self._model is not None else None, self._global_step))
