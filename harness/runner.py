"""`harness run`: record everything that decides the result, launch the ranks, record how it ended."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from omegaconf import DictConfig

from harness import __version__
from harness import tags as T
from harness.config import flatten, split_entry, to_container, to_yaml
from harness.errors import EXIT_FAILED, EXIT_OK, EXIT_SIGINT, HarnessError, Interrupted, RunFailed
from harness.gitsource import GitState
from harness.messages import Checkpoint, Determinism, Final, Fingerprint, Initial, Message, Metrics, Total
from harness.container import ENV_DIGEST
from harness.tracking import RunSummary, Tracker, save_series


@dataclass
class Outcome:
    run_id: str
    status: str  # FINISHED | FAILED | KILLED
    exit_code: int
    message: str = ""
    fingerprints: dict[int, str] = field(default_factory=dict)


def experiment_name(exp_dir: Path) -> str:
    return Path(exp_dir).resolve().name


def local_image_tags(image: str) -> dict[str, str]:
    """Local executor: the pinned image and, when a local engine knows it, its registry digest (else why not)."""
    from harness import docker
    from harness.config import is_no_image

    if is_no_image(image):
        digest, image_id, reason = None, None, "no image pinned (image: none): a local-only experiment"
    else:
        digest, image_id, reason = docker.local_digest_or_reason(image)
    facts = {
        T.IMAGE: image,
        T.IMAGE_DIGEST: digest or "unknown",
        T.EXECUTOR: "local",
        T.IMAGE_NOTE: "ran outside the pinned image (local executor): the environment is this machine's",
    }
    if image_id:
        facts[T.IMAGE_ID] = image_id
    if reason:
        facts[T.IMAGE_DIGEST_REASON] = reason
    return facts


def recorded_config(tracker: Tracker, run: RunSummary) -> DictConfig:
    """The resolved config stored with the run, with auto device/backend pinned to what it ran on."""
    from omegaconf import OmegaConf

    from harness.config import compose

    text = tracker.read_text(run.run_id, T.ARTIFACT_CONFIG)
    if text is None:
        raise HarnessError(f"run '{run.run_id}' has no {T.ARTIFACT_CONFIG} artifact; it cannot be replayed.")
    pinned = {key: run.tags[tag] for key, tag in (("device", T.DEVICE), ("backend", T.BACKEND)) if tag in run.tags}
    return compose([("recorded config", OmegaConf.create(text)), ("recorded runtime", OmegaConf.create(pinned))])


def record_tags(cfg: DictConfig, exp_dir: Path, git: GitState, image: dict[str, str]) -> dict[str, str]:
    """Tags known before anything runs: code, image, seeds, topology as configured."""
    from harness.determinism import derive_rank_seeds

    rel = Path(exp_dir).resolve().relative_to(git.root.resolve()).as_posix()
    source = f"{rel}/{split_entry(cfg.entry)[0]}"
    tags: dict[str, str] = {
        T.VERSION: __version__,
        T.KIND: T.KIND_RUN,
        T.EXPERIMENT_PATH: rel,
        T.ENTRY: str(cfg.entry),
        T.GIT_COMMIT: git.commit,
        T.GIT_BRANCH: git.branch or "(detached)",
        T.GIT_DIRTY: str(git.dirty).lower(),
        T.MLFLOW_GIT_COMMIT: git.commit,
        T.MLFLOW_SOURCE_NAME: source,
        T.MLFLOW_SOURCE_TYPE: "PROJECT",
        T.SEED: str(cfg.seed),
        T.RANK_SEEDS: ",".join(map(str, derive_rank_seeds(cfg.seed, cfg.world_size))),
        T.WORLD_SIZE: str(cfg.world_size),
        T.THREADS_PER_RANK: str(cfg.threads_per_rank),
    }
    if git.branch:
        tags[T.MLFLOW_GIT_BRANCH] = git.branch
    if git.repo_url:
        tags[T.GIT_REPO_URL] = git.repo_url
        tags[T.MLFLOW_GIT_REPO_URL] = git.repo_url
    if git.dirty:
        import hashlib

        tags[T.GIT_PATCH_SHA256] = hashlib.sha256(git.patch).hexdigest()
    tags.update(image)
    return tags


def create_record(
    tracker: Tracker,
    cfg: DictConfig,
    exp_dir: Path,
    git: GitState,
    *,
    image: dict[str, str],
    extra_tags: dict[str, str] | None = None,
    run_name: str | None = None,
    experiment: str | None = None,
) -> str:
    """One MLflow run holding the resolved config and the code state."""
    tags = record_tags(cfg, exp_dir, git, image)
    tags.update(extra_tags or {})
    run_id = tracker.create_run(experiment or experiment_name(exp_dir), tags, run_name=run_name)
    try:
        tracker.log_params(run_id, flatten(cfg))
        tracker.log_text(run_id, to_yaml(cfg), T.ARTIFACT_CONFIG)
        if git.dirty:
            tracker.log_bytes(run_id, git.patch, T.ARTIFACT_PATCH)
    except BaseException:
        tracker.end_run(run_id, T.FAILED)
        raise
    return run_id


def launch_spec(
    cfg: DictConfig, code_dir: Path, device: str, backend: str, log_dir: Path, checkpoints: Any = None
) -> Any:
    """The plain-values description of the ranks for this config (see launch.LaunchSpec)."""
    from harness.determinism import derive_rank_seeds
    from harness.launch import LaunchSpec

    entry_file, entry_func = split_entry(str(cfg.entry))
    return LaunchSpec(
        code_dir=str(Path(code_dir).resolve()),
        entry_file=entry_file,
        entry_func=entry_func,
        world_size=cfg.world_size,
        device=device,
        backend=backend,
        seed=cfg.seed,
        rank_seeds=derive_rank_seeds(cfg.seed, cfg.world_size),
        threads_per_rank=cfg.threads_per_rank,
        determinism=cfg.determinism.level.value,
        fingerprint_every=cfg.fingerprint_every,
        train_cfg=to_container(cfg)["train"],
        log_dir=str(log_dir),
        checkpoints=checkpoints,
        invariant_shards=cfg.determinism.shards if cfg.determinism.world_size_invariant else 0,
        timeout_s=float(cfg.timeout_s),
        output_dir=str(Path(log_dir).parent / "outputs"),
    )


def checkpoint_plan(tracker: Tracker, run_id: str, cfg: DictConfig, **kwargs: Any) -> Any:
    """Checkpoints live in the run's own artifact folder, so the MLflow UI lists them with the run."""
    from harness.context import CheckpointPlan

    if cfg.checkpoint_every <= 0 and not kwargs:
        return None
    return CheckpointPlan(str(tracker.local_artifact_dir(run_id) / T.ARTIFACT_CHECKPOINTS), cfg.checkpoint_every, **kwargs)


