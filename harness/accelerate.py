"""Hugging Face Accelerate inside `train(ctx)`: one changed line, `Accelerator(...)` -> `Accelerator(ctx, ...)`.

    import harness.accelerate
    accelerator = harness.accelerate.Accelerator(ctx, ...)    # was: accelerate.Accelerator(...)

The subclass makes Accelerate see harness's job (every rank, on the CPU too), forwards `accelerator.log` to
`ctx.log` (`Tracker`), registers the first model it prepares for fingerprints and checkpoints, and hands a
`ctx.loader` back without sharding it a second time. Only training code that uses Accelerate imports this module;
harness itself never does (docs/training-api.md, "Accelerate").
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import accelerate
import torch
from accelerate.tracking import GeneralTracker, MLflowTracker
from accelerate.utils import send_to_device

from harness import tags as T
from harness.errors import ExperimentError
from harness.runtime import boundaries
from harness.runtime.context import Context, metric_value

__all__ = ["Accelerator", "Tracker"]


def _is_number(key: Any, value: Any) -> bool:
    """What ctx.log records: a real number, or a tensor or array holding one."""
    try:
        metric_value(key, value)
    except ExperimentError:
        return False
    return True


def _same(device: torch.device, other: torch.device) -> bool:
    """One device: Accelerate's CPU is `cpu:0`, harness's `cpu`."""
    return device.type == other.type and (device.type == "cpu" or device.index == other.index)


class Tracker(GeneralTracker):
    """`Accelerator(log_with=[harness.accelerate.Tracker(ctx)])`: `accelerator.log(values, step)` becomes
    `ctx.log(values, step)` (rank 0's values, judged by replay). A step of None is `ctx.step`. A value that is not
    a number (a string, an image, a table) is skipped with one notice: Accelerate's other trackers take such values,
    and a run must not fail for what harness cannot compare. The configuration is not stored again: harness
    recorded the resolved config before any rank started."""

    name = "harness"
    requires_logging_directory = False

    def __init__(self, ctx: Context) -> None:
        super().__init__()
        self.ctx = ctx

    @property
    def tracker(self) -> Context:
        return self.ctx

    def start(self) -> None:
        """Called by init_trackers() once the Accelerator exists: a plain `accelerate.Accelerator()` on the CPU sees
        no GPU and runs every rank alone (each on all the data, never synchronised); say so before it trains."""
        processes = accelerate.PartialState().num_processes
        if processes != self.ctx.world_size:
            raise ExperimentError(
                f"Accelerate sees {processes} process(es) in a job of {self.ctx.world_size} ranks: each would train "
                "alone. Use accelerator = harness.accelerate.Accelerator(ctx, ...) (it passes cpu=True on the CPU)."
            )

    def store_init_configuration(self, values: dict) -> None:
        pass  # harness records the experiment's resolved config itself (params and config.yaml)

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        numbers_only = {key: value for key, value in values.items() if _is_number(key, value)}
        skipped = sorted(str(key) for key in values.keys() - numbers_only.keys())
        if skipped:
            kinds = ", ".join(f"{key} ({type(values[key]).__name__})" for key in skipped)
            # One notice for the run (ctx keeps each key once): a value logged every step would repeat it.
            self.ctx._notice(
                "accelerate-non-number",
                f"accelerator.log: skipped values that are not numbers ({kinds}, and any later ones): harness "
                "records and compares numbers only; Accelerate's other trackers still get them.",
            )
        if numbers_only:
            self.ctx.log(numbers_only, self.ctx.step if step is None else step)


class _MLflowInRun(MLflowTracker):
    """Accelerate's MLflow tracker (`log_with="mlflow"`, or `"all"`, which takes it wherever mlflow is installed, as
    it is with harness) inside a harness rank. Rank 0's MLflow is the harness run (MLFLOW_RUN_ID, which the tracker
    reads before its own arguments): its params are the recorded config and its metrics are ctx.log's. So:

    - `init_trackers(config=...)` is stored as params `accelerate.<key>`: under its own names a config's `seed`,
      `device` or `world_size` is a param harness logged already, and MLflow's "Changing param values is not allowed"
      would fail the run;
    - `accelerator.log` writes nothing more: the harness Tracker beside this one already took the values to the run
      through ctx.log, at ctx.step. A second write would put each point in MLflow twice - a step of None at step 0 -
      and the history, which a run cut off before its series was written is judged from, would mix them;
    - figures and artifacts go under `accelerate/` in the run's artifacts, never over harness's own files.
    """

    def __init__(self, ctx: Context, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._harness_ctx = ctx

    @classmethod
    def of(cls, ctx: Context, tracker: MLflowTracker) -> _MLflowInRun:
        """One the user made (`log_with=[MLflowTracker(...)]`), with its arguments."""
        return cls(ctx, tracker.experiment_name, tracker.logging_dir, tracker.run_id, tracker.tags, tracker.nested_run,
                   tracker.run_name, tracker.description)

    def store_init_configuration(self, values: dict) -> None:
        super().store_init_configuration({f"{T.ACCELERATE_PARAM_PREFIX}{key}": value for key, value in values.items()})

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        if self._harness_ctx.run_id and self.run_id == self._harness_ctx.run_id:
            return  # in the run already, through ctx.log
        super().log(values, step, **kwargs)  # a run of its own: a re-execution's scratch store (audit, trace)

    def log_figure(self, figure: Any, artifact_file: str, **save_kwargs: Any) -> None:
        super().log_figure(figure, f"{T.ACCELERATE_ARTIFACTS}/{artifact_file}", **save_kwargs)

    def log_artifacts(self, local_dir: str, artifact_path: str | None = None) -> None:
        super().log_artifacts(local_dir, _under_accelerate(artifact_path))

    def log_artifact(self, local_path: str, artifact_path: str | None = None) -> None:
        super().log_artifact(local_path, _under_accelerate(artifact_path))


def _under_accelerate(artifact_path: str | None) -> str:
    return T.ACCELERATE_ARTIFACTS if not artifact_path else f"{T.ACCELERATE_ARTIFACTS}/{artifact_path}"


class _OnDevice:
    """A ctx.loader handed back by prepare: the same loader (this rank's shard, harness's step boundaries,
    checkpoints and data-order digests), its batches moved to the accelerator's device as a prepared loader's are."""

    def __init__(self, loader: torch.utils.data.DataLoader, device: torch.device, non_blocking: bool) -> None:
        self.loader = loader
        self.device = device
        self.non_blocking = non_blocking

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            yield send_to_device(batch, self.device, non_blocking=self.non_blocking)

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)  # sampler, dataset, batch_size: the loader's own


class Accelerator(accelerate.Accelerator):
    """`accelerate.Accelerator` inside a harness rank: `harness.accelerate.Accelerator(ctx, **kwargs)` takes every
    argument Accelerate's does.

    - Accelerate sees harness's job: on the CPU, `Accelerator()` would see no GPU and train each rank alone (each on
      all the data, never synchronised), so `cpu=True` is passed there; a job Accelerate sees otherwise than harness
      launched it (world size, rank, device) is refused in one line.
    - `accelerator.log` reaches `ctx.log` (a `Tracker` beside the `log_with` ones, without `init_trackers`).
    - Accelerate's MLflow tracker (`log_with="all"` or `"mlflow"`) logs into the harness run without clashing with
      it: its config as params `accelerate.<key>`, its artifacts under `accelerate/` (see `_MLflowInRun`).
    - The first model prepared is registered with `ctx.register` for fingerprints and checkpoints.
    - A `ctx.loader` passed to `prepare` comes back unsharded (see `prepare_data_loader`).
    """

    def __init__(self, ctx: Context, *args: Any, **kwargs: Any) -> None:
        if ctx.device.type == "cpu":
            kwargs.setdefault("cpu", True)
        super().__init__(*args, **kwargs)
        self._harness_ctx = ctx
        self._harness_model: torch.nn.Module | None = None
        self._harness_tracker = Tracker(ctx)
        ctx._loop_of(boundaries.ACCELERATE)  # its loop has harness's step boundaries only over a ctx.loader
        # In trackers now, so accelerator.log works without init_trackers(), as harness records from the start.
        self.trackers.append(self._harness_tracker)
        if (self.num_processes, self.process_index) != (ctx.world_size, ctx.rank) or not _same(self.device, ctx.device):
            raise ExperimentError(
                f"Accelerate sees {self.num_processes} process(es), this one rank {self.process_index} on "
                f"{self.device}, but harness launched rank {ctx.rank} of {ctx.world_size} on {ctx.device}: "
                "training would not be the recorded job. Leave cpu= and the process settings to harness "
                "(harness.accelerate.Accelerator(ctx) sets them) and choose the device with device= in experiment.yaml."
            )

    def init_trackers(self, project_name: str, config: dict | None = None, init_kwargs: dict | None = None) -> None:
        # Accelerate's MLflow tracker logs into the harness run: made here as one that cannot clash with it.
        options = (init_kwargs or {}).get("mlflow", {})
        self.log_with = [
            _MLflowInRun(self._harness_ctx, project_name, **options) if str(t) == "mlflow"
            else _MLflowInRun.of(self._harness_ctx, t) if type(t) is MLflowTracker else t
            for t in self.log_with  # type: ignore[has-type]
        ]
        super().init_trackers(project_name, config, init_kwargs)
        # The harness tracker is already in trackers; a Tracker in log_with, or a second call, must not log twice
        # (ctx.log refuses a second value at one step).
        others = [t for t in self.trackers if not (isinstance(t, Tracker) and t.ctx is self._harness_ctx)]
        self.trackers[:] = [*others, self._harness_tracker]

    def prepare_data_loader(
        self, data_loader: torch.utils.data.DataLoader, device_placement: bool | None = None, slice_fn_for_dispatch: Any = None
    ) -> Any:
        """A `ctx.loader` is already this rank's shard of one seeded permutation; Accelerate would shard it again
        (each rank would see 1/world_size of its shard, 1/world_size^2 of the data). It comes back as it is, its
        batches moved to the device, and keeps what harness does with it (steps, checkpoints, resume, data order).
        Any other DataLoader is Accelerate's to shard, as without harness."""
        if getattr(data_loader, "_harness_ctx", None) is None:
            return super().prepare_data_loader(data_loader, device_placement, slice_fn_for_dispatch)
        place = self.device_placement if device_placement is None else device_placement
        if not place:
            return data_loader
        return _OnDevice(data_loader, self.device, self.non_blocking)

    def prepare_model(
        self, model: torch.nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> Any:
        prepared = super().prepare_model(model, device_placement, evaluation_mode)
        if not evaluation_mode and self._harness_model is None:
            # After the DDP wrap, which broadcast rank 0's weights: the ranks' common start is what is registered.
            # harness fingerprints one model: the first one prepared (a second, e.g. a GAN's critic, is not).
            self._harness_ctx.register(prepared)
            self._harness_model = model
        return prepared
