"""`harness run`: record everything that decides the result, launch the ranks, record how it ended."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from harness import events, executors, seeds, tags as T
from harness.commands.options import CheckOptions, RunOptions
from harness.config import (
    Experiment,
    boolean_words,
    compose,
    flatten,
    load_experiment,
    profile_warning,
    split_entry,
    to_container,
)
from harness.configschema import ExperimentConfig
from harness.errors import RepositoryError, SecretRefused, UsageError
from harness.executors import Here, Job, JobInputs, Outcome, Topology, TorchrunEnv
from harness.fmt import plain_name, printable
from harness.record import confine, loading, redaction, unchanged
from harness.record.newrun import PARAM_LIMIT, Labels, create_record, data_paths, experiment_name, fit_params
from harness.record.rerun import git_code_id, recorded_config, tags_code_id
from harness.runtime.plan import Steering
from harness.store.reach import local_paths, probe_store, resolve_uri, store_timeout
from harness.store.tracking import Tracker
from harness.systems import git as gitsource
from harness.systems.git import GitState

if TYPE_CHECKING:  # imported where a run hashes its data, as the functions below do
    from harness.record.data import HashStats

__all__ = ["Outcome", "Preflight", "check", "placed", "preflight", "run", "execute_recorded"]


@dataclasses.dataclass
class Preflight:
    """What `harness run` checked before recording: the validated experiment, the code state, and warnings."""

    experiment: Experiment
    git: GitState
    warnings: list[str]
    data: dict | None = None  # the declared data's manifest, hashed before anything is recorded
    data_stats: HashStats | None = None  # what hashing it read
    read_ns: int | None = None  # time.time_ns() before the code and the data were read: a file written after changed
    topology: Topology = dataclasses.field(default_factory=Topology)  # where this process sits in the job
    here: Here = dataclasses.field(default_factory=Here)  # what the backend decided on this machine (its device)

    @property
    def cfg(self) -> ExperimentConfig:
        """The experiment's typed values."""
        return self.experiment.config


def preflight(options: CheckOptions, *, topology: Topology | None = None, warm_ranks: bool = False) -> Preflight:
    """Every check that needs neither the store nor an engine; raises HarnessError, records nothing.

    `topology`: where this process sits in the job, as the API decided it (None: one node, this process starting its
    ranks); under torchrun it is a rank, whose string-hash seed was fixed when it started. `warm_ranks`: this process
    will start the job's ranks, so the backend may start their imports as soon as the config says it is wanted.
    """
    from harness.record import data

    read_ns = time.time_ns()
    topology = topology or Topology()
    exp_dir, overrides, executor, tracking_uri = Path(options.experiment_dir), list(options.overrides), \
        options.executor, options.tracking_uri
    if executor is not None:
        overrides = [*overrides, f"executor={executor}"]
    experiment = _load(exp_dir, overrides)
    cfg = experiment.config
    runner = executors.executor_for(str(cfg.executor), topology)
    # Before any rank or rank server starts: they take the string-hash seed from this process's environment.
    hash_seed = seeds.pin_hash_seed(cfg.seed, starts_ranks=topology.torchrun is None)
    if warm_ranks:
        runner.warm(cfg, topology)  # its torch import overlaps git, the data's hashes, MLflow and the record
    git = _code(exp_dir, cfg, tracking_uri, options.allow_untracked_secrets)
    warnings: list[str] = boolean_words(list(overrides), experiment.composed)
    git = _secrets_in_diff(git, cfg, tracking_uri, options.allow_secret_in_diff, warnings)
    warnings += _record_warnings(git, experiment, options.require_clean)
    here = runner.check_here(cfg, topology)  # the device, refused before recording
    warnings += here.warnings
    if hash_seed.source == seeds.FROM_TORCHRUN:
        warnings.append(seeds.unpinned_warning(cfg.seed))
    profiled = profile_warning(cfg.profile)
    if profiled:
        warnings.append(profiled)
    # Last: the other checks are instant, and hashing (cached) may read gigabytes.
    stats = data.HashStats()
    manifest = data.resolve_and_hash(cfg.data, Path(exp_dir), git.root, stats)
    return Preflight(experiment, git, warnings, manifest, stats if manifest is not None else None, read_ns, topology,
                     here)


