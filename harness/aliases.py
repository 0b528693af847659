"""The import paths of modules that moved into harness/extras, kept: `import harness.optrace.tracer` gives the module
now at harness/extras/trace/optrace/tracer.py, the same module object (its classes, its private names, a test's
monkeypatch), never a second copy.

A finder on sys.meta_path, installed by harness/__init__.py, answers for the old names only and imports the new
module when one is asked for: the core's own modules import no extra (pyproject.toml's contract), and a user's
`from harness.judge.claims import Claim` keeps working. No file is left at an old path, so that git follows each
moved file.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

# Old name -> new name; an old package's submodules follow it (harness.optrace.diff), unless named on their own.
MOVED = {
    "harness.optrace": "harness.extras.trace.optrace",
    "harness.optrace.hooks": "harness.runtime.hooks",  # the hooks on the user's modules are the runtime's own
    "harness.extras.trace.optrace.hooks": "harness.runtime.hooks",  # `from harness.optrace import hooks`
    "harness.commands.trace": "harness.extras.trace.command",
    "harness.commands.bisect": "harness.extras.bisect.command",
    "harness.commands.verify": "harness.extras.verify.command",
    "harness.judge.claims": "harness.extras.verify.claims",
    "harness.judge.verify_report": "harness.extras.verify.report",
    "harness.record.attest": "harness.extras.attest.signing",
    "harness.runtime.invariant": "harness.extras.invariant.training",
}


def new_name(old: str) -> str | None:
    """Where the module once named `old` is now; None: it did not move."""
    if old in MOVED:
        return MOVED[old]
    package = old.rpartition(".")[0]
    while package:
        if package in MOVED:
            return f"{MOVED[package]}.{old[len(package) + 1:]}"
        package = package.rpartition(".")[0]
    return None


class _Moved(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> ModuleSpec | None:
        new = new_name(fullname)
        if new is None:
            return None
        module = importlib.import_module(new)
        # The module's own __spec__, __name__ and __path__ stay: the import system sets only what a module lacks.
        return importlib.util.spec_from_loader(fullname, self, is_package=hasattr(module, "__path__"))

    def create_module(self, spec: ModuleSpec) -> ModuleType:
        new = new_name(spec.name)
        assert new is not None  # find_spec answered for it
        return importlib.import_module(new)

    def exec_module(self, module: ModuleType) -> None:
        pass  # the module ran under its new name


def install() -> None:
    """Answer for the old names in this process (before the path finders, which would load a second copy)."""
    if not any(isinstance(f, _Moved) for f in sys.meta_path):
        sys.meta_path.insert(0, _Moved())
