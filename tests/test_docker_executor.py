"""The docker executor against a real engine and registry: runs and replays inside the pinned image."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from conftest import EXPERIMENTS, IMAGE, REPOSITORY, TAG, Project, _registry_digest, make_project
from snippets import CRASHING

pytestmark = pytest.mark.slow


def docker_cli(*args: str, stdin: str | None = None) -> str:
    return subprocess.run(["docker", *args], input=stdin, capture_output=True, text=True, check=True,
                          env={**os.environ, "DOCKER_BUILDKIT": "0"}).stdout.strip()


def in_image_python(image: str) -> str:
    return docker_cli("run", "--rm", image, "python", "-c", "import platform; print(platform.python_version())")


@pytest.fixture(scope="module")
def dproject(engine: str, tmp_path_factory: pytest.TempPathFactory) -> Project:
    return make_project(tmp_path_factory.mktemp("docker"))


@pytest.fixture(scope="module")
def docker_run(dproject: Project):
    result = dproject.harness("run", "experiments/linear_ddp", "--executor", "docker", "train.epochs=2")
    assert result.returncode == 0, result.stderr
    return result


def test_run_in_container_records_registry_digest(dproject: Project, docker_run) -> None:
    client = dproject.client()
    run = client.get_run(docker_run.last_line)
    tags = run.data.tags
    assert run.info.status == "FINISHED"
    assert tags["harness.executor"] == "docker" and tags["harness.in_image"] == "true"
    registry = _registry_digest(REPOSITORY, TAG)
    assert registry is not None and tags["harness.image.digest"] == registry
    assert tags["harness.image"] == IMAGE and tags["harness.image.tag_digest"] == registry
    assert tags["harness.image.id"] == docker_cli("image", "inspect", "--format", "{{.Id}}", IMAGE)
    assert "is pinned by tag" in docker_run.stderr  # the warning that the pin should carry the digest
    # The environment was measured inside the container, not on this host.
    assert tags["harness.env.python"] == in_image_python(IMAGE)
    lock = Path(client.download_artifacts(docker_run.last_line, "environment/requirements.lock")).read_text()
    assert "ddp-harness==0.1.0" in lock.splitlines()
    assert len(client.get_metric_history(docker_run.last_line, "loss")) == 10
    assert "epoch 2/2" in docker_run.stderr  # rank 0's log streamed to the terminal
    assert docker_cli("ps", "-a", "--filter", f"name=harness-{docker_run.last_line[:12]}", "-q") == ""


def test_replay_in_container_is_bitwise(dproject: Project, docker_run) -> None:
    result = dproject.harness("replay", docker_run.last_line)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().splitlines()[-2].startswith("verdict: BITWISE")
    tags = dproject.client().get_run(result.last_line).data.tags
    assert tags["harness.executor"] == "docker" and tags["harness.in_image"] == "true"
    assert tags["harness.image.digest"] == dproject.client().get_run(docker_run.last_line).data.tags["harness.image.digest"]


def test_local_replay_of_container_run_says_so(dproject: Project, docker_run) -> None:
    result = dproject.harness("replay", docker_run.last_line, "--executor", "local")
    assert result.returncode in (0, 1), result.stderr
    assert "harness.in_image: true -> false" in result.stdout
    assert "ran outside the pinned image" in result.stdout


def test_moved_tag_replays_the_recorded_digest(dproject: Project, engine: str) -> None:
    moving = f"localhost:5000/harness-moving-{uuid.uuid4().hex[:8]}:1"
    docker_cli("tag", engine, moving)
    docker_cli("push", moving)
    first = _registry_digest(moving.split("/", 1)[1].split(":")[0], "1")
    run = dproject.harness("run", "experiments/linear_ddp", "--executor", "docker", f"image={moving}",
                           "train.epochs=1")
    assert run.returncode == 0, run.stderr
    # Move the tag: a different image (one more label) pushed under the same name.
    docker_cli("build", "-t", moving, "-", stdin=f"FROM {engine}\nLABEL moved=\"{uuid.uuid4()}\"\n")
    docker_cli("push", moving)
    second = _registry_digest(moving.split("/", 1)[1].split(":")[0], "1")
    assert first and second and first != second
    result = dproject.harness("replay", run.last_line)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().splitlines()[-2].startswith("verdict: BITWISE")
    assert f"harness.image.tag_digest: {first} -> {second}" in result.stdout
    assert f"now points to {second}" in result.stderr
    assert dproject.client().get_run(result.last_line).data.tags["harness.image.digest"] == first


@pytest.mark.parametrize(
    "extra,env,message",
    [
        ([], {"DOCKER_HOST": "unix:///tmp/harness-no-engine.sock"}, "Docker engine is not running"),
        (["image=localhost:5000/harness-does-not-exist:1"], {}, "not found locally and could not be pulled"),
        (["image=localhost:5000/harness-cpu:latest"], {}, "--allow-unpinned"),
        (["image=localhost:5000/harness-cpu"], {}, "'latest' tag"),
    ],
    ids=["engine-down", "unknown-image", "latest-tag", "implicit-latest"],
)
def test_docker_problems_are_one_line_exit_2(dproject: Project, extra, env, message) -> None:
    before = len(dproject.all_runs())
    result = dproject.harness("run", "experiments/linear_ddp", "--executor", "docker", *extra, env=env)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and message in lines[0], result.stderr
    assert len(dproject.all_runs()) == before


def test_failing_rank_in_container_fails_run_and_removes_container(dproject: Project) -> None:
    dproject.add_experiment("crash_in_container", train_py=CRASHING.replace(
        'pathlib.Path(os.environ["PID_DIR"], f"rank{ctx.rank}").write_text(str(os.getpid()))', "pass"))
    result = dproject.harness("run", "experiments/crash_in_container", "--executor", "docker",
                              "train={steps: 100, fail_rank: 1, fail_step: 2, sleep: 0.01}")
    assert result.returncode == 1, result.stderr
    client = dproject.client()
    run = client.get_run(result.last_line)
    assert run.info.status == "FAILED" and run.data.tags["harness.failed_rank"] == "1"
    failure = Path(client.download_artifacts(result.last_line, "failure.txt")).read_text()
    assert "RuntimeError: boom at step 2" in failure
    assert docker_cli("ps", "-a", "--filter", f"name=harness-{result.last_line[:12]}", "-q") == ""


def test_sigterm_stops_the_container_and_kills_the_run(dproject: Project) -> None:
    dproject.add_experiment("crash_in_container", train_py=CRASHING.replace(
        'pathlib.Path(os.environ["PID_DIR"], f"rank{ctx.rank}").write_text(str(os.getpid()))', "pass"))
    proc = dproject.popen("run", "experiments/crash_in_container", "--executor", "docker",
                          "train={steps: 100000, fail_rank: -1, fail_step: -1, sleep: 0.05}")
    client = dproject.client()
    deadline = time.monotonic() + 180
    run_id = None
    while run_id is None:  # wait until rank 0 has logged something
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(1)
        for r in dproject.all_runs():
            if r.info.status == "RUNNING" and client.get_metric_history(r.info.run_id, "loss"):
                run_id = r.info.run_id
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert out.strip().splitlines()[-1] == run_id
    assert client.get_run(run_id).info.status == "KILLED"
    assert docker_cli("ps", "-a", "--filter", f"name=harness-{run_id[:12]}", "-q") == ""


def test_declared_data_is_read_inside_the_container(dproject: Project, tmp_path: Path) -> None:
    """A data file outside the repository and the store: mounted at its hashed path, read by every rank."""
    table = tmp_path / "lab data" / "table.bin"
    table.parent.mkdir()
    table.write_bytes(b"\x00\x01" * 500)
    source = (EXPERIMENTS / "linear_ddp" / "train.py").read_text()
    first = "    cfg = ctx.cfg\n"
    reads = first + '    ctx.log({"data_bytes": float(len(ctx.data["table"].read_bytes()))}, 0)\n'
    dproject.add_experiment("reads_data", train_py=source.replace(first, reads, 1),
                            yaml_extra=f"data:\n  table: '{table}'\n")
    result = dproject.harness("run", "experiments/reads_data", "--executor", "docker", "train.epochs=1")
    assert result.returncode == 0, result.stderr
    run = dproject.client().get_run(result.last_line)
    assert run.data.tags["harness.in_image"] == "true"
    assert run.data.metrics["data_bytes"] == 1000.0
