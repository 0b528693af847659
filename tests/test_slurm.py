"""The Slurm backend against a real cluster: slurmctld here, slurmd node1 and node2 in two network
namespaces (tests/infra.py). Jobs are submitted by `harness run --executor slurm`, one task per
node, each spawning its node's ranks; the store is an SQLite file every node sees."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import Project, on_cpu
from snippets import CRASHING


@pytest.fixture
def slurm_env(slurm, tmp_path_factory) -> dict[str, str]:
    # The batch script, its output and the code's worktree go where every node sees them.
    jobs = tmp_path_factory.mktemp("slurm-jobs")
    return {"SLURM_CONF": str(slurm.conf), "HARNESS_SLURM_DIR": str(jobs)}


def _start_endless(project: Project, slurm_env: dict[str, str], pid_dir: Path, nodes: int) -> subprocess.Popen:
    """A Slurm job that trains until stopped; each rank writes its pid to PID_DIR/rank<R>."""
    project.add_experiment("crashing", train_py=CRASHING)
    env = {**os.environ, "MLFLOW_TRACKING_URI": project.uri, "PYTHONUNBUFFERED": "1", "PID_DIR": str(pid_dir),
           **slurm_env}
    proc = subprocess.Popen(
        [sys.executable, "-m", "harness", *on_cpu(["run", "experiments/crashing", "--executor", "slurm", "--nodes",
                                                   str(nodes), "train={steps: 100000, fail_rank: -1, fail_step: -1, sleep: 0.05}"])],
        cwd=project.root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while not all((pid_dir / f"rank{r}").exists() for r in range(nodes)):
        assert proc.poll() is None and time.monotonic() < deadline, "the job never started its ranks"
        time.sleep(0.2)
    return proc


def _verdict(result) -> str:
    return next(line for line in result.stdout.splitlines() if line.startswith("verdict:"))


def test_one_node_job_is_one_run_and_replays_through_slurm_bitwise(project: Project, slurm, slurm_env) -> None:
    before = {r.info.run_id for r in project.all_runs()}
    run = project.harness("run", "experiments/linear_ddp", "train.epochs=1", "--executor", "slurm", "--nodes", "1",
                          env=slurm_env)
    assert run.returncode == 0, run.stderr
    assert "Submitted job" in run.stderr and "epoch 1/1" in run.stderr  # the job's output streams here
    assert {r.info.run_id for r in project.all_runs()} - before == {run.last_line}
    tags = project.client().get_run(run.last_line).data.tags
    assert tags["harness.executor"] == "slurm" and tags["harness.launcher"] == "slurm"
    assert tags["harness.slurm.job_id"].isdigit() and tags["harness.nnodes"] == "1"
    assert tags["harness.env.hostname"] in slurm.nodes  # measured on the node, not here

    replay = project.harness("replay", run.last_line, env=slurm_env)
    assert replay.returncode == 0, replay.stderr
    assert _verdict(replay).startswith("verdict: BITWISE")
    rtags = project.client().get_run(replay.last_line).data.tags
    assert rtags["harness.executor"] == "slurm" and rtags["harness.slurm.job_id"] != tags["harness.slurm.job_id"]

    here = project.harness("replay", run.last_line, "--executor", "local", env=slurm_env)  # off the cluster
    assert here.returncode == 0 and _verdict(here).startswith("verdict: BITWISE"), here.stdout + here.stderr


def test_two_node_job_is_one_run_with_both_nodes_and_replays_bitwise(
    project: Project, slurm, slurm_env, reference_run: str
) -> None:
    before = {r.info.run_id for r in project.all_runs()}
    run = project.harness("run", "experiments/linear_ddp", "train.epochs=1", "--executor", "slurm", "--nodes", "2",
                          env=slurm_env)
    assert run.returncode == 0, run.stderr
    assert {r.info.run_id for r in project.all_runs()} - before == {run.last_line}
    tags = project.client().get_run(run.last_line).data.tags
    assert tags["harness.nnodes"] == "2" and tags["harness.nproc_per_node"] == "1"
    assert {tags["harness.env.hostname"], tags["harness.node.1.hostname"]} == set(slurm.nodes)
    assert tags["harness.slurm.nodelist"] == "node[1-2]"

    # The same config on one machine and on two Slurm nodes: the same bits.
    cmp = project.harness("compare", reference_run, run.last_line)
    assert cmp.returncode == 0 and "verdict: BITWISE" in cmp.stdout, cmp.stdout

    replay = project.harness("replay", run.last_line, env=slurm_env)
    assert replay.returncode == 0, replay.stderr
    assert _verdict(replay).startswith("verdict: BITWISE")
    assert project.client().get_run(replay.last_line).data.tags["harness.nnodes"] == "2"


def test_scancel_marks_the_run_killed(project: Project, slurm, slurm_env, tmp_path: Path) -> None:
    proc = _start_endless(project, slurm_env, tmp_path, nodes=2)
    time.sleep(2)
    run = next(r for r in project.all_runs() if r.info.status == "RUNNING" and r.data.tags.get("harness.slurm.job_id"))
    slurm.scancel(run.data.tags["harness.slurm.job_id"])  # from outside, as an admin or a preemption would
    out, err = proc.communicate(timeout=120)
    assert out.strip().splitlines()[-1] == run.info.run_id
    assert project.client().get_run(run.info.run_id).info.status == "KILLED", err
    assert proc.returncode != 0
    for rank in (0, 1):
        pid = int((tmp_path / f"rank{rank}").read_text())
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()


def test_ctrl_c_cancels_the_job(project: Project, slurm, slurm_env, tmp_path: Path) -> None:
    proc = _start_endless(project, slurm_env, tmp_path, nodes=1)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    run = project.client().get_run(out.strip().splitlines()[-1])
    assert run.info.status == "KILLED"
    assert slurm.job_state(run.data.tags["harness.slurm.job_id"]) == "CANCELLED"
