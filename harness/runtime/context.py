"""The training API: what `train(ctx)` receives in every rank."""

from __future__ import annotations

import hashlib
import itertools
import multiprocessing as mp
import numbers
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from harness.errors import ExperimentError
from harness.messages import (
    Checkpoint,
    DataOrder,
    Evaluation,
    Final,
    Fingerprint,
    Initial,
    Loop,
    Message,
    Notice,
    Performance,
    SegmentEnd,
    SegmentStart,
    Total,
)
from harness.optrace import hooks, tracefile, tracer as optrace
from harness.runtime import boundaries, checkpoint as ckpt, determinism, optimization, perf
from harness.runtime.cfgview import redacted_view
from harness.runtime.fingerprint import fingerprint
from harness.runtime.invariant import (
    EvalSampler,
    InvariantModule,
    InvariantStep,
    KeyedDataset,
    ShardBatchSampler,
    broadcast_parameters,
)
from harness.runtime.outbox import Outbox
from harness.runtime.plan import CheckpointPlan, ProfilePlan
from harness.runtime.steps import StepClock, optimizer_parameters
from harness.tags import EVAL_AT_STEP, OWN_METRIC_PREFIX


class StopSegment(BaseException):
    """Raised out of the training loop when an audit segment reaches its end (not an error)."""


class _Loader(DataLoader):
    """A DataLoader whose iteration ctx drives: step counting, checkpoints, resume, audit stops."""

    _harness_ctx: Context | None = None
    _harness_raw = False

    def __iter__(self):
        ctx = self._harness_ctx
        if ctx is None or self._harness_raw:
            return super().__iter__()
        if ctx._train_loader is not self:
            return ctx._beating(super().__iter__())
        return ctx._train_iter(self)


def _batch_order(loader: DataLoader) -> list[np.ndarray] | None:
    """This epoch's batches as the sampler ctx.loader made hands them out (index arrays), for the data-order
    digests. Iterating that sampler again draws nothing (its permutation is a function of seed and epoch); any
    other sampler might draw from a global RNG, so it is not read (None)."""
    batches: Any = loader.batch_sampler
    if isinstance(batches, ShardBatchSampler):
        # World-size-invariant mode: the global batch, which every world size shares, not this rank's part of it.
        batches = batches.global_view()
    elif batches is None or not isinstance(getattr(batches, "sampler", None), DistributedSampler):
        return None
    return [np.asarray(list(b), dtype=np.int64) for b in batches]


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


# This process's contexts, by token: what a pickled or copied reference to a context comes back as (Context.__reduce__).
_LIVE: weakref.WeakValueDictionary[int, Context] = weakref.WeakValueDictionary()
_TOKENS = itertools.count()


def _live_context(token: int) -> Context:
    """The context a pickled reference names, in the process that made it."""
    ctx = _LIVE.get(token)
    if ctx is None:
        raise ExperimentError(
            "a harness context (ctx) was unpickled outside the rank whose context it is: ctx is a rank's link to its "
            "launcher, not data. Keep ctx out of what is saved or sent to another process (store the values you "
            "need from it, e.g. ctx.rank or ctx.cfg)."
        )
    return ctx


class _StepHook(hooks.ModuleHook):
    """The registered model's forward pre-hook: a training-mode forward with gradients is the next step's work
    beginning. Copies of the model are made without it (hooks.add); the context is held weakly and the module checked
    to be the registered one all the same, since another model's forwards (an EMA copy's) are not this one's steps."""

    def __init__(self, ctx: Context) -> None:
        self._ctx = weakref.ref(ctx)

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        ctx = self._ctx()
        if ctx is not None and module is ctx._model and module.training and torch.is_grad_enabled():
            ctx.clock.begin()


