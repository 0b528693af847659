"""The options of every verb: one frozen dataclass per verb, the API's (`harness.RunOptions`, ...: re-exported by
api.py) and the verb function's argument, from the API to the bottom. Light on purpose: the API imports it at once,
and audit and resume load torch; the backends' declared options load only when a Placement names some."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.commands.bundleformat import DEFAULT_MAX_RATIO, DEFAULT_MAX_UNPACKED_MIB, Limits
from harness.errors import UsageError
from harness.events import Listener

if TYPE_CHECKING:
    from harness.executors.base import Topology
    from harness.judge.compare import Comparison
    from harness.store.tracking import RunRecord, Tracker

DEFAULT_MAX_PROBES = 24  # bisect: the replays it may run before it stops and says how far it got


@dataclass(frozen=True)
class CalibrateOptions:
    """`harness calibrate RUN_ID [KEY=VALUE ...] [--members K] [--steps M]`: the rounding envelope of a run's first M
    steps."""

    run_id: str  # a run, or a replay / audit of one (the run it was made from is calibrated)
    members: int | None = None  # default calibrate.DEFAULT_MEMBERS
    steps: int | None = None  # default: calibrate.DEFAULT_STEPS, or the run's steps when fewer
    tracking_uri: str | None = None
    on_event: Listener | None = None
    overrides: tuple[str, ...] = ()  # KEY=VALUE: only the secrets the record hides, given again as to replay


@dataclass(frozen=True)
class ResumeOptions:
    """`harness resume RUN_ID`: continue a FAILED or KILLED run from its last complete checkpoint."""

    run_id: str
    tracking_uri: str | None = None
    repo: Path | None = None
    on_event: Listener | None = None


@dataclass(frozen=True)
class AuditOptions:
    """`harness audit RUN_ID --segments K`: replay K random checkpoint-to-checkpoint segments of a FINISHED run."""

    run_id: str
    segments: int
    seed: int | None = None  # the draw's seed (default: random, recorded)
    tracking_uri: str | None = None
    repo: Path | None = None
    on_event: Listener | None = None


@dataclass(frozen=True)
class VerifyOptions:
    """`harness verify CLAIMS_FILE`: a paper's claims against the recorded studies and runs, optionally replayed."""

    claims_file: Path
    overrides: tuple[str, ...] = ()  # with replay and allow_changes: KEY=VALUE changes of the replays' config
    replay: bool = False  # replay each study or run the claims rest on (once) and judge the claims on the replays
    members: int | None = None  # replay: K members of each study (default: all)
    world_size: int | None = None
    allow_changes: bool = False
    executor: str | None = None
    tracking_uri: str | None = None
    on_event: Listener | None = None


@dataclass(frozen=True)
class BisectOptions:
    """`harness bisect GOOD BAD`: the commit or config key whose change flips GOOD's result into BAD's."""

    good: str
    bad: str
    max_probes: int = DEFAULT_MAX_PROBES  # replays it may run before it stops and says how far it got
    tracking_uri: str | None = None
    repo: Path | None = None  # the clone holding both runs' commits (default: the one holding the current folder)
    localize: bool = False  # trace the culprit's probe and name the first op that differs from GOOD
    resume: str | None = None  # an earlier bisect of GOOD and BAD, cut short: its probes are taken up
    on_event: Listener | None = None


@dataclass(frozen=True)
class RunsOptions:
    """`harness runs [EXPERIMENT]`: the newest runs, with their replays' verdicts."""

    experiment: str | None = None  # default: every experiment
    limit: int = 20
    tracking_uri: str | None = None
    on_event: Listener | None = None
    all: bool = False  # also the runs folded under the run they were made from (record/nesting.py)
    kind: str | None = None  # only runs of this harness.kind (folded ones too)
    status: str | None = None  # only runs with this status (RUNNING, FINISHED, FAILED, KILLED or STALE; folded ones too)


@dataclass(frozen=True)
class MarkOptions:
    """`harness mark RUN_ID --status FAILED|KILLED`: close a RUNNING run whose launcher is gone."""

    run_id: str
    status: str  # FAILED | KILLED (tags.INCOMPLETE)
    force: bool = False  # close a run that has no heartbeat tags
    tracking_uri: str | None = None
    on_event: Listener | None = None


