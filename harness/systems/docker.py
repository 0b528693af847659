"""The one boundary to Docker: resolve image references to registry digests, build `docker run` argument lists."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from harness.errors import BackendError

# Calls that only ask the engine something must fail fast when no engine runs: `harness run`
# with the local executor asks for the digest on every run, engine or not.
QUERY_TIMEOUT_S = 5.0
PULL_TIMEOUT_S = 1800.0
STOP_GRACE_S = 10

_INSTALL_HINT = "Install Docker (https://docs.docker.com/engine/install/) and retry."
_START_HINT = "Start it (systemctl start docker, or dockerd) and retry."

# Docker's reference grammar (distribution/reference), simplified to what a user can type.
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_HOST = r"(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)*|\[[0-9a-fA-F:]+\])(?::[0-9]+)?"
_REFERENCE = re.compile(
    rf"^(?P<repository>(?:{_HOST}/)?{_COMPONENT}(?:/{_COMPONENT})*)"
    r"(?::(?P<tag>[\w][\w.-]{0,127}))?"
    r"(?:@(?P<digest>[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}))?$"
)


class DockerError(BackendError):
    """Docker is missing, unreachable, or does not know an image; the message says how to fix it."""


class EngineUnavailable(DockerError):
    """The docker CLI is missing or no engine answers it."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason
        """Short form for records, e.g. `docker CLI not found`, `engine not running: <error>`."""


@dataclass
class ImageInfo:
    """What the local engine knows about one image reference."""

    reference: str
    """The reference as given (e.g. `localhost:5000/harness-cpu:0.1`)."""
    digest: str | None
    """Registry manifest digest (`sha256:...`) for the reference's repository; None if never pushed/pulled."""
    repo_digests: list[str]
    """All `repository@sha256:...` the engine records for the image."""
    image_id: str
    """Local image ID (`sha256:...` of the config); not portable across registries."""
    tags: list[str]
    """All `repository:tag` names of the image on this engine."""


def parse_reference(ref: str) -> tuple[str, str | None, str | None]:
    """Split `[host[:port]/]path[:tag][@digest]` into (repository, tag, digest); a missing tag means latest."""
    match = _REFERENCE.match(ref.strip())
    if not ref.strip() or match is None:
        raise DockerError(
            f"invalid image reference {ref!r}. Use REPOSITORY[:TAG][@sha256:DIGEST], "
            "e.g. localhost:5000/harness:0.1 or localhost:5000/harness@sha256:<64 hex>."
        )
    return match["repository"], match["tag"], match["digest"]


def is_unpinned(ref: str) -> bool:
    """True when the reference names the mutable `latest` tag (explicitly or implicitly) and no digest."""
    _, tag, digest = parse_reference(ref)
    return digest is None and tag in (None, "latest")


def engine_available() -> tuple[bool, str]:
    """(True, "") when a Docker engine answers; else (False, why not)."""
    try:
        _ping_engine()
    except DockerError as err:
        return False, str(err)
    return True, ""


def inspect_image(ref: str) -> ImageInfo | None:
    """What the engine knows about `ref`, or None if it does not have it; never pulls."""
    repository, _, digest = parse_reference(ref)
    proc = _docker(["image", "inspect", ref], timeout=QUERY_TIMEOUT_S)
    if proc.returncode != 0:
        if _is_no_such(proc.stderr):
            return None
        raise _failure("docker image inspect", proc)
    data = json.loads(proc.stdout)[0]
    repo_digests = list(data.get("RepoDigests") or [])
    return ImageInfo(
        reference=ref,
        digest=digest or _digest_for(repository, repo_digests),
        repo_digests=repo_digests,
        image_id=data["Id"],
        tags=list(data.get("RepoTags") or []),
    )


def resolve_image(ref: str, pull: bool = True) -> ImageInfo:
    """Inspect `ref`, pulling it first if the engine lacks it (like `docker run`'s default policy).

    A tag the engine already has is not re-pulled, so the digest is that of the local copy.
    `digest` is None when the image was built here and never pushed; callers decide if that is allowed.
    """
    info = inspect_image(ref)
    if info is None and pull:
        proc = _docker(["pull", ref], timeout=PULL_TIMEOUT_S)
        if proc.returncode != 0:
            if _is_engine_down(proc.stderr):
                raise _failure("docker pull", proc)
            raise DockerError(
                f"image {ref!r} not found locally and could not be pulled: {_first_line(proc.stderr)}. "
                "Build/push it or fix `image` in experiment.yaml."
            )
        info = inspect_image(ref)
    if info is None:
        raise DockerError(
            f"image {ref!r} not found locally{' and pulling is off' if not pull else ''}. "
            "Build/pull it or fix `image` in experiment.yaml."
        )
    repository, _, digest = parse_reference(ref)
    if digest is not None and _digest_for(repository, info.repo_digests, digest) is None:
        # The engine matched by content but never recorded this manifest digest for the repository.
        raise DockerError(
            f"the engine has no record of {repository}@{digest} (its RepoDigests: "
            f"{', '.join(info.repo_digests) or 'none'}). Pull it by digest (docker pull {ref}) and retry."
        )
    return info


