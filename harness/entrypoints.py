"""Declarations found by name: a registry's built-in ones, then every outside package's through an entry-point group.

The executor backends (harness/executors) and the extras (harness/extensions.py) register this way: a built-in module
is imported by its name and its declaration read, an outside package's entry point is loaded and checked to be a
declaration of the registry's kind. A broken outside package must not take harness down with it: what does not load,
or declares something else, is a warning naming the entry point, never a failure.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from importlib import metadata
from typing import TypeVar

from harness import events

D = TypeVar("D")


def load(builtin: Iterable[str], package: str, attribute: str, group: str, kind: type[D], what: str,
         register: Callable[[D], None]) -> None:
    """Register `package.NAME`'s `attribute` for each NAME in `builtin`, then each entry point of `group`: its
    `attribute` when it is a module that has one, else what it loads to; `what` names the kind in a warning
    (`the executor entry point ...`, `... is not a harness Backend`)."""
    for name in builtin:
        register(getattr(importlib.import_module(f"{package}.{name}"), attribute))
    for point in metadata.entry_points(group=group):
        try:
            loaded = point.load()
        except Exception as err:  # a broken outside package must not take harness down with it
            events.emit(events.Warning(f"the {what} entry point {point.name} ({point.value}) does not load: {err}"))
            continue
        declared = getattr(loaded, attribute, loaded)
        if not isinstance(declared, kind):
            events.emit(events.Warning(f"the {what} entry point {point.name} ({point.value}) is not a harness "
                                       f"{kind.__name__}; ignored."))
            continue
        register(declared)
