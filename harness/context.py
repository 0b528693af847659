"""The training API: what `train(ctx)` receives in every rank."""

from __future__ import annotations

import multiprocessing as mp
import numbers
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from harness import checkpoint as ckpt
from harness.errors import ExperimentError
from harness.fingerprint import fingerprint
from harness.outbox import Outbox
from harness.messages import Checkpoint, Final, Fingerprint, Initial, Message, SegmentEnd, SegmentStart, Total

@dataclass
class CheckpointPlan:
    """Where and how often ranks checkpoint, and what this launch resumes from or stops at."""

    directory: str
    every: int  # 0: never save (a resume or audit may still load)
    resume_step: int | None = None  # load the checkpoint of this step before the first epoch
    stop_at: int | None = None  # an audit segment ends when this many steps are done
    # harness trace: an op-level trace (optrace.OpTracer) around this step, on these ranks, written to
    # trace_dir/rank<R>.jsonl.gz when the step ends.
    trace_step: int | None = None
    trace_ranks: tuple[int, ...] = ()
    trace_dir: str = ""


class StopSegment(BaseException):
    """Raised out of the training loop when an audit segment reaches its end (not an error)."""


class _Loader(DataLoader):
    """A DataLoader whose iteration ctx drives: step counting, checkpoints, resume, audit stops."""

    _harness_ctx: "Context | None" = None
    _harness_raw = False

    def __iter__(self):  # type: ignore[override]
        ctx = self._harness_ctx
        if ctx is None or self._harness_raw:
            return super().__iter__()
        if ctx._train_loader is not self:
            return ctx._beating(super().__iter__())
        return ctx._train_iter(self)


def _seed_worker(worker_id: int) -> None:
    # torch already gives each DataLoader worker seed = loader generator draw + worker_id;
    # numpy and random must follow it or augmentations repeat across workers and epochs.
    import random

    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)


