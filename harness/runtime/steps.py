"""What a training step is: one step of the counted optimizer, whatever feeds the batches.

A loop may draw its batches from `ctx.loader`, from a `get_batch()` of its own, or accumulate several
micro-batches per update; the one thing every loop shares is the optimizer step. So the clock counts
the steps of the tracked optimizer (`ctx.track`), or of the first optimizer that steps when none is
tracked, and `ctx.step` is the index of the step in progress - or of the step that has just ended,
until the next step's work begins, so that a value logged after `optimizer.step()` lands at the step
it belongs to (as it did when a step was a batch).

Signs that the next step has begun: a batch from the training loader, an iteration of `ctx.steps()`,
a training-mode forward of the registered model, the counted optimizer about to step again, or a key
logged a second time at the step that has ended.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from harness.runtime import hooks
from harness.runtime.optimization import ScalerSteps


class StepClock:
    """Counts optimizer steps in one rank and says when a step begins and ends.

    `on_begin(k, clean)` is called once when step k's work begins (`clean`: at a boundary harness
    controls, before anything of step k ran: a training-loader fetch or a `ctx.steps()` iteration);
    `on_end(k)` when the counted optimizer finished step k; `on_optimizer(phase, optimizer)` for every
    counted optimizer step ("pre"/"post"), for an op tracer that must see them. `beat()` is any sign of life.
    """

    def __init__(
        self,
        on_begin: Callable[[int, bool], None],
        on_end: Callable[[int], None],
        beat: Callable[[], None],
        on_optimizer: Callable[[str, Any], None] | None = None,
        on_first_step: Callable[[Any], None] | None = None,
    ) -> None:
        self.done = 0  # counted optimizer steps completed (or ctx.steps iterations begun)
        self.index = 0  # ctx.step
        self.begun = False  # step `index` has begun
        self.optimizer_steps = 0  # counted optimizer steps actually taken (a GradScaler may skip some)
        self._tracked: Any = None
        # The optimizer whose steps count, held: train() may drop it before the end-of-run fingerprint is taken.
        self._counted: Any = None
        self._on_begin, self._on_end, self._beat = on_begin, on_end, beat
        self._on_optimizer = on_optimizer
        self._on_first_step = on_first_step
        self._steps_before_scaler = 0  # optimizer_steps when a GradScaler.step began
        self._handles: list[Any] = [
            register_optimizer_step_pre_hook(self._pre),
            register_optimizer_step_post_hook(self._post),
            ScalerSteps(self._scaler_step),
        ]

    # -- which optimizer counts ------------------------------------------------------------------
    def track(self, optimizer: Any) -> None:
        """ctx.track(optimizer): its steps are the run's steps (another optimizer's are not counted)."""
        self._tracked = optimizer
        self._counted = optimizer

    @property
    def counted(self) -> Any:
        return self._counted

    def _counts(self, optimizer: Any) -> bool:
        if self._counted is None:
            # None tracked: the first optimizer that steps is the run's (a GAN's second one is not counted).
            self._counted = optimizer
            return True
        return self._counted is optimizer

    # -- events ----------------------------------------------------------------------------------
    @property
    def pending(self) -> bool:
        """Step `index` has ended and the next has not begun yet."""
        return self.done > self.index

    def begin(self, clean: bool = False) -> int:
        """The work of a step is starting now: advance to it if the previous one has ended."""
        if self.pending:
            self.index, self.begun = self.done, False
        if not self.begun:
            self.begun = True
            self._on_begin(self.index, clean)
        self._beat()
        return self.index

    def would_begin(self) -> bool:
        """The next begin() would start a new step (used to checkpoint before a fetch draws anything)."""
        return self.pending or not self.begun

    def set(self, step: int) -> None:
        """ctx.steps() is at iteration `step`: that is the step, whatever the optimizer counted."""
        self.done = step
        if self.index != step:
            self.index, self.begun = step, False

    def _pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self._counts(optimizer):
            return
        if self.optimizer_steps == 0 and self._on_first_step is not None:
            self._on_first_step(optimizer)
        self.begin()
        if self._on_optimizer is not None:
            self._on_optimizer("pre", optimizer)

    def _post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._counted is not optimizer:
            return
        if self._on_optimizer is not None:
            self._on_optimizer("post", optimizer)
        self.optimizer_steps += 1
        self.done = self.index + 1
        self._beat()
        self._on_end(self.index)

    def _scaler_step(self, phase: str, optimizer: Any) -> None:
        """A GradScaler that found an inf or a NaN in the gradients skips optimizer.step(): the step still ends there -
        its batches were drawn and its values logged - as it would have, had the optimizer stepped. (Without this the
        next batch of a ctx.loader loop worked on the same step, and a ctx.log of the same key failed the run.)"""
        if phase == "before":
            self._steps_before_scaler = self.optimizer_steps
            return
        if self.optimizer_steps != self._steps_before_scaler or not self._counts(optimizer):
            return  # it stepped (and _post ended the step), or it is not the optimizer whose steps count
        self.begin()
        self.done = self.index + 1
        self._beat()
        self._on_end(self.index)

    def close(self) -> None:
        """Remove the global optimizer hooks (an audit runs several contexts in one process)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def optimizer_parameters(optimizer: Any) -> torch.nn.Module:
    """The parameters an optimizer steps, as a module (names `g<group>.<index>`): what is fingerprinted,
    compared across ranks and checkpointed when no model was given to ctx.ddp. The tensors are the
    optimizer's own (no copy), so loading a state dict into it restores them."""
    holder = torch.nn.Module()
    for g, group in enumerate(optimizer.param_groups):
        for i, param in enumerate(group["params"]):
            holder.register_parameter(f"g{g}_{i}", param if isinstance(param, torch.nn.Parameter)
                                      else torch.nn.Parameter(param, requires_grad=param.requires_grad))
    return holder


class StepHook(hooks.ModuleHook):
    """The registered model's forward pre-hook: a training-mode forward with gradients is the next step's work
    beginning. Copies of the model are made without it (hooks.add); the clock (and through it the rank's context) is
    held weakly and the module checked to be the registered one all the same, since another model's forwards (an EMA
    copy's) are not this one's steps."""

    def __init__(self, model: torch.nn.Module, clock: StepClock) -> None:
        self._model, self._clock = weakref.ref(model), weakref.ref(clock)

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        clock = self._clock()
        if clock is not None and module is self._model() and module.training and torch.is_grad_enabled():
            clock.begin()
