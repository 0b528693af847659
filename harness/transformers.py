"""Hugging Face transformers' Trainer inside `train(ctx)`: one changed line, `Trainer(...)` -> `Trainer(ctx, ...)`.

    import harness.transformers
    trainer = harness.transformers.Trainer(ctx, model=model, args=args, train_dataset=data)   # was: Trainer(...)

What the line adds, and why each piece is needed:
- `Callback`: the Trainer's logs (`loss`, `grad_norm`, `learning_rate`, the end-of-training summary) become
  `ctx.log` values and its evaluations' (`eval_*`, also a final `trainer.evaluate()`) evaluation values, at harness's
  step: the optimizer step that has just ended (the Trainer's `global_step` - 1), so a replay judges them (without it
  a replay has NOTHING_TO_COMPARE); it registers the model for fingerprints and refuses a Trainer that does not run
  the job's world size;
- `report_to: [mlflow]` logs into the harness run: the Trainer's MLflow callback keeps its params (TrainingArguments
  and the model's config) as `transformers.<key>` - under their own names `seed` is harness's param already and
  MLflow's "Changing param values is not allowed" would lose the batch - and writes no metric a second time (they are
  in the run through ctx.log, at their steps); its end_run leaves the run open, as the user's does (usermlflow);
- `output_dir` and checkpoints (`save_strategy`): a relative `output_dir` is placed under `ctx.output_dir`, so the
  Trainer's checkpoints are the run's artifacts, not files in the experiment folder (which is code: they would make
  the next run dirty); on the CPU `use_cpu=True`, so that the Trainer runs harness's gloo job.

The Trainer's `set_seed(args.seed)` is seen by harness's seed watch and recorded with the Trainer(...) line; a seed
that is not harness's is warned about (pass `seed=ctx.seed` in TrainingArguments).

Resume. The loop is the Trainer's own, so harness has no step boundary of its own in it; the Trainer's checkpoints
are the run's instead. With `checkpoint_every: N` (the Trainer is asked to save every N steps when its
save_strategy is "no"), each checkpoint the Trainer saves becomes the run's checkpoint of that step: its folder
kept in the step's (hard links), beside harness's bookkeeping and the digests of the weights and optimizer state
as they are then. `harness resume` proves the step as for any loop - a re-execution from the checkpoint before it
must land on those digests and log what the run logged - and continues through the Trainer's own
`train(resume_from_checkpoint=...)`, which restores the model, optimizer, scheduler and RNGs and skips the batches
already trained. What the Trainer's checkpoint lacks - its running loss sum, so that the next logged `loss` and
the final `train_loss` average the same steps - rides in harness's rank file and is put back at on_train_begin.

This module imports transformers; harness's core never imports it (`pip install ddp-harness[transformers]`).
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

import torch
import transformers
from accelerate.state import PartialState
from transformers.integrations import MLflowCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from harness import tags as T
from harness.errors import ExperimentError
from harness.runtime import boundaries, checkpoint_steps
from harness.runtime.context import Context, metric_value

__all__ = ["Callback", "Trainer"]

_EVAL_PREFIXES = ("eval_", "test_")  # Trainer.evaluate()'s and .predict()'s metric_key_prefix defaults
_LOSS_STATE = "transformers"  # the rank file's entry for the Trainer's running loss (harness's checkpoint extra)
_RNG_FILE = re.compile(r"rng_state_(\d+)\.pth")  # the Trainer's per-process RNG file in a multi-process job


class Callback(transformers.TrainerCallback):
    """The Trainer's logs as ctx.log values at harness's step, its model registered. For a Trainer subclass of
    another library: `callbacks=[harness.transformers.Callback(ctx)]` (harness.transformers.Trainer adds it)."""

    def __init__(self, ctx: Context) -> None:
        self._ctx = ctx
        self._at: int | None = None
        self._values: dict[str, float] = {}  # what was logged at self._at
        self._trainer: Any = None  # harness.transformers.Trainer sets it: its running loss is checkpointed
        self._resumed: tuple[int, dict[str, Any]] | None = None  # (step, extra) of the checkpoint resumed from

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if args.world_size != self._ctx.world_size:
            raise ExperimentError(
                f"the Trainer runs {args.world_size} process(es), but harness started {self._ctx.world_size} ranks: it "
                "would shard the data for another job than the ranks that run. Leave the process settings to harness "
                "(harness.transformers.Trainer(ctx, ...) passes use_cpu=True on the CPU)."
            )
        if isinstance(model, torch.nn.Module):
            self._ctx.register(model)
        plan = self._ctx._plan
        if self._resumed is None and plan is not None and plan.resume_step is not None:
            raise ExperimentError(
                f"this launch resumes the run from its checkpoint of step {plan.resume_step}, which only "
                "harness.transformers.Trainer(ctx, ...) hands to the Trainer's resume_from_checkpoint: build the "
                "Trainer with it (a Trainer of another library: subclass harness.transformers.Trainer), or rerun the "
                "run from its start with harness replay.")
        if self._resumed is not None:
            step, extra = self._resumed
            if int(state.global_step) != step:
                raise ExperimentError(
                    f"the Trainer resumed at step {state.global_step}, not at the checkpoint's step {step}: its "
                    "checkpoint folder was changed. Resume from the run's own checkpoints.")
            loss = extra.get(_LOSS_STATE)
            if loss is not None and self._trainer is not None:
                # _inner_training_loop zeroed these just before on_train_begin; the run carried them on.
                self._trainer._tr_loss.copy_(loss["tr_loss"])
                self._trainer._total_loss_scalar = float(loss["total_loss_scalar"])
                self._trainer._globalstep_last_logged = int(loss["globalstep_last_logged"])

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The Trainer saved `checkpoint-<global_step>`: the run's checkpoint of that step (when the launch keeps
        any), its files kept in harness's step folder, where a resume finds them on any artifact store."""
        step = int(state.global_step)
        folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{step}"
        if args.save_only_model or not folder.is_dir():
            why = ("holds only the model (save_only_model=True)" if args.save_only_model
                   else f"is not at {folder} (a hyperparameter search's folder)")
            self._ctx._notice("trainer-checkpoint", (
                f"the Trainer's checkpoint of step {step} {why}: harness keeps none of its checkpoints, so the run "
                "cannot be resumed. Let the Trainer save its whole state under its output_dir."))
            return
        rank = self._ctx.rank

        def keep(target: Path) -> None:
            # Each process wrote its own RNG file; the rest is rank 0's (the model, optimizer, scheduler, state).
            names = [entry.name for entry in folder.iterdir()
                     if (match := _RNG_FILE.fullmatch(entry.name)) is None and rank == 0
                     or match is not None and int(match.group(1)) == rank]
            checkpoint_steps.keep_files(folder, target, names)

        trainer = self._trainer
        extra = {} if trainer is None else {_LOSS_STATE: {
            "tr_loss": trainer._tr_loss.detach().to("cpu", copy=True),
            "total_loss_scalar": float(trainer._total_loss_scalar),
            "globalstep_last_logged": int(trainer._globalstep_last_logged)}}
        if not self._ctx._framework_checkpoint(step, keep, extra) and self._ctx._plan is None:
            self._ctx._notice("trainer-checkpoint", (
                f"the Trainer saved its checkpoint of step {step}, which harness does not keep (checkpoint_every is "
                "0): the run cannot be resumed. Set checkpoint_every: N to make its checkpoints the run's."))

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        at = max(int(state.global_step) - 1, 0)  # after k optimizer steps, step k-1 has just ended
        if at != self._at:
            self._at, self._values = at, {}
        training: dict[str, float] = {}
        evaluation: dict[str, float] = {}
        for key, value in (logs or {}).items():
            if isinstance(value, bool) or not isinstance(value, int | float | torch.Tensor):
                continue  # a string or a list (a Trainer's `total_flos` is a float): harness compares numbers only
            number = metric_value(key, value)
            if key in self._values:
                if _same(self._values[key], number):
                    continue  # `epoch` comes with the step's logs, its evaluation's and the summary: one value
                raise ExperimentError(
                    f"the Trainer logged '{key}' twice at step {at} ({self._values[key]!r}, then {number!r}); the "
                    "second would overwrite the first. Log it once per step, or give the second value its own name "
                    "(trainer.evaluate(..., metric_key_prefix='test') names a second evaluation's)."
                )
            self._values[key] = number
            (evaluation if key.startswith(_EVAL_PREFIXES) else training)[key] = number
        if training:
            self._ctx.log(training, at)
        if evaluation:
            self._ctx._log_evaluation(evaluation, at)