def _load(exp_dir: Path, overrides: list[str]) -> Experiment:
    """The experiment's config, validated; its folder's name first: every run it records would be named so."""
    name = experiment_name(exp_dir)
    if not plain_name(name):
        raise UsageError(
            f"the experiment folder's name '{printable(name)}' is no plain name (it holds a newline, a tab or another "
            "control character, or a backslash, or is over 256 characters); it names the MLflow experiment, and a "
            "bundle of its runs could not be imported. Rename the folder.")
    return load_experiment(exp_dir, overrides, schema=executors.schema())


def _code(exp_dir: Path, cfg: ExperimentConfig, tracking_uri: str | None, allow_untracked_secrets: bool) -> GitState:
    """The code's state in git, the entry and what it links to confined to the repository."""
    git = gitsource.inspect(
        exp_dir, max_untracked_mib=cfg.record.max_untracked_mib, allow_secrets=allow_untracked_secrets,
        exclude=tuple(local_paths(resolve_uri(tracking_uri))),  # the store records runs; it is not their code
    )
    confine.check_code(git.root, exp_dir, split_entry(cfg.entry)[0], gitsource.recorded_symlinks(git.root, exp_dir))
    return git


def _secrets_in_diff(git: GitState, cfg: ExperimentConfig, tracking_uri: str | None, allow: bool,
                     warnings: list[str]) -> GitState:
    """Secrets in the uncommitted changes: refused, or (`allow`) cut from the patch the store gets, said in `warnings`."""
    keys = redaction.known_keys(resolve_uri(tracking_uri)) if git.dirty else {}
    in_diff = redaction.patch_secrets(git.patch, keys) if git.dirty else []
    for sub in git.submodules:  # a submodule's own uncommitted changes are stored beside the patch, by the same rules
        in_diff += [dataclasses.replace(f, path=f"{sub.path}/{f.path}") for f in redaction.patch_secrets(sub.patch, keys)]
    if any(not f.cuttable for f in in_diff):
        raise SecretRefused(redaction.uncuttable_refusal([f for f in in_diff if not f.cuttable]))
    if in_diff and not allow:
        raise SecretRefused(redaction.patch_refusal(in_diff))
    if not in_diff:
        return git
    # The store gets the patch with the secrets cut out; the ranks run the working tree as it is.
    where = tuple(dict.fromkeys(f"{f.path}:{f.line}" for f in in_diff))
    if not executors.backend(str(cfg.executor)).runs_working_tree:  # it runs a checkout of the record: code without them
        raise SecretRefused(
            f"--allow-secret-in-diff cuts the secrets at {', '.join(where)} from the recorded code, and the "
            f"{cfg.executor} executor runs the recorded code, not the working tree. Move the secrets to "
            "environment variables, or use --executor local."
        )
    warnings.append(
        f"--allow-secret-in-diff: the secrets at {', '.join(where)} are cut from the stored patch, so it is not "
        "the code that ran there (tagged harness.git.patch_redacted); a replay runs those lines with <redacted>."
    )
    return dataclasses.replace(
        git, patch=redaction.redact_patch(git.patch), redacted=where,
        submodules=tuple(dataclasses.replace(sub, patch=redaction.redact_patch(sub.patch)) for sub in git.submodules))


