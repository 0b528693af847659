"""harness: run PyTorch DDP experiments so that they can be replayed and judged bit for bit.

The Python API (harness/commands/api.py) is here by name: `harness.run(harness.RunOptions(...))`,
`harness.replay`, `harness.compare`, ... one function per command line verb, and their options. It loads on
first use, so that `import harness` (and `harness --help`) stays instant; type checkers read the real
signatures from __init__.pyi (an import here, even under TYPE_CHECKING, would put the whole API in the import
graph of every module that reads `harness.__version__`, the rank's code among them).
"""

from __future__ import annotations

import importlib
from typing import Any

from harness.version import __version__

# What a call raises, by what went wrong (harness/errors.py, a leaf): each a HarnessError with its exit code.
_ERRORS = (
    "BackendError", "ConfigError", "DataChanged", "HarnessError", "Interrupted", "RepositoryError", "RunFailed",
    "RunNotFound", "RunRefused", "SecretRefused", "StoreUnavailable", "UsageError",
)

# Every verb of the command line, by its name (`import` is Python's word: `harness.import_`), and its options; the
# typed names type checkers see are in __init__.pyi, which must list the same names: a name missing there is untyped.
__all__ = [
    "AttestOptions", "Attested", "AuditOptions", "BisectOptions", "CalibrateOptions", "CheckOptions", "CompareOptions",
    "ExportOptions", "ImportOptions", "MarkOptions", "Marked", "Placement", "RecordVerified", "ReplayOptions",
    "ResumeOptions", "RunOptions", "RunsOptions", "TraceOptions", "VerifyOptions", "VerifyRecordOptions",
    "__version__", "attest", "audit", "bisect", "calibrate", "check", "compare", "export", "import_", "mark",
    "replay", "resume", "run", "runs", "trace", "verify", "verify_record",
    *_ERRORS,
]


def __getattr__(name: str) -> Any:
    if name in __all__ and name != "__version__":
        # On first use: the API loads the config schema (omegaconf), the store and the executors. By importlib:
        # harness's own code inside a rank imports this package (its version), and must not reach the store.
        return getattr(importlib.import_module("harness.errors" if name in _ERRORS else "harness.commands.api"), name)
    raise AttributeError(f"module 'harness' has no attribute {name!r}")
