"""The training code's own calls to things harness does too (issue 20): destroy_process_group, MLflow's fluent
API, os.chdir and seeding the RNGs itself. Each is a loop written the way a torchrun script is, run through the
real CLI on real ranks and a real store."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from conftest import Project

# Ends like a torchrun script: the group is destroyed by the training code, then (tamper) rank 1's weights are
# changed where no collective follows - only harness's replica check, after the destroy, can see it.
DESTROYS = '''"""Linear(10, 5) on random data; destroys the process group itself at the end."""

import torch
import torch.distributed as dist
from torch import nn


def train(ctx):
    data = torch.randn(40, 10, generator=torch.Generator().manual_seed(ctx.seed))
    loader = ctx.loader(data, batch_size=10)
    model = ctx.ddp(nn.Linear(10, 5))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in ctx.epochs(1):
        for batch in loader:
            optimizer.zero_grad()
            loss = model(batch).pow(2).mean()
            loss.backward()
            optimizer.step()
            ctx.log({"loss": loss}, ctx.step)
    dist.destroy_process_group()
    if ctx.cfg.tamper and ctx.rank == 1:
        with torch.no_grad():
            model.module.bias.add_(1.0)
'''


def test_destroy_process_group_at_the_end_still_finishes_and_checks_replicas(project: Project) -> None:
    project.add_experiment("destroys", train_py=DESTROYS, yaml_extra="  tamper: false\n")
    result = project.harness("run", "experiments/destroys")
    assert result.returncode == 0, result.stderr
    run = project.client().get_run(result.last_line)
    assert run.info.status == "FINISHED"
    assert len(run.data.tags["harness.fingerprint"]) == 64
    fingerprints = json.loads(Path(project.client().download_artifacts(run.info.run_id, "fingerprints.json")).read_text())
    assert fingerprints["final"] == run.data.tags["harness.fingerprint"] and fingerprints["steps_total"] == 2

    # The replica check ran on a group harness re-created after the user's destroy: it catches rank 1's change.
    tampered = project.harness("run", "experiments/destroys", "train.tamper=true")
    assert tampered.returncode != 0
    assert "the ranks ended with different parameters" in tampered.stderr, tampered.stderr


# Rank 0 uses MLflow's fluent API every way a script does; rank 1 calls it unguarded. Mid-run, rank 0 writes
# down what it saw of the harness run after its own end_run().
USES_MLFLOW = '''"""Linear(4, 1) that also logs through MLflow itself."""

import mlflow
import torch
from torch import nn


def train(ctx):
    data = torch.randn(16, 4, generator=torch.Generator().manual_seed(ctx.seed))
    loader = ctx.loader(data, batch_size=4)
    model = ctx.ddp(nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if ctx.rank == 0:
        mlflow.start_run()  # attaches to the run harness records (MLFLOW_RUN_ID)
        mlflow.log_param("user_param", "x")
        mlflow.set_tag("user.tag", "y")
    for _ in ctx.epochs(1):
        for batch in loader:
            optimizer.zero_grad()
            loss = model(batch).pow(2).mean()
            loss.backward()
            optimizer.step()
            ctx.log({"loss": loss}, ctx.step)
            if ctx.rank == 0:
                mlflow.log_metric("user_loss", loss.item(), step=ctx.step)
            else:
                mlflow.log_metric("rank1_loss", loss.item(), step=ctx.step)  # unguarded
    if ctx.rank == 0:
        mlflow.end_run()
        seen = {"status_after_end_run": mlflow.get_run(ctx.run_id).info.status}
        with mlflow.start_run() as again:  # the same run again, and `with` ends (detaches from) it once more
            mlflow.log_metrics({"lr": 0.1, "after": 1.0})
            seen["again"] = again.info.run_id
        mlflow.log_metric("after_with", 2.0)
        seen["active"] = mlflow.active_run().info.run_id
        seen["ctx_run_id"] = ctx.run_id
        (ctx.output_dir / "seen.json").write_text(__import__("json").dumps(seen))
'''


def test_the_users_own_mlflow_calls_land_in_the_harness_run(project: Project) -> None:
    exp = project.add_experiment("uses_mlflow", train_py=USES_MLFLOW)
    # A relative store: the ranks run in the experiment folder, where it would name another file.
    relative = "sqlite:///./mlruns/relative.db"
    result = project.harness("run", "experiments/uses_mlflow", env={"MLFLOW_TRACKING_URI": relative})
    assert result.returncode == 0, result.stderr
    run_id = result.last_line
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{project.root / 'mlruns' / 'relative.db'}")
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    assert [r.info.run_id for r in runs] == [run_id]  # no second run, not even from rank 1 or after end_run
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["user_param"] == "x" and run.data.tags["user.tag"] == "y"
    assert {"loss", "user_loss", "lr", "after", "after_with"} <= set(run.data.metrics)
    assert "rank1_loss" not in run.data.metrics  # like ctx.log, other ranks' calls are ignored
    assert [m.step for m in client.get_metric_history(run_id, "user_loss")] == [0, 1]
    seen = json.loads(Path(client.download_artifacts(run_id, "outputs/seen.json")).read_text())
    assert seen == {"status_after_end_run": "RUNNING", "again": run_id, "active": run_id, "ctx_run_id": run_id}
    assert run.data.tags["harness.user.mlflow_metrics"] == "after,after_with,lr,user_loss"
    assert "through MLflow directly" not in result.stderr  # no longer a warning: they are judged (below)
    # No store in the code folder: the experiment stays clean for the next run.
    assert not any((exp / name).exists() for name in ("mlruns", "mlflow.db", "mlartifacts"))
    assert subprocess.run(["git", "status", "--porcelain"], cwd=project.root, capture_output=True, text=True).stdout == ""

    # The replay's rank 0 logs them into the replay run, and the verdict judges them as ctx.log's, at their own
    # steps: loss and user_loss at steps 0 and 1, lr, after and after_with at MLflow's default step 0.
    replay = project.harness("replay", run_id, env={"MLFLOW_TRACKING_URI": relative})
    assert replay.returncode == 0, replay.stdout + replay.stderr
    verdict = replay.stdout.strip().splitlines()[-2]
    assert verdict.startswith("verdict: BITWISE: 5 metrics (7 values) + harness.lr bit-identical"), verdict
    assert client.get_metric_history(replay.last_line, "user_loss")[1].value == \
        client.get_metric_history(run_id, "user_loss")[1].value


def test_absolute_uri_resolves_only_relative_sqlite_paths(tmp_path: Path, monkeypatch) -> None:
    from harness.store.uris import absolute_uri

    monkeypatch.chdir(tmp_path)
    assert absolute_uri("sqlite:///./mlruns/mlflow.db?timeout=30") == f"sqlite:///{tmp_path}/mlruns/mlflow.db?timeout=30"
    for uri in ("sqlite:////abs/mlflow.db", "http://127.0.0.1:5050", "postgresql://u@h/db", "sqlite:///:memory:"):
        assert absolute_uri(uri) == uri


# Changes directory first thing, as scripts that write next to a data folder do; the traced ops must still name
# the user's lines.
CHDIR = '''"""Linear(6, 3) trained from the filesystem root as cwd."""

import os

import torch
from torch import nn


def train(ctx):
    os.chdir("/")
    data = torch.randn(24, 6, generator=torch.Generator().manual_seed(ctx.seed))
    loader = ctx.loader(data, batch_size=4)
    model = ctx.ddp(nn.Linear(6, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in ctx.epochs(1):
        for batch in loader:
            optimizer.zero_grad()
            out = model(batch)  # MARK: forward
            loss = out.pow(2).mean()
            loss.backward()
            optimizer.step()
            ctx.log({"loss": loss}, ctx.step)
'''


def test_trace_names_user_lines_after_chdir(project: Project) -> None:
    from harness.optrace import tracefile as optrace

    project.add_experiment("chdir", train_py=CHDIR)
    run = project.harness("run", "experiments/chdir")
    assert run.returncode == 0, run.stderr
    traced = project.harness("trace", run.last_line, "--step", "1")
    assert traced.returncode == 0, traced.stdout + traced.stderr
    client = project.client()
    trace = optrace.loads(Path(client.download_artifacts(traced.last_line, "trace/rank0.jsonl.gz")).read_bytes())
    forward = next(n for n, line in enumerate(CHDIR.splitlines(), 1) if line.endswith("# MARK: forward"))
    lines = {op.user_line.split("  ")[0] for op in trace.ops if op.user_line}
    assert f"train.py:{forward}" in lines
    assert all(line.startswith("train.py:") for line in lines), lines  # never <string>:1 nor a torch file
    assert client.get_run(traced.last_line).data.tags["harness.trace.reproduced"] == "true"


# Seeds itself, and draws everything from the global RNG without ctx.loader's seeded shuffle: every member of a
# study trains the very same model.
SEEDS_ITSELF = '''"""Linear(4, 2) on data from the global RNG, which the code seeds itself."""

import random

import torch
from torch import nn


def train(ctx):
    torch.manual_seed(1337 + ctx.cfg.offset)
    random.seed(7)
    data = torch.randn(32, 4)
    model = ctx.ddp(nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        batch = data[8 * step: 8 * step + 8] + random.random()
        optimizer.zero_grad()
        loss = model(batch).pow(2).mean()
        loss.backward()
        optimizer.step()
        ctx.log({"loss": loss}, step)
'''


def test_a_study_whose_code_seeds_itself_says_so(project: Project) -> None:
    project.add_experiment("seeds_itself", train_py=SEEDS_ITSELF, yaml_extra="  offset: 0\n")
    result = project.harness("run", "experiments/seeds_itself", "--seeds", "2", "world_size=1")
    assert result.returncode == 0, result.stderr
    study_id = result.last_line
    line = next(n for n, text in enumerate(SEEDS_ITSELF.splitlines(), 1) if "torch.manual_seed" in text)
    own = f"train.py:{line} torch.manual_seed(1337); train.py:{line + 1} random.seed(7)"
    warning = [w for w in result.stderr.splitlines() if "bit-identical" in w]
    assert warning == [f"Warning: the study's 2 members are bit-identical (every metric and the final weights): the "
                       f"code ignores the seed (it seeds itself: {own}), so their spread says nothing about the noise. "
                       "Seed from ctx.seed / ctx.rank_seed, or drop your own seeding (harness seeds every RNG)."]
    client = project.client()
    assert client.get_run(study_id).data.tags["harness.study.seed_ignored"] == "true"
    summary = json.loads(Path(client.download_artifacts(study_id, "study/summary.json")).read_text())
    assert summary["members_identical"] is True
    members = [r for r in project.all_runs() if r.data.tags.get("harness.study") == study_id]
    assert len(members) == 2 and all(r.data.tags["harness.user.seeds"] == own for r in members)
    assert summary["user_seeds"] == {r.info.run_id: own for r in members}


def test_seed_watch_still_seeds_and_notes_only_the_experiments_calls(tmp_path: Path) -> None:
    import random

    import numpy
    import torch

    from harness.config import load_module_function
    from harness.runtime import userseed

    code = tmp_path / "my exp"
    code.mkdir()
    (code / "seeding.py").write_text(
        "import random\n\nimport numpy\nfrom torch import manual_seed\n\n\n"
        "def go():\n    generator = manual_seed(5)\n    numpy.random.seed(6)\n    random.seed(7)\n"
        "    return generator\n"
    )
    originals = (torch.manual_seed, numpy.random.seed, random.seed)
    watch = userseed.watch(str(code))
    try:
        go = load_module_function(code / "seeding.py", "go")
        assert go() is torch.default_generator  # what torch.manual_seed returns
        go()  # the same calls again: noted once
        drawn = (torch.rand(2), numpy.random.rand(), random.random())
        torch.manual_seed(5)  # this file is not the experiment's: not noted
        numpy.random.seed(6)
        random.seed(7)
        assert torch.equal(drawn[0], torch.rand(2)) and drawn[1:] == (numpy.random.rand(), random.random())
    finally:
        watch.stop()
    assert (torch.manual_seed, numpy.random.seed, random.seed) == originals
    # torch.manual_seed seeds CUDA through torch.cuda.manual_seed_all: that inner call is not the user's.
    assert userseed.describe(watch.calls) == ("seeding.py:8 torch.manual_seed(5); seeding.py:9 numpy.random.seed(6); "
                                             "seeding.py:10 random.seed(7)")


# A rank leaves without Python's teardown once train() returns (runtime/rank/child.py) - unless a thread of the user's is
# still working: an asynchronous saver that outlives train() must finish its file before the rank is gone.
LATE_SAVER = '''"""linear_ddp whose rank 0 hands its last file to a plain (non-daemon) thread that is still writing when train()
returns, as an asynchronous checkpoint saver does."""

import threading
import time

import torch
from torch import nn


def train(ctx):
    model = ctx.ddp(nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        ctx.log({"loss": float(step)}, step)

    def save_later():
        time.sleep(1.5)
        (ctx.output_dir / "late.txt").write_text("x" * 100_000)

    if ctx.rank == 0:
        threading.Thread(target=save_later).start()
'''


def test_a_thread_still_saving_when_train_returns_finishes_its_file(fresh_project: Project, tmp_path: Path) -> None:
    fresh_project.add_experiment("late_saver", train_py=LATE_SAVER)
    result = fresh_project.harness("run", "experiments/late_saver")
    assert result.returncode == 0, result.stderr
    got = fresh_project.client().download_artifacts(result.last_line, "outputs/late.txt", str(tmp_path))
    assert Path(got).read_text() == "x" * 100_000


# How a library looks mlflow up before the user's code imports it: transformers and Accelerate probe with find_spec
# (which asks the import hooks for a spec it never executes), others import it by name.
LOOKS_UP = '''import importlib, importlib.util, json, os, sys
from harness.runtime import usermlflow
usermlflow.keep_run_open(os.environ["MLFLOW_RUN_ID"])
assert importlib.util.find_spec("mlflow") is not None
mlflow = importlib.import_module("mlflow")
mlflow.start_run()
mlflow.log_params({"seed": 7, "lr": 0.1, "world_size": 2})
mlflow.log_param("seed", 7)
mlflow.end_run()
print(json.dumps(mlflow.get_run(os.environ["MLFLOW_RUN_ID"]).info.status))
'''


def test_mlflow_looked_up_by_a_probe_first_is_still_the_harness_run(tmp_path: Path) -> None:
    """After a find_spec probe, importlib.import_module("mlflow") still gets the wrapped mlflow: end_run leaves the
    run open, and a param harness holds already (`seed`) with another value is kept as `user.seed`, the rest of its
    batch logged (an equal value, `world_size`, is logged as it is)."""
    import os
    import sys

    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("probe")).info.run_id
    client.log_param(run_id, "seed", "0")
    client.log_param(run_id, "world_size", "2")
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "MLFLOW_RUN_ID": run_id}
    done = subprocess.run([sys.executable, "-c", LOOKS_UP], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == "RUNNING"  # end_run detached, the run left open
    assert client.get_run(run_id).data.params == {"seed": "0", "user.seed": "7", "lr": "0.1", "world_size": "2"}
    assert done.stderr.count("'seed' is the run's param already ('0'); your value '7' is kept as 'user.seed'") == 2
