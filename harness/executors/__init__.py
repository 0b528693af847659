"""Where a job's ranks run. One module per backend; `get(name)` finds it (see base.py for the contract).

A new backend (say, Kubernetes) is one module here defining `EXECUTOR`, an `Executor` subclass,
and its name in the config schema's `Executor` enum (the CLI's --executor choices follow it; a test
checks they agree); run, replay, resume and audit need no change.
"""

from __future__ import annotations

import importlib

from harness.config import Executor as _Backend
from harness.executors.base import Event, Executor, Handle, Job, Outcome, Output, Submitted, Topology, run_job

BACKENDS = tuple(b.value for b in _Backend)  # each is a module of this package

__all__ = ["BACKENDS", "Event", "Executor", "Handle", "Job", "Outcome", "Output", "Submitted", "Topology", "get", "run", "run_job"]


def get(name: str) -> Executor:
    """A fresh executor of the named backend (it may keep per-job state between prepare and start)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown executor {name!r}; known: {', '.join(BACKENDS)}")
    return importlib.import_module(f"harness.executors.{name}").EXECUTOR()


def run(job: Job, on_event=None) -> Outcome:
    """Run `job` on the backend its config names; when torchrun started this process, as its rank."""
    if job.topology.launcher == "torchrun":
        from harness.executors.torchrun import TorchrunExecutor

        return run_job(TorchrunExecutor(), job, on_event)
    return run_job(get(job.executor), job, on_event)
