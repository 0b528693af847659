"""harness.systems.docker against a real Docker engine and a real local registry (127.0.0.1:5000)."""

from __future__ import annotations

import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.systems import docker
from harness.systems.docker import DockerError

ROOT = Path(__file__).resolve().parents[1]
from conftest import REPOSITORY, TAG, _registry_digest  # noqa: E402  (engine fixture: conftest)


@pytest.fixture
def unpushed_tag(engine: str) -> Iterator[str]:
    """The CPU image under a fresh local tag that was never pushed to any registry."""
    ref = f"localhost:5000/harness-never-pushed:{uuid.uuid4().hex[:12]}"
    subprocess.run(["docker", "tag", engine, ref], check=True, capture_output=True)
    yield ref
    subprocess.run(["docker", "rmi", ref], check=False, capture_output=True)


# --- pure: references ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ref", "expected"),
    [
        ("ubuntu", ("ubuntu", None, None)),
        ("ubuntu:22.04", ("ubuntu", "22.04", None)),
        ("library/ubuntu:latest", ("library/ubuntu", "latest", None)),
        ("localhost:5000/harness-cpu", ("localhost:5000/harness-cpu", None, None)),
        ("localhost:5000/harness-cpu:0.1", ("localhost:5000/harness-cpu", "0.1", None)),
        (
            "registry.example.com:443/team/sub/harness:v1.2_rc-3",
            ("registry.example.com:443/team/sub/harness", "v1.2_rc-3", None),
        ),
        ("localhost:5000/harness@sha256:" + "a" * 64, ("localhost:5000/harness", None, "sha256:" + "a" * 64)),
        ("localhost:5000/harness:0.1@sha256:" + "b" * 64, ("localhost:5000/harness", "0.1", "sha256:" + "b" * 64)),
        ("pytorch/pytorch:2.9.1-cuda12.8-cudnn9-runtime", ("pytorch/pytorch", "2.9.1-cuda12.8-cudnn9-runtime", None)),
    ],
)
def test_parse_reference(ref: str, expected: tuple[str, str | None, str | None]) -> None:
    assert docker.parse_reference(ref) == expected


@pytest.mark.parametrize(
    "ref",
    ["", "  ", "Ubuntu:22.04", "ubuntu:", "ubuntu@sha256:123", "localhost:5000/", "a b:1", "ubuntu:tag with space"],
)
def test_parse_reference_rejects_invalid(ref: str) -> None:
    with pytest.raises(DockerError) as err:
        docker.parse_reference(ref)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("invalid image reference") and "REPOSITORY[:TAG][@sha256:DIGEST]" in message


@pytest.mark.parametrize(
    ("ref", "unpinned"),
    [
        ("ubuntu", True),
        ("ubuntu:latest", True),
        ("localhost:5000/harness", True),
        ("localhost:5000/harness:latest", True),
        ("localhost:5000/harness:0.1", False),
        ("localhost:5000/harness@sha256:" + "c" * 64, False),
        ("localhost:5000/harness:latest@sha256:" + "c" * 64, False),
    ],
)
def test_is_unpinned(ref: str, unpinned: bool) -> None:
    assert docker.is_unpinned(ref) is unpinned


# --- pure: docker run arguments --------------------------------------------------------------


def test_run_args_golden(tmp_path: Path) -> None:
    work = tmp_path / "my exp (v2)"
    data = tmp_path / "data, shared"
    args = docker.run_args(
        "localhost:5000/harness@sha256:" + "d" * 64,
        workdir_host=work,
        workdir_container="/workspace",
        mounts=[(data, "/data"), (tmp_path / "mlruns", "/mlruns")],
        env={"RANK": "0", "MASTER_ADDR": "127.0.0.1", "HARNESS_NOTE": "a b=c"},
        gpus=True,
        command=["harness", "_worker", "--run-id", "abc 123"],
        name="harness-abc123",
    )
    assert args == [
        "docker", "run", "--rm", "--init", "--name", "harness-abc123", "--ipc=host",
        "--gpus", "all",
        "--network", "host",
        "-v", f"{tmp_path}/my exp (v2):/workspace",
        "-v", f"{tmp_path}/data, shared:/data",
        "-v", f"{tmp_path}/mlruns:/mlruns",
        "-w", "/workspace",
        "-e", "HARNESS_NOTE=a b=c",
        "-e", "MASTER_ADDR=127.0.0.1",
        "-e", "RANK=0",
        "localhost:5000/harness@sha256:" + "d" * 64,
        "harness", "_worker", "--run-id", "abc 123",
    ]  # fmt: skip


def test_run_args_cpu_bridge_relative_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    args = docker.run_args(
        "img:1", workdir_host=Path("exp"), workdir_container="/w", mounts=[], env={},
        gpus=False, command=["true"], name="n", network_host=False,
    )  # fmt: skip
    # A relative host path would be taken by docker as a named volume, so it is made absolute.
    assert args == [
        "docker",
        "run",
        "--rm",
        "--init",
        "--name",
        "n",
        "--ipc=host",
        "-v",
        f"{tmp_path}/exp:/w",
        "-w",
        "/w",
        "img:1",
        "true",
    ]


