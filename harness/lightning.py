"""PyTorch Lightning (Trainer and Fabric) inside `train(ctx)`: one line gives a full record.

    trainer = L.Trainer(max_epochs=3, **harness.lightning.trainer_kwargs(ctx))
    cli = LightningCLI(Model, DataModule, trainer_defaults=harness.lightning.trainer_kwargs(ctx), args=..., run=False)
    fabric = harness.lightning.fabric(ctx, accelerator="cpu", devices=ctx.world_size)

What the line adds, and why each piece is needed:
- `Logger`: what the LightningModule logs (`self.log`, `fabric.log`) becomes `ctx.log` at the trainer's step,
  so replays judge it (without it a replay has NOTHING_TO_COMPARE); what validation and test log is recorded as
  evaluation values (an evaluation batch's at Lightning's count of evaluation batches, not a training step);
- `Callback`: registers the LightningModule for fingerprints (ctx.register: no throwaway ctx.ddp), and refuses a
  Trainer whose world size is not the job's before it trains on a share of the data that is not its own;
- `Environment`: Lightning's ClusterEnvironment for processes harness started (`creates_processes_externally`): it
  reuses harness's process group and refuses `devices` x `num_nodes` that is not the job's world size - a replay
  at another world size with `devices=2` hard-coded would otherwise shard the data for ranks that do not exist;
- `default_root_dir=ctx.output_dir`: Lightning's logs and checkpoints are the run's artifacts, not files in the
  experiment folder (which is code: they would make the next run dirty);
- PL_GLOBAL_SEED (unless the code set it, e.g. with L.seed_everything): the seed of the DistributedSampler the
  Trainer puts in, which otherwise is 0 whatever the recorded seed.

The objects it adds deep-copy and pickle (LightningCLI deep-copies its defaults): each copy holds the same ctx,
which copies as a reference to the rank's one context.

Settings the Trainer puts in force (`deterministic=`, precision switches) are read back by harness at the first
step and at the end, and recorded with the line that set them; seeds the code sets itself are recorded and warned
about. This module imports Lightning; harness's core never imports it (`pip install ddp-harness[lightning]`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
from lightning.fabric import Fabric
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch.loggers import Logger as _LightningLogger

from harness.errors import ExperimentError
from harness.runtime import boundaries
from harness.runtime.context import Context, metric_value

SEED_ENV = "PL_GLOBAL_SEED"  # Lightning's: its DistributedSampler's seed, and what its reset_seed() seeds with


def trainer_kwargs(ctx: Context, **kwargs: Any) -> dict[str, Any]:
    """Keyword arguments for `L.Trainer`: yours (`kwargs`) with harness's logger, callback, cluster environment and
    `default_root_dir` added. Pass your own `logger=`, `callbacks=` or `plugins=` through here, not beside it:
    `L.Trainer(**harness.lightning.trainer_kwargs(ctx, max_epochs=3, callbacks=[...]))`."""
    merged = dict(kwargs)
    merged.setdefault("default_root_dir", str(ctx.output_dir))
    merged["logger"] = [*_as_list(kwargs.get("logger"), drop=(True, None, False)), Logger(ctx)]
    merged["callbacks"] = [*_as_list(kwargs.get("callbacks")), Callback(ctx)]
    merged["plugins"] = [*_without_environment(_as_list(kwargs.get("plugins"))), Environment(ctx)]
    _seed_sampler(ctx)
    return merged


def fabric(ctx: Context, **kwargs: Any) -> Fabric:
    """`L.Fabric(**kwargs)` with harness's logger and cluster environment, checked to run the job's world size.
    Register the model with ctx.register(model) (or pass it to fabric.setup through harness.lightning.setup)."""
    merged = dict(kwargs)
    merged["loggers"] = [*_as_list(kwargs.get("loggers")), Logger(ctx)]
    merged["plugins"] = [*_without_environment(_as_list(kwargs.get("plugins"))), Environment(ctx)]
    _seed_sampler(ctx)
    made = Fabric(**merged)
    _check_world_size(ctx, made.world_size, "L.Fabric")
    return made


class Logger(_LightningLogger):
    """Lightning's metrics as ctx.log values at the step Lightning logs them at (rank 0's; ctx ignores the others).

    Lightning logs some keys at one step twice with one value (`epoch` with the step's and the epoch's metrics):
    those are one value. Two different values of a key at one step would overwrite each other in MLflow: that
    fails the run with one line, as ctx.log does.

    What validation and test log (the Trainer's Callback says when they run) are evaluation values: an evaluation
    epoch's at the trainer's step, as Lightning logs them; an evaluation batch's (`self.log(..., on_step=True)` in
    validation_step) at Lightning's count of evaluation batches, which is no training step - recorded as an index of
    their own ("validation batch 3"), so that no verdict names a training step that did not log them."""

    def __init__(self, ctx: Context) -> None:
        super().__init__()
        self._ctx = ctx
        self._at: tuple[str | None, int] | None = None
        self._values: dict[str, float] = {}  # what was logged at self._at
        self._evaluation: str | None = None  # "validation" or "test" while one runs (set by Callback)
        self._eval_batch = False  # the next log is an evaluation batch's (Lightning logs it right after its end hooks)

    @property
    def name(self) -> str:
        return "harness"

    @property
    def version(self) -> str:
        return self._ctx.run_id or "unrecorded"

    @property
    def save_dir(self) -> str:
        return str(self._ctx.output_dir)

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        """The experiment's config is recorded by harness already (`train:` is the run's params)."""

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        at = self._ctx.step if step is None else int(step)
        index = f"{self._evaluation} batch" if self._evaluation and self._eval_batch else None
        self._eval_batch = False
        if (index, at) != self._at:
            self._at, self._values = (index, at), {}
        fresh: dict[str, float] = {}
        for key, value in metrics.items():
            number = metric_value(key, value)
            if key in self._values:
                if _same(self._values[key], number):
                    continue
                raise ExperimentError(
                    f"Lightning logged '{key}' twice at {index or 'step'} {at} ({self._values[key]!r}, then "
                    f"{number!r}); the second would overwrite the first. Log it once per step (self.log(..., "
                    "on_step=True, on_epoch=False), or give the epoch's value its own name)."
                )
            self._values[key] = fresh[key] = number
        if not fresh:
            return
        if self._evaluation is None:
            self._ctx.log(fresh, at)
        else:
            self._ctx._log_evaluation(fresh, at, index)


class Callback(pl.Callback):
    """Registers the LightningModule for fingerprints, refuses a Trainer that does not run the job's world size, and
    tells harness's Logger when validation and test run (and when one of their batches has ended)."""

    def __init__(self, ctx: Context) -> None:
        self._ctx = ctx
        self._loggers: list[Logger] = []

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        _check_world_size(self._ctx, trainer.world_size, "L.Trainer")
        _check_mlflow_loggers(self._ctx, trainer.loggers)
        self._ctx.register(pl_module)
        self._ctx._loop_of(boundaries.LIGHTNING)  # its loop, which harness cannot checkpoint: said with Lightning's way
        self._loggers = [lg for lg in trainer.loggers if isinstance(lg, Logger) and lg._ctx is self._ctx]

    def _evaluating(self, what: str | None) -> None:
        for logger in self._loggers:
            logger._evaluation, logger._eval_batch = what, False

    def _batch_ended(self, ended: bool) -> None:
        for logger in self._loggers:
            logger._eval_batch = ended

    # Lightning logs an evaluation batch's values right after its *_batch_end hooks (update_eval_step_metrics), and
    # the evaluation epoch's before on_*_end.
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._evaluating("validation")

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._evaluating("test")

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._evaluating(None)

    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._evaluating(None)

    def on_validation_batch_start(self, *args: Any, **kwargs: Any) -> None:
        self._batch_ended(False)

    def on_test_batch_start(self, *args: Any, **kwargs: Any) -> None:
        self._batch_ended(False)

    def on_validation_batch_end(self, *args: Any, **kwargs: Any) -> None:
        self._batch_ended(True)

    def on_test_batch_end(self, *args: Any, **kwargs: Any) -> None:
        self._batch_ended(True)

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._batch_ended(False)

    def on_test_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._batch_ended(False)