# -- where the ranks run --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Placement:
    """Where a job's ranks run, beyond the backend: the nodes of a multi-node job, and the backends' own options.

    Each topology field is the command line option named in its comment; None: not given. `backend` holds the
    options the backends declare (harness/executors: each backend's `CliOption`s), by their names: one with a
    config key becomes a recorded `BACKEND.KEY=VALUE` override (`nodes=2`: slurm.nodes=2), one without is a choice
    for this job only (`allow_unpinned`).
    """

    nnodes: int | None = None  # --nnodes: nodes of a multi-node job (the same command runs on each)
    node_rank: int | None = None  # --node-rank: this node's rank (0 records the run)
    master_addr: str | None = None  # --master-addr: node 0's address, reachable from every node
    master_port: int | None = None  # --master-port: a free TCP port on node 0 for the rendezvous
    backend: Mapping[str, Any] = field(default_factory=dict)  # the backends' options given, by name

    @classmethod
    def of(cls, given: Mapping[str, Any]) -> Placement:
        """From parsed options by name (the CLI's): the topology fields, and every other one given as a backend's."""
        own = {"nnodes", "node_rank", "master_addr", "master_port"}
        return cls(**{k: v for k, v in given.items() if k in own},
                   backend={k: v for k, v in given.items() if k not in own and v is not None})

    def given(self) -> list[str]:
        """The command line flags of what is set: the topology's in declaration order, then the backends'."""
        flags = [MULTI_NODE[f.name] for f in fields(self) if f.name in MULTI_NODE and getattr(self, f.name) is not None]
        return flags + [opt.flag for _, opt in self._backend_options() if opt.dest in self.backend]

    def multi_node(self) -> list[str]:
        """The flags given that place this process among several nodes."""
        return [flag for flag in self.given() if flag in MULTI_NODE.values()]

    def backend_overrides(self) -> list[str]:
        """The backends' options that set their config, as `BACKEND.KEY=VALUE` overrides (a replay records them)."""
        from harness.config import as_override

        return [as_override(f"{name}.{opt.key}", str(self.backend[opt.dest])) for name, opt in self._backend_options()
                if opt.key is not None and opt.dest in self.backend]

    def job_options(self) -> dict[str, Any]:
        """The backends' options that are choices for this job only (no config key)."""
        return {opt.dest: self.backend[opt.dest] for _, opt in self._backend_options()
                if opt.key is None and opt.dest in self.backend}

    def _backend_options(self) -> list[tuple[str, Any]]:
        if not self.backend:  # nothing given: the backends need not load (runs and compares stay light)
            return []
        from harness.executors import backends

        declared = [(name, opt) for name, b in backends().items() for opt in b.cli]
        unknown = sorted(set(self.backend) - {opt.dest for _, opt in declared})
        if unknown:
            raise UsageError(f"no backend takes the option(s) {', '.join(unknown)}; known: "
                               f"{', '.join(sorted({opt.dest for _, opt in declared}))}.")
        return declared


MULTI_NODE = {"nnodes": "--nnodes", "node_rank": "--node-rank", "master_addr": "--master-addr",
              "master_port": "--master-port"}


# -- run and check --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CheckOptions:
    """`harness check EXPERIMENT_DIR [KEY=VALUE ...]`: what `harness run` checks, without running or recording; the
    part of RunOptions that the checks before a run read (RunOptions.checks)."""

    experiment_dir: Path
    overrides: tuple[str, ...] = ()
    require_clean: bool = False  # refuse a git tree with uncommitted changes
    allow_untracked_secrets: bool = False  # record untracked files named like secrets in the code patch
    allow_secret_in_diff: bool = False  # record a patch holding secrets with them cut out (tagged patch_redacted)
    tracking_uri: str | None = None
    on_event: Listener | None = None
    executor: str | None = None  # a registered backend (default: `executor` in the config)


@dataclass(frozen=True)
class RunOptions:
    """`harness run EXPERIMENT_DIR [KEY=VALUE ...]`."""

    experiment_dir: Path  # the experiment folder (experiment.yaml and its entry), inside a git repository
    overrides: tuple[str, ...] = ()  # KEY=VALUE config overrides
    seeds: int | None = None  # --seeds N: a study of N runs with seeds seed .. seed+N-1 (also `seeds:` in the config)
    parallel: int | None = None  # --parallel J: a study's members run J at once
    require_clean: bool = False  # refuse a git tree with uncommitted changes
    executor: str | None = None  # a registered backend: local | docker | slurm | ... (default: `executor` in the config)
    placement: Placement = field(default_factory=Placement)
    allow_unpinned: bool = False  # accept an image pinned by the moving 'latest' tag
    allow_untracked_secrets: bool = False  # record untracked files named like secrets in the code patch
    allow_secret_in_diff: bool = False  # record a patch holding secrets with them cut out (tagged patch_redacted)
    tracking_uri: str | None = None  # default: $MLFLOW_TRACKING_URI, else sqlite:///./mlruns/mlflow.db
    on_event: Listener | None = None  # gets what the command says while it works; None: nothing is said
    calibrate: bool = False  # --calibrate: once the run FINISHED, `harness calibrate` it with the defaults
    name: str | None = None  # --name: the run's name in MLflow (default: the experiment's name and the id's start)
    tags: Mapping[str, str] | tuple[str, ...] = ()  # --tag KEY=VALUE: tags of the user's own (not harness./mlflow.)

    def checks(self) -> CheckOptions:
        """What the checks before the run read: the fields CheckOptions shares with these (taken by name, so that a
        flag is spelled once), the backends' options that set their config added to the overrides."""
        shared = {f.name: getattr(self, f.name) for f in fields(CheckOptions) if f.name != "overrides"}
        return CheckOptions(**shared, overrides=(*self.overrides, *self.placement.backend_overrides()))


