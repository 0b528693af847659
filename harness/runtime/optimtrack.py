"""The optimizer a checkpoint holds when the training code gave none to `ctx.track`.

A loop that steps an optimizer it never tracked would checkpoint without that optimizer's state (momentum, Adam's
moments, its step counts), and a resume from it would start them anew. Where the choice is unambiguous - exactly one
live optimizer steps over the registered model's parameters (all its trainable ones, nothing else) - that optimizer is
tracked as `ctx.track(optimizer)` would, at the first checkpoint saved or loaded: every rank runs the same code, so
each finds its own counterpart. Otherwise the checkpoint says which optimizer it lacks (rank 0's marker), and the
resume refusal names the line to add.
"""

from __future__ import annotations

import gc
import sys
from typing import Any

import torch

KIND = "optimizer"  # an untracked entry's "kind" (states.UNTRACKED) for an optimizer's missing state


def find(model: torch.nn.Module) -> Any:
    """The one live optimizer over `model`'s parameters (each of its trainable ones, no other tensor; a wrapper of it
    is it), or None when there is none or more than one."""
    every = {id(p) for p in model.parameters()}
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    if not trainable:
        return None
    found = []
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.optim.Optimizer):  # isinstance would ask proxies for their __class__
            continue
        stepped = {id(p) for group in obj.param_groups for p in group["params"]}
        if trainable <= stepped <= every:
            found.append(obj)
    # A wrapper that holds the stepping optimizer as `.optimizer` (Accelerate's AcceleratedOptimizer) shares its
    # param_groups: the one is the other, and the inner one is what steps and holds the state.
    inner = [obj for obj in found if not any(getattr(obj, "optimizer", None) is other for other in found)]
    return inner[0] if len(inner) == 1 else None


def entry(optimizer: Any, model: torch.nn.Module) -> dict[str, str]:
    """The checkpoint marker's entry for an untracked optimizer: its name in the training code, its class, the
    registered model's class."""
    inner = getattr(model, "module", model)
    return {"kind": KIND, "name": _name(optimizer), "type": type(optimizer).__name__, "of": type(inner).__name__}


def _name(optimizer: Any) -> str:
    """The training code's name for `optimizer`, from the frames of the code that is saving (the training loop's own
    frame is among them: a checkpoint is saved from inside its `for`); "optimizer" when none holds it."""
    frame = sys._getframe(1)
    while frame is not None:
        if str(frame.f_globals.get("__name__", "")).split(".")[0] not in ("harness", "torch"):
            for name, value in list(frame.f_locals.items()):
                if value is optimizer and not name.startswith("_"):
                    return name
        frame = frame.f_back  # type: ignore[assignment]
    return "optimizer"