def local_digest_or_reason(ref: str) -> tuple[str | None, str | None, str | None]:
    """(digest, image_id, reason the digest is unknown) from the local engine; never raises, never pulls."""
    try:
        parse_reference(ref)
    except DockerError:
        return None, None, f"invalid image reference {ref!r}"
    try:
        info = inspect_image(ref)
    except EngineUnavailable as err:
        return None, None, err.reason
    except (DockerError, OSError, ValueError, KeyError, IndexError) as err:
        return None, None, f"docker image inspect failed: {err}"
    if info is None:
        return None, None, "image not present locally"
    if info.digest is None:
        return None, info.image_id, "image has no registry digest (never pushed or pulled)"
    return info.digest, info.image_id, None


SAVE_TIMEOUT_S = 1800.0  # `docker save` / `docker load` of a multi-GB image on a slow disk


def save_image(image_id: str, reference: str, dest: Path) -> None:
    """`docker save` of the local image `image_id` (with every name it has here) to the file `dest`."""
    info = inspect_image(image_id)
    if info is None:
        raise DockerError(
            f"the image of {reference!r} ({image_id}) is not on this Docker engine, so it cannot be saved. "
            f"Pull it (docker pull {reference}) and export again, or export without --with-image."
        )
    proc = _docker(["save", "-o", str(dest), *(info.tags or [image_id])], timeout=SAVE_TIMEOUT_S)
    if proc.returncode != 0:
        raise _failure("docker save", proc)


def load_image(archive: Path, expected_id: str) -> ImageInfo:
    """`docker load` of `archive`; refused unless the engine then holds an image with id `expected_id`."""
    proc = _docker(["load", "-q", "-i", str(archive)], timeout=SAVE_TIMEOUT_S)
    if proc.returncode != 0:
        raise _failure("docker load", proc)
    info = inspect_image(expected_id)
    if info is None:
        loaded = " ".join(proc.stdout.split()) or "nothing"
        raise DockerError(
            f"docker load of the bundled image gave {loaded}, not the recorded image {expected_id}. "
            "The bundle's image is not the one the run used; export it again from the run's own store."
        )
    return info


def run_args(
    image: str,
    *,
    workdir_host: Path,
    workdir_container: str,
    mounts: list[tuple[Path, str]],
    env: dict[str, str],
    gpus: bool | str,
    command: list[str],
    name: str,
    network_host: bool = True,
    passed: tuple[str, ...] = (),
) -> list[str]:
    """The `docker run` argument list that runs `command` in `image` with the workdir bind-mounted.

    `passed`: variables given by name only (`-e NAME`): docker copies their values from its own environment
    (start_container's `env`), so that a secret (a tracking URI with a password) is not on the command line.
    `gpus`: True for all of the host's GPUs, or docker's own --gpus value ('"device=0,1"').
    """
    # ipc=host: DataLoader workers and NCCL need shared memory. --init: a real PID 1 that forwards
    # SIGTERM/SIGINT to the harness inside (a bare Python PID 1 ignores signals it has no handler for).
    args = ["docker", "run", "--rm", "--init", "--name", name, "--ipc=host"]
    if gpus:
        args += ["--gpus", "all" if gpus is True else gpus]
    if network_host:
        args += ["--network", "host"]  # rendezvous on the host's addresses, as outside a container
    for host, container in [(workdir_host, workdir_container), *mounts]:
        args += ["-v", _volume(Path(host), container)]
    args += ["-w", workdir_container]
    for key in sorted(env):
        if not key or "=" in key:
            raise DockerError(
                f"invalid environment variable name {key!r} for the container. Use NAME=VALUE names without '='."
            )
        args += ["-e", f"{key}={env[key]}"]
    for key in sorted(passed):
        args += ["-e", key]
    return [*args, image, *command]


def start_container(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start `docker run` (from run_args) attached: the container's output streams to our stderr,
    keeping stdout for the run id. `env`: the values of run_args' `passed` variables."""
    import os
    import sys

    if shutil.which("docker") is None:
        raise EngineUnavailable(f"docker CLI not found on PATH. {_INSTALL_HINT}", "docker CLI not found")
    return subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=sys.stderr, stderr=sys.stderr,
                            env={**os.environ, **env} if env else None)


