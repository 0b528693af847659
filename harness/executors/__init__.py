"""Where a job's ranks run: the registry of backends, and `get(name)` / `run(job)` over it (base.py: the contract).

A backend is one module that declares `BACKEND`, a `Backend`: its name, its `Executor`, its config section
(a dataclass, merged into the experiment schema under its name), its command-line options (`CliOption`,
which harness/cli turns into click options), whether it can re-execute segments (audit, trace) and what the
commands need to know of its jobs (where its ranks run, how its processes learn their place: base.Backend). The
registry builds the experiment schema from the sections (`schema()`), which harness.config takes as an argument.

The built-in backends are modules of this package (`BUILTIN`; torchrun is a launcher mode of local, not a
backend). A backend from another package registers through the `harness.executors` entry-point group:

    [project.entry-points."harness.executors"]
    k8s = "my_package.k8s:BACKEND"

or, in-process, through `register(backend)`. run, replay, resume, audit and trace need no change for either.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from harness import configschema, entrypoints
from harness.configschema import ExperimentConfig
from harness.errors import BackendError, UsageError
from harness.executors.base import (
    Backend,
    CliOption,
    Executor,
    Handle,
    Here,
    Job,
    JobEvent,
    JobInputs,
    JobOptions,
    Outcome,
    Output,
    Submitted,
    Topology,
    TorchrunEnv,
    run_job,
)
from harness.messages import Message

BUILTIN = ("local", "docker", "slurm")  # each is a module of this package declaring BACKEND
ENTRY_POINTS = "harness.executors"  # the entry-point group of outside backends

__all__ = [
    "BUILTIN", "ENTRY_POINTS", "Backend", "CliOption", "JobEvent", "Executor", "Handle", "Here", "Job", "JobInputs",
    "JobOptions", "Outcome", "Output", "Submitted", "Topology", "TorchrunEnv", "backend", "backends", "get",
    "options_for", "register", "run", "check_segments", "check_torchrun", "early_ranks", "executing", "executor_for",
    "placed", "run_job", "run_segments", "schema", "topology_from_env", "torchrun_topology",
]

_REGISTRY: dict[str, Backend] = {}
_loaded = False
_schema: configschema.Schema | None = None  # built from the registry at first use, again after each register()


def _ensure_loaded() -> None:
    """The built-in backends and the entry points' are loaded at the first use of the registry, not when this
    package is imported: a backend imports the layers beside this one (record.recorded, the recorder), and they
    import this package - loading at import would run into modules still half imported."""
    global _loaded
    if not _loaded:
        _loaded = True  # first: _load() registers through register(), which lands here again
        _load()


def register(declared: Backend) -> None:
    """Make a backend known (in this process): `executor: NAME`, its section and its options."""
    _ensure_loaded()  # the built-in ones first, whoever registers first
    global _schema
    _REGISTRY[declared.name] = declared
    _schema = None


def schema() -> configschema.Schema:
    """The experiment schema the known backends make (each one's section after `executor`): what every function of
    harness.config that reads a config takes."""
    global _schema
    _ensure_loaded()
    if _schema is None:
        _schema = configschema.Schema(tuple(configschema.BackendSchema(b.name, b.section, b.check) for b in _REGISTRY.values()))
    return _schema


def _load() -> None:
    entrypoints.load(BUILTIN, "harness.executors", "BACKEND", ENTRY_POINTS, Backend, "executor", register)


def backends() -> dict[str, Backend]:
    """Every known backend by name: the built-in ones first, then the entry points', then register()'s."""
    _ensure_loaded()
    return dict(_REGISTRY)


def backend(name: str) -> Backend:
    """The named backend, or one line naming the known ones (exit 2)."""
    _ensure_loaded()
    if name not in _REGISTRY:
        raise UsageError(f"unknown executor {name!r}; known: {', '.join(_REGISTRY)}.")
    return _REGISTRY[name]


def get(name: str) -> Executor:
    """A fresh executor of the named backend (it may keep per-job state between prepare and start)."""
    return backend(name).executor()


def options_for(name: str, **given: Any) -> JobOptions:
    """The named backend's options object from the choices given: those it has no field for do not apply to it."""
    kind = backend(name).options
    fields = set(getattr(kind, "__dataclass_fields__", {}))
    return kind(**{k: v for k, v in given.items() if k in fields})


def topology_from_env(environ: Mapping[str, str] | None = None) -> Topology | None:
    """This process's place in a job when a scheduler started it (one task per node), else None: what a backend's
    `place` reads from its own variables (Slurm's), else the plain variables any scheduler can set (multinode)."""
    from harness.executors.multinode import topology_from_env as plain

    env = os.environ if environ is None else environ
    for declared in backends().values():
        found = declared.place(env) if declared.place is not None else None
        if found is not None:
            return found
    return plain(env)


def torchrun_topology(environ: Mapping[str, str] | None = None) -> Topology | None:
    """This process's place when torchrun started it as one of the job's ranks (what torchrun told it attached, as
    Topology.torchrun), else None; HarnessError for torchrun variables harness cannot lay out as nodes."""
    from harness.executors.torchrun import topology, torchrun_env

    env = torchrun_env(environ)
    return topology(env) if env is not None else None


def check_torchrun(layout: Topology, executor: str | None, given: Sequence[str]) -> None:
    """Under torchrun (`layout`) torchrun places the ranks: no placement option `given` applies, and only a backend
    whose ranks run on this machine (Backend.ranks_here) can run this process's rank. One line (exit 2) else."""
    env = layout.torchrun
    assert env is not None, layout
    if given:
        raise UsageError(f"torchrun started this process (rank {env.rank} of {env.world_size}): {', '.join(given)} "
                         "cannot apply, torchrun places the ranks. Drop them, or pass torchrun's own --nnodes & co.")
    if executor is not None and not backend(executor).ranks_here:
        raise UsageError(f"torchrun started this process, so its rank runs here: --executor {executor} does not "
                         f"apply. Run `harness run --executor {executor} ...` without torchrun.")


def placed(topology: Topology | None = None) -> Topology:
    """The job's topology: `topology` as given (torchrun's variables attached when torchrun launched it), else
    torchrun's when torchrun started this process, else one node. What a library caller that decided no placement
    gets; the API decides it (harness/commands/api.py) and hands it down."""
    if topology is not None and (topology.launcher != "torchrun" or topology.torchrun is not None):
        return topology
    return torchrun_topology() or topology or Topology()


def executor_for(name: str, topology: Topology) -> Executor:
    """The executor that runs a job of backend `name` placed at `topology`: torchrun's when torchrun started this
    process as one of the ranks (torchrun is a launcher mode of local, not a backend), else the backend's."""
    if topology.launcher == "torchrun":
        from harness.executors.torchrun import TorchrunExecutor

        return TorchrunExecutor()
    return get(name)


def executing(name: str) -> Executor:
    """What `harness _execute` runs a recorded job of backend `name` with, where that backend sent it (a container,
    a batch job's task): the backend it declares (`Backend.executes`), else itself."""
    return get(backend(name).executes or name)


def run(job: Job, on_event: Callable[[JobEvent], None] | None = None) -> Outcome:
    """Run `job` on the backend its config names; when torchrun started this process, as its rank."""
    return run_job(executor_for(job.executor, job.topology), job, on_event)


def run_segments(job: Job, plans: list[Any], on_message: Callable[[Message], None], what: str) -> None:
    """Re-execute checkpoint segments of `job` (audit, trace: `what`) on its backend; nothing is recorded here.

    A backend that cannot run segments is refused in one line before anything runs or is recorded.
    """
    check_segments(job.cfg, what)
    get(job.executor).run_segments(job, plans, on_message)


def check_segments(cfg: ExperimentConfig, what: str, *, here: bool = True) -> None:
    """The backend `cfg` names re-executes segments (and, with `here`, can on this machine): else one line (exit 2),
    before anything is recorded."""
    declared = backend(str(cfg.executor))
    if not declared.runs_segments:
        able = ", ".join(n for n, b in backends().items() if b.runs_segments) or "none"
        raise BackendError(f"{what} re-executes segments of the run on its backend, and the {declared.name} backend "
                           f"runs no segments (those that do: {able}).")
    check = getattr(declared.executor(), "check_segments", None)
    if here and check is not None:
        check(cfg)


def early_ranks(cfg: ExperimentConfig, topology: Topology) -> Any:
    """This node's ranks started now, for a single-node job of a backend that starts them early (its executor's
    start_here: the warm ranks), so that they import torch while the run is recorded; None for any other. The caller
    stops them and removes their work folder (Here.stop)."""
    return executor_for(str(cfg.executor), topology).start_here(cfg, topology, Here()).ranks