def _counted(index: str) -> str:
    return "training steps" if index == EVAL_AT_STEP else f"{index} indexes"


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
        profile: ProfilePlan | None = None,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.device = device
        self.cfg = redacted_view(cfg)  # print(ctx.cfg) in a rank log shows no secret; ctx.cfg.key is the real value
        self.seed = seed
        self.rank_seed = rank_seed
        self._every = fingerprint_every
        self._channel = channel  # only rank 0 holds one
        self._outbox = Outbox(channel) if channel is not None else None
        self._model: torch.nn.Module | None = None
        self._samplers: list[DistributedSampler] = []
        self._data_order: dict[int, Any] = {}  # step -> sha256 over the sample indices of this rank's batches
        # step -> that digest (16 hex digits), for the steps before a resume: carried in the checkpoint resumed from.
        self._data_order_before: dict[int, str] = {}
        self._steps_per_epoch: int | None = None
        self._next_fingerprint = 0
        self._last_step: int | None = None
        self._plan = checkpoints
        self._shards = invariant_shards  # > 0: world-size-invariant mode
        self._invariant_step: Any = None
        self._tracked: dict[str, Any] = {}
        self._loaders: list[DataLoader] = []
        self._train_loader: DataLoader | None = None
        self._epoch = 0
        self._epoch_start_generator: torch.Tensor | None = None
        self._resume: tuple[ckpt.TrainingPosition, dict] | None = None  # until the first batch after it
        self._resumed = False  # the checkpoint of plan.resume_step is loaded (by ctx.epochs or ctx.steps)
        self._progress = progress  # tells the launcher this rank is alive, and at which step
        self._in_backward = False  # invariant mode: gradients may reach the model only inside ctx.backward
        # What drives the loop, so what a step boundary is: "loader" (the training ctx.loader's fetches),
        # "steps" (ctx.steps() iterations) or None (a loop of the user's own: only optimizer steps are seen).
        self._driver: str | None = None
        # The framework whose loop runs the steps or feeds their batches (boundaries.LIGHTNING, .ACCELERATE), set by
        # its integration: a step boundary missing there has another way out than a loop of the user's own.
        self._framework: str | None = None
        self._loop_sent = False
        self._logged: dict[str, set[int]] = {}  # rank 0: the steps each key was logged at (no silent overwrite)
        # rank 0: what each key's steps count (EVAL_AT_STEP, or an evaluation's index of its own), and which keys
        # training logged and which an evaluation did (the record names the evaluation's: harness.metrics.evaluation)
        self._index_of: dict[str, str] = {}
        self._by_training: set[str] = set()
        self._by_evaluation: set[str] = set()
        self._saved: set[int] = set()  # steps checkpointed by this context
        self._noted: set[str] = set()  # notices already sent
        self._stepped_params: torch.nn.Module | None = None  # the optimizer's parameters, when no model is registered
        self._forward_hook: hooks.Handle | None = None
        self._initial_fingerprint: str | None = None  # rank 0: the registered model's, when it was registered
        self._tracer: optrace.OpTracer | None = None  # of plan.trace_step while it runs
        self._trace_written = False
        # Every step's wall time and loader wait; torch.profiler over the planned steps (profile: in experiment.yaml).
        self._timer = perf.StepTimer(rank, device, profile)
        self.clock = StepClock(self._on_begin, self._on_end, self._beat_now, self._on_optimizer, self._on_first_step)
        # Rank 0 of a recorded job: what trains the model (optimizer, LR schedulers, GradScaler, autocast), the
        # learning rate of every step and the GradScaler's scale.
        self._optimization = optimization.Watch(self._coming_step).start() if self._outbox is not None else None
        self.output_dir = Path(output_dir) if output_dir else Path.cwd() / "outputs"
        """A folder for files the run produces (checkpoints of your own, samples, plots): they become the
        run's artifacts under outputs/. Write there, not into the experiment folder, which is code."""
        if self.is_main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
        self.data: Mapping[str, Path] = DataPaths({k: Path(v) for k, v in (data or {}).items()})
        """The experiment's declared data (`data:` in experiment.yaml), name -> absolute path, checked by hash."""
        self._token = next(_TOKENS)
        _LIVE[self._token] = self
        self.run_id = run_id
        """The MLflow run this job records ("" in a re-execution that records none: audit, trace). Rank 0's own
        mlflow.log_metric/log_param/set_tag calls land in it (see docs/training-api.md: your own calls)."""
        # The experiment folder, fixed at start: the training code may os.chdir() away from it.
        self._code_dir = code_dir or str(Path.cwd())
        if self._traced(0):
            # Step 0 of a loop harness does not drive begins with train() itself; a loader or ctx.steps
            # that turns up restarts the trace at its first batch.
            self._start_trace(0)

    def __reduce__(self) -> tuple[Any, ...]:
        # The context is the rank's link to its launcher (a pipe, a sender thread, shared memory): copying it would
        # make a second sender on one pipe, and a copy that failed halfway closed the rank's descriptors as it was
        # freed. So copy.deepcopy and pickle take it by reference: a model, a config or a Lightning logger that
        # holds ctx copies, and the copy holds this same context.
        return (_live_context, (self._token,))

    @property
    def step(self) -> int:
        """Index of the current training step (0-based): the counted optimizer's steps so far, or the step that
        has just ended until the next one's work begins (so a value logged after optimizer.step() is that step's)."""
        return self.clock.index

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
        self._adopt(model)
        if self._shards:
            # Invariant mode reduces gradients itself (ctx.backward), in one canonical order; DDP's
            # all-reduce would add them in a world-size-dependent order. Start from rank 0's weights, as DDP does.

            broadcast_parameters(model)
            self._invariant_step = InvariantStep(self._shards, self.world_size, self.rank, self.seed)
            self._guard_gradients(model)
            self._send_initial(model)
            return InvariantModule(model)
        if self.device.type == "cuda":
            ddp_kwargs.setdefault("device_ids", [self.device.index])
        wrapped = DDP(model, **ddp_kwargs)  # broadcasts rank 0's weights: the initial fingerprint comes after
        _fix_buckets(wrapped)
        self._send_initial(model)
        return wrapped

    def register(self, model: torch.nn.Module) -> torch.nn.Module:
        """Fingerprint and checkpoint `model` without wrapping it: for code whose framework (Lightning, Fabric,
        Accelerate) or own lines wrap it in DDP. Returns `model` unchanged; a DDP wrapper is looked through, so
        the fingerprints hash the module the user named. Call it once the weights are the ranks' common start
        (after the wrap, or on every rank before a wrap that broadcasts rank 0's)."""
        from torch.nn.parallel import DistributedDataParallel as DDP

        inner = model.module if isinstance(model, DDP) else model
        if not isinstance(inner, torch.nn.Module):
            raise ExperimentError(f"ctx.register: {type(model).__name__} is not a torch.nn.Module; register the model.")
        if inner is self._model:
            return model  # a framework's hook may see the same model again (fit, then validate)
        if self._model is not None:
            raise ExperimentError(
                f"ctx.register: a model ({type(self._model).__name__}) is already registered and harness fingerprints "
                f"one; {type(inner).__name__} is a second. Register the model being trained, once."
            )
        if self.clock.optimizer_steps:
            raise ExperimentError(
                f"ctx.register after {self.clock.optimizer_steps} optimizer steps: the fingerprints start from the "
                "weights before the first update. Register the model before training starts."
            )
        if self._shards:
            raise ExperimentError(
                "ctx.register: world-size-invariant mode reduces the gradients itself, which needs the model from "
                "model = ctx.ddp(model); a framework's own DDP cannot run in it. Set determinism.world_size_invariant=false."
            )
        self._adopt(inner)
        self._send_initial(inner)
        return model

    def _send_initial(self, model: torch.nn.Module) -> None:
        """Rank 0: the registered model's weights before the first update (harness.fingerprint.initial)."""
        if self.is_main:
            self._initial_fingerprint = fingerprint(model)
            self._send(Initial(self._initial_fingerprint))

    def _adopt(self, model: torch.nn.Module) -> None:
        """`model` is the one fingerprinted, checkpointed and traced (ctx.ddp and ctx.register)."""
        self._model = model
        if self._plan is not None and self._plan.perturb_seed is not None:
            # A calibration member (harness calibrate): the weights start one ulp off, before the first fingerprint.
            from harness.runtime.perturb import nudge

            nudge(model, self._plan.perturb_seed)
        # A training forward of the registered model is the next step's work beginning (a loop of its own).
        self._forward_hook = hooks.add(model, _StepHook(self))
        if self._tracer is not None:
            self._tracer.attach(model)

    def _guard_gradients(self, model: torch.nn.Module) -> None:
        """Invariant mode: a gradient that reaches the model outside ctx.backward is never synchronised across
        ranks (there is no DDP to do it), so the ranks would silently train apart. Fail at that step instead."""

        def check(grad: torch.Tensor) -> torch.Tensor:
            if not self._in_backward:
                raise ExperimentError(
                    f"step {self.step}: gradients reached the model outside ctx.backward in world-size-invariant "
                    "mode, where nothing else synchronises them across ranks. Replace loss.backward() with "
                    "loss = ctx.backward(batch, loss_fn) (see docs/world-size-invariant.md)."
                )
            return grad

        for param in model.parameters():
            if param.requires_grad:
                param.register_hook(check)

    def track(self, optimizer: Any = None, scheduler: Any = None, scaler: Any = None) -> None:
        """Register what a checkpoint must hold besides the model (optimizer, LR scheduler, GradScaler), by position
        or by name."""
        from torch.amp import GradScaler
        from torch.optim.lr_scheduler import LRScheduler

        for name, obj, wrong, what in (("scheduler", scheduler, GradScaler, "a GradScaler"),
                                       ("scaler", scaler, LRScheduler, "an LR scheduler")):
            if isinstance(obj, wrong):
                right = "scaler" if name == "scheduler" else "scheduler"
                raise ExperimentError(
                    f"ctx.track: {what} ({type(obj).__name__}) was given as the {name}. Pass it by name: "
                    f"ctx.track(optimizer, {right}={right})."
                )
        for name, obj in (("optimizer", optimizer), ("scheduler", scheduler), ("scaler", scaler)):
            if obj is not None:
                self._tracked[name] = obj
        if optimizer is not None:
            self.clock.track(optimizer)  # its steps are the run's steps

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
        sampler: DistributedSampler = DistributedSampler(
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
        common: dict[str, Any] = {"generator": generator, "worker_init_fn": _seed_worker, "pin_memory": self.device.type == "cuda"}
        if num_workers > 0 and "fork" in mp.get_all_start_methods():
            # Ranks are spawned, and workers would inherit that: spawning a worker re-imports
            # torch every epoch (seconds); fork is PyTorch's own default on Linux.
            common["multiprocessing_context"] = "fork"
        user_init = loader_kwargs.pop("worker_init_fn", None)
        if user_init is not None:
            common["worker_init_fn"] = _Chained(_seed_worker, user_init)  # seeded first, then the user's own set-up
        common.update(loader_kwargs)
        return common

    def _register(self, dl: _Loader, shuffle: bool) -> DataLoader:
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
        """range(n) that calls set_epoch on every sampler made by ctx.loader (reshuffles each epoch); after a
        resume it starts at the checkpoint's epoch."""
        per_epoch = steps_per_epoch or self._steps_per_epoch
        if per_epoch:
            self._send(Total(n * per_epoch))
        start = self._load_resume_checkpoint()
        done_at_start = self.clock.done
        for epoch in range(start, n):
            if epoch == start + 1 and per_epoch and not steps_per_epoch:
                # Batches are not steps when micro-batches accumulate: the first epoch counted the real ones.
                counted = self.clock.done - done_at_start
                if counted and counted != per_epoch:
                    self._send(Total(self.clock.done + (n - epoch) * counted))
            for sampler in self._samplers:
                sampler.set_epoch(epoch)
            self._epoch = epoch
            yield epoch

    def steps(self, n: int) -> Iterator[int]:
        """range(n) over training steps, for a loop that draws its own batches (`for it in ctx.steps(max_iters)`):
        each iteration is one step (a boundary where checkpoints are saved and an audit or trace stops), the
        progress bar knows the total, and after a resume it starts at the checkpoint's step."""
        self._driver = "steps"
        self._send(Total(n))
        start = self._load_resume_checkpoint()
        if self._resume is not None:
            # No loader replays batches here: the RNGs go back to the checkpoint's at once.
            ckpt.set_rng_state(self._resume[1], self.device)
            self._resume = None
        for k in range(start, n):
            self.clock.set(k)
            self._before_step(k, ckpt.TrainingPosition(k, self._epoch, 0, None))
            self.clock.begin(clean=True)
            yield k
        self._end_trace()
        self.clock.done = max(self.clock.done, n)

    # -- recording ------------------------------------------------------------------------------
    def log(self, metrics: Mapping[str, float | torch.Tensor], step: int) -> None:
        """Record rank 0's values at `step` (other ranks' calls are ignored). Never blocks on MLflow.

        A key logged twice at one step fails in one line (a second value would overwrite the first) - except
        at the step that has just ended, before anything else of the next step was seen: a loop that logs at
        the top of its body is logging the next step."""
        if not self.is_main:
            return
        values = {str(k): metric_value(k, v) for k, v in metrics.items()}
        _not_own(values)
        self._logged_by(values, EVAL_AT_STEP, evaluation=False)
        self._log_at_step(values, int(step))

    def _log_evaluation(self, metrics: Mapping[str, float | torch.Tensor], step: int, index: str | None = None) -> None:
        """Rank 0's values logged by an evaluation (a framework's validation or test, not training): at training step
        `step` as ctx.log logs, or, with `index` ("validation batch"), at position `step` of an index of their own -
        the framework's count of evaluation batches, which is no training step. The record names these keys, so that
        a verdict says what their steps are. For the framework integrations (harness.lightning)."""
        if not self.is_main:
            return
        values = {str(k): metric_value(k, v) for k, v in metrics.items()}
        _not_own(values)
        self._logged_by(values, index or EVAL_AT_STEP, evaluation=True)
        if index is None:
            self._log_at_step(values, int(step))
            return
        self._beat_now()
        self._once_per_step(values, int(step), f"{index} {int(step)}")
        if self._outbox is not None:
            self._outbox.add(int(step), values, int(time.time() * 1000))

    def _logged_by(self, keys: Mapping[str, float], index: str, evaluation: bool) -> None:
        """Note what logged `keys` and what their steps count; a key's series holds one kind of step."""
        seen = self._by_evaluation if evaluation else self._by_training
        # Every call after a key's first (a key training logged counts steps: it got past the check below).
        if seen.issuperset(keys) and (not evaluation or all(self._index_of[key] == index for key in keys)):
            return
        before = self._evaluation_keys()
        for key in keys:
            known = self._index_of.setdefault(key, index)
            if known != index:
                raise ExperimentError(
                    f"'{key}' was logged at {_counted(known)}, and now at {_counted(index)}: one series cannot hold "
                    "both. Give one of them its own key."
                )
            (self._by_evaluation if evaluation else self._by_training).add(key)
        after = self._evaluation_keys()
        if after != before:
            self._send(Evaluation(after))

    def _evaluation_keys(self) -> dict[str, str]:
        return {key: self._index_of[key] for key in sorted(self._by_evaluation - self._by_training)}

    def _once_per_step(self, values: Mapping[str, float], step: int, where: str) -> None:
        for key in values:
            seen = self._logged.setdefault(key, set())
            if step in seen:
                raise ExperimentError(self._logged_twice(key, step, where))
            seen.add(step)

    def _log_at_step(self, values: Mapping[str, float], step: int) -> None:
        clock = self.clock
        if clock.pending and step == clock.index and any(step in self._logged.get(k, ()) for k in values):
            step = clock.begin()
        self._beat_now()  # the clock's step, not the one logged at (a counter of the user's may be anything)
        self._once_per_step(values, step, f"step {step}")
        self._last_step = step if self._last_step is None else max(self._last_step, step)
        target = self._fingerprinted()
        if target is not None and step >= self._next_fingerprint:
            # Taken at the first log() of a step on or past each multiple of fingerprint_every.
            self._send(Fingerprint(step, fingerprint(target)))
            self._next_fingerprint = (step // self._every + 1) * self._every
        if self._outbox is not None:
            self._outbox.add(step, values, int(time.time() * 1000))

    def _logged_twice(self, key: str, step: int, where: str) -> str:
        """Why `key` came back at `step` (`where`: "step 3", or an evaluation's index): micro-batches of one step, or
        a loop whose updates no optimizer makes."""
        said = f"ctx.log: '{key}' was already logged at {where}; a second value would overwrite the first."
        micro = ("Log each key once per step (ctx.step counts optimizer steps: micro-batches share one), or give this "
                 "value its own key.")
        if where != f"step {step}" or self.clock.optimizer_steps or self.clock.counted is not None or self._driver == "steps":
            return f"{said} {micro}"
        by_hand = ("ctx.step counts the steps of a torch.optim optimizer (or the iterations of ctx.steps), and an "
                   "update written by hand (p.data.add_(p.grad, alpha=-lr)) is neither, so every value lands at step 0. "
                   "Drive the loop with `for step in ctx.steps(n):`, one iteration per update, or update with an "
                   "optimizer (torch.optim.SGD(model.parameters(), lr=lr)).")
        if self._model is None:
            return f"{said} No optimizer has stepped yet. If the loop updates the weights by hand: {by_hand} Else: {micro}"
        if fingerprint(self._model) == self._initial_fingerprint:
            return f"{said} {micro}"  # the weights are as registered: micro-batches before the first optimizer step
        return f"{said} The weights changed but no optimizer has stepped: {by_hand}"

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
        target = self._wrap_up()
        if self.is_main:
            of = "model" if self._model is not None else "optimizer" if target is not None else None
            self._send(Final(fingerprint(target) if target is not None else None, self.clock.done, of))

    def finish_stopped(self) -> None:
        """replay --steps K stopped every rank where step K would begin (StopSegment, the same step on each): the run
        ends there, so it is checked and reported as at an end - its weights went with the SegmentEnd already.
        Called by the launcher, not by the training code."""
        self._wrap_up()

    def _wrap_up(self) -> torch.nn.Module | None:
        """What every end of training checks and sends: the ranks hold one model, determinism, the data order."""
        self._end_trace()
        target = self._fingerprinted()
        self._check_replicas_equal(target)
        if self._model is None and target is not None:
            self._notice("unregistered", (
                "no model was given to ctx.ddp or ctx.register: the fingerprints hash the parameters the optimizer "
                f"stepped ({len(list(target.parameters()))} tensors; buffers such as BatchNorm statistics are not among "
                "them)" + (", compared across ranks" if self.world_size > 1 else "") + ". Register it with "
                "model = ctx.ddp(model), or, where the script wraps it in DDP itself, ctx.register(model) after its "
                "DDP(...) line."
            ))
        self._send(determinism.observe(self.clock.done, determinism.END))  # determinism read-back: training ends
        self._send_data_order()
        self._send_performance()
        if self._optimization is not None:
            self._send(self._optimization.message())
        return target

    def _own_data_order(self) -> dict[int, str]:
        """This rank's per-step sample-index digests: the steps before a resume (from its checkpoint), then its own."""
        return {**self._data_order_before, **{step: h.hexdigest()[:16] for step, h in self._data_order.items()}}

    def _send_data_order(self) -> None:
        """Every rank's per-step sample-index digests, joined per step in rank order, to rank 0's launcher."""
        mine = self._own_data_order()
        every: list[Any] = [mine]
        if self.world_size > 1 and dist.is_initialized():
            every = [None] * self.world_size
            dist.all_gather_object(every, mine)
        steps = sorted(set().union(*(e or {} for e in every)))
        if self.is_main and steps:
            # Invariant mode digests the global batch on every rank: the ranks' distinct digests (one when they
            # agree) are joined, so the same samples give the same digest for any world size.
            def joined_at(step: int) -> str:
                digests = [(e or {}).get(step, "-") for e in every]
                return ",".join(sorted(set(digests)) if self._shards else digests)

            joined = (hashlib.sha256(joined_at(s).encode()).hexdigest()[:16] for s in steps)
            self._send(DataOrder(tuple(steps), tuple(joined)))

    def _send_performance(self) -> None:
        """Every rank's step times, gathered once (no per-step collective), to rank 0's launcher: rank 0's own, the
        slowest rank's at each step, rank 0's loader wait and samples, and the profiled steps' summaries."""
        timer = self._timer
        times, mine = timer.times, dict(zip(timer.times.steps, timer.times.seconds))
        every: list[Any] = [(mine, timer.profiled)]
        if self.world_size > 1 and dist.is_initialized():
            every = [None] * self.world_size
            dist.all_gather_object(every, (mine, timer.profiled))
        if not self.is_main:
            return
        ranks: list[tuple[dict[int, float], list[dict[str, Any]]]] = [e or ({}, []) for e in every]
        slowest = [max(r[0].get(step, seconds) for r in ranks) for step, seconds in zip(times.steps, times.seconds)]
        profiled = sorted((p for r in ranks for p in r[1]), key=lambda p: (p["step"], p["rank"]))
        missed = sorted(set(timer.plan.steps) - {p["step"] for p in profiled})
        if missed:
            self._notice("profile-missed", (
                f"profile.steps {', '.join(map(str, missed))}: no such step ran to its end (the run did {self.clock.done} "
                f"steps), so {'it was' if len(missed) == 1 else 'they were'} not profiled. Profile steps below "
                f"{self.clock.done}, e.g. profile.steps=[{min(3, max(self.clock.done - 1, 0))}]."))
        if not times.steps and not profiled:
            return
        self._send(Performance(tuple(times.steps), tuple(times.seconds), tuple(slowest), tuple(times.waits),
                               tuple(times.samples), tuple(profiled)))

    def close(self) -> None:
        """Send every value still buffered and stop the sender thread; also after a failure. Called by the
        launcher once train(ctx) has returned or raised, not by the training code."""
        self.clock.close()
        self._timer.close()
        if self._optimization is not None:
            self._optimization.stop()
        if self._forward_hook is not None:
            self._forward_hook.remove()
        if self._tracer is not None:  # an audit stop or a failure inside the traced step: no trace is written
            self._tracer.__exit__(None, None, None)
            self._tracer = None
        if self._outbox is not None:
            self._outbox.close()

    def _send(self, message: Message | None) -> None:
        if self._outbox is not None and message is not None:
            self._outbox.send(message)

    def _notice(self, key: str, text: str) -> None:
        """A one-line warning for the launcher to print and record, once per context."""
        if key not in self._noted:
            self._noted.add(key)
            self._send(Notice(key, text) if self.is_main else None)

    def _beat(self, step: int) -> None:
        if self._progress is not None:
            self._progress(step)

    def _beat_now(self) -> None:
        self._beat(self.clock.index)

    def _beating(self, batches: Iterator[Any]) -> Iterator[Any]:
        """Another loader's batches (validation): each one is progress too."""
        for batch in batches:
            self._beat(self.step)
            yield batch

    # -- step boundaries ------------------------------------------------------------------------
    def _fingerprinted(self) -> torch.nn.Module | None:
        """What the fingerprints hash: the registered model, else the parameters the counted optimizer steps."""
        if self._model is not None:
            return self._model
        if self._stepped_params is None and self.clock.counted is not None:
            self._stepped_params = optimizer_parameters(self.clock.counted)
        return self._stepped_params

    def _checkpointed(self) -> torch.nn.Module:
        """What a checkpoint holds as its model: the registered one, else the tracked optimizer's parameters."""
        if self._model is not None:
            return self._model
        optimizer = self._tracked.get("optimizer")
        if optimizer is None:
            raise ExperimentError(
                "checkpoint_every is set but no model is registered: call ctx.ddp(model) (ctx.register(model) where "
                "the script wraps DDP itself), or ctx.track(optimizer), whose parameters are then checkpointed, or set "
                "checkpoint_every: 0."
            )
        if self._stepped_params is None:
            self._stepped_params = optimizer_parameters(optimizer)
        return self._stepped_params

    def _on_first_step(self, optimizer: Any) -> None:
        if self._model is None and self.is_main:
            # No ctx.ddp: the weights before the first update are the parameters this optimizer steps.
            self._send(Initial(fingerprint(optimizer_parameters(optimizer))))

    def _on_optimizer(self, phase: str, optimizer: Any) -> None:
        if self._tracer is not None:
            self._tracer.optimizer_event(phase, optimizer)
        if phase == "pre" and self._optimization is not None and self._outbox is not None:
            values, first = self._optimization.on_step(optimizer)
            if first:  # the set-up as the first step found it: a run killed later still has it on record
                self._send(self._optimization.message())
            if values:
                self._outbox.add(self.clock.index, values, int(time.time() * 1000))

    def _coming_step(self) -> int:
        """The step whose work is under way, or comes next once the previous one has ended."""
        clock = self.clock
        return clock.done if clock.pending else clock.index

    def _on_begin(self, step: int, clean: bool) -> None:
        """Step `step`'s work has begun (`clean`: at a fetch or ctx.steps() iteration, nothing of it ran yet)."""
        self._send(determinism.observe(step, determinism.FIRST_STEP))  # determinism read-back: the first step
        self._send_loop()
        self._end_trace(before=step)
        self._check_stop(step)
        if not clean:
            self._note_unsaved(step)
        if self._traced(step) and (clean or self._tracer is None):
            self._start_trace(step)
        self._timer.begin(step)

    def _on_end(self, step: int) -> None:
        """The counted optimizer finished step `step`. A loop of the user's own shows no other boundary: its
        step K is traced from the end of step K-1 to the end of step K."""
        self._timer.end(step)
        if self._driver is None:
            # A loop of the user's own shows its next step only at the model's forward or the optimizer's step: the
            # next step is timed (and profiled) from here, its own batch drawing included.
            self._timer.starting(step + 1)
            self._end_trace(before=step + 1)
            if self._traced(step + 1):
                self._start_trace(step + 1)

    def _before_step(self, step: int, position: ckpt.TrainingPosition) -> None:
        """A clean boundary: nothing of `step` has run yet (checkpoints are saved here, audits stop here)."""
        self._send(determinism.observe(step, determinism.FIRST_STEP))  # read back before a checkpoint takes it
        self._send_loop()
        self._end_trace(before=step)
        self._maybe_checkpoint(position)
        self._check_stop(step)
        self._timer.starting(step)

    def _check_stop(self, step: int) -> None:
        plan = self._plan
        if plan is not None and plan.stop_at is not None and step >= plan.stop_at:
            self._end_trace()
            self._send(self._segment_end(step))
            raise StopSegment()

    def _note_unsaved(self, step: int) -> None:
        """A checkpoint is due but this step began where harness cannot restart a loop."""
        plan = self._plan
        if plan is None or plan.every <= 0 or step % plan.every or step == plan.resume_step or step in self._saved:
            return
        loop = self._loop()
        if not boundaries.has_boundaries(loop):
            cause, fix = boundaries.why(loop)
            what = f"no checkpoint at step {step} or after: {cause}"
        else:
            what, fix = f"no checkpoint at step {step}: {boundaries.PREFETCH[0]}", boundaries.PREFETCH[1]
        self._notice(
            "no-checkpoint",
            f"checkpoint_every={plan.every}: {what}, so harness has no step boundary to save at or resume from there. "
            f"{fix}",
        )

    def _loop(self) -> str:
        """What drives the steps (boundaries.LOADER, ...). Lightning's Trainer runs its loop whatever it iterates."""
        if self._framework == boundaries.LIGHTNING:
            return self._framework
        if self._driver is not None:
            return boundaries.LOADER if self._driver == "loader" else boundaries.STEPS
        return self._framework or boundaries.OWN

    def _send_loop(self) -> None:
        if not self._loop_sent:
            self._loop_sent = True
            self._send(Loop(self._loop()))

    def _loop_of(self, framework: str) -> None:
        """The framework (boundaries.LIGHTNING, .ACCELERATE) runs the loop or feeds its batches. For the framework
        integrations."""
        self._framework = framework

    def _train_iter(self, loader: _Loader) -> Iterator[Any]:
        """Hand out the training batches of one epoch; checkpoint before fetching a step's first batch."""
        epoch, first = self._epoch, 0
        if self._driver is None:
            self._driver = "loader"
        loader._harness_raw = True  # iter(loader) inside here must be DataLoader's own
        try:
            if self._resume is not None and self._resume[0].epoch == epoch:
                position, rng = self._resume
                iterator = ckpt.resume_iterator(loader, position)  # replays this epoch's first batches
                self._epoch_start_generator = position.epoch_start_generator
                ckpt.set_rng_state(rng, self.device)  # after the replay: it drew from the RNGs as the original did
                self._resume, first = None, position.batch_in_epoch
            else:
                self._epoch_start_generator = ckpt.generator_state(loader.generator)
                iterator = iter(loader)
        finally:
            loader._harness_raw = False
        n = len(loader)
        clock = self.clock
        order = _batch_order(loader)
        for i in range(first, n):
            if clock.would_begin():
                # Before the batch is fetched: fetching draws from the RNGs (workers, augmentation).
                step = clock.done if clock.pending else clock.index
                self._before_step(step, ckpt.TrainingPosition(step, epoch, i, self._epoch_start_generator))
            fetch = time.perf_counter()
            try:
                batch = next(iterator)
            except StopIteration:
                return
            self._timer.fetched(time.perf_counter() - fetch,
                                len(order[i]) * (1 if self._shards else self.world_size) if order is not None and i < len(order) else 0)
            step = clock.begin(clean=True)  # a micro-batch of a step already begun only beats
            if order is not None and i < len(order):
                self._data_order.setdefault(step, hashlib.sha256()).update(order[i].tobytes())
            yield batch

    def _traced(self, step: int) -> bool:
        plan = self._plan
        return plan is not None and plan.trace_step == step and self.rank in plan.trace_ranks

    def _start_trace(self, step: int) -> None:
        """Trace step `step` from now on (a trace begun earlier for it, e.g. at train()'s start, starts over)."""
        assert self._plan is not None
        if self._trace_written:
            return
        if self._tracer is not None:
            self._tracer.__exit__(None, None, None)
        meta = {"step": step, "rank": self.rank, "world_size": self.world_size, "invariant_shards": self._shards}
        # self._model is the module inside DDP (ctx.ddp keeps it): its submodules' names are the user's.
        self._tracer = optrace.OpTracer(self._code_dir, model=self._model, meta=meta, optimizer_hooks=False,
                                        device=self.device)
        self._tracer.__enter__()

    def _end_trace(self, before: int | None = None) -> None:
        """Stop tracing and write the trace (a file that exists is a whole trace); `before`: only once that step
        is past the traced one."""
        tracer, plan = self._tracer, self._plan
        if tracer is None or plan is None or (before is not None and before <= (plan.trace_step or 0)):
            return
        self._tracer = None
        tracer.__exit__(None, None, None)

        path = Path(plan.trace_dir) / f"rank{self.rank}.jsonl.gz"
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(tracefile.dumps(tracer.result()))
        tmp.replace(path)
        self._trace_written = True

    def _maybe_checkpoint(self, position: ckpt.TrainingPosition) -> None:
        plan, step = self._plan, position.step
        if plan is None or plan.every <= 0 or step % plan.every or step == plan.resume_step or step in self._saved:
            return
        model = self._checkpointed()
        generators = {str(i): dl.generator for i, dl in enumerate(self._loaders) if dl is not self._train_loader}
        # The data order so far rides along: a run resumed from here records every step's, not only those after it.
        extra = {"next_fingerprint": self._next_fingerprint, "data_order": ckpt.pack_digests(self._own_data_order())}
        state = ckpt.build(
            model=model, position=position, loader_generators=generators, extra=extra, device=self.device, copy=False,
            **self._tracked,
        )
        directory = Path(plan.directory)
        # Saved and digested before the loop goes on: the live CPU tensors (copy=False) are what the file holds.
        tensors = ckpt.save_with_digests(state, ckpt.path_for(directory, step, self.rank), model,
                                         self._tracked.get("optimizer"))
        # The gather is also the barrier: every rank's file is on disk before the step is marked complete.
        ranks = self._gather(ckpt.replica_sha256(tensors, model))
        self._saved.add(step)
        if self.is_main:
            if self._outbox is not None:
                # What was logged before the step is in the pipe before the step is complete: a kill from here on
                # costs the record nothing that the resume from this step will not log again.
                self._outbox.flush()
            # The marker carries the digests the message announces: a kill between the two leaves them on disk.
            ckpt.mark_complete(directory, step, self.world_size,
                               {"sha256": state["fingerprint"], "tensors": tensors, "ranks": ranks})
            self._send(Checkpoint(step, state["fingerprint"], tensors, tuple(ranks)))
        self._send(determinism.observe(step, determinism.CHECKPOINT))  # determinism read-back: checkpoint saved

    def _segment_end(self, step: int) -> SegmentEnd:
        target = self._model if self._model is not None else self._stepped_params
        if target is None:
            return SegmentEnd(step, None)
        # Per tensor too: a segment that ends elsewhere than the run's checkpoint names the tensors that differ.
        tensors = ckpt.live_tensor_fingerprints(target, self._tracked.get("optimizer"))
        return SegmentEnd(step, fingerprint(target), tensors)

    def _gather(self, value: str) -> list[str]:
        """`value` of every rank, in rank order (a collective: it waits for all ranks, like a barrier)."""
        if self.world_size == 1 or not dist.is_initialized():
            return [value]
        every: list[Any] = [None] * self.world_size
        dist.all_gather_object(every, value)
        return [str(v) for v in every]

    def _load_resume_checkpoint(self) -> int:
        """Load plan.resume_step's checkpoint once (ctx.epochs or ctx.steps, whichever comes first); returns the
        epoch (ctx.epochs) or step (ctx.steps) to start at, 0 when there is nothing to resume."""
        plan = self._plan
        if plan is None or plan.resume_step is None or self._resumed:
            return 0
        self._resumed = True
        state = ckpt.load(ckpt.path_for(Path(plan.directory), plan.resume_step, self.rank))
        position = ckpt.restore(state, model=self._checkpointed(), **self._tracked)
        for i, dl in enumerate(self._loaders):
            key = str(i)
            if dl is not self._train_loader and key in state["loader_generators"]:
                ckpt.set_generator_state(dl.generator, state["loader_generators"][key])
        self.clock.set(position.step)
        self._next_fingerprint = int(state["extra"]["next_fingerprint"])
        # Written before data orders rode along: only the steps from the resume on are recorded.
        before = ckpt.unpack_digests(state["extra"].get("data_order"))
        self._data_order_before = {step: digest for step, digest in before.items() if step < position.step}
        self._resume = (position, state["rng"])
        return position.step if self._driver == "steps" else position.epoch

    def _check_replicas_equal(self, target: torch.nn.Module | None) -> None:
        """Data parallelism promises one model: ranks whose parameters differ at the end trained apart."""
        if self.world_size == 1 or not dist.is_initialized():
            return
        # Parameters only: buffers such as BatchNorm statistics may legitimately differ between DDP ranks.
        mine = fingerprint(target, buffers=False) if target is not None else None
        every: list[Any] = [None] * self.world_size
        dist.all_gather_object(every, mine)
        if mine is not None and len(set(every)) > 1:
            groups: dict[str, list[int]] = {}
            for rank, sha in enumerate(every):
                groups.setdefault(str(sha)[:12], []).append(rank)
            shown = "; ".join(
                f"{'rank' if len(ranks) == 1 else 'ranks'} {','.join(map(str, ranks))}: {sha}" for sha, ranks in groups.items()
            )
            what = ("Train the model ctx.ddp returned (not model.module) and call optimizer.step() on every rank."
                    if self._model is not None else
                    "No model was given to ctx.ddp, so nothing synchronised them: wrap it with model = ctx.ddp(model).")
            raise ExperimentError(
                f"the ranks ended with different parameters ({shown}): their gradients were not synchronised. {what}"
            )


def _fix_buckets(ddp: Any) -> None:
    """Lay DDP's gradient buckets out once, in parameter order, before the first step.

    Left alone, DDP reduces the first step of every process in one bucket of all parameters and then
    rebuilds its buckets in the order the gradients became ready. With three or more ranks an element's
    sum depends on where it lies in its bucket (gloo's and NCCL's ring algorithms add chunks in different
    rank orders), so a process that starts from a checkpoint - a resume, an audit segment - reduced its
    first step in another layout than the original process did at that step, and ended with other bits.
    Fixed up front (what DDP's own uneven-inputs join does), every process reduces the same buffers.
    """
    reducer = getattr(ddp, "reducer", None)
    if reducer is None or not hasattr(reducer, "_push_all_rebuilt_params"):
        return  # another torch: a resume that then differs is refused by its own proof
    reducer._push_all_rebuilt_params()
    reducer._rebuild_buckets()


def metric_value(key: Any, value: Any) -> float:
    """A metric value as a float (NaN and +-inf kept); anything else names the key and its type. What ctx.log and the
    framework integrations' loggers record."""
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


def _not_own(values: Mapping[str, float]) -> None:
    for key in values:
        if key.startswith(OWN_METRIC_PREFIX):
            raise ExperimentError(
                f"ctx.log: '{key}' is named like the metrics harness logs itself ({OWN_METRIC_PREFIX}*: the "
                "learning rate, the GradScaler's scale). Give your value another key."
            )