def execute(
    tracker: Tracker, run_id: str, cfg: DictConfig, code_dir: Path, resume_step: int | None = None
) -> Outcome:
    """Measure the runtime, run every rank, stream metrics, and end the MLflow run accordingly.

    With `resume_step`, the ranks continue from that checkpoint in the same MLflow run: metrics and
    fingerprints already recorded are kept, and values re-logged identically are not written twice.
    """
    from harness.console import Console
    from harness.launch import failure_details, launch, resolve_device
    from harness.provenance import package_lock, runtime_facts

    work = Path(tempfile.mkdtemp(prefix="harness-run-"))
    log_dir = work / "logs"
    log_dir.mkdir()
    writer = None
    console = None
    heartbeat = None
    failure_text = ""  # the failing rank's traceback, printed once the progress view is closed
    fingerprints: dict[int, str] = {}
    final: dict[str, Any] = {"checkpoints": {}}
    prior = None
    if resume_step is not None:
        prior = tracker.load_record(run_id)
        fingerprints = {k: v for k, v in prior.fingerprints.items() if k < resume_step}
        final["checkpoints"] = {k: v for k, v in prior.checkpoints.items() if k <= resume_step}
    status, code, message = T.FAILED, EXIT_FAILED, ""
    try:
        device, backend = resolve_device(cfg.device.value, cfg.backend.value, cfg.world_size)
        facts = {T.ENV_PREFIX + k: v for k, v in runtime_facts().items()}
        facts.update({T.DEVICE: device, T.BACKEND: backend})
        # Where the ranks run: inside the pinned image only if the docker executor said so.
        in_image = bool(os.environ.get(ENV_DIGEST))
        facts[T.IN_IMAGE] = str(in_image).lower()
        if in_image:
            facts[T.IMAGE_NOTE] = f"ran inside the pinned image {os.environ[ENV_DIGEST]}"
        tracker.set_tags(run_id, facts)
        tracker.log_text(run_id, "\n".join(package_lock()) + "\n", T.ARTIFACT_LOCK)  # where the ranks run

        heartbeat = tracker.heartbeat(run_id, cfg.heartbeat_s)
        plan = checkpoint_plan(tracker, run_id, cfg, **({} if resume_step is None else {"resume_step": resume_step}))
        spec = launch_spec(cfg, code_dir, device, backend, log_dir, plan)
        writer = tracker.metric_writer(run_id, cfg.flush_interval_s)
        if prior is not None:
            writer.prime(prior.metrics)
        console = Console(log_dir / "rank0.log", f"{experiment_name(code_dir)} x{cfg.world_size}")

        def on_message(msg: Message) -> None:
            match msg:
                case Metrics(step, values, unix_ms):
                    writer.add(step, values, unix_ms)
                    console.step(step)
                case Fingerprint(step, sha256):
                    fingerprints[step] = sha256
                case Final(sha256, steps):
                    final["fingerprint"], final["steps_total"] = sha256, steps
                case Initial(sha256):
                    final["initial"] = sha256
                case Determinism(settings, env):
                    final["determinism"], final["vars"] = settings, env
                case Total(steps):
                    console.total(steps)
                case Checkpoint(step, sha256):
                    final["checkpoints"][step] = sha256

        try:
            launch(spec, on_message)
            status, code = T.FINISHED, EXIT_OK
        except RunFailed as err:
            rank, tb, expected = failure_details(err)
            failure_text = "" if expected else tb
            message = str(err)
            tracker.log_text(run_id, f"rank: {rank}\n\n{tb}", T.ARTIFACT_FAILURE)
            tracker.set_tags(run_id, {T.FAILED_RANK: str(rank), T.STATUS_REASON: message})
        except Interrupted as err:
            status, code, message = T.KILLED, err.exit_code, str(err)
            tracker.set_tags(run_id, {T.STATUS_REASON: message})
    except KeyboardInterrupt:
        status, code, message = T.KILLED, EXIT_SIGINT, "interrupted by SIGINT"
    except BaseException as err:
        message = str(err)
        tracker.set_tags(run_id, {T.STATUS_REASON: message[:500]})
        raise
    finally:
        # A signal now would cut the record short and leave the run RUNNING: it waits until the run is closed.
        with _deferred_signals() as deferred:
            if console is not None:
                console.close()
            if failure_text:
                print(failure_text.rstrip(), file=sys.stderr)
            try:
                if heartbeat is not None:
                    heartbeat.close()
                if writer is not None:
                    writer.close()
                    save_series(writer.series, work / "series.npz")
                logs = T.ARTIFACT_LOGS_DIR if resume_step is None else f"{T.ARTIFACT_LOGS_DIR}/resume-from-{resume_step}"
                _record_results(tracker, run_id, fingerprints, final, work, logs)
                if status == T.FINISHED:
                    _warn_if_vacuous(tracker, run_id, writer, final)
            finally:
                tracker.end_run(run_id, status)
                shutil.rmtree(work, ignore_errors=True)
    if deferred:
        print(f"{signal.Signals(deferred[0]).name} arrived while the run was being recorded; it was recorded "
              "in full first.", file=sys.stderr)
        code = 128 + deferred[0]
    return Outcome(run_id, status, code, message, fingerprints)


