"""The training API: what `train(ctx)` receives in every rank."""

from __future__ import annotations

import itertools
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from harness.errors import ExperimentError
from harness.messages import (
    Evaluation,
    Final,
    Fingerprint,
    Initial,
    Message,
    SegmentStart,
    Total,
)
from harness.runtime import (
    checkpoint as ckpt,
    determinism,
    hooks,
    loaders,
    optimization,
    perf,
    perturb,
    replicas,
    sharding,
)
from harness.runtime.cfgview import redacted_view
from harness.runtime.checkpoint_steps import CheckpointSteps
from harness.runtime.dataorder import SampleOrder
from harness.runtime.fingerprint import fingerprint
from harness.runtime.metrics import Logged, logged_twice, metric_value, not_own
from harness.runtime.outbox import Outbox
from harness.runtime.plan import LaunchPlan, ProfilePlan
from harness.runtime.states import Copies, check_trackable
from harness.runtime.stepping import Stepping, StopSegment as StopSegment  # StopSegment: the launcher's
from harness.runtime.steps import StepClock, StepHook
from harness.runtime.tracing import StepTrace
from harness.tags import EVAL_AT_STEP


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


class Context(Stepping):
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
        checkpoints: LaunchPlan | None = None,
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
        self._progress = progress  # tells the launcher this rank is alive, and at which step
        self._plan = checkpoints
        self._shards = invariant_shards  # > 0: world-size-invariant mode
        self._init_loop_state()
        self._init_step_work(checkpoints, code_dir, profile)
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
        if self._trace.wanted(0):
            # Step 0 of a loop harness does not drive begins with train() itself; a loader or ctx.steps
            # that turns up restarts the trace at its first batch.
            self._trace.start(0, self._model)

    def _init_loop_state(self) -> None:
        """What the context learns as the training loop runs: the model, the loaders, the epoch, the steps seen."""
        world_size, rank = self.world_size, self.rank
        self._model: torch.nn.Module | None = None
        self._samplers: list[Any] = []  # of ctx.loader's loaders: ctx.epochs calls their set_epoch
        self._data_order = SampleOrder(world_size, rank, self._shards)
        self._steps_per_epoch: int | None = None
        self._next_fingerprint = 0
        self._fingerprints: dict[int, str] = {}  # rank 0: every Fingerprint sent, so that a checkpoint carries them
        self._last_step: int | None = None
        self._shard = loaders.Shard(world_size, rank, self.seed, self.rank_seed, self.device, self._shards)
        self._invariant_step: Any = None
        self._tracked: dict[str, Any] = {}
        self._loaders: list[DataLoader] = []
        self._train_loader: DataLoader | None = None
        self._epoch = 0
        self._epoch_start_generator: torch.Tensor | None = None
        self._resume: tuple[ckpt.TrainingPosition, dict] | None = None  # until the first batch after it
        self._in_backward = False  # invariant mode: gradients may reach the model only inside ctx.backward
        # What drives the loop, so what a step boundary is: "loader" (the training ctx.loader's fetches),
        # "steps" (ctx.steps() iterations) or None (a loop of the user's own: only optimizer steps are seen).
        self._driver: str | None = None
        # The framework whose loop runs the steps or feeds their batches (boundaries.LIGHTNING, .ACCELERATE), set by
        # its integration: a step boundary missing there has another way out than a loop of the user's own.
        self._framework: str | None = None
        self._loop_sent = False
        self._sketched = False
        self._digested = False
        self._logged = Logged()  # rank 0: what was logged, at which steps, by training or an evaluation
        self._noted: set[str] = set()  # notices already sent
        self._stepped_params: torch.nn.Module | None = None  # the optimizer's parameters, when no model is registered
        self._forward_hook: hooks.Handle | None = None
        self._initial_fingerprint: str | None = None  # rank 0: the registered model's, when it was registered
        self._copies = Copies()

    def _init_step_work(self, plan: LaunchPlan | None, code_dir: str, profile: ProfilePlan | None) -> None:
        """What the launch plan asks of the steps: checkpoints, an op trace, timing, a calibration member's nudge,
        and, on rank 0 of a recorded job, the watch on what trains the model."""
        rank, world_size, device = self.rank, self.world_size, self.device
        self._checkpoints = CheckpointSteps(plan, rank, world_size, device)
        # plan.trace_step's op trace; the experiment folder fixed at start: the training code may os.chdir() away.
        self._trace = StepTrace(plan, rank, world_size, self._shards, code_dir or str(Path.cwd()), device)
        # Every step's wall time and loader wait; torch.profiler over the planned steps (profile: in experiment.yaml).
        self._timer = perf.StepTimer(rank, device, profile)
        self.clock = StepClock(self._on_begin, self._on_end, self._beat_now, self._on_optimizer, self._on_first_step)
        # A calibration member (harness calibrate): its trained weights start nudged (its reference, member 0, is
        # the run itself). Every optimizer made from here on has its parameters nudged as it is made.
        nudged = plan.perturb_seed if plan is not None else None
        self._member = perturb.MemberNudge(nudged) if nudged not in (None, perturb.REFERENCE) else None
        if self._member is not None:
            self._member.install()
        # Rank 0 of a recorded job: what trains the model (optimizer, LR schedulers, GradScaler, autocast), the
        # learning rate of every step and the GradScaler's scale.
        self._optimization = optimization.Watch(self._coming_step).start() if self._outbox is not None else None

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
        if self._shards:
            sharding.refuse_invariant(model)
        sharding.refuse_ddp(model)
        self._adopt(model)
        if self._shards:
            # Invariant mode reduces gradients itself (ctx.backward), in one canonical order; DDP's
            # all-reduce would add them in a world-size-dependent order. Start from rank 0's weights, as DDP does.
            # The mode is the invariant extra's (loaders.invariant_mode: the registry).
            mode = loaders.invariant_mode()
            mode.broadcast_parameters(model)
            self._invariant_step = mode.InvariantStep(self._shards, self.world_size, self.rank, self.seed)
            self._guard_gradients(model)
            self._send_initial(model)
            return mode.InvariantModule(model)
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
            sharding.refuse_invariant(inner)
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
        if self._member is not None:
            self._member.apply(model)  # before the first fingerprint
        # A training forward of the registered model is the next step's work beginning (a loop of its own).
        self._forward_hook = hooks.add(model, StepHook(model, self.clock))
        self._trace.attach(model)

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

    def track(self, optimizer: Any = None, scheduler: Any = None, scaler: Any = None, **states: Any) -> None:
        """Register what a checkpoint must hold besides the model: the optimizer, LR scheduler and GradScaler, by
        position or by name, and, by a name of your choice, anything else the steps depend on that has
        state_dict()/load_state_dict() (an EMA or AveragedModel, a data loader's position, a sampler):
        `ctx.track(optimizer, ema=ema)`. Each is saved in every checkpoint and loaded back on a resume."""
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
        if states:
            check_trackable(states)
            self._tracked.setdefault("states", {}).update(states)
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
        dl, sampler = loaders.make(self._shard, dataset, batch_size, shuffle=shuffle, num_workers=num_workers,
                                   drop_last=drop_last, **loader_kwargs)
        self._samplers.append(sampler)
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
        self._trace.end()
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
        not_own(values)
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
        not_own(values)
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
        evaluation_keys = self._logged.by(keys, index, evaluation)
        if evaluation_keys is not None:
            self._send(Evaluation(evaluation_keys))

    def _once_per_step(self, values: Mapping[str, float], step: int, where: str) -> None:
        key = self._logged.again(values, step)
        if key is not None:
            clock = self.clock
            counted = bool(clock.optimizer_steps) or clock.counted is not None or self._driver == "steps"
            raise ExperimentError(logged_twice(key, step, where, counted=counted, model=self._model,
                                               initial_fingerprint=self._initial_fingerprint))

    def _log_at_step(self, values: Mapping[str, float], step: int) -> None:
        clock = self.clock
        if clock.pending and step == clock.index and self._logged.any_at(values, step):
            step = clock.begin()
        self._beat_now()  # the clock's step, not the one logged at (a counter of the user's may be anything)
        self._once_per_step(values, step, f"step {step}")
        self._last_step = step if self._last_step is None else max(self._last_step, step)
        target = self._fingerprinted()
        if target is not None and step >= self._next_fingerprint:
            # Taken at the first log() of a step on or past each multiple of fingerprint_every.
            sha = fingerprint(target)
            if self.is_main:
                self._fingerprints[step] = sha
            self._send(Fingerprint(step, sha))
            self._next_fingerprint = (step // self._every + 1) * self._every
        if self._outbox is not None:
            self._outbox.add(step, values, int(time.time() * 1000))

    def barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    # -- used by the launcher, not by the training code ------------------------------------------
    def announce_segment(self, index: int, *said: Message) -> None:
        """Tell the launcher that audit segment `index` is about to run (rank 0 only), then `said` (a calibration
        member's settings), through the one ordered sender: what follows the start belongs to the segment. Called by
        the launcher."""
        if self.is_main:
            for message in (SegmentStart(index), *said):
                self._send(message)

    def finish(self) -> None:
        """End training: check the ranks hold one model, and send rank 0's final fingerprint and step count.

        Called by the launcher after train(ctx) returns, not by the training code.
        """
        target, whole = self._wrap_up()
        self._maybe_sketch(self.clock.done)  # a run of exactly plan.sketch_at steps reached no boundary after them
        if self.is_main:
            of = "model" if self._model is not None else "optimizer" if target is not None else None
            sha = whole or (fingerprint(target) if target is not None else None)  # whole: a sharded model's
            self._send(Final(sha, self.clock.done, of))

    def finish_stopped(self) -> None:
        """replay --steps K stopped every rank where step K would begin (StopSegment, the same step on each): the run
        ends there, so it is checked and reported as at an end - its weights went with the SegmentEnd already.
        Called by the launcher, not by the training code."""
        self._wrap_up()

    def _wrap_up(self) -> tuple[torch.nn.Module | None, str | None]:
        """What every end of training checks and sends: the ranks hold one model, determinism, the data order; the
        model, and the fingerprint of the whole when it is sharded."""
        self._trace.end()
        target = self._fingerprinted()
        whole = replicas.check_equal(target, self.world_size, registered=self._model is not None)
        if self._model is None and target is not None:
            self._notice("unregistered", (
                "no model was given to ctx.ddp or ctx.register: the fingerprints hash the parameters the optimizer "
                f"stepped ({len(list(target.parameters()))} tensors; buffers such as BatchNorm statistics are not among "
                "them)" + (", compared across ranks" if self.world_size > 1 else "") + ". Register it with "
                "model = ctx.ddp(model), or, where the script wraps it in DDP itself, ctx.register(model) after its "
                "DDP(...) line."
            ))
        self._send(determinism.observe(self.clock.done, determinism.END))  # determinism read-back: training ends
        self._send(self._data_order.gathered())
        notice, performance = self._timer.gathered(self.world_size, self.clock.done)
        if notice is not None:
            self._notice("profile-missed", notice)
        self._send(performance)
        if self._optimization is not None:
            self._send(self._optimization.message())
        return target, whole

    def close(self) -> None:
        """Send every value still buffered and stop the sender thread; also after a failure. Called by the
        launcher once train(ctx) has returned or raised, not by the training code."""
        self.clock.close()
        if self._member is not None:
            self._member.uninstall()
        self._timer.close()
        if self._optimization is not None:
            self._optimization.stop()
        if self._forward_hook is not None:
            self._forward_hook.remove()
        self._trace.close()  # an audit stop or a failure inside the traced step: no trace is written
        if self._outbox is not None:
            self._outbox.close()


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
