"""The docker executor: run a recorded job inside its pinned image, by digest, and see it ended."""

from __future__ import annotations

import contextlib
import shutil
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import docker
from harness import tags as T
from harness.errors import EXIT_FAILED, EXIT_OK, HarnessError, Interrupted
from harness.store import artifact_path, database_file
from harness.tracking import Tracker

WORKSPACE = "/workspace"  # where the code (repository root or replay worktree) is mounted
ENV_DIGEST = "HARNESS_IMAGE_DIGEST"  # a container cannot learn its own digest: it is told


@dataclass(frozen=True)
class PinnedImage:
    reference: str  # as pinned in experiment.yaml
    digest: str  # registry manifest digest
    image_id: str
    run_reference: str  # repository@digest: what actually runs
    tag_digest: str | None  # what the reference's tag resolves to now (None for a digest-only pin)


def pin(reference: str, *, allow_unpinned: bool = False, digest: str | None = None) -> PinnedImage:
    """Resolve the experiment's image to a registry digest (pulling if absent).

    `digest` (replay) forces that digest whatever the tag points to now.
    """
    if docker.is_unpinned(reference) and not allow_unpinned and digest is None:
        raise HarnessError(
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
        raise HarnessError(
            f"image {reference!r} has no registry digest (built here, never pushed). Push it to a registry "
            "(docker push) so that the run can be replayed by digest."
        )
    run_reference = f"{repository}@{want}"
    info = docker.resolve_image(run_reference)
    if pinned_digest is None and digest is None:
        print(
            f"Warning: image {reference!r} is pinned by tag; it resolved to {want}. Pin the digest for "
            f"replays elsewhere: image: {run_reference}",
            file=sys.stderr,
        )
    return PinnedImage(reference, want, info.image_id, run_reference, tag_digest)


def image_tags(image: PinnedImage) -> dict[str, str]:
    tags = {T.IMAGE: image.reference, T.IMAGE_DIGEST: image.digest, T.IMAGE_ID: image.image_id, T.EXECUTOR: "docker"}
    if image.tag_digest is not None:
        tags[T.IMAGE_TAG_DIGEST] = image.tag_digest
    return tags


def _store_mounts(tracker: Tracker, run_id: str) -> list[tuple[Path, str]]:
    """Local store paths the container must see at the same absolute paths (URIs stay valid)."""
    paths: list[Path] = []
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


def run_in_container(
    tracker: Tracker, run_id: str, image: PinnedImage, code_root: Path, exp_rel: str, gpus: bool,
    extra_args: list[str] | None = None,
) -> tuple[str, int, str]:
    """Run `harness _execute` for `run_id` in the image; returns (status, exit code, message)."""
    name = f"harness-{run_id[:12]}"
    workdir = f"{WORKSPACE}/{exp_rel}"
    args = docker.run_args(
        image.run_reference,
        workdir_host=code_root,
        workdir_container=WORKSPACE,
        mounts=_store_mounts(tracker, run_id),
        env={"MLFLOW_TRACKING_URI": tracker.uri, ENV_DIGEST: image.digest, "PYTHONUNBUFFERED": "1"},
        gpus=gpus,
        command=["harness", "_execute", run_id, "--code-dir", workdir, *(extra_args or [])],
        name=name,
    )
    interrupted: list[int] = []

    def on_signal(signum: int, frame: Any) -> None:
        interrupted.append(signum)
        # Stopping the container sends SIGTERM to the harness inside, which marks the run KILLED.
        threading.Thread(target=docker.stop_container, args=(name,), daemon=True).start()

    handlers = {}
    if threading.current_thread() is threading.main_thread():
        handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    proc = docker.start_container(args)
    try:
        code = proc.wait()
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
        if proc.poll() is None:
            proc.kill()
        with contextlib.suppress(docker.DockerError):
            if docker.container_exists(name):
                docker.stop_container(name)

    status = tracker.get_run(run_id).status
    if interrupted:
        signum = interrupted[0]
        if status == T.RUNNING:
            tracker.end_run(run_id, T.KILLED)
            status = T.KILLED
        return status, 128 + signum, str(Interrupted(signum))
    if status == T.RUNNING:  # the container died without ending the run (OOM kill, engine error)
        reason = f"container exited with code {code} before the run ended"
        tracker.set_tags(run_id, {T.STATUS_REASON: reason})
        tracker.end_run(run_id, T.FAILED)
        return T.FAILED, EXIT_FAILED, reason
    if status == T.FINISHED and code == EXIT_OK:
        return status, EXIT_OK, ""
    reason = tracker.get_run(run_id).tags.get(T.STATUS_REASON, f"container exited with code {code}")
    return status, code if code else EXIT_FAILED, reason


def wants_gpus(device: str) -> bool:
    """--gpus all when the job runs on cuda, or on auto when this host has NVIDIA GPUs."""
    return device == "cuda" or (device == "auto" and shutil.which("nvidia-smi") is not None)
