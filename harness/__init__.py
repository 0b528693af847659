"""harness: run PyTorch DDP experiments so that they can be replayed and judged bit for bit.

The Python API (harness/commands/api.py) is here by name: `harness.run(harness.RunOptions(...))`,
`harness.replay`, `harness.compare`, ... one function per command line verb, and their options. It loads on
first use, so that `import harness` (and `harness --help`) stays instant; type checkers read the real
signatures from __init__.pyi (an import here, even under TYPE_CHECKING, would put the whole API in the import
graph of every module that reads `harness.__version__`, the rank's code among them).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
from typing import Any

from harness import aliases
from harness.version import __version__ as __version__

aliases.install()  # the old import paths of what moved into harness/extras (harness.optrace, harness.judge.claims...)

# What a call raises, by what went wrong (harness/errors.py, a leaf): each a HarnessError with its exit code.
_ERRORS = (
    "BackendError", "ConfigError", "DataChanged", "HarnessError", "Interrupted", "RepositoryError", "RunFailed",
    "RunNotFound", "RunRefused", "SecretRefused", "StoreUnavailable", "UsageError",
)

# Every verb of the core's command line, by its name (`import` is Python's word: `harness.import_`), and its options;
# the extras' (trace, bisect, verify, attest, verify_record and theirs) come from the registry (harness.extensions).
# The typed names type checkers see are in __init__.pyi (tests/test_api.py holds the two to the same list).
_CORE = (
    "AuditOptions", "CalibrateOptions", "CheckOptions", "CompareOptions", "ExportOptions", "ImportOptions",
    "MarkOptions", "Marked", "Placement", "ReplayOptions", "ResumeOptions", "RunOptions", "RunsOptions", "audit",
    "calibrate", "check", "compare", "export", "import_", "mark", "replay", "resume", "run", "runs",
)


def __getattr__(name: str) -> Any:
    # On first use: the API loads the config schema (omegaconf), the store and the executors. By importlib:
    # harness's own code inside a rank imports this package (its version), and must not reach the store.
    if name == "__all__":
        extras = importlib.import_module("harness.extensions").api_names()
        return sorted({"__version__", *_CORE, *_ERRORS, *extras})
    if name in _ERRORS:
        return getattr(importlib.import_module("harness.errors"), name)
    if name in _CORE:
        return getattr(importlib.import_module("harness.commands.api"), name)
    # An extra's verb or its options. Not a dunder (a tool's hasattr), nor a submodule not imported yet: `from
    # harness import events` asks here first, before it imports harness.events.
    if not name.startswith("_") and importlib.util.find_spec(f"harness.{name}") is None:
        with contextlib.suppress(AttributeError):
            return importlib.import_module("harness.extensions").api(name)
    raise AttributeError(f"module 'harness' has no attribute {name!r}")
