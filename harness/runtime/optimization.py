"""What trains the model, as rank 0 sees it: the counted optimizer's class and settings, the LR schedulers bound to
it, the GradScaler that steps it and the autocast regions the training code enters; per step, the learning rate the
step used and the GradScaler's scale.

Read, never changed. An LR scheduler and an autocast region leave no trace on the optimizer, so the constructors of
LR schedulers, autocast's `__enter__` and `GradScaler.step` are wrapped for as long as a context lives (the last
`stop()` puts them back): each wrapper notes what it saw and calls the original with the same arguments. Every rank's
step clock hears GradScaler.step too (ScalerSteps): a step whose gradients held an inf or a NaN is skipped there, and
no optimizer hook tells it the step ended.
"""

from __future__ import annotations

import functools
import math
import numbers
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.optim import lr_scheduler

from harness.messages import Optimization
from harness.tags import METRIC_GRAD_SCALE, METRIC_LR

_SCHEDULER_STATE = ("optimizer", "last_epoch", "verbose")  # where it stands, not how it was set up
_SCHEDULER_PARTS = ("_schedulers", "_milestones")  # SequentialLR / ChainedScheduler keep their set-up private
_MAX_SHOWN = 200  # characters of a value harness cannot describe (its repr)


def class_path(obj: Any) -> str:
    kind = type(obj)
    return f"{kind.__module__}.{kind.__qualname__}"


def plain(value: Any) -> Any:
    """`value` as JSON can hold it: numbers, strings, lists, dicts; a one-element tensor as its number, a function
    as its name (LambdaLR's lr_lambdas), a scheduler as its class, anything else as its repr."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        number = float(value)
        return number if math.isfinite(number) else repr(number)
    if isinstance(value, torch.Tensor):
        return plain(value.item()) if value.numel() == 1 else f"tensor of shape {list(value.shape)}"
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (lr_scheduler.LRScheduler, lr_scheduler.ReduceLROnPlateau, torch.optim.Optimizer)):
        return class_path(value)
    if callable(value):
        return getattr(value, "__qualname__", None) or class_path(value)
    return repr(value)[:_MAX_SHOWN]


def describe_optimizer(optimizer: Any) -> dict[str, Any]:
    """The class and every param group's settings, the parameters themselves only counted."""
    groups = []
    for group in optimizer.param_groups:
        params = list(group.get("params", ()))
        settings = {str(k): plain(v) for k, v in group.items() if k != "params"}
        settings["params"] = f"{len(params)} tensors, {sum(p.numel() for p in params)} elements"
        groups.append(settings)
    return {"class": class_path(optimizer), "groups": groups}


def describe_scheduler(scheduler: Any) -> dict[str, Any]:
    """The class and its set-up: public attributes but the optimizer and its position; a sequence's schedulers by
    class (each is bound to the optimizer too, so described on its own)."""
    settings = {k: plain(v) for k, v in vars(scheduler).items() if not k.startswith("_") and k not in _SCHEDULER_STATE}
    for part in _SCHEDULER_PARTS:
        if isinstance(getattr(scheduler, part, None), (list, tuple)):
            settings[part.lstrip("_")] = plain(getattr(scheduler, part))
    return {"class": class_path(scheduler), "settings": settings}


def describe_scaler(scaler: Any) -> dict[str, Any]:
    settings: dict[str, Any] = {"enabled": bool(scaler.is_enabled())}
    if settings["enabled"]:
        settings.update(init_scale=plain(getattr(scaler, "_init_scale", None)),
                        growth_factor=plain(scaler.get_growth_factor()),
                        backoff_factor=plain(scaler.get_backoff_factor()),
                        growth_interval=plain(scaler.get_growth_interval()))
    return {"class": class_path(scaler), "settings": settings}


def learning_rates(optimizer: Any) -> dict[str, float]:
    """Each param group's lr as the step about to run uses it: METRIC_LR for group 0, METRIC_LR.group<i> for the rest."""
    out = {}
    for i, group in enumerate(optimizer.param_groups):
        lr = group.get("lr")
        if isinstance(lr, torch.Tensor):
            lr = lr.item() if lr.numel() == 1 else None
        if isinstance(lr, numbers.Real):
            out[METRIC_LR if i == 0 else f"{METRIC_LR}.group{i}"] = float(lr)
    return out


def _bound_to(scheduler: Any, optimizer: Any) -> bool:
    bound = getattr(scheduler, "optimizer", None)
    # A framework's wrapper (Accelerate's AcceleratedOptimizer) keeps the torch optimizer that steps as .optimizer.
    return bound is optimizer or getattr(bound, "optimizer", None) is optimizer


_LIVE: list[Watch] = []  # the watches started and not stopped, in start order
_RESTORE: list[tuple[Any, str, Any]] = []  # (owner, name, what it held) for every wrapper installed
# Called with ("before" | "after", optimizer) around every GradScaler.step: every rank's step clock, which must see a
# step the GradScaler skipped (inf or NaN gradients: no optimizer.step(), so no optimizer hook fires).
_SCALER_STEPS: list[Callable[[str, Any], None]] = []


class ScalerSteps:
    """`listener` hears every GradScaler.step until remove(); the wrappers stay while a watch or a listener lives."""

    def __init__(self, listener: Callable[[str, Any], None]) -> None:
        if not _LIVE and not _SCALER_STEPS:
            _install()
        _SCALER_STEPS.append(listener)
        self._listener = listener

    def remove(self) -> None:
        if self._listener in _SCALER_STEPS:
            _SCALER_STEPS.remove(self._listener)
            if not _LIVE and not _SCALER_STEPS:
                _uninstall()


