"""harness: run PyTorch DDP experiments so that they can be replayed and judged bit for bit.

The Python API (harness/commands/api.py) is here by name: `harness.run(harness.RunOptions(...))`,
`harness.replay`, `harness.compare`, `harness.resume`, `harness.audit`, `harness.trace`, `harness.verify`
and their options. It loads on first use, so that `import harness` (and `harness --help`) stays instant.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"


__all__ = [
    "AuditOptions", "CalibrateOptions", "CompareOptions", "Placement", "ReplayOptions", "ResumeOptions", "RunOptions", "TraceOptions",
    "VerifyOptions", "__version__", "audit", "calibrate", "compare", "replay", "resume", "run", "trace", "verify",
]


def __getattr__(name: str) -> Any:
    if name in __all__ and name != "__version__":
        # On first use: the API loads the config schema (omegaconf), the store and the executors. By importlib:
        # harness's own code inside a rank imports this package (its version), and must not reach the store.
        return getattr(importlib.import_module("harness.commands.api"), name)
    raise AttributeError(f"module 'harness' has no attribute {name!r}")