def container_exists(name: str) -> bool:
    """True if a container (running or stopped) has this name."""
    proc = _docker(["container", "inspect", "--format", "{{.Id}}", name], timeout=QUERY_TIMEOUT_S)
    if proc.returncode == 0:
        return True
    if _is_no_such(proc.stderr):
        return False
    raise _failure("docker container inspect", proc)


def stop_container(name: str, grace_s: int = STOP_GRACE_S) -> bool:
    """Stop (SIGTERM, then SIGKILL after `grace_s`) and remove the named container; False if none existed."""
    proc = _docker(["stop", "--time", str(grace_s), name], timeout=grace_s + 30)
    if proc.returncode != 0:
        if _is_no_such(proc.stderr):
            return False
        raise _failure("docker stop", proc)
    # --rm containers remove themselves; others are removed here so the name can be reused.
    rm = _docker(["rm", "--force", name], timeout=QUERY_TIMEOUT_S + 30)
    if rm.returncode != 0 and not _is_no_such(rm.stderr) and "removal of container" not in rm.stderr:
        raise _failure("docker rm", rm)
    return True


# --- helpers ---------------------------------------------------------------------------------


def _docker(args: list[str], *, timeout: float) -> subprocess.CompletedProcess[str]:
    # Resolved per call so that PATH and DOCKER_HOST/DOCKER_CONTEXT in the environment are honoured.
    cli = shutil.which("docker")
    if cli is None:
        raise EngineUnavailable(f"docker CLI not found on PATH. {_INSTALL_HINT}", "docker CLI not found")
    try:
        return subprocess.run([cli, *args], capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise EngineUnavailable(
            f"`docker {args[0]}` got no answer within {timeout:.0f}s. "
            "Check that the Docker engine is running and responsive (docker version) and retry.",
            f"engine not answering (docker {args[0]} timed out after {timeout:.0f}s)",
        ) from None


def _ping_engine() -> None:
    proc = _docker(["version", "--format", "{{.Server.Version}}"], timeout=QUERY_TIMEOUT_S)
    if proc.returncode != 0:
        raise _engine_down("docker version", proc)


def _engine_down(what: str, proc: subprocess.CompletedProcess[str]) -> EngineUnavailable:
    error = _first_line(proc.stderr)
    return EngineUnavailable(
        f"Docker engine is not running ({what} failed: {error}). {_START_HINT}", f"engine not running: {error}"
    )


def _failure(what: str, proc: subprocess.CompletedProcess[str]) -> DockerError:
    if _is_engine_down(proc.stderr):
        return _engine_down(what, proc)
    return DockerError(f"{what} failed: {_first_line(proc.stderr)}. Check the Docker engine (docker info) and retry.")


def _is_no_such(stderr: str) -> bool:
    return (
        "no such image" in stderr.lower() or "no such container" in stderr.lower() or "no such object" in stderr.lower()
    )


def _is_engine_down(stderr: str) -> bool:
    text = stderr.lower()
    return (
        "cannot connect to the docker daemon" in text
        or "error during connect" in text
        or "is the docker daemon running" in text
    )


def _first_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0].rstrip(".") if lines else "no error output"


def _familiar(repository: str) -> str:
    # RepoDigests use Docker Hub's short names: docker.io/library/ubuntu is listed as ubuntu.
    for prefix in ("docker.io/", "index.docker.io/", "registry-1.docker.io/"):
        if repository.startswith(prefix):
            repository = repository[len(prefix) :]
            if repository.startswith("library/") and repository.count("/") == 1:
                repository = repository[len("library/") :]
            break
    return repository


def _digest_for(repository: str, repo_digests: list[str], digest: str | None = None) -> str | None:
    """The first RepoDigest of `repository` (or `digest` itself if the engine records it for that repository)."""
    wanted = _familiar(repository)
    for entry in repo_digests:
        name, _, found = entry.partition("@")
        if _familiar(name) == wanted and found and (digest is None or found == digest):
            return found
    return None


def _volume(host: Path, container: str) -> str:
    # Docker reads a relative host path as a named volume, and ':' as the field separator.
    host_str = str(host.absolute())
    if ":" in host_str or ":" in container:
        raise DockerError(
            f"cannot bind-mount {host_str!r} at {container!r}: docker -v paths may not contain ':'. "
            "Rename or move the folder and retry."
        )
    return f"{host_str}:{container}"
