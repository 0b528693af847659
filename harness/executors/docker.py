"""The docker backend: run a recorded job inside its pinned image, by digest, and see it ended.

The container runs `harness _execute RUN_ID`, which runs the ranks with the local backend and records
into the same store (mounted, or reached over HTTP); this side only starts, stops and checks.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from harness import events, tags as T
from harness.config import is_no_image, to_container
from harness.configschema import ExperimentConfig
from harness.errors import BackendError, ConfigError, SecretRefused
from harness.executors.base import (
    FAILED,
    KILLED,
    RUNNING,
    Backend,
    CliOption,
    Job,
    JobEvent,
    JobOptions,
)
from harness.executors.remote import Ended, RemoteExecutor, RemoteHandle, execute_command
from harness.record.recorder import ENV_DIGEST
from harness.record.redaction import redact
from harness.secrets import env_name_is_secret
from harness.store.probe import SUPPRESS_URL
from harness.store.tracking import Tracker
from harness.store.uris import artifact_path, database_file
from harness.systems import docker

WORKSPACE = "/workspace"  # where the code (repository root or replay worktree) is mounted

# The host's variables that change numerics or communication, which a container does not inherit (it starts from
# the image's environment): without them a user's NCCL_ALGO, CUBLAS_WORKSPACE_CONFIG or NVIDIA_TF32_OVERRIDE pin
# would be silently absent where the ranks run.
_FORWARD_PREFIXES = ("NCCL_", "CUBLAS_", "CUBLASLT_", "TORCH_")
_FORWARD_NAMES = frozenset({"NVIDIA_TF32_OVERRIDE", "DISABLE_ADDMM_CUDA_LT"})
# CUDA_VISIBLE_DEVICES values under which CUDA sees no GPU at all.
_NO_DEVICES = frozenset({"", "-1", "none", "nodevfiles", "void"})


@dataclass(frozen=True)
class HostEnvironment:
    """What of the host's environment a job's container gets."""

    values: dict[str, str]  # forwarded as -e NAME=VALUE
    # Credential-named (NCCL_AUTH_KEY, TORCH_HUB_TOKEN...): forwarded by name, -e NAME, the value handed to
    # docker's own environment, so that it is on no command line.
    by_name: dict[str, str]
    gpus: str | None  # docker's --gpus value; None: the container gets no GPU


def host_environment(device: str, environ: Mapping[str, str], gpus_here: bool) -> HostEnvironment:
    """The host's numerics and NCCL variables for the container, and the GPUs it may use: those
    CUDA_VISIBLE_DEVICES names, or all when it is unset (`gpus_here`: this host has NVIDIA GPUs)."""
    values: dict[str, str] = {}
    by_name: dict[str, str] = {}
    for name, value in environ.items():
        if name.startswith(_FORWARD_PREFIXES) or name in _FORWARD_NAMES:
            (by_name if env_name_is_secret(name) else values)[name] = value
    gpus = None
    if device == "cuda" or (device == "auto" and gpus_here):
        visible = environ.get("CUDA_VISIBLE_DEVICES")
        if visible is None:
            gpus = "all"
        elif visible.strip().lower() not in _NO_DEVICES:
            # The container is given exactly those GPUs, and numbers them 0..n-1 itself: CUDA_VISIBLE_DEVICES is
            # not forwarded, since its host indices (2,3) would name GPUs the container does not have. docker
            # splits --gpus at commas unless the value is quoted (docker run --gpus '"device=2,3"').
            devices = ",".join(d.strip() for d in visible.split(",") if d.strip())
            gpus = f'"device={devices}"'
    return HostEnvironment(values, by_name, gpus)


@dataclass(frozen=True)
class PinnedImage:
    reference: str  # as pinned in experiment.yaml
    digest: str  # registry manifest digest
    image_id: str
    run_reference: str  # repository@digest: what actually runs
    tag_digest: str | None  # what the reference's tag resolves to now (None for a digest-only pin)
    by_id: bool = False  # found by the recorded image id, the registry digest unknown to this engine (harness import)


def pin(reference: str, *, allow_unpinned: bool = False, digest: str | None = None) -> PinnedImage:
    """Resolve the experiment's image to a registry digest (pulling if absent).

    `digest` (replay) forces that digest whatever the tag points to now.
    """
    if docker.is_unpinned(reference) and not allow_unpinned and digest is None:
        raise BackendError(
            f"image {reference!r} uses the 'latest' tag, which moves; pin a version or a digest "
            "(name@sha256:...) in experiment.yaml, or pass --allow-unpinned."
        )
    repository, tag, pinned_digest = docker.parse_reference(reference)
    tag_digest = None
    if tag is not None or pinned_digest is None:
        tag_ref = f"{repository}:{tag or 'latest'}"
        # A first run pulls the tag if needed; a replay only looks where the tag points now.
        info = docker.resolve_image(tag_ref) if digest is None else docker.inspect_image(tag_ref)
        tag_digest = info.digest if info is not None else None
    want = digest or pinned_digest or tag_digest
    if want is None:
        raise BackendError(
            f"image {reference!r} has no registry digest (built here, never pushed). Push it to a registry "
            "(docker push) so that the run can be replayed by digest."
        )
    run_reference = f"{repository}@{want}"
    info = docker.resolve_image(run_reference)
    if pinned_digest is None and digest is None:
        events.emit(events.Warning(
            f"image {reference!r} is pinned by tag; it resolved to {want}. Pin the digest for "
            f"replays elsewhere: image: {run_reference}"
        ))
    return PinnedImage(reference, want, info.image_id, run_reference, tag_digest)


def local_by_id(recorded: dict[str, str], digest: str) -> PinnedImage | None:
    """The recorded image found here by its id when the engine has no record of its registry digest.

    An image loaded from a bundle (`harness import --with-image`) has no RepoDigests; its id (the
    digest of its config, which names every layer's content) equal to the recorded one is the same
    image, and running it needs no registry. None when the digest is known here or the id is not.
    """
    image_id = recorded.get(T.IMAGE_ID)
    repository, _, _ = docker.parse_reference(recorded[T.IMAGE])
    if not image_id or docker.inspect_image(f"{repository}@{digest}") is not None:
        return None
    info = docker.inspect_image(image_id)
    if info is None or info.image_id != image_id:
        return None
    events.emit(events.Notice(f"Note: the engine has no record of {repository}@{digest}; running the local image "
                              f"with the recorded id {image_id}."))
    return PinnedImage(recorded[T.IMAGE], digest, image_id, image_id, None, by_id=True)


def image_tags(image: PinnedImage) -> dict[str, str]:
    tags = {T.IMAGE: image.reference, T.IMAGE_DIGEST: image.digest, T.IMAGE_ID: image.image_id, T.EXECUTOR: "docker"}
    if image.by_id:
        tags[T.IMAGE_RESOLVED_BY] = "id"
    if image.tag_digest is not None:
        tags[T.IMAGE_TAG_DIGEST] = image.tag_digest
    return tags


def _mounts(tracker: Tracker, run_id: str, data: dict[str, str]) -> list[tuple[Path, str]]:
    """Local store paths and the declared data, which the container must see at the same absolute paths
    (the store's URIs stay valid, and ctx.data gives the paths that were hashed)."""
    paths: list[Path] = [Path(p) for p in data.values()]
    db = database_file(tracker.uri)
    if db is not None:
        paths.append(db.parent)
    artifacts = artifact_path(tracker.get_run(run_id).artifact_uri)
    if artifacts is not None:
        paths.append(artifacts.parent.parent)  # the experiment's artifact folder
    unique: list[Path] = []
    for p in paths:
        if not any(p == u or u in p.parents for u in unique):
            unique = [u for u in unique if p not in u.parents] + [p]
    return [(p, str(p)) for p in unique]


class DockerExecutor(RemoteExecutor):
    name = "docker"

    def prepare(self, job: Job) -> dict[str, str]:
        """Pin the image: the config's reference on a first run, the recorded digest on a replay or resume."""
        if job.topology.multi_node:
            raise BackendError("the docker executor runs one node; for several, use --executor slurm or local --nnodes.")

        secret = redact(to_container(job.cfg), None)[1]
        if secret:  # the container reads the recorded config, which holds placeholders, not the values
            raise SecretRefused(
                f"{', '.join(secret)} look{'s' if len(secret) == 1 else ''} like a secret, which the record does not "
                "hold and the container reads its config from the record. Use --executor local."
            )
        if job.recorded is None:
            allow_unpinned = isinstance(job.options, DockerOptions) and job.options.allow_unpinned
            self.pinned = pin(str(job.cfg.image), allow_unpinned=allow_unpinned)
        else:
            tags = job.recorded.tags
            digest = tags.get(T.IMAGE_DIGEST, "unknown")
            on_host = digest == T.HOST
            if on_host:  # in its pinned image as that resolved when the run started, where this engine knew it
                digest = tags.get(T.IMAGE_TAG_DIGEST, "unknown")
            if not digest.startswith("sha256:"):
                what = "ran on the host and recorded no digest of its pinned image" if on_host else "recorded no image digest"
                raise BackendError(
                    f"run {job.recorded.run_id} {what} "
                    f"({tags.get(T.IMAGE_DIGEST_REASON, 'unknown')}), so there is no exact image to run it in. "
                    "Use --executor local."
                )
            self.pinned = local_by_id(tags, digest) or pin(tags[T.IMAGE], digest=digest)
            if self.pinned.tag_digest and self.pinned.tag_digest != digest:
                events.emit(events.Notice(f"Note: {tags[T.IMAGE]} now points to {self.pinned.tag_digest}; the "
                                          f"recorded digest {digest} runs."))
        return image_tags(self.pinned)

    def launch(self, job: Job, on_event: Callable[[JobEvent], None], code: contextlib.ExitStack) -> RemoteHandle:
        # The code is mounted as it is (the repository root, or the replay's worktree): it needs no checkout.
        return ContainerHandle(job, self.pinned)


EXECUTOR = DockerExecutor


@dataclass(frozen=True)
class DockerOptions(JobOptions):
    allow_unpinned: bool = False  # run an image pinned by the moving 'latest' tag


def check(cfg: ExperimentConfig) -> None:
    if is_no_image(cfg.image) and cfg.executor == "docker":
        raise ConfigError("executor docker needs an image, but image is none. Pin one (name:tag or name@sha256:...).")


BACKEND = Backend(
    name="docker", executor=DockerExecutor, check=check, options=DockerOptions, runs_segments=True,
    runs_working_tree=True, executes="local",
    help="inside the pinned image, by digest",
    cli=(CliOption("--allow-unpinned", "allow_unpinned", "Accept an image pinned by the moving 'latest' tag.", bool,
                   commands=("run",)),),
)


class ContainerHandle(RemoteHandle):
    """`docker run` of `harness _execute` for the job's run; its output streams to our stderr."""

    def __init__(self, job: Job, image: PinnedImage) -> None:
        super().__init__(job)
        self.name = f"harness-{job.run_id[:12]}"
        tracker = job.tracker
        host = host_environment(job.cfg.device.value, os.environ, _nvidia_smi_here())
        args = docker.run_args(
            image.run_reference,
            workdir_host=job.code_root,
            workdir_container=WORKSPACE,
            mounts=_mounts(tracker, job.run_id, job.data),
            env={**host.values, ENV_DIGEST: image.digest, "PYTHONUNBUFFERED": "1", SUPPRESS_URL: "true"},
            # by name: the tracking URI's value may hold the server's password, and so may a credential-named variable
            passed=("MLFLOW_TRACKING_URI", *sorted(host.by_name)),
            gpus=host.gpus or False,
            command=execute_command(job, f"{WORKSPACE}/{job.exp_rel}"),
            name=self.name,
        )
        self.proc = docker.start_container(args, {**host.by_name, "MLFLOW_TRACKING_URI": tracker.uri})

    def poll(self) -> str:
        return RUNNING if self.proc.poll() is None else (KILLED if self.interrupted else FAILED)

    def stop(self) -> None:
        # Stopping the container sends SIGTERM to the harness inside, which marks the run KILLED.
        docker.stop_container(self.name)

    def follow(self) -> Ended:
        try:
            code = self.proc.wait()
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            with contextlib.suppress(docker.DockerError):
                if docker.container_exists(self.name):
                    docker.stop_container(self.name)
        # A container that died without ending the run (OOM kill, engine error); a stopped one's run ends KILLED.
        vanished = None if self.interrupted else f"container exited with code {code} before the run ended"
        return Ended(code, f"container exited with code {code}", vanished)


def _nvidia_smi_here() -> bool:
    """This host has NVIDIA GPUs (their driver's tool is installed): a job on device auto gets them."""
    return shutil.which("nvidia-smi") is not None