class DataPaths(dict):
    """ctx.data: a name that was not declared fails with the names that were, not a bare KeyError."""

    def __missing__(self, name: str) -> Path:
        declared = ", ".join(sorted(self)) or "none"
        raise ExperimentError(
            f"ctx.data[{name!r}]: no data named {name!r} is declared (declared: {declared}). "
            f"Declare it under data: in experiment.yaml (data: {{{name}: PATH}})."
        )


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
        progress: Callable[[int], None] | None = None,
        output_dir: str = "",
        data: dict[str, str] | None = None,
        run_id: str = "",
        code_dir: str = "",
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
        self._outbox = Outbox(channel) if channel is not None else None
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
        self._progress = progress  # tells the launcher this rank is alive, and at which step
        self._in_backward = False  # invariant mode: gradients may reach the model only inside ctx.backward
        self.step = 0
        """Index of the current training step (0-based): the batch just handed out by the training loader."""
        self.output_dir = Path(output_dir) if output_dir else Path.cwd() / "outputs"
        """A folder for files the run produces (checkpoints of your own, samples, plots): they become the
        run's artifacts under outputs/. Write there, not into the experiment folder, which is code."""
        if self.is_main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
        self.data: Mapping[str, Path] = DataPaths({k: Path(v) for k, v in (data or {}).items()})
        """The experiment's declared data (`data:` in experiment.yaml), name -> absolute path, checked by hash."""
        self.run_id = run_id
        """The MLflow run this job records ("" in a re-execution that records none: audit, trace). Rank 0's own
        mlflow.log_metric/log_param/set_tag calls land in it (see README: your own MLflow calls)."""
        # The experiment folder, fixed at start: the training code may os.chdir() away from it.
        self._code_dir = code_dir or str(Path.cwd())

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
            from harness.invariant import InvariantModule, InvariantStep, broadcast_parameters

            broadcast_parameters(model)
            self._invariant_step = InvariantStep(self._shards, self.world_size, self.rank, self.seed)
            self._guard_gradients(model)
            self._send(Initial(fingerprint(model)) if self.is_main else None)
            return InvariantModule(model)
        if self.device.type == "cuda":
            ddp_kwargs.setdefault("device_ids", [self.device.index])
        wrapped = DDP(model, **ddp_kwargs)  # broadcasts rank 0's weights: the initial fingerprint comes after
        self._send(Initial(fingerprint(model)) if self.is_main else None)
        return wrapped

    def _guard_gradients(self, model: torch.nn.Module) -> None:
        """Invariant mode: a gradient that reaches the model outside ctx.backward is never synchronised across
        ranks (there is no DDP to do it), so the ranks would silently train apart. Fail at that step instead."""

        def check(grad: torch.Tensor) -> torch.Tensor:
            if not self._in_backward:
                raise ExperimentError(
                    f"step {self.step}: gradients reached the model outside ctx.backward in world-size-invariant "
                    "mode, where nothing else synchronises them across ranks. Replace loss.backward() with "
                    "loss = ctx.backward(batch, loss_fn) (see README: world-size-invariant mode)."
                )
            return grad

        for param in model.parameters():
            if param.requires_grad:
                param.register_hook(check)

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
            # DataLoader calls a batch sampler's loader.sampler a SequentialSampler; user code that calls
            # loader.sampler.set_epoch(epoch), as with a DistributedSampler, must keep working.
            object.__setattr__(dl, "sampler", sampler)
        else:
            sampler = EvalSampler(len(dataset), self.world_size, self.rank, chunk=batch_size)  # type: ignore[arg-type]
            dl = _Loader(keyed, batch_size=batch_size, sampler=sampler, num_workers=num_workers, **common)
        self._samplers.append(sampler)
        return self._register(dl, shuffle)

    def _loader_common(self, num_workers: int, loader_kwargs: dict[str, Any]) -> dict[str, Any]:
        """harness's DataLoader defaults; the caller's keyword arguments win, except those that would undo the sharding."""
        for key in ("sampler", "batch_sampler"):
            if key in loader_kwargs:
                raise ExperimentError(
                    f"ctx.loader(..., {key}=...): ctx.loader makes the sampler itself (this rank's shard of one "
                    "seeded permutation). Remove it and use shuffle=True/False, or build a DataLoader yourself."
                )
        generator = torch.Generator()
        generator.manual_seed(self.rank_seed)
        common: dict[str, Any] = dict(generator=generator, worker_init_fn=_seed_worker, pin_memory=self.device.type == "cuda")
        if num_workers > 0 and "fork" in mp.get_all_start_methods():
            # Ranks are spawned, and workers would inherit that: spawning a worker re-imports
            # torch every epoch (seconds); fork is PyTorch's own default on Linux.
            common["multiprocessing_context"] = "fork"
        user_init = loader_kwargs.pop("worker_init_fn", None)
        if user_init is not None:
            common["worker_init_fn"] = _Chained(_seed_worker, user_init)  # seeded first, then the user's own set-up
        common.update(loader_kwargs)
        return common

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
            self._in_backward = True
            try:
                return self._invariant_step.backward(self._model, batch, loss_fn, self.step)
            finally:
                self._in_backward = False
        args = tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
        loss = loss_fn(*args)
        loss.backward()
        return loss.detach()

    def epochs(self, n: int, steps_per_epoch: int | None = None) -> Iterator[int]:
        """range(n) that calls set_epoch on every sampler made by ctx.loader (reshuffles each epoch)."""
        per_epoch = steps_per_epoch or self._steps_per_epoch
        if per_epoch:
            self._send(Total(n * per_epoch))
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
        values = {str(k): _number(k, v) for k, v in metrics.items()}
        step = int(step)
        self._last_step = step if self._last_step is None else max(self._last_step, step)
        if self._model is not None and step >= self._next_fingerprint:
            # Taken at the first log() of a step on or past each multiple of fingerprint_every.
            self._send(Fingerprint(step, fingerprint(self._model)))
            self._next_fingerprint = (step // self._every + 1) * self._every
        if self._outbox is not None:
            self._outbox.add(step, values, int(time.time() * 1000))

    def barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    # -- used by the launcher, not by the training code ------------------------------------------
    def announce_segment(self, index: int) -> None:
        """Tell the launcher that audit segment `index` is about to run (rank 0 only). Called by the launcher."""
        if self.is_main:
            self._send(SegmentStart(index))

    def finish(self) -> None:
        """End training: check the ranks hold one model, and send rank 0's final fingerprint and step count.

        Called by the launcher after train(ctx) returns, not by the training code.
        """
        self._check_replicas_equal()
        if self.is_main:
            self._send(Final(fingerprint(self._model) if self._model is not None else None, self._global_step))

    def close(self) -> None:
        """Send every value still buffered and stop the sender thread; also after a failure. Called by the
        launcher once train(ctx) has returned or raised, not by the training code."""
        if self._outbox is not None:
            self._outbox.close()

    def _send(self, message: Message | None) -> None:
        if self._outbox is not None and message is not None:
            self._outbox.send(message)

    def _beat(self, step: int) -> None:
        if self._progress is not None:
            self._progress(step)

    def _beating(self, batches: Iterator[Any]) -> Iterator[Any]:
        """Another loader's batches (validation): each one is progress too."""
        for batch in batches:
            self._beat(self.step)
            yield batch

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
                self._send(self._segment_end(step))
                raise StopSegment()
            try:
                batch = next(iterator)
            except StopIteration:
                return
            self.step = step
            self._beat(step)
            if self._traced(step):
                yield from self._traced_step(batch, step)
            else:
                yield batch
            self._global_step += 1

    def _traced(self, step: int) -> bool:
        plan = self._plan
        return plan is not None and plan.trace_step == step and self.rank in plan.trace_ranks

    def _traced_step(self, batch: Any, step: int) -> Iterator[Any]:
        """Hand out the batch of the traced step inside an OpTracer; the step ends when the next batch is asked
        for (or the loop ends), and the trace goes to its file."""
        from harness import optrace

        assert self._plan is not None
        meta = {"step": step, "rank": self.rank, "world_size": self.world_size, "invariant_shards": self._shards}
        # self._model is the module inside DDP (ctx.ddp keeps it): its submodules' names are the user's.
        tracer = optrace.OpTracer(self._code_dir, model=self._model, meta=meta)
        with tracer:
            yield batch
        path = Path(self._plan.trace_dir) / f"rank{self.rank}.jsonl.gz"
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(optrace.dumps(tracer.result()))
        tmp.replace(path)  # a file that exists is a whole trace

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
        tensors = ckpt.tensor_fingerprints(state, self._model, self._tracked.get("optimizer"))
        # The gather is also the barrier: every rank's file is on disk before the step is marked complete.
        ranks = self._gather(ckpt.replica_sha256(tensors, self._model))
        if self.is_main:
            ckpt.mark_complete(directory, step, self.world_size)
            self._send(Checkpoint(step, state["fingerprint"], tensors, tuple(ranks)))

    def _segment_end(self, step: int) -> SegmentEnd:
        if self._model is None:
            return SegmentEnd(step, None)
        # Per tensor too: a segment that ends elsewhere than the run's checkpoint names the tensors that differ.
        tensors = ckpt.live_tensor_fingerprints(self._model, self._tracked.get("optimizer"))
        return SegmentEnd(step, fingerprint(self._model), tensors)

    def _gather(self, value: str) -> list[str]:
        """`value` of every rank, in rank order (a collective: it waits for all ranks, like a barrier)."""
        if self.world_size == 1 or not dist.is_initialized():
            return [value]
        every: list[Any] = [None] * self.world_size
        dist.all_gather_object(every, value)
        return [str(v) for v in every]

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

    def _check_replicas_equal(self) -> None:
        """Data parallelism promises one model: ranks whose parameters differ at the end trained apart."""
        if self.world_size == 1 or not dist.is_initialized():
            return
        # Parameters only: buffers such as BatchNorm statistics may legitimately differ between DDP ranks.
        mine = fingerprint(self._model, buffers=False) if self._model is not None else None
        every: list[Any] = [None] * self.world_size
        dist.all_gather_object(every, mine)
        if mine is not None and len(set(every)) > 1:
            groups: dict[str, list[int]] = {}
            for rank, sha in enumerate(every):
                groups.setdefault(str(sha)[:12], []).append(rank)
            shown = "; ".join(
                f"{'rank' if len(ranks) == 1 else 'ranks'} {','.join(map(str, ranks))}: {sha}" for sha, ranks in groups.items()
            )
            raise ExperimentError(
                f"the ranks ended with different parameters ({shown}): their gradients were not synchronised. "
                "Train the model ctx.ddp returned (not model.module) and call optimizer.step() on every rank."
            )


def _number(key: Any, value: Any) -> float:
    """A metric value as a float (NaN and +-inf kept); anything else names the key and its type."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ExperimentError(
                f"ctx.log: metric '{key}' is a tensor of shape {tuple(value.shape)}; log one number per key "
                "(e.g. loss.item(), or a 0-d tensor)."
            )
        value = value.item()
    if isinstance(value, np.ndarray) and value.size == 1:
        value = value.item()
    if not isinstance(value, numbers.Real):
        raise ExperimentError(
            f"ctx.log: metric '{key}' is a {type(value).__name__} ({value!r:.40}); log numbers (int, float or a "
            "one-element tensor)."
        )
    return float(value)


class _Chained:
    """Picklable (DataLoader workers may be spawned): call `first`, then `second`."""

    def __init__(self, first: Callable[[int], None], second: Callable[[int], None]) -> None:
        self.first, self.second = first, second

    def __call__(self, worker_id: int) -> None:
        self.first(worker_id)
        self.second(worker_id)
