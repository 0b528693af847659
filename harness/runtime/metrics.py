"""What `ctx.log` records: a metric's value as a float, keys harness keeps for its own metrics refused, and rank 0's
book of what was logged - each key's steps (a second value at one step is refused, never overwritten) and what its
steps count (training steps, or an evaluation's index of its own)."""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from harness.errors import ExperimentError
from harness.runtime.fingerprint import fingerprint
from harness.tags import EVAL_AT_STEP, OWN_METRIC_PREFIX


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


def not_own(values: Mapping[str, float]) -> None:
    for key in values:
        if key.startswith(OWN_METRIC_PREFIX):
            raise ExperimentError(
                f"ctx.log: '{key}' is named like the metrics harness logs itself ({OWN_METRIC_PREFIX}*: the "
                "learning rate, the GradScaler's scale). Give your value another key."
            )


def _counted(index: str) -> str:
    return "training steps" if index == EVAL_AT_STEP else f"{index} indexes"


class Logged:
    """Rank 0's book of the keys logged: the steps each was logged at, what its steps count, and which keys training
    logged and which an evaluation did (the record names the evaluation's: harness.metrics.evaluation)."""

    def __init__(self) -> None:
        self.steps: dict[str, set[int]] = {}  # the steps each key was logged at (no silent overwrite)
        self._index_of: dict[str, str] = {}  # what each key's steps count: EVAL_AT_STEP, or an evaluation's index
        self._by_training: set[str] = set()
        self._by_evaluation: set[str] = set()

    def by(self, keys: Mapping[str, float], index: str, evaluation: bool) -> dict[str, str] | None:
        """Note what logged `keys` and what their steps count (a key's series holds one kind of step); the evaluation's
        keys when they changed, else None."""
        seen = self._by_evaluation if evaluation else self._by_training
        # Every call after a key's first (a key training logged counts steps: it got past the check below).
        if seen.issuperset(keys) and (not evaluation or all(self._index_of[key] == index for key in keys)):
            return None
        before = self.evaluation_keys()
        for key in keys:
            known = self._index_of.setdefault(key, index)
            if known != index:
                raise ExperimentError(
                    f"'{key}' was logged at {_counted(known)}, and now at {_counted(index)}: one series cannot hold "
                    "both. Give one of them its own key."
                )
            (self._by_evaluation if evaluation else self._by_training).add(key)
        after = self.evaluation_keys()
        return after if after != before else None

    def evaluation_keys(self) -> dict[str, str]:
        return {key: self._index_of[key] for key in sorted(self._by_evaluation - self._by_training)}

    def again(self, values: Mapping[str, float], step: int) -> str | None:
        """Note `values` at `step`; the first key already logged there (its value would overwrite), else None."""
        for key in values:
            seen = self.steps.setdefault(key, set())
            if step in seen:
                return key
            seen.add(step)
        return None

    def any_at(self, values: Mapping[str, float], step: int) -> bool:
        return any(step in self.steps.get(k, ()) for k in values)


def logged_twice(key: str, step: int, where: str, *, counted: bool, model: torch.nn.Module | None,
                 initial_fingerprint: str | None) -> str:
    """Why `key` came back at `step` (`where`: "step 3", or an evaluation's index): micro-batches of one step, or
    a loop whose updates no optimizer makes. `counted`: an optimizer (or ctx.steps) counts the steps."""
    said = f"ctx.log: '{key}' was already logged at {where}; a second value would overwrite the first."
    micro = ("Log each key once per step (ctx.step counts optimizer steps: micro-batches share one), or give this "
             "value its own key.")
    if where != f"step {step}" or counted:
        return f"{said} {micro}"
    by_hand = ("ctx.step counts the steps of a torch.optim optimizer (or the iterations of ctx.steps), and an "
               "update written by hand (p.data.add_(p.grad, alpha=-lr)) is neither, so every value lands at step 0. "
               "Drive the loop with `for step in ctx.steps(n):`, one iteration per update, or update with an "
               "optimizer (torch.optim.SGD(model.parameters(), lr=lr)).")
    if model is None:
        return f"{said} No optimizer has stepped yet. If the loop updates the weights by hand: {by_hand} Else: {micro}"
    if fingerprint(model) == initial_fingerprint:
        return f"{said} {micro}"  # the weights are as registered: micro-batches before the first optimizer step
    return f"{said} The weights changed but no optimizer has stepped: {by_hand}"