def _install() -> None:
    def made(cls: type, *args: Any, **kwargs: Any) -> Any:
        # Every scheduler is made through here, whether or not its __init__ calls its base's (SequentialLR's does
        # not); object.__new__ takes no arguments when __init__ is defined.
        scheduler: Any = object.__new__(cls)
        for watch in _LIVE:
            watch._made(scheduler)
        return scheduler

    autocast = torch.amp.autocast_mode.autocast
    original_enter = autocast.__enter__

    @functools.wraps(original_enter)
    def enter(region: Any) -> Any:
        entered = original_enter(region)
        if getattr(region, "_enabled", False):
            for watch in _LIVE:
                watch._entered(region)
        return entered

    scaler_class = torch.amp.GradScaler
    original_step = scaler_class.step

    @functools.wraps(original_step)
    def scaler_step(scaler: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        outer = [(watch, watch._scaler) for watch in _LIVE]
        for watch, _ in outer:
            watch._scaler = scaler
        listeners = list(_SCALER_STEPS)
        for listener in listeners:
            listener("before", optimizer)
        try:
            retval = original_step(scaler, optimizer, *args, **kwargs)
        finally:
            for watch, was in outer:
                watch._scaler = was
        for listener in listeners:
            listener("after", optimizer)
        return retval

    for owner in (lr_scheduler.LRScheduler, lr_scheduler.ReduceLROnPlateau):
        if "__new__" not in owner.__dict__ and not any("__new__" in c.__dict__ for c in owner.__mro__[1:-1]):
            _patch(owner, "__new__", staticmethod(made))  # ReduceLROnPlateau is LRScheduler's subclass since torch 2.2
    _patch(autocast, "__enter__", enter)
    _patch(scaler_class, "step", scaler_step)


def _patch(owner: Any, name: str, replacement: Any) -> None:
    _RESTORE.append((owner, name, owner.__dict__.get(name)))
    setattr(owner, name, replacement)


def _uninstall() -> None:
    for owner, name, original in reversed(_RESTORE):
        if original is None:
            delattr(owner, name)  # inherited again (object.__new__)
        else:
            setattr(owner, name, original)
    _RESTORE.clear()


class Watch:
    """Rank 0's view of the optimization, from start() to stop(). `step()` is the step whose work is under way."""

    def __init__(self, step: Callable[[], int]) -> None:
        self._step = step
        self._schedulers: list[weakref.ref[Any]] = []  # every LR scheduler made while watching, in order
        self._described: dict[int, dict[str, Any]] = {}  # id(scheduler) -> its description, taken once
        self._optimizer: weakref.ref[Any] | None = None  # the counted optimizer, once it stepped
        self._optimizer_settings: dict[str, Any] | None = None  # as at its first step
        self._scaler: Any = None  # the GradScaler whose step() is under way
        self._scaler_settings: dict[str, Any] | None = None
        self._autocast: dict[tuple[str, str], int] = {}  # (device type, dtype) -> the step it was first entered in

    # -- what the training code does -------------------------------------------------------------------
    def start(self) -> Watch:
        """Watch from now on. The wrappers are installed once for every watch alive in the process and put back when
        the last one stops, whatever the order the watches stop in (two contexts of one process, closed first to
        last, would otherwise leave the first one's wrapper installed for good)."""
        if not _LIVE and not _SCALER_STEPS:
            _install()
        _LIVE.append(self)
        return self

    def stop(self) -> None:
        if self in _LIVE:
            _LIVE.remove(self)
            if not _LIVE and not _SCALER_STEPS:
                _uninstall()

    # -- what the wrappers tell every live watch --------------------------------------------------------
    def _made(self, scheduler: Any) -> None:
        self._schedulers.append(weakref.ref(scheduler))

    def _entered(self, region: Any) -> None:
        key = (str(region.device), str(region.fast_dtype).removeprefix("torch."))
        if key not in self._autocast:
            self._autocast[key] = self._step()

    def on_step(self, optimizer: Any) -> tuple[dict[str, float], bool]:
        """The counted optimizer is about to take a step: the values to log at it (its learning rates, the
        GradScaler's scale), and whether this is the first step seen (the set-up is then taken)."""
        first = self._optimizer is None
        if first:
            self._optimizer = weakref.ref(optimizer)
            self._optimizer_settings = describe_optimizer(optimizer)
            self._describe_schedulers(optimizer)
        values = learning_rates(optimizer)
        scaler = self._scaler
        if scaler is not None:
            if self._scaler_settings is None:
                self._scaler_settings = describe_scaler(scaler)
            if scaler.is_enabled():
                # The scale is a one-element tensor: GradScaler.step has just read its inf checks, so this waits for nothing.
                values[METRIC_GRAD_SCALE] = float(scaler.get_scale())
        return values, first

    def _describe_schedulers(self, optimizer: Any) -> None:
        for ref in self._schedulers:
            scheduler = ref()
            if scheduler is not None and id(scheduler) not in self._described and _bound_to(scheduler, optimizer):
                self._described[id(scheduler)] = describe_scheduler(scheduler)

    def message(self) -> Optimization:
        """What was seen so far; a scheduler made after the first step is described as it is now."""
        optimizer = self._optimizer() if self._optimizer is not None else None
        if optimizer is not None:
            self._describe_schedulers(optimizer)
        return Optimization(
            optimizer=self._optimizer_settings,
            schedulers=tuple(self._described.values()),
            grad_scaler=self._scaler_settings,
            autocast=tuple({"device_type": d, "dtype": t, "first_step": s} for (d, t), s in self._autocast.items()),
        )