def test_run_args_rejects_colon_in_path(tmp_path: Path) -> None:
    with pytest.raises(DockerError, match=r"docker -v paths may not contain ':'.*Rename or move"):
        docker.run_args(
            "img:1", workdir_host=tmp_path / "a:b", workdir_container="/w", mounts=[], env={},
            gpus=False, command=["true"], name="n",
        )  # fmt: skip


# --- no engine -------------------------------------------------------------------------------


def test_dead_socket_reports_engine_not_running(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DOCKER_HOST", "unix:///tmp/nonexistent.sock")
    ok, reason = docker.engine_available()
    assert not ok
    assert reason.startswith("Docker engine is not running (docker version failed: ")
    assert "/tmp/nonexistent.sock" in reason and reason.endswith(
        "Start it (systemctl start docker, or dockerd) and retry."
    )
    assert "\n" not in reason
    started = time.monotonic()
    digest, image_id, why = docker.local_digest_or_reason("localhost:5000/harness-cpu:0.1")
    assert time.monotonic() - started < docker.QUERY_TIMEOUT_S + 1
    assert (digest, image_id) == (None, None)
    assert why is not None and why.startswith("engine not running: ")
    with pytest.raises(docker.EngineUnavailable):
        docker.inspect_image("localhost:5000/harness-cpu:0.1")


def test_missing_cli(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    ok, reason = docker.engine_available()
    assert not ok and reason.startswith("docker CLI not found on PATH. Install Docker")
    assert docker.local_digest_or_reason("localhost:5000/harness-cpu:0.1") == (None, None, "docker CLI not found")


# --- real engine and registry ----------------------------------------------------------------


@pytest.mark.slow
def test_resolve_pushed_tag_matches_registry_digest(engine: str) -> None:
    info = docker.resolve_image(engine)
    registry_digest = _registry_digest(REPOSITORY, TAG)
    assert registry_digest is not None
    assert info.digest == registry_digest
    assert f"localhost:5000/{REPOSITORY}@{registry_digest}" in info.repo_digests
    assert engine in info.tags
    assert info.image_id.startswith("sha256:") and info.image_id != info.digest
    assert docker.local_digest_or_reason(engine) == (registry_digest, info.image_id, None)


@pytest.mark.slow
def test_resolve_by_digest(engine: str) -> None:
    by_tag = docker.resolve_image(engine)
    assert by_tag.digest is not None
    for ref in (f"localhost:5000/{REPOSITORY}@{by_tag.digest}", f"{engine}@{by_tag.digest}"):
        info = docker.resolve_image(ref, pull=False)
        assert info.digest == by_tag.digest
        assert info.image_id == by_tag.image_id


@pytest.mark.slow
def test_inspect_absent_image_is_none(engine: str) -> None:
    assert docker.inspect_image(f"localhost:5000/harness-absent:{uuid.uuid4().hex[:12]}") is None
    assert docker.local_digest_or_reason("localhost:5000/harness-absent:x") == (None, None, "image not present locally")


@pytest.mark.slow
def test_resolve_absent_image_fails_in_one_line(engine: str) -> None:
    ref = f"localhost:5000/harness-absent:{uuid.uuid4().hex[:12]}"
    with pytest.raises(DockerError) as err:
        docker.resolve_image(ref)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"image '{ref}' not found locally and could not be pulled: ")
    assert "manifest unknown" in message
    assert message.endswith("Build/push it or fix `image` in experiment.yaml.")
    assert err.value.exit_code == 2


@pytest.mark.slow
def test_never_pushed_tag_has_no_digest(unpushed_tag: str) -> None:
    # The image has a RepoDigest, but for harness-cpu: none belongs to this reference's repository.
    info = docker.resolve_image(unpushed_tag, pull=False)
    assert info.digest is None and info.repo_digests
    digest, image_id, reason = docker.local_digest_or_reason(unpushed_tag)
    assert digest is None and image_id == info.image_id
    assert reason == "image has no registry digest (never pushed or pulled)"


@pytest.mark.slow
def test_run_args_run_for_real_and_stop(engine: str, tmp_path: Path) -> None:
    work = tmp_path / "exp dir"
    work.mkdir()
    name = f"harness-test-{uuid.uuid4().hex[:12]}"
    args = docker.run_args(
        engine,
        workdir_host=work,
        workdir_container="/workspace",
        mounts=[],
        env={"GREETING": "hello world"},
        gpus=False,
        command=[
            "python",
            "-c",
            "import os, torch; open('out.txt', 'w').write(os.environ['GREETING'] + ' ' + torch.__version__)",
        ],
        name=name,
    )
    subprocess.run(args, check=True, capture_output=True, timeout=120)
    assert (work / "out.txt").read_text() == "hello world 2.13.0+cpu"
    assert not docker.container_exists(name)  # --rm

    sleeper = subprocess.Popen([*args[:-3], "sleep", "300"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not docker.container_exists(name):
            assert time.monotonic() < deadline, "container did not start"
            time.sleep(0.2)
        assert docker.stop_container(name, grace_s=1)
        sleeper.wait(timeout=30)
        assert not docker.container_exists(name)
        assert docker.stop_container(name) is False
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
