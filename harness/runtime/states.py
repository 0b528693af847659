"""State a step depends on besides the model, optimizer, scheduler and scaler: what `ctx.track` takes by name (an EMA,
a loader's file position, a sampler, a scaler of the user's own), and the live copies of the registered model that it
was not given.

A copy of the registered model that training updates (torch's AveragedModel, torchvision's ExponentialMovingAverage,
timm's ModelEmaV2, SWA, a `copy.deepcopy` the loop averages into) is state no checkpoint holds unless it is tracked: a
resumed process would make it anew. Rank 0 looks for such copies whenever it saves a checkpoint, and the checkpoint
says which it found, so that a resume refuses with the line to add rather than continue with a copy started afresh.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from harness.errors import ExperimentError, HarnessError
from harness.runtime.fingerprint import fingerprint

UNTRACKED = "untracked"  # the COMPLETE marker's entry: [{"name", "type", "of"}] of each untracked live copy


def check_trackable(states: Mapping[str, Any]) -> None:
    """What ctx.track takes by name must save and load its state."""
    for name, obj in states.items():
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise ExperimentError(
                f"ctx.track({name}=...): a {type(obj).__name__} has no state_dict()/load_state_dict(), so no checkpoint "
                "can hold it. Track an object with both (an nn.Module such as an AveragedModel, or a class of your own "
                "that returns and takes its state as tensors and plain values)."
            )


def check_names(saved: Mapping[str, Any], given: Mapping[str, Any]) -> None:
    """The states ctx.track took by name are the ones the checkpoint holds: one left out would start anew."""
    lacking, unsaved = sorted(saved.keys() - given.keys()), sorted(given.keys() - saved.keys())
    if lacking:
        raise HarnessError(
            f"the checkpoint holds the state of {lacking[0]!r} (ctx.track({lacking[0]}=...)) but this code tracks "
            "nothing by that name. Resume with the code of the checkpointed run, which passes it to ctx.track."
        )
    if unsaved:
        raise HarnessError(
            f"ctx.track({unsaved[0]}=...) is tracked but the checkpoint holds no state of {unsaved[0]!r}: it was "
            "written by code that did not track it, and resuming would start it anew. Resume with the code of the "
            "checkpointed run."
        )


def tensors_in(obj: Any, path: str = "") -> list[tuple[str, torch.Tensor]]:
    """Every tensor in a state_dict's nesting, with its dotted path."""
    if isinstance(obj, torch.Tensor):
        return [(path, obj)]
    items = obj.items() if isinstance(obj, Mapping) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    return [found for key, value in items for found in tensors_in(value, f"{path}.{key}" if path else str(key))]


def track_line(entry: Mapping[str, str]) -> str:
    """The line that tracks an untracked copy or optimizer, as the training code names it."""
    if entry.get("kind") == "optimizer":
        return f"ctx.track({entry.get('name') or 'optimizer'})"
    name = entry.get("name") or "ema"
    return f"ctx.track({name}={name})"


def described(entry: Mapping[str, str]) -> str:
    """An untracked copy, as a line names it: `ema` (an AveragedModel), a live copy of the registered Net; or an
    untracked optimizer: the state of the AdamW `opt`, the optimizer whose steps are the run's."""
    kind = entry["type"]
    a = "an" if kind[:1].lower() in "aeiou" else "a"
    named = f"`{entry['name']}` ({a} {kind})" if entry.get("name") else f"{a} {kind}"
    if entry.get("kind") == "optimizer":
        return f"the state of the {kind} `{entry.get('name') or 'optimizer'}`, the optimizer whose steps are the run's"
    return f"{named}, a live copy of the registered {entry['of']}"


def _module_ids(obj: Any) -> set[int]:
    """The modules `obj` holds: its own when it is one, else those among its attributes (an EMA class of one's own)."""
    if isinstance(obj, torch.nn.Module):
        return {id(m) for m in obj.modules()}
    found: set[int] = set()
    for value in getattr(obj, "__dict__", {}).values():
        if isinstance(value, torch.nn.Module):
            found |= {id(m) for m in value.modules()}
    return found


def _layout(module: torch.nn.Module) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    return [(k, tuple(v.shape), v.dtype) for k, v in module.state_dict().items() if isinstance(v, torch.Tensor)]


def _holds(value: Any, copy: torch.nn.Module) -> bool:
    if value is copy:
        return True
    if isinstance(value, torch.nn.Module):
        return any(m is copy for m in value.modules())
    return any(v is copy or (isinstance(v, torch.nn.Module) and any(m is copy for m in v.modules()))
               for v in getattr(value, "__dict__", {}).values() if isinstance(v, torch.nn.Module))


def _owner(copy: torch.nn.Module) -> tuple[str, str]:
    """(the training code's name for what holds `copy`, its type), from the frames of the code that is saving: the
    training loop's own frame is among them (a checkpoint is saved from inside its `for`)."""
    frame = sys._getframe(1)
    while frame is not None:
        module = str(frame.f_globals.get("__name__", ""))
        if module.split(".")[0] not in ("harness", "torch"):
            for name, value in list(frame.f_locals.items()):
                try:
                    held = not name.startswith("_") and _holds(value, copy)
                except Exception:  # an object of the user's whose attributes cannot be read: not the holder
                    held = False
                if held:
                    return name, type(value).__name__
        frame = frame.f_back  # type: ignore[assignment]
    return "", type(copy).__name__


class Copies:
    """Rank 0's watch over the live copies of the registered model that ctx.track was not given."""

    def __init__(self) -> None:
        self._seen: dict[int, str] = {}  # id of a copy -> its fingerprint at the last checkpoint

    def untracked(self, model: torch.nn.Module, tracked: Iterable[Any], initial: str | None) -> list[dict[str, str]]:
        """The copies of `model` (same class, same tensors' names and shapes) that no tracked object holds and that
        training changed: since the last checkpoint, or, seen for the first time, away from the initial weights (a
        copy of the initial weights is made again the same by a resumed process)."""
        covered = {id(m) for m in model.modules()}
        for obj in tracked:
            covered |= _module_ids(obj)
        kind, layout, found, seen = type(model), None, [], {}
        for obj in gc.get_objects():
            if type(obj) is not kind or id(obj) in covered:
                continue
            layout = layout if layout is not None else _layout(model)
            if _layout(obj) != layout:
                continue
            sha = fingerprint(obj)
            before = self._seen.get(id(obj))
            seen[id(obj)] = sha
            if (before is None and sha != initial) or (before is not None and before != sha):
                name, owner = _owner(obj)
                found.append({"name": name, "type": owner, "of": kind.__name__})
        self._seen = seen
        return found