class Environment(ClusterEnvironment):
    """Lightning's view of the ranks harness started: the job's world size, ranks and rendezvous, never its own."""

    def __init__(self, ctx: Context) -> None:
        super().__init__()
        self._ctx = ctx

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return os.environ.get("MASTER_ADDR", "127.0.0.1")

    @property
    def main_port(self) -> int:
        return int(os.environ.get("MASTER_PORT", "0"))

    @staticmethod
    def detect() -> bool:
        return False  # chosen by trainer_kwargs/fabric, never detected

    def world_size(self) -> int:
        return self._ctx.world_size

    def set_world_size(self, size: int) -> None:
        if size != self._ctx.world_size:
            raise _world_size_error(self._ctx, f"devices x num_nodes make {size} process{'es' if size != 1 else ''}")

    def global_rank(self) -> int:
        return self._ctx.rank

    def set_global_rank(self, rank: int) -> None:
        if rank != self._ctx.rank:
            raise ExperimentError(
                f"Lightning computed global rank {rank} for harness's rank {self._ctx.rank}: its devices/num_nodes are "
                f"not the job's layout. {_fix(self._ctx)}"
            )

    def local_rank(self) -> int:
        return self._ctx.local_rank

    def node_rank(self) -> int:
        return self._ctx.rank // _local_world_size(self._ctx)

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        if num_devices * num_nodes != self._ctx.world_size or num_devices != _local_world_size(self._ctx):
            raise _world_size_error(self._ctx, f"devices={num_devices} x num_nodes={num_nodes} make "
                                    f"{num_devices * num_nodes} process{'es' if num_devices * num_nodes != 1 else ''}")


