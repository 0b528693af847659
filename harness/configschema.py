"""The experiment schema: experiment.yaml's sections as typed dataclasses, a docstring under every field, and the
`Schema` the backends' registry builds from them. Loading, overrides and validation are harness/config.py."""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from omegaconf import MISSING

_Section = TypeVar("_Section")


class Backend(enum.Enum):
    auto = "auto"
    gloo = "gloo"
    nccl = "nccl"


class Device(enum.Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class Launcher(str, enum.Enum):
    """How the launcher starts this machine's ranks (the results are the same either way)."""

    forkserver = "forkserver"  # forked from a warm rank server that imported torch once (executors/procs.py)
    spawn = "spawn"  # a fresh interpreter per rank that imports torch itself, as torch.multiprocessing.spawn does


class Weights(enum.Enum):
    """How a replay's parameters are held to the original's (replay.tolerance.weights)."""

    exact = "exact"  # differing fingerprints are a divergence, whatever the metrics' tolerance
    any = "any"  # the parameters may differ where every metric stays within its tolerance


class Level(enum.Enum):
    """How hard determinism is enforced in every rank."""

    strict = "strict"  # deterministic algorithms (errors on nondeterministic ops), cuDNN/TF32/cuBLAS pinned
    warn = "warn"  # same settings, but nondeterministic ops only warn
    off = "off"  # nothing is changed; the run is recorded as such


@dataclass
class DeterminismConfig:
    level: Level = Level.strict
    """strict | warn | off (see Level)."""
    world_size_invariant: bool = False
    """Train so that any world size dividing `shards` gives bit-identical results (see docs/world-size-invariant.md)."""
    shards: int = 8
    """Invariant mode: fixed shards per global step (a power of two); batch_size is the shard size."""


@dataclass
class Tolerance:
    rtol: float = 0.0
    """Relative tolerance: |replay - original| <= atol + rtol * |original|."""
    atol: float = 0.0
    """Absolute tolerance."""


@dataclass
class ToleranceConfig:
    default: Tolerance = field(default_factory=Tolerance)
    """Applies to every metric not listed under `metrics`."""
    metrics: dict[str, Tolerance] = field(default_factory=dict)
    """Per-metric tolerances, keyed by metric name."""
    weights: Weights = Weights.exact
    """`exact`: differing parameter fingerprints are DIVERGED, whatever the metrics' tolerance (a fingerprint is a
    digest: how far the weights moved cannot be read from it). `any`: the metrics decide, and the weights may
    differ where every metric stays within its tolerance."""


@dataclass
class ReplayConfig:
    tolerance: ToleranceConfig = field(default_factory=ToleranceConfig)


@dataclass
class RecordConfig:
    max_untracked_mib: float = 10.0
    """Untracked files larger than this are refused from the code record (commit, ignore or declare them as data)."""


@dataclass
class ProfileConfig:
    steps: list[int] = field(default_factory=list)
    """Training steps to run under torch.profiler (CPU activity, CUDA too on cuda; shapes and memory): each one's
    Chrome trace, key_averages table and summary become artifacts under profile/, the first one's communication share
    and peak memory tags (docs/performance.md). Profiling changes no number; a profiled step's wall time is left out
    of the step-time statistics."""
    ranks: list[int] = field(default_factory=lambda: [0])
    """The ranks that profile `steps` (each < world_size)."""
    samples_per_step: int = 0
    """Samples one training step consumes over all ranks, for the throughput (harness.perf.samples_per_s). 0: counted
    from the training ctx.loader's batches; a loop without one records no throughput unless this is set."""


@dataclass
class ExperimentConfig:
    image: str = MISSING
    """Container image the experiment is meant to run in: `name:tag` or `name@sha256:...`."""
    entry: str = MISSING
    """Training function as `FILE.py:FUNCTION`, relative to the experiment folder."""
    world_size: int = 1
    """Number of ranks (processes) started by mp.spawn."""
    backend: Backend = Backend.auto
    """auto picks nccl on cuda, gloo on cpu."""
    device: Device = Device.auto
    """auto picks cuda when a GPU is visible, else cpu."""
    seed: int = 0
    """Base seed; every rank's seed is derived from it and recorded."""
    seeds: list[int] | None = None
    """Distinct seeds, each in [0, 2**63-1]: run a study, one ordinary run per seed nested under a parent run
    (harness/commands/study.py). `harness run --seeds N` sets it to seed, seed+1, ..., seed+N-1."""
    threads_per_rank: int = 1
    """torch intra-op threads in each rank (results depend on it)."""
    launcher: Launcher = Launcher.forkserver
    """How ranks start: forkserver forks them from a server that imported torch once (seconds faster per run);
    spawn starts a fresh interpreter per rank, as torch.multiprocessing.spawn does. Recorded as harness.rank_start."""
    determinism: DeterminismConfig = field(default_factory=DeterminismConfig)
    flush_interval_s: float = 2.0
    """How often logged metrics are written to MLflow in the background."""
    fingerprint_every: int = 100
    """Hash the model parameters every this many steps (and at the end)."""
    checkpoint_every: int = 0
    """Save a checkpoint every this many steps (and at step 0); 0 disables. Needed by resume and audit."""
    executor: str = "local"
    """local: ranks run on this machine (or on several, one `harness run --nnodes` each); docker: inside the
    pinned image; slurm: submitted as a batch job, one task per node. Any backend registered in
    harness/executors; each one's own section (`slurm:`) follows this key."""
    rendezvous_timeout_s: float = 300.0
    """How long node 0 waits for the other nodes of a multi-node job to join before it gives up."""
    heartbeat_s: float = 30.0
    """How often the launcher marks the run alive in MLflow; `harness runs` calls a silent RUNNING run STALE."""
    timeout_s: float = 1800.0
    """A rank or collective that makes no progress for this long ends the job (also the process-group timeout)."""
    stall_s: float = 60.0
    """A job whose ranks make no progress while none of its processes (ranks, DataLoader workers, subprocesses) uses a
    CPU or reads or writes is stopped after this long, or 20x its slowest step so far if that is longer, naming the
    stuck rank and what it waits for. Work never counts as a stall; 0 turns this off (timeout_s still applies)."""
    record: RecordConfig = field(default_factory=RecordConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    """Step times are recorded in every run; `profile:` adds torch.profiler over chosen steps (docs/performance.md)."""
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    train: dict[str, Any] = field(default_factory=dict)
    """The experiment's own hyper-parameters, free-form; `ctx.cfg` in the training code."""
    data: dict[str, str] = field(default_factory=dict)
    """Data the training reads, name -> file or folder (relative to this folder; $VAR and ~ expanded):
    hashed in full at run start, recorded, checked again by replay; `ctx.data["name"]` is the path."""

    # Not fields: what the experiment's values decide. An experiment is never changed in place (a change is a new
    # one: config.Experiment.with_changes), so a value derived from it once holds for its life.

    @functools.cached_property
    def rank_seeds(self) -> tuple[int, ...]:
        """Every rank's seed, derived from `seed` once per experiment: the record (harness.rank_seeds), the check of
        the seeds the training code set, and the ranks (LaunchSpec.rank_seeds) read this one value."""
        from harness.seeds import derive_rank_seeds

        return tuple(derive_rank_seeds(self.seed, self.world_size))

    def section(self, name: str, kind: type[_Section]) -> _Section:
        """A backend's own section (`slurm:`), typed: the sections are fields of the schema's class (Schema.cls),
        which only the registry of backends knows."""
        value = getattr(self, name)
        if not isinstance(value, kind):
            raise TypeError(f"section {name!r} is a {type(value).__name__}, not a {kind.__name__}")
        return value


# -- the backends' sections ---------------------------------------------------------------------------------
# Which executors exist, and the config section each brings, is declared by the backends themselves
# (harness/executors: one module per backend, and outside packages through the `harness.executors` entry
# points). That registry builds the `Schema` (executors.schema()) and every function of harness/config.py that reads
# a config takes it: both modules are leaves and know no backend.


@dataclass(frozen=True)
class BackendSchema:
    name: str
    section: type | None = None  # a dataclass, merged in as `name:`
    check: Callable[[ExperimentConfig], None] | None = None  # run by validate() on every config


@dataclass(frozen=True)
class Schema:
    """The experiment schema: ExperimentConfig with every backend's section after `executor`, in the order given."""

    backends: tuple[BackendSchema, ...] = ()

    def names(self) -> list[str]:
        return [b.name for b in self.backends]

    @functools.cached_property
    def cls(self) -> type[ExperimentConfig]:
        """ExperimentConfig with each backend's section inserted after `executor` (a subclass made once)."""
        sections = [(b.name, b.section, field(default_factory=b.section)) for b in self.backends if b.section]
        made = dataclasses.make_dataclass("ExperimentConfig", sections, bases=(ExperimentConfig,),
                                          namespace={"__module__": __name__})
        # A subclass's own fields follow its base's; the sections belong after `executor`, where experiment.yaml,
        # the recorded config.yaml and the schema's reference have them (OmegaConf reads dataclasses.fields' order).
        order: list[str] = []
        for f in dataclasses.fields(ExperimentConfig):
            order.append(f.name)
            if f.name == "executor":
                order += [name for name, _, _ in sections]
        own = made.__dataclass_fields__  # type: ignore[attr-defined]
        made.__dataclass_fields__ = {name: own[name] for name in order}  # type: ignore[attr-defined]
        return made

    @functools.cached_property
    def defaults(self) -> ExperimentConfig:
        """An instance of `cls` with every default: what a key's type is, for the error lines."""
        return self.cls()
