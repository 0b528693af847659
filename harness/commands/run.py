"""`harness run`: record everything that decides the result, launch the ranks, record how it ended."""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness import events, executors, seeds, tags as T
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
from harness.configschema import ExperimentConfig, Launcher
from harness.errors import RepositoryError, SecretRefused, UsageError
from harness.executors import procs
from harness.executors.base import Job, JobInputs, Outcome, Topology
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
    from harness.executors.torchrun import TorchrunEnv
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

    @property
    def cfg(self) -> ExperimentConfig:
        """The experiment's typed values."""
        return self.experiment.config


def preflight(
    exp_dir: Path,
    overrides: list[str],
    *,
    require_clean: bool = False,
    executor: str | None = None,
    allow_untracked_secrets: bool = False,
    allow_secret_in_diff: bool = False,
    tracking_uri: str | None = None,
    nnodes: int = 1,
    warm_ranks: bool = False,
    torchrun: bool = False,
) -> Preflight:
    """Every check that needs neither the store nor an engine; raises HarnessError, records nothing.

    `nnodes`: the nodes the job spans; each holds world_size / nnodes of its ranks. `warm_ranks`: this process will
    start the job's ranks, so the rank server starts its imports as soon as the config says it is wanted.
    `torchrun`: torchrun started this process as a rank (its string-hash seed was fixed when it started).
    """
    from harness.executors.launch import capacity_warning, resolve_device
    from harness.record import data

    read_ns = time.time_ns()
    if executor is not None:
        overrides = [*overrides, f"executor={executor}"]
    name = experiment_name(Path(exp_dir))
    if not plain_name(name):  # before anything else: every run it records would be named so
        raise UsageError(
            f"the experiment folder's name '{printable(name)}' is no plain name (it holds a newline, a tab or another "
            "control character, or a backslash, or is over 256 characters); it names the MLflow experiment, and a "
            "bundle of its runs could not be imported. Rename the folder.")
    experiment = load_experiment(Path(exp_dir), overrides, schema=executors.schema())
    cfg = experiment.config
    declared = executors.backend(cfg.executor)
    # Before any rank or rank server starts: they take the string-hash seed from this process's environment.
    hash_seed = seeds.pin_hash_seed(cfg.seed, starts_ranks=not torchrun)
    if warm_ranks and declared.early_ranks and nnodes == 1 and cfg.launcher is Launcher.forkserver:
        procs.warm()  # its torch import overlaps git, the data's hashes, MLflow and the record
    git = gitsource.inspect(
        Path(exp_dir), max_untracked_mib=cfg.record.max_untracked_mib, allow_secrets=allow_untracked_secrets,
        exclude=tuple(local_paths(resolve_uri(tracking_uri))),  # the store records runs; it is not their code
    )
    confine.check_code(git.root, Path(exp_dir), split_entry(cfg.entry)[0],
                       gitsource.recorded_symlinks(git.root, Path(exp_dir)))
    warnings: list[str] = boolean_words(list(overrides), experiment.composed)
    keys = redaction.known_keys(resolve_uri(tracking_uri)) if git.dirty else {}
    in_diff = redaction.patch_secrets(git.patch, keys) if git.dirty else []
    for sub in git.submodules:  # a submodule's own uncommitted changes are stored beside the patch, by the same rules
        in_diff += [dataclasses.replace(f, path=f"{sub.path}/{f.path}") for f in redaction.patch_secrets(sub.patch, keys)]
    if any(not f.cuttable for f in in_diff):
        raise SecretRefused(redaction.uncuttable_refusal([f for f in in_diff if not f.cuttable]))
    if in_diff and not allow_secret_in_diff:
        raise SecretRefused(redaction.patch_refusal(in_diff))
    if in_diff:  # the store gets the patch with the secrets cut out; the ranks run the working tree as it is
        where = tuple(dict.fromkeys(f"{f.path}:{f.line}" for f in in_diff))
        if not declared.runs_working_tree:  # it runs a checkout of the record: code without them
            raise SecretRefused(
                f"--allow-secret-in-diff cuts the secrets at {', '.join(where)} from the recorded code, and the "
                f"{cfg.executor} executor runs the recorded code, not the working tree. Move the secrets to "
                "environment variables, or use --executor local."
            )
        git = dataclasses.replace(
            git, patch=redaction.redact_patch(git.patch), redacted=where,
            submodules=tuple(dataclasses.replace(sub, patch=redaction.redact_patch(sub.patch)) for sub in git.submodules))
        warnings.append(
            f"--allow-secret-in-diff: the secrets at {', '.join(where)} are cut from the stored patch, so it is not "
            "the code that ran there (tagged harness.git.patch_redacted); a replay runs those lines with <redacted>."
        )
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
    if declared.ranks_here:
        here = max(cfg.world_size // nnodes, 1)
        device, _ = resolve_device(cfg.device.value, cfg.backend.value, here)  # refuse before recording
        warning = capacity_warning(device, here, cfg.threads_per_rank)
        if warning:
            warnings.append(warning)
    if hash_seed.source == seeds.FROM_TORCHRUN:
        warnings.append(seeds.unpinned_warning(cfg.seed))
    profiled = profile_warning(cfg.profile)
    if profiled:
        warnings.append(profiled)
    # Last: the other checks are instant, and hashing (cached) may read gigabytes.
    stats = data.HashStats()
    manifest = data.resolve_and_hash(cfg.data, Path(exp_dir), git.root, stats)
    return Preflight(experiment, git, warnings, manifest, stats if manifest is not None else None, read_ns)


def placed(topology: Topology | None) -> tuple[Topology, TorchrunEnv | None]:
    """The job's topology (None: torchrun's, when torchrun started this process, else one node) and torchrun's
    environment when torchrun started it."""
    from harness.executors.torchrun import topology as torchrun_topology, torchrun_env

    torchrun = torchrun_env() if topology is None or topology.launcher == "torchrun" else None
    if topology is None:
        topology = torchrun_topology(torchrun) if torchrun else Topology()
    return topology, torchrun


def check(
    exp_dir: Path,
    overrides: list[str],
    *,
    topology: Topology | None = None,
    require_clean: bool = False,
    tracking_uri: str | None = None,
    executor: str | None = None,
    allow_untracked_secrets: bool = False,
    allow_secret_in_diff: bool = False,
    warm_ranks: bool = True,
) -> Preflight:
    """What `harness run` checks before it records: the store reached, then preflight. `warm_ranks`: this process may
    start the job's ranks (not under torchrun), so the rank server may start its imports at once."""
    topology, torchrun = placed(topology)
    # A store that cannot be reached is said in a second, before the config, git and torch are looked at.
    probe_store(resolve_uri(tracking_uri), True, store_timeout())
    return preflight(
        exp_dir, overrides, require_clean=require_clean, executor=executor,
        allow_untracked_secrets=allow_untracked_secrets, allow_secret_in_diff=allow_secret_in_diff,
        tracking_uri=tracking_uri, nnodes=topology.nnodes, warm_ranks=warm_ranks and torchrun is None,
        torchrun=torchrun is not None,
    )


def run(
    exp_dir: Path,
    overrides: list[str],
    *,
    require_clean: bool = False,
    tracking_uri: str | None = None,
    executor: str | None = None,
    allow_unpinned: bool = False,
    allow_untracked_secrets: bool = False,
    allow_secret_in_diff: bool = False,
    topology: Topology | None = None,
    job_options: Mapping[str, Any] | None = None,
    named: Labels | None = None,
    checked: Preflight | None = None,
) -> Outcome:
    """Validate, record, launch: the Outcome. Bad input raises HarnessError before any run is created. `checked`:
    what check() found, when the caller checked already (the API, which routes a config with `seeds` to a study).

    Started by torchrun, this process runs as the rank torchrun made it (executors/torchrun.py).
    """
    from harness.executors.torchrun import check_config

    topology, torchrun = placed(topology)
    if checked is None:
        checked = check(
            exp_dir, overrides, topology=topology, require_clean=require_clean, tracking_uri=tracking_uri,
            executor=executor, allow_untracked_secrets=allow_untracked_secrets,
            allow_secret_in_diff=allow_secret_in_diff,
        )
    cfg, git = checked.cfg, checked.git
    if cfg.seeds is not None:  # the API routes a study (harness/commands/api.py): one run is not one
        raise UsageError("the config sets `seeds`: it is a study, which `harness run` and harness.run() run. Use "
                           "one of them, or set seeds=null for a single run.")
    if torchrun is not None:
        # Before the store is opened (one rank at a time on a fresh one): every rank gets to say why it
        # refuses before torchrun stops the others.
        check_config(torchrun, cfg.world_size)
    elif executors.backend(str(cfg.executor)).ranks_here and not topology.multi_node:
        procs.check_main_guarded()  # a script that would run again in every rank: said before "recording"
        # The first line, once the input is known good (bad input stays one line) and before torch, MLflow
        # and the store, which take seconds.
        count = f"{cfg.world_size} rank{'s' if cfg.world_size != 1 else ''}"
        events.emit(events.Notice(f"harness: recording {printable(Path(exp_dir).resolve().name)}, starting {count}"))
    for warning in checked.warnings:
        events.emit(events.Warning(warning))
    if checked.data_stats is not None:
        events.emit(events.Notice(checked.data_stats.summary()))
    # This node's ranks start now and import torch while MLflow loads and the run is recorded; they run
    # the entry only once the run exists, and a record that fails stops them. Torch is imported (to spawn)
    # before MLflow, not beside it in a thread: imports hold the GIL, and torch's import walks sys.modules,
    # so importing both at once was 2-3 s slower than one after the other.
    ranks = executors.early_ranks(cfg, topology)
    try:
        tracker = Tracker(tracking_uri)
        inputs = JobInputs(git.root, Path(exp_dir), data=data_paths(checked.data),
                           code_id=git_code_id(git))
        job = Job(
            tracker, cfg, inputs,
            record=lambda tags: create_record(tracker, checked.experiment, Path(exp_dir), git, image=tags, data=checked.data,
                                              extra_tags=dict(named.tags) if named else None,
                                              run_name=named.name if named else None),
            topology=topology, ranks=ranks,
            # The ranks that run the working tree itself could import an edit made while they run: looked at again.
            verify=lambda: unchanged.changes(git if executors.backend(str(cfg.executor)).runs_working_tree else None,
                                             checked.data, checked.read_ns),
            options=executors.options_for(cfg.executor, **{"allow_unpinned": allow_unpinned, **(job_options or {})}),
        )
        return executors.run(job)
    finally:
        if ranks is not None:
            ranks.stop()
            shutil.rmtree(Path(ranks.log_dir).parent, ignore_errors=True)


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