# -- replay and compare ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class ReplayOptions:
    """`harness replay RUN_ID [KEY=VALUE ...]`: a run, or a study (every member, or `members` of them)."""

    run_id: str  # a run, a study, or a replay / audit / study replay of one (followed unless follow=False)
    overrides: tuple[str, ...] = ()  # KEY=VALUE changes of the recorded config; need allow_changes
    world_size: int | None = None  # replay with another number of ranks
    allow_changes: bool = False
    allow_data_changes: bool = False  # replay although the declared data no longer hashes as recorded
    data_paths: Mapping[str, str] = field(default_factory=dict)  # declared data NAME -> where it is on this machine
    executor: str | None = None  # where the replay runs (default: as recorded)
    placement: Placement = field(default_factory=Placement)
    allow_incomplete: bool = False  # replay a FAILED or KILLED run, judged on the steps it reached
    follow: bool = True  # False: replay a replay or audit run itself, not the original it was made from
    members: int | None = None  # a study: replay K of its members drawn at random (the draw's seed is recorded)
    members_seed: int | None = None  # a study with `members`: the draw's seed
    localize: bool | None = None  # trace a DIVERGED replay's first divergent step (None: when it has checkpoints)
    tolerances: tuple[str, ...] = ()  # METRIC=ATOL[,RTOL] over the recorded replay.tolerance
    steps: int | None = None  # a first check: train and judge only the first K steps (harness.replay.steps)
    tracking_uri: str | None = None
    repo: Path | None = None  # the git repository holding the recorded commit (default: found from the cwd)
    on_event: Listener | None = None


# What traces a DIVERGED replay and records where it first differed, on the replay: (tracker, replay_id, comparison,
# changes, original's record, replay's record, repo) -> trace.Localized. The trace verb's after_replay is one.
Localizer = Callable[["Tracker", str, "Comparison", list[str], "RunRecord", "RunRecord", "Path | None"], Any]


@dataclass(frozen=True)
class ReplayContext:
    """What the composing layer adds to a replay the user asked for (ReplayOptions): what no command line option
    gives, set by the API and by the verbs that replay (a study replay, calibrate, bisect)."""

    tracker: Tracker | None = None  # the store, when the caller holds it open (default: options.tracking_uri's)
    topology: Topology | None = None  # where this process sits in the job (the API resolves it from the placement)
    localizer: Localizer | None = None  # traces a DIVERGED replay where `localize` asks (trace's after_replay)
    extra_tags: Mapping[str, str] = field(default_factory=dict)  # tags of the replay run beyond a replay's own
    study_members: Sequence[RunRecord] | None = None  # the study's member records, when the caller has them
    commit: str | None = None  # run the code of this commit instead of the recorded one (bisect's probes)
    perturb_seed: int | None = None  # a calibration member: the weights start nudged, and it is not judged
    sketch_at: int | None = None  # rank 0 sketches the weights after that many steps
    # Further calibration members, (perturb seed, their tags), run by the same ranks after this one (a backend that
    # runs members: Backend.runs_members), each recorded as a replay of its own.
    then: Sequence[tuple[int, Mapping[str, str]]] = ()


@dataclass(frozen=True)
class CompareOptions:
    """`harness compare RUN_A [RUN_B]`: two runs (delta and verdict; RUN_A alone: with its newest replay), or two
    traces (the first differing op)."""

    run_a: str  # the reference: its tolerance applies
    run_b: str | None = None  # None: run A's newest replay
    tolerances: tuple[str, ...] = ()  # two runs: METRIC=ATOL[,RTOL] over the recorded replay.tolerance
    report: Path | None = None  # two traces: also write the localization report here (HTML if .html, else markdown)
    tracking_uri: str | None = None
    on_event: Listener | None = None


# -- export, import --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ExportOptions:
    """`harness export RUN_ID -o BUNDLE`: the run, its code and its replays in one portable bundle."""

    run_id: str
    output: Path  # the bundle to write (.tar.gz)
    with_checkpoints: bool = False
    with_image: bool = False  # the pinned image (docker save); import loads it
    with_data: bool = False  # the declared data's files, checked against their recorded sha256
    sign_key: Path | None = None  # an ed25519 private key (PEM): also write OUTPUT.intoto.json
    tracking_uri: str | None = None
    repo: Path | None = None  # the clone holding the recorded commit (default: found from the cwd)
    tree_only: bool = False  # the code bundle without the git history before the recorded commit
    on_event: Listener | None = None


@dataclass(frozen=True)
class ImportOptions:
    """`harness import BUNDLE`: verify a bundle and import its run and replays into this store."""

    bundle: Path
    data_dir: Path | None = None  # where the declared data goes (default ./harness-data/ORIGINAL_RUN_ID)
    tracking_uri: str | None = None
    on_event: Listener | None = None
    # The bounds checked on the manifest before anything is unpacked: every member's listed size summed (MiB), and
    # that sum over the bundle file's size. Raise them for a legitimately huge bundle from a source you trust.
    max_unpacked_mib: float = DEFAULT_MAX_UNPACKED_MIB
    max_ratio: float = DEFAULT_MAX_RATIO

    def limits(self) -> Limits:
        """The bounds as the bundle's check takes them."""
        return Limits(self.max_unpacked_mib, self.max_ratio)