class _MLflowInRun(MLflowCallback):
    """The Trainer's MLflow callback (`report_to: [mlflow]`, or "all") inside a harness rank, whose MLflow is the
    harness run in rank 0 (usermlflow): params as `transformers.<key>`, no metric written twice."""

    def __init__(self, ctx: Context) -> None:
        super().__init__()
        self._harness_ctx = ctx
        self._ml_flow = _Prefixed(self._ml_flow)  # type: ignore[assignment]

    def _in_run(self) -> bool:
        """Rank 0 of a recorded job logs into the harness run: the active run, or (after the Trainer's end_run
        detached from it) the one MLFLOW_RUN_ID names, which MLflow's next call attaches to again."""
        run_id = self._harness_ctx.run_id
        active = self._ml_flow.active_run()
        at = active.info.run_id if active is not None else os.environ.get("MLFLOW_RUN_ID")
        return bool(run_id) and at == run_id

    def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:  # type: ignore[override]
        if not self._initialized:
            self.setup(args, state, kwargs.get("model"))
        if self._in_run():
            return  # in the run already, through ctx.log (Callback), at harness's steps
        super().on_log(args, state, control, **kwargs)  # a re-execution's scratch store (audit, trace)


class _Prefixed:
    """mlflow, with log_params putting `transformers.` before each name."""

    def __init__(self, mlflow: Any) -> None:
        self._mlflow = mlflow

    def log_params(self, params: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        return self._mlflow.log_params({f"{T.TRANSFORMERS_PARAM_PREFIX}{k}": v for k, v in params.items()}, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._mlflow, name)


class Trainer(transformers.Trainer):
    """`transformers.Trainer` inside a harness rank: `harness.transformers.Trainer(ctx, **kwargs)` takes every
    argument the Trainer's does (see the module's docstring for what it adds)."""

    def __init__(self, ctx: Context, *args: Any, **kwargs: Any) -> None:
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if training_args is None:  # the Trainer's own default, made here so that it can be placed
            training_args = kwargs["args"] = transformers.TrainingArguments(output_dir=str(ctx.output_dir / "trainer"))
        _place(ctx, training_args)
        super().__init__(*args, **kwargs)
        self._harness_ctx = ctx
        ctx._loop_of(boundaries.TRANSFORMERS)  # its loop, over a DataLoader of its own: said with its way out
        handler = self.callback_handler
        for callback in list(handler.callbacks):
            if type(callback) is MLflowCallback:
                handler.remove_callback(callback)
                handler.add_callback(_MLflowInRun(ctx))
        mine = [c for c in handler.callbacks if isinstance(c, Callback) and c._ctx is ctx]
        if not mine:
            mine = [Callback(ctx)]
            handler.add_callback(mine[0])
        self._harness_callback = mine[0]
        self._harness_callback._trainer = self

    def train(self, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        """`Trainer.train`; in `harness resume` (and its proof) from the run's checkpoint of the step it resumes."""
        resumed = self._harness_ctx._framework_resume()
        if resumed is not None:
            step, extra, folder = resumed
            if resume_from_checkpoint not in (None, False):
                raise ExperimentError(
                    f"trainer.train(resume_from_checkpoint={resume_from_checkpoint!r}) in a resume of the run: harness "
                    f"continues it from its own checkpoint of step {step}. Call trainer.train() without it.")
            self._harness_callback._resumed = (step, extra)
            resume_from_checkpoint = str(folder)
        return super().train(resume_from_checkpoint, *args, **kwargs)


def _place(ctx: Context, args: Any) -> None:
    """A relative output_dir would be the experiment folder's (the ranks' cwd): under ctx.output_dir it is the run's.
    checkpoint_every: N asks a Trainer that saves nothing for a checkpoint every N steps. On the CPU the Trainer runs
    harness's gloo job only with use_cpu=True."""
    if args.output_dir is None or not Path(args.output_dir).is_absolute():
        args.output_dir = str(ctx.output_dir / (args.output_dir or "trainer"))
    plan = ctx._plan
    if plan is not None and plan.every > 0 and args.save_strategy == transformers.trainer_utils.SaveStrategy.NO:
        args.save_strategy, args.save_steps = transformers.trainer_utils.SaveStrategy.STEPS, plan.every
    if ctx.device.type == "cpu" and not args.use_cpu:
        # TrainingArguments chose its device and Accelerate's process state when made, without use_cpu: one
        # process on its own. Both are chosen again, for harness's job.
        args.use_cpu = True
        PartialState._reset_state()
        args.__dict__.pop("_setup_devices", None)  # a cached_property
        args._setup_devices  # noqa: B018 - sets args.distributed_state again


def _cpu_index(storage: Any, location: str) -> Any:
    """torch.load's restorer for "cpu:<n>": a resumed multi-process Trainer on the CPU loads its optimizer with
    map_location=args.device, which Accelerate makes torch.device("cpu", local rank), a location torch knows no
    restorer for ("don't know how to restore data location ... cpu:0"). On the CPU the index names no other memory."""
    return storage if location.startswith("cpu:") else None


torch.serialization.register_package(100, lambda obj: None, _cpu_index)


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))