def _record_warnings(git: GitState, experiment: Experiment, require_clean: bool) -> list[str]:
    """What the record will hold otherwise than given: long values, secrets in the config, the store's files, a dirty
    tree (refused with `require_clean`)."""
    warnings: list[str] = []
    long = fit_params(flatten(experiment.composed))[1]
    if long:
        warnings.append(
            f"{len(long)} config value{'s are' if len(long) > 1 else ' is'} longer than MLflow's {PARAM_LIMIT}-character "
            f"params ({', '.join(long[:3])}{', ...' if len(long) > 3 else ''}): recorded in params as length and sha256, "
            "whole in config.yaml."
        )
    _, secret_keys = redaction.redact(to_container(experiment.composed), None)
    if secret_keys:
        warnings.append(redaction.warning(secret_keys))
    if git.excluded:
        shown = ", ".join(git.excluded)
        warnings.append(
            f"the tracking store's files ({shown}) lie inside the repository and are not ignored; they are left out "
            f"of the code record. Add {', '.join(sorted({p.split('/')[0] + '/' for p in git.excluded}))} to .gitignore."
        )
    if git.dirty:
        if require_clean:
            raise RepositoryError(
                f"the working tree of {git.root} has uncommitted changes and --require-clean was given. "
                "Commit or stash them."
            )
        edited = [s.path for s in git.submodules if s.patch]
        warnings.append(
            "uncommitted changes: a run records them as a patch (git/uncommitted.patch) and is tagged dirty."
            + (f" Submodules with changes of their own (git/submodules.json): {gitsource.first_few(edited)}."
               if edited else "")
            + (f" Untracked files among them: {gitsource.first_few(git.untracked)}." if git.untracked else "")
            + gitsource.framework_hint(gitsource.framework_outputs(list(git.untracked)))
        )
    return warnings


def placed(topology: Topology | None) -> tuple[Topology, TorchrunEnv | None]:
    """The job's topology (None: torchrun's, when torchrun started this process, else one node) and what torchrun told
    this process when it started it (executors.placed, which the topology carries as `torchrun`)."""
    topology = executors.placed(topology)
    return topology, topology.torchrun


def check(options: CheckOptions, *, topology: Topology | None = None, warm_ranks: bool = True) -> Preflight:
    """What `harness run` checks before it records: the store reached, then preflight. `topology`: as the API decided
    it (None: torchrun's when torchrun started this process, else one node). `warm_ranks`: this process may start the
    job's ranks, so the backend may start their imports at once."""
    topology = executors.placed(topology)
    # A store that cannot be reached is said in a second, before the config, git and torch are looked at.
    probe_store(resolve_uri(options.tracking_uri), True, store_timeout())
    return preflight(options, topology=topology, warm_ranks=warm_ranks)


def run(options: RunOptions, *, topology: Topology | None = None, named: Labels | None = None,
        checked: Preflight | None = None) -> Outcome:
    """Validate, record, launch: the Outcome. Bad input raises HarnessError before any run is created. `checked`:
    what check() found, when the caller checked already (the API, which routes a config with `seeds` to a study);
    its topology is the job's.

    Started by torchrun, this process runs as the rank torchrun made it (executors/torchrun.py).
    """
    exp_dir, tracking_uri = Path(options.experiment_dir), options.tracking_uri
    if checked is None:
        checked = check(options.checks(), topology=topology)
    cfg, git, topology = checked.cfg, checked.git, checked.topology
    if cfg.seeds is not None:  # the API routes a study (harness/commands/api.py): one run is not one
        raise UsageError("the config sets `seeds`: it is a study, which `harness run` and harness.run() run. Use "
                           "one of them, or set seeds=null for a single run.")
    runner = executors.executor_for(str(cfg.executor), topology)
    # This node's ranks start now and import torch while MLflow loads and the run is recorded; they run the entry
    # only once the run exists, and a record that fails stops them. Torch is imported (to spawn) before MLflow, not
    # beside it in a thread: imports hold the GIL, and torch's import walks sys.modules, so importing both at once
    # was 2-3 s slower than one after the other.
    here = runner.start_here(cfg, topology, checked.here)
    try:
        _say_checked(checked, here, Path(exp_dir))
        tracker = Tracker(tracking_uri)
        inputs = JobInputs(git.root, Path(exp_dir), data=data_paths(checked.data), code_id=git_code_id(git))
        job = Job(
            tracker, cfg, inputs,
            record=lambda tags: create_record(tracker, checked.experiment, Path(exp_dir), git, image=tags, data=checked.data,
                                              extra_tags=dict(named.tags) if named else None,
                                              run_name=named.name if named else None),
            topology=topology, ranks=here.ranks, here=here,
            # The ranks that run the working tree itself could import an edit made while they run: looked at again.
            verify=lambda: unchanged.changes(git if executors.backend(str(cfg.executor)).runs_working_tree else None,
                                             checked.data, checked.read_ns),
            options=executors.options_for(cfg.executor, **{"allow_unpinned": options.allow_unpinned,
                                                                    **options.placement.job_options()}),
        )
        return executors.run_job(runner, job)
    finally:
        here.stop()


