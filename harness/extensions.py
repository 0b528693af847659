"""The registry of extras: optional verbs and modes beside the core, each declared as an `Extra`.

The core (run, replay, compare, the record, the UI) imports no extra (pyproject.toml's contract); it reaches them
through this registry, as the commands reach a backend through harness.executors. An extra declares, by module
path, the click commands it adds to the `harness` group (`cli`), the names it adds to the Python API (`api`:
`harness.NAME`, named in `names`), and the extension points of the core it fills (`hooks`: point -> "module:attribute"), so that
declaring one loads nothing: `harness --help` and `import harness` stay instant, and a rank loads only the hook
it calls.

The built-in extras are the folders of harness/extras (`BUILTIN`). One from another package registers through the
`harness.extras` entry-point group:

    [project.entry-points."harness.extras"]
    mine = "my_package.extra:EXTRA"

or, in-process, through `register(extra)`. One that does not load is a warning, not a failure of harness.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Protocol

from harness import entrypoints, events

BUILTIN = ("trace", "bisect", "verify", "attest", "invariant")  # each a package of harness.extras declaring EXTRA
ENTRY_POINTS = "harness.extras"  # the entry-point group of outside extras

# The extension points the core calls, and what each is handed (the extra's function decides the rest).
LOCALIZE = "replay.localize"  # a DIVERGED replay's first differing op: (tracker, replay_id, comparison, ...) -> Localized
COMPARE = "compare"  # compare's other meanings: (tracker, run_a, run_b, report) -> a result, or None (two runs)
SIGN = "export.sign"  # export --sign: (tracker, run_id, key) -> the attestation's bytes
STEP_TRACER = "rank.step_tracer"  # inside a rank: (code_dir, model, meta, device) -> the traced step's tracer
INVARIANT = "rank.invariant"  # inside a rank: () -> world-size-invariant mode's model wrapper, step and samplers


class Compared(Protocol):
    """What a COMPARE hook returns for two runs it compares (two traces): the CLI prints its lines, its --json
    document, and exits with its code."""

    @property
    def exit_code(self) -> int: ...

    def lines(self) -> list[str]: ...

    def document(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Extra:
    """One extra: its name, and where its parts are (module paths, imported on first use)."""

    name: str
    cli: str | None = None  # the module whose click commands join the `harness` group
    api: str | None = None  # the module of the names it adds to the Python API (harness.NAME)
    names: tuple[str, ...] = ()  # those names (the module's __all__): known without importing it
    hooks: Mapping[str, str] = field(default_factory=dict)  # extension point -> "module:attribute"


_REGISTRY: dict[str, Extra] = {}
_loaded = False


def _ensure_loaded() -> None:
    global _loaded
    if not _loaded:
        _loaded = True  # first: _load() registers through register(), which lands here again
        _load()


def _load() -> None:
    entrypoints.load(BUILTIN, "harness.extras", "EXTRA", ENTRY_POINTS, Extra, "extra", register)


def register(extra: Extra) -> None:
    """Make an extra known (in this process): its commands, its API names and its hooks."""
    _ensure_loaded()  # the built-in ones first, whoever registers first
    _REGISTRY[extra.name] = extra


def extras() -> dict[str, Extra]:
    """Every known extra by name: the built-in ones first, then the entry points', then register()'s."""
    _ensure_loaded()
    return dict(_REGISTRY)


def _loads(extra: Extra, what: str, path: str) -> ModuleType | None:
    try:
        return importlib.import_module(path)
    except Exception as err:  # an outside extra's broken module is a warning; harness's own failing is a bug
        if extra.name in BUILTIN:
            raise
        events.emit(events.Warning(f"the extra {extra.name}'s {what} ({path}) does not load: {err}"))
        return None


def cli_modules() -> list[ModuleType]:
    """The modules of the extras' commands, in the registry's order (harness/cli/main.py adds their commands)."""
    found = [_loads(e, "commands", e.cli) for e in extras().values() if e.cli is not None]
    return [m for m in found if m is not None]


def api_names() -> dict[str, str]:
    """The names the extras add to the Python API, with the module of each (none is imported)."""
    return {name: extra.api for extra in extras().values() if extra.api is not None for name in extra.names}


def api(name: str) -> Any:
    """The extras' API name `name` (harness.trace, harness.TraceOptions, ...); AttributeError when none has it."""
    module = api_names().get(name)
    if module is None:
        raise AttributeError(name)
    return getattr(importlib.import_module(module), name)


def hook(point: str) -> Callable[..., Any] | None:
    """The function that fills extension point `point` (the first extra that declares it), else None: the core
    then goes without what the extra adds."""
    for extra in extras().values():
        target = extra.hooks.get(point)
        if target is None:
            continue
        path, _, attribute = target.partition(":")
        module = _loads(extra, f"hook {point}", path)
        if module is not None:
            found: Callable[..., Any] = getattr(module, attribute)
            return found
    return None
