"""Studies (`harness run EXP --seeds N [--parallel J]`): real CLI, real store, real ranks.

Two studies of the same three seeds carry most checks: conftest's shared wide study (sequential, via
--seeds) and one with --parallel 2 (via `seeds=[...]`); bad input, a failing member and Ctrl-C cost
one process each, in a project of their own.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from conftest import KEPT_RANK_SERVER, WIDE_CONFIG, Project, make_project, pid_alive
from harness import tags as T
from harness.errors import HarnessError



@pytest.fixture(scope="module")
def study_project(tmp_path_factory: pytest.TempPathFactory) -> Project:
    return make_project(tmp_path_factory.mktemp("study"))


@pytest.fixture(scope="module")
def sequential(wide_study_run):
    return wide_study_run


@pytest.fixture(scope="module")
def parallel(project: Project, sequential):
    result = project.harness("run", "experiments/wide", "--parallel", "2", "seeds=[0,1,2]", *WIDE_CONFIG)
    assert result.returncode == 0, result.stderr
    return result


def _members(project: Project, study_id: str) -> dict[int, object]:
    runs = [r for r in project.all_runs() if r.data.tags.get(T.STUDY) == study_id]
    return {int(r.data.tags[T.SEED]): r for r in runs}


def _artifact(project: Project, run_id: str, path: str, dest: Path) -> Path:
    return Path(project.client().download_artifacts(run_id, path, str(dest)))


def _config(project: Project, run_id: str, tmp: Path) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(_artifact(project, run_id, T.ARTIFACT_CONFIG, tmp / run_id)))


def _series(project: Project, run_id: str, tmp: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    path = _artifact(project, run_id, T.ARTIFACT_SERIES, tmp / run_id)
    with np.load(path) as data:
        keys = json.loads(str(data["keys"]))
        return {k: (data[f"steps_{i}"], data[f"values_{i}"]) for i, k in enumerate(keys)}


def test_sequential_study_is_a_parent_of_ordinary_runs(project: Project, sequential, tmp_path: Path) -> None:
    study_id = sequential.last_line
    client = project.client()
    study = client.get_run(study_id)
    assert study.info.status == T.FINISHED
    assert study.data.tags[T.KIND] == T.KIND_STUDY
    assert (study.data.tags[T.STUDY_SEEDS], study.data.tags[T.STUDY_SIZE], study.data.tags[T.STUDY_PARALLEL]) == ("0,1,2", "3", "1")
    assert _config(project, study_id, tmp_path)["seeds"] == [0, 1, 2]
    members = _members(project, study_id)
    assert sorted(members) == [0, 1, 2]
    configs = {}
    for seed, run in members.items():
        assert run.info.status == T.FINISHED
        assert run.data.tags[T.KIND] == T.KIND_RUN
        assert run.data.tags[T.MLFLOW_PARENT_RUN_ID] == study_id
        assert run.info.run_name == f"wide-seed{seed}"
        assert run.data.tags[T.GIT_COMMIT] == study.data.tags[T.GIT_COMMIT]
        configs[seed] = _config(project, run.info.run_id, tmp_path)
        assert configs[seed]["seed"] == seed and configs[seed]["seeds"] is None
    # The members' recorded configs differ in the seed only.
    assert len({json.dumps({**c, "seed": None}, sort_keys=True) for c in configs.values()}) == 1
    # One line per member start and end; the table; the study id last on stdout.
    for seed, run in members.items():
        assert f"seed {seed}: run {run.info.run_id} started" in sequential.stderr
        assert f"seed {seed}: run {run.info.run_id} FINISHED" in sequential.stderr
    assert "95% prediction interval" in sequential.stderr
    from harness.commands.runs import render_runs  # in-process: `harness runs` itself is tested elsewhere

    listing = render_runs(project.uri, "wide", 50)
    assert any(line.startswith(study_id) and "study (3)" in line for line in listing.splitlines()), listing


def test_summary_is_the_members_exact_series(project: Project, sequential, tmp_path: Path) -> None:
    study_id = sequential.last_line
    summary = json.loads(_artifact(project, study_id, T.ARTIFACT_STUDY_SUMMARY, tmp_path).read_text())
    members = _members(project, study_id)
    assert summary["seeds"] == [0, 1, 2]
    assert summary["members"] == [{"run_id": members[s].info.run_id, "seed": s, "status": T.FINISHED} for s in (0, 1, 2)]
    series = {s: _series(project, members[s].info.run_id, tmp_path) for s in (0, 1, 2)}
    assert set(summary["metrics"]) == {"loss"}
    loss = summary["metrics"]["loss"]
    finals = [float(series[s]["loss"][1][np.argmax(series[s]["loss"][0])]) for s in (0, 1, 2)]
    assert [f["value"] for f in loss["finals"]] == finals
    assert [f["seed"] for f in loss["finals"]] == [0, 1, 2]
    spread = loss["spread"]
    assert spread["n"] == 3
    assert spread["mean"] == float(np.mean(finals)) and spread["std"] == float(np.std(finals, ddof=1))
    assert (spread["min"], spread["max"]) == (min(finals), max(finals))
    assert spread["pi95"][0] < spread["ci95"][0] < spread["mean"] < spread["ci95"][1] < spread["pi95"][1]
    # Per step: every member logged the same 12 steps (512 samples / 2 ranks / batch 64, 3 epochs).
    table = np.vstack([series[s]["loss"][1] for s in (0, 1, 2)])
    curve = loss["curve"]
    assert curve["steps"] == series[0]["loss"][0].tolist() == list(range(12))
    assert curve["mean"] == table.mean(axis=0).tolist()
    assert curve["std"] == table.std(axis=0, ddof=1).tolist()
    assert curve["min"] == table.min(axis=0).tolist() and curve["max"] == table.max(axis=0).tolist()
    # The curves as MLflow metrics on the study run (what the UI plots), and the spread plot.
    client = project.client()
    history = sorted((m.step, m.value) for m in client.get_metric_history(study_id, "loss/mean"))
    assert history == list(zip(curve["steps"], curve["mean"]))
    assert len(client.get_metric_history(study_id, "loss/std")) == 12
    names = [a.path for a in client.list_artifacts(study_id, T.ARTIFACT_STUDY_DIR)]
    assert f"{T.ARTIFACT_STUDY_DIR}/spread_loss.png" in names


def test_a_member_replays_bitwise(project: Project, sequential) -> None:
    member = _members(project, sequential.last_line)[1].info.run_id
    result = project.harness("replay", member)
    assert result.returncode == 0, result.stderr
    assert "BITWISE" in result.stdout + result.stderr


def test_parallel_members_equal_sequential_ones(project: Project, sequential, parallel, tmp_path: Path) -> None:
    study = project.client().get_run(parallel.last_line)
    assert study.info.status == T.FINISHED and study.data.tags[T.STUDY_PARALLEL] == "2"
    seq, par = _members(project, sequential.last_line), _members(project, parallel.last_line)
    assert sorted(par) == [0, 1, 2]
    for seed in (0, 1, 2):
        a, b = seq[seed], par[seed]
        assert b.info.status == T.FINISHED
        assert a.data.tags[T.FINGERPRINT] == b.data.tags[T.FINGERPRINT]
        sa, sb = _series(project, a.info.run_id, tmp_path), _series(project, b.info.run_id, tmp_path)
        assert sa.keys() == sb.keys()
        for key in sa:
            assert np.array_equal(sa[key][0], sb[key][0])
            assert sa[key][1].tobytes() == sb[key][1].tobytes()
    # No progress bars or rank output interleaved: members' lines only (a sequential study shows rank 0's).
    assert "epoch 1/3" in sequential.stderr and "epoch 1/3" not in parallel.stderr


@pytest.mark.parametrize("args, message", [
    (["--seeds", "0"], "--seeds must be >= 1, got 0."),
    (["--seeds", "2", "seeds=[5,6]"], "--seeds 2 and `seeds: [5, 6]` in the config both choose the seeds"),
    (["seeds=[4,7,4]"], "seeds lists 4 more than once"),
    # `seeds:` in the config: the API routes it to a study once the config is loaded, which refuses other nodes.
    (["seeds=[1,2]", "--nnodes", "2"], "a study runs its members one job after another on this machine: --nnodes "
                                       "cannot apply. Drop it, or set seeds=null for a single run."),
])
def test_bad_input_records_nothing(study_project: Project, args: list[str], message: str) -> None:
    before = len(study_project.all_runs())
    result = study_project.cli("run", "experiments/linear_ddp", *args)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("Error: ") and message in result.stderr and result.stderr.count("\n") == 1
    assert result.stdout == ""
    assert len(study_project.all_runs()) == before


def test_a_study_config_is_no_single_run(study_project: Project) -> None:
    """Only the API decides that a config is a study: the run verb, called with one, refuses it in one line (it does
    not start a study of its own) and records nothing."""
    from harness.commands import run as run_command
    from harness.commands.options import RunOptions

    before = len(study_project.all_runs())
    with pytest.raises(HarnessError) as err:
        run_command.run(RunOptions(study_project.root / "experiments" / "linear_ddp", ("seeds=[1,2]", "device=cpu"),
                                   tracking_uri=study_project.uri))
    assert str(err.value) == ("the config sets `seeds`: it is a study, which `harness run` and harness.run() run. Use "
                              "one of them, or set seeds=null for a single run.")
    assert len(study_project.all_runs()) == before


def test_seed_resolution() -> None:
    from harness.config import MAX_SEED
    from harness.commands.study import resolve_seeds

    assert resolve_seeds(None, 7, 3) == [7, 8, 9]
    assert resolve_seeds([3, 1], 0, None) == [3, 1]
    with pytest.raises(HarnessError, match="past the largest seed"):
        resolve_seeds(None, MAX_SEED, 2)
    with pytest.raises(HarnessError, match="within"):
        resolve_seeds([MAX_SEED + 1], 0, None)
    with pytest.raises(HarnessError, match="empty"):
        resolve_seeds([], 0, None)
    with pytest.raises(HarnessError, match="give --seeds N"):
        resolve_seeds(None, 0, None)


def test_curve_keeps_the_steps_every_member_logged() -> None:
    from harness.commands.study import curve

    c = curve([(np.array([0, 1, 2]), np.array([1.0, 2.0, 3.0])), (np.array([1, 2, 3]), np.array([4.0, 6.0, 8.0]))])
    assert c == {"steps": [1, 2], "mean": [3.0, 4.5], "std": [float(np.std([2.0, 4.0], ddof=1)), float(np.std([3.0, 6.0], ddof=1))],
                 "min": [2.0, 3.0], "max": [4.0, 6.0]}
    one = curve([(np.array([0]), np.array([1.0]))])
    assert one["mean"] == [1.0] and np.isnan(one["std"][0])


FLAKY = '''
import torch
from torch import nn


def train(ctx):
    if ctx.seed == 1:
        raise ValueError("seed 1 is cursed")
    model = ctx.ddp(nn.Linear(2, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad()
        loss = model(torch.ones(4, 2)).pow(2).mean()
        loss.backward()
        opt.step()
        ctx.log({"loss": loss}, step)
'''


def test_a_failing_member_fails_the_study(study_project: Project, tmp_path: Path) -> None:
    study_project.add_experiment("flaky", train_py=FLAKY)
    result = study_project.harness("run", "experiments/flaky", "seeds=[1,2]")
    assert result.returncode == 1, result.stderr
    assert "too few seeds to judge a replay against the noise (need >= 3)" in result.stderr
    study_id = result.last_line
    study = study_project.client().get_run(study_id)
    assert study.info.status == T.FAILED
    members = _members(study_project, study_id)
    assert sorted(members) == [1]  # seed 2 never started
    assert members[1].info.status == T.FAILED
    assert f"member seed 1 (run {members[1].info.run_id}) failed" in result.stderr
    assert "seed 1 is cursed" in result.stderr
    assert not [r for r in study_project.all_runs() if r.info.status == T.RUNNING]
    summary = json.loads(_artifact(study_project, study_id, T.ARTIFACT_STUDY_SUMMARY, tmp_path).read_text())
    assert [(m["seed"], m["status"]) for m in summary["members"]] == [(1, T.FAILED), (2, "NOT_STARTED")]
    assert summary["metrics"] == {}


def _rank_processes(pid: int) -> list[int]:
    """The rank processes below the command `pid`: spawned ones, or forked by the rank server (its children)."""
    found = []
    for child in psutil.Process(pid).children(recursive=True):
        try:
            cmd, parent = " ".join(child.cmdline()), child.ppid()
        except psutil.Error:
            continue
        if "spawn_main" in cmd or ("multiprocessing.forkserver" in cmd and parent != pid):
            found.append(child.pid)
    return found


def test_ctrl_c_stops_every_member(study_project: Project) -> None:
    # The per-launch rank server: its ranks are the command's descendants, found below (a kept server's die with
    # their launcher too: tests/test_startup.py).
    proc = study_project.popen("run", "experiments/linear_ddp", "--seeds", "3", "--parallel", "2", "train.epochs=100000",
                               env={KEPT_RANK_SERVER: "0"})
    lines: list[str] = []
    def read() -> None:
        for line in proc.stderr:
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + 300
    try:
        while sum(" started" in line for line in lines) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.2)
        # Both members' ranks running (forked by the rank server, grandchildren of the command): they must go too.
        while len(ranks := _rank_processes(proc.pid)) < 4:
            assert proc.poll() is None and time.monotonic() < deadline, (ranks, "".join(lines))
            time.sleep(0.2)
        children = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        os.killpg(proc.pid, signal.SIGINT)
        stdout, _ = proc.communicate(timeout=120)
    finally:  # a failed assertion must not leave a 100,000-epoch study running beside the rest of the suite
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
    reader.join(timeout=10)
    assert proc.returncode == 130, "".join(lines)
    study_id = stdout.strip().splitlines()[-1]
    client = study_project.client()
    assert client.get_run(study_id).info.status == T.KILLED
    members = _members(study_project, study_id)
    assert sorted(members) == [0, 1]  # the third seed never started
    assert all(r.info.status == T.KILLED for r in members.values())
    time.sleep(1)
    assert not [pid for pid in children if pid_alive(pid)]