def _say_checked(checked: Preflight, here: Here, exp_dir: Path) -> None:
    """What the checks found, once the input is known good (bad input stays one line) and before torch, MLflow and the
    store, which take seconds: the first line (this process starts every rank), the warnings, the data's hashing."""
    if here.starts_all:
        count = f"{checked.cfg.world_size} rank{'s' if checked.cfg.world_size != 1 else ''}"
        events.emit(events.Notice(f"harness: recording {printable(exp_dir.resolve().name)}, starting {count}"))
    for warning in checked.warnings:
        events.emit(events.Warning(warning))
    if checked.data_stats is not None:
        events.emit(events.Notice(checked.data_stats.summary()))


def execute_recorded(
    run_id: str, code_dir: Path, tracking_uri: str | None = None, resume_step: int | None = None,
    topology: Topology | None = None,
) -> Outcome:
    """Inside a container or a batch job: run an already recorded run from its stored config, locally."""
    from omegaconf import OmegaConf

    from harness.record.data import recorded_data

    tracker = Tracker(tracking_uri)
    run = loading.load(tracker, run_id, loading.EXECUTE).summary
    experiment = recorded_config(tracker, run)
    seeds.apply_recorded_hash_seed(run.tags, run.run_id)  # the submitting side recorded it; these ranks start here
    container = to_container(experiment.composed)
    if redaction.redacted_keys(container):  # a batch job has the submitting shell's variables
        restored, _ = redaction.restore(
            container, [], redaction.parse_sources(run.tags.get(T.CONFIG_REDACTED)), os.environ, run_id,
            redaction.store_key(tracker.uri),
        )
        experiment = Experiment.of(compose([("recorded config", OmegaConf.create(restored))], executors.schema()))
    cfg = experiment.config
    code_dir = Path(code_dir)
    rel = confine.recorded_path(run.tags.get(T.EXPERIMENT_PATH, ""), "experiment folder", run_id)
    root = code_dir.resolve()
    for _ in Path(rel).parts:
        root = root.parent
    inputs = JobInputs(
        root, code_dir, code_id=tags_code_id(run.tags),
        # Where the submitting side found the data (a Slurm job shares its filesystem).
        data=data_paths(recorded_data(tracker, run_id)),
    )
    job = Job(
        tracker, cfg, inputs, run_id=run_id, resume_step=resume_step,
        # replay --steps K, a calibration member: the submitting side tagged the run with it when it created it.
        steering=Steering.from_tags(run.tags),
        topology=topology or Topology(),
        # The run exists; the tags this process learns (where it ran, the nodes) are added to it.
        record=lambda tags: _add_tags(tracker, run_id, tags),
    )
    return executors.run_job(executors.executing(cfg.executor), job)


def _add_tags(tracker: Tracker, run_id: str, tags: dict[str, str]) -> str:
    # The submitting side recorded where the job was sent (executor, image); keep those.
    keep = {T.EXECUTOR, T.IMAGE, T.IMAGE_DIGEST, T.IMAGE_ID, T.IMAGE_NOTE, T.IMAGE_DIGEST_REASON, T.IMAGE_TAG_DIGEST}
    tracker.set_tags(run_id, {k: v for k, v in tags.items() if k not in keep})
    return run_id
