"""Hooks harness puts on the user's modules, made so that a module copies, pickles and saves as it would without them."""

from __future__ import annotations

from typing import Any

# What a copy of a module holds in place of a harness hook: a built-in that accepts any positional arguments and
# returns None (tuple's __init__ is object's, which ignores extra arguments for a type with its own __new__), so a
# hook's call on the copy changes nothing, and the pickle names only builtins: a model saved with torch.save inside
# a run loads where harness is not installed.
_INERT = ().__init__


class ModuleHook:
    """Base of every forward (pre-)hook harness registers on a user's module.

    A hook's own references (the rank's context, a tracer) must not travel with the module: `copy.deepcopy(model)`
    (every EMA recipe: torchvision's, `torch.optim.swa_utils.AveragedModel`, timm's) would copy the context with its
    pipe and shared memory - which fails, and the half-made copy's finaliser closed the rank's descriptors - and
    `torch.save(model)` would fail to pickle it. A copy, deep or pickled, gets a no-op hook instead: the copy is
    another model, whose forwards are not the registered model's training steps.
    """

    def __reduce__(self) -> tuple[Any, ...]:
        return (getattr, ((), "__init__"))

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return _INERT
