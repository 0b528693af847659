"""Where a job's ranks may run, as the command line offers it: the registered backends (their options and their
help line, read when a command is parsed or its help shown) and the place a `harness _execute` task learns from
its environment. Light on purpose: parsing `harness run` loads the registry and nothing of the store or the judge."""

from __future__ import annotations

from harness.executors import backends as backends, topology_from_env as topology_from_env

__all__ = ["backends", "topology_from_env"]