@contextlib.contextmanager
def _deferred_signals() -> Iterator[list[int]]:
    """Hold SIGINT/SIGTERM back for the duration; yields the list of signals that arrived."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return
    previous = {s: signal.signal(s, lambda signum, frame: received.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield received
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _record_results(
    tracker: Tracker, run_id: str, fingerprints: dict[int, str], final: dict[str, Any], work: Path, logs: str
) -> None:
    tags: dict[str, str] = {}
    if "determinism" in final:
        tags.update({T.DETERMINISM_PREFIX + k: v for k, v in final["determinism"].items()})
        tags.update({T.VAR_PREFIX + k: v for k, v in final["vars"].items()})
    if final.get("fingerprint"):
        tags[T.FINGERPRINT] = final["fingerprint"]
    tracker.set_tags(run_id, tags)
    if fingerprints or final.get("fingerprint") or final["checkpoints"]:
        doc = {
            "steps": {str(k): v for k, v in sorted(fingerprints.items())},
            "final": final.get("fingerprint"),
            "steps_total": final.get("steps_total"),
            "checkpoints": {str(k): v for k, v in sorted(final["checkpoints"].items())},
        }
        tracker.log_text(run_id, json.dumps(doc, indent=2), T.ARTIFACT_FINGERPRINTS)
    if (work / "series.npz").exists():
        tracker.log_file(run_id, work / "series.npz", str(Path(T.ARTIFACT_SERIES).parent))
    if any((work / "logs").iterdir()):
        tracker.log_dir(run_id, work / "logs", logs)
    outputs = work / "outputs"
    if outputs.is_dir() and any(outputs.iterdir()):
        tracker.log_dir(run_id, outputs, T.ARTIFACT_OUTPUTS_DIR)


def _warn_if_vacuous(tracker: Tracker, run_id: str, writer: Any, final: dict[str, Any]) -> None:
    """A finished run that logged nothing, or whose model never changed, proves nothing: say so, and record it."""
    initial, last = final.get("initial"), final.get("fingerprint")
    if writer is not None and not writer.series:
        if initial or last:
            print("Warning: the run logged no metrics (call ctx.log(...) in train); a replay can only compare "
                  "the model's fingerprints.", file=sys.stderr)
        else:
            print("Warning: the run logged no metrics and registered no model (ctx.log(...), ctx.ddp(model)): a "
                  "replay will have nothing to compare.", file=sys.stderr)
    if initial and last:
        changed = initial != last
        tracker.set_tags(run_id, {T.INITIAL_FINGERPRINT: initial, T.WEIGHTS_CHANGED: str(changed).lower()})
        if not changed:
            print("Warning: the model's weights never changed (its fingerprint at the end equals the one at "
                  "ctx.ddp): nothing was trained. Check the loss, the learning rate and optimizer.step().",
                  file=sys.stderr)


@dataclass
class Preflight:
    """What `harness run` checked before recording: the validated config, the code state, and warnings."""

    cfg: DictConfig
    git: GitState
    warnings: list[str]


def preflight(
    exp_dir: Path,
    overrides: list[str],
    *,
    require_clean: bool = False,
    executor: str | None = None,
    allow_untracked_secrets: bool = False,
    tracking_uri: str | None = None,
) -> Preflight:
    """Every check that needs neither the store nor an engine; raises HarnessError, records nothing."""
    from harness import gitsource
    from harness.config import Executor, load_experiment
    from harness.launch import capacity_warning, resolve_device
    from harness.store import local_paths
    from harness.tracking import resolve_uri

    if executor is not None:
        overrides = [*overrides, f"executor={executor}"]
    cfg = load_experiment(Path(exp_dir), overrides)
    git = gitsource.inspect(
        Path(exp_dir), max_untracked_mib=cfg.record.max_untracked_mib, allow_secrets=allow_untracked_secrets,
        exclude=tuple(local_paths(resolve_uri(tracking_uri))),  # the store records runs; it is not their code
    )
    warnings: list[str] = []
    if git.excluded:
        shown = ", ".join(git.excluded)
        warnings.append(
            f"the tracking store's files ({shown}) lie inside the repository and are not ignored; they are left out "
            "of the code record. Add them to .gitignore (e.g. mlruns/)."
        )
    if git.dirty:
        if require_clean:
            raise HarnessError(
                f"the working tree of {git.root} has uncommitted changes and --require-clean was given. "
                "Commit or stash them."
            )
        warnings.append(
            "uncommitted changes: a run records them as a patch (git/uncommitted.patch) and is tagged dirty."
        )
    if cfg.executor == Executor.local:
        device, _ = resolve_device(cfg.device.value, cfg.backend.value, cfg.world_size)  # refuse before recording
        warning = capacity_warning(device, cfg.world_size, cfg.threads_per_rank)
        if warning:
            warnings.append(warning)
    return Preflight(cfg, git, warnings)


def run(
    exp_dir: Path,
    overrides: list[str],
    *,
    require_clean: bool = False,
    tracking_uri: str | None = None,
    executor: str | None = None,
    allow_unpinned: bool = False,
    allow_untracked_secrets: bool = False,
) -> Outcome:
    """Validate, record, launch. Bad input raises HarnessError before any run is created."""
    from harness import container
    from harness.config import Executor
    from harness.store import probe_store, store_timeout
    from harness.tracking import resolve_uri

    # A store that cannot be reached is said in a second, before the config, git and torch are looked at.
    probe_store(resolve_uri(tracking_uri), True, store_timeout())
    checked = preflight(
        exp_dir, overrides, require_clean=require_clean, executor=executor,
        allow_untracked_secrets=allow_untracked_secrets, tracking_uri=tracking_uri,
    )
    cfg, git = checked.cfg, checked.git
    for warning in checked.warnings:
        print(f"Warning: {warning}", file=sys.stderr)
    if cfg.executor == Executor.docker:
        pinned = container.pin(str(cfg.image), allow_unpinned=allow_unpinned)
        tracker = Tracker(tracking_uri)
        run_id = create_record(tracker, cfg, Path(exp_dir), git, image=container.image_tags(pinned))
        rel = Path(exp_dir).resolve().relative_to(git.root.resolve()).as_posix()
        status, code, message = container.run_in_container(
            tracker, run_id, pinned, git.root, rel, container.wants_gpus(cfg.device.value)
        )
        return Outcome(run_id, status, code, message)
    tracker = Tracker(tracking_uri)
    run_id = create_record(tracker, cfg, Path(exp_dir), git, image=local_image_tags(str(cfg.image)))
    return execute(tracker, run_id, cfg, Path(exp_dir))


def execute_recorded(
    run_id: str, code_dir: Path, tracking_uri: str | None = None, resume_step: int | None = None
) -> Outcome:
    """Inside the container: run an already recorded run from its stored config."""
    tracker = Tracker(tracking_uri)
    run = tracker.harness_run(run_id)
    if run.status != T.RUNNING:
        raise HarnessError(f"run {run_id} is {run.status}, not RUNNING; it was already executed.")
    return execute(tracker, run_id, recorded_config(tracker, run), code_dir, resume_step=resume_step)