def _check_mlflow_loggers(ctx: Context, loggers: list[Any]) -> None:
    """Lightning's MLFlowLogger makes a run of its own unless given one: beside the harness run it would be a run
    no record links to (`harness runs` lists it, replay refuses it). Only a recorded job's rank 0 logs at all."""
    if not (ctx.is_main and ctx.run_id):
        return
    for logger in loggers:
        if type(logger).__name__ == "MLFlowLogger" and getattr(logger, "_run_id", None) != ctx.run_id:
            raise ExperimentError(
                "MLFlowLogger would log into a run of its own beside harness's, which no record links to. Pass "
                "MLFlowLogger(run_id=ctx.run_id, tracking_uri=os.environ['MLFLOW_TRACKING_URI']) to log into the harness "
                "run (its values are kept as your own, not compared by replay), or drop it: harness.lightning's "
                "logger records what self.log logs."
            )


def _check_world_size(ctx: Context, size: int, what: str) -> None:
    if size != ctx.world_size:
        raise _world_size_error(ctx, f"{what} runs {size} process{'es' if size != 1 else ''}")


def _world_size_error(ctx: Context, what: str) -> ExperimentError:
    return ExperimentError(
        f"Lightning's {what}, but harness started {ctx.world_size} rank{'s' if ctx.world_size != 1 else ''} "
        f"(world_size: {ctx.world_size}): it would shard the data and synchronise the gradients for another layout "
        "than the ranks that run. "
        f"{_fix(ctx)}"
    )


def _fix(ctx: Context) -> str:
    local = _local_world_size(ctx)
    if local == ctx.world_size:
        return "Pass devices=ctx.world_size, so that every world size harness runs (a replay's too) is Lightning's."
    return (f"Pass devices={local}, num_nodes={ctx.world_size // local} (ranks per node, nodes: "
            "int(os.environ['LOCAL_WORLD_SIZE']) and ctx.world_size // it).")


def _local_world_size(ctx: Context) -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", ctx.world_size))


def _seed_sampler(ctx: Context) -> None:
    # Lightning's reset_seed() then seeds every rank with it at fit's start, after harness's per-rank seeding: the
    # recorded seed still decides it, and the seed watch records the call (with this value, not warned about).
    os.environ.setdefault(SEED_ENV, str(ctx.seed))


def _as_list(value: Any, drop: tuple[Any, ...] = (None,)) -> list[Any]:
    if any(value is d for d in drop):
        return []
    return list(value) if isinstance(value, list | tuple) else [value]


def _without_environment(plugins: list[Any]) -> list[Any]:
    for plugin in plugins:
        if isinstance(plugin, ClusterEnvironment):
            raise ExperimentError(
                f"plugins= holds a cluster environment of your own ({type(plugin).__name__}); inside harness the ranks "
                "are harness's (harness.lightning.Environment). Drop it: harness runs the job on Slurm or torchrun itself."
            )
    return plugins


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))
