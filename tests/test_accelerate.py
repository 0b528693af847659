"""Hugging Face Accelerate inside train(ctx) (issue 25): a script written for Accelerate (Accelerator, prepare,
accelerator.backward, accelerator.log, end_training) converted with one line, harness.accelerate.Accelerator(ctx).
Real Accelerate, real `harness run`/`replay` subprocesses, 2 ranks on gloo, a real store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import Project, Result
from infra import in_ci

try:
    import accelerate  # noqa: F401
except ImportError as err:  # the test extra installs it: CI must run these, a laptop may lack it
    if in_ci():
        pytest.fail(f"accelerate is required in CI (pip install -e '.[test]'): {err}", pytrace=False)
    pytest.skip(f"accelerate is not installed: {err}", allow_module_level=True)

# Each rank writes down the sample indices it trained on, per epoch; rank 0 keeps every rank's in seen.json.
# A value that is not a number is logged every step beside the loss (Accelerate's trackers take strings).
# log_with="mlflow", as Accelerate's examples pass "all" (which takes MLflow, installed with harness): its tracker
# logs into the harness run, and its config holds the `seed` and `world_size` harness recorded as params already.
TRAIN = '''"""An MLP trained the way an Accelerate script is, converted with one line."""

import json

import accelerate
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import harness.accelerate


def train(ctx):
    cfg = ctx.cfg
    if cfg.unconverted:  # Accelerate's own class, only the tracker added
        accelerator = accelerate.Accelerator(log_with=[harness.accelerate.Tracker(ctx)])
    else:
        accelerator = harness.accelerate.Accelerator(ctx, log_with="mlflow")  # was: accelerate.Accelerator(...)
    accelerator.init_trackers("mlp", config={"lr": cfg.lr, "seed": 1234, "world_size": 8})
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.arange(cfg.samples), torch.randn(cfg.samples, 8, generator=g),
                         torch.randn(cfg.samples, 1, generator=g))
    if cfg.loader == "ctx":
        loader, epochs = ctx.loader(data, batch_size=cfg.batch_size), ctx.epochs(cfg.epochs)
    else:
        loader, epochs = DataLoader(data, batch_size=cfg.batch_size, shuffle=True), range(cfg.epochs)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    seen = []
    for _ in epochs:
        seen.append([])
        for index, x, y in loader:
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            seen[-1] += index.tolist()
            accelerator.log({"loss": loss.item(), "note": "a string"})  # step None: ctx.step
    every = [None] * ctx.world_size
    dist.all_gather_object(every, seen)
    if ctx.is_main:
        (ctx.output_dir / "seen.json").write_text(json.dumps(every))
    accelerator.end_training()  # destroys the process group harness made
'''

YAML = """image: none
entry: train.py:train
world_size: 2
seed: 0
threads_per_rank: 1
determinism:
  level: strict
fingerprint_every: 4
checkpoint_every: 4
train:
  lr: 0.05
  epochs: 2
  samples: 64
  batch_size: 8
  loader: plain
  unconverted: false
"""

SAMPLES, EPOCHS, BATCH = 64, 2, 8


@pytest.fixture(scope="module")
def experiment(project: Project) -> str:
    from conftest import git

    exp = project.add_experiment("accelerate_mlp", train_py=TRAIN, commit=False)
    (exp / "experiment.yaml").write_text(YAML)
    git(project.root, "add", "-A")
    git(project.root, "commit", "-qm", "an Accelerate script")
    return "experiments/accelerate_mlp"


@pytest.fixture(scope="module")
def original(project: Project, experiment: str) -> Result:
    return project.harness("run", experiment)


def seen(project: Project, run_id: str, tmp_path: Path) -> list[list[list[int]]]:
    """Per rank, per epoch: the sample indices that rank trained on."""
    return json.loads(Path(project.client().download_artifacts(run_id, "outputs/seen.json", str(tmp_path))).read_text())


def assert_sharded_once(every: list[list[list[int]]], world_size: int) -> None:
    """Each epoch: every rank trains on its own 1/world_size of the data, and together they cover all of it once."""
    assert len(every) == world_size
    for epoch in range(EPOCHS):
        shards = [rank[epoch] for rank in every]
        assert [len(s) for s in shards] == [SAMPLES // world_size] * world_size, shards
        assert sorted(i for s in shards for i in s) == list(range(SAMPLES))


def test_run_finishes_after_end_training_with_fingerprints(project: Project, original: Result, tmp_path: Path) -> None:
    """end_training() destroyed harness's process group: the run still finishes (the replica check runs on a
    re-created group); the prepared model is fingerprinted; accelerator.log reached ctx.log at ctx.step; Accelerate
    sharded its plain DataLoader once over harness's 2 ranks (without cpu=True it would train each rank alone)."""
    assert original.returncode == 0, original.stderr
    assert "Process group cannot be None" not in original.stderr
    run = project.client().get_run(original.last_line)
    tags = run.data.tags
    assert run.info.status == "FINISHED"
    assert len(tags["harness.fingerprint"]) == 64 and tags["harness.fingerprint.of"] == "model"
    assert tags["harness.fingerprint.initial"] != tags["harness.fingerprint"] and tags["harness.weights_changed"] == "true"
    steps = SAMPLES // 2 // BATCH * EPOCHS
    history = project.client().get_metric_history(original.last_line, "loss")
    assert sorted(m.step for m in history) == list(range(steps))
    assert "note" not in run.data.metrics
    # The string is skipped with one notice, printed once and recorded, not a failure.
    assert original.stderr.count("accelerator.log: skipped values that are not numbers (note (str)") == 1, original.stderr
    assert "accelerator.log: skipped" in tags["harness.notices"]
    assert_sharded_once(seen(project, original.last_line, tmp_path), 2)


def test_accelerates_mlflow_tracker_logs_into_the_run_without_clashing(project: Project, original: Result) -> None:
    """Accelerate's MLflow tracker attaches to the harness run (MLFLOW_RUN_ID): init_trackers' config is kept as
    params `accelerate.<key>` (its `seed` under its own name would be a change of the recorded param, which MLflow
    refuses: the run failed), no experiment of its own is made, and accelerator.log's values are in the run once, at
    ctx.step (the tracker's own writes would add each again - a step of None at step 0)."""
    assert original.returncode == 0, original.stderr
    run = project.client().get_run(original.last_line)
    params = run.data.params
    assert (params["seed"], params["world_size"]) == ("0", "2")
    assert {k: v for k, v in params.items() if k.startswith("accelerate.")} == {
        "accelerate.lr": "0.05", "accelerate.seed": "1234", "accelerate.world_size": "8"}
    assert "mlp" not in [e.name for e in project.client().search_experiments()]
    history = project.client().get_metric_history(original.last_line, "loss")
    steps = SAMPLES // 2 // BATCH * EPOCHS
    assert [m.step for m in history] == list(range(steps)), [m.step for m in history]


def test_checkpoint_every_over_accelerates_own_loader_names_the_way_out(project: Project, original: Result) -> None:
    """Accelerate's loop over a DataLoader of its own gives harness no step boundary: the notice and audit's refusal
    (read from the record) name a ctx.loader through accelerator.prepare - the way out an Accelerate loop has - and
    not `for it in ctx.steps(...)`, which cannot be written there."""
    assert original.returncode == 0, original.stderr
    tags = project.client().get_run(original.last_line).data.tags
    assert tags["harness.loop"] == "accelerate"
    line = next(line for line in original.stderr.splitlines() if "checkpoint_every=4" in line)
    assert "Accelerate's loop iterates a DataLoader of its own, not a ctx.loader" in line, line
    assert "Pass a ctx.loader(...) to accelerator.prepare" in line and "ctx.steps" not in line, line
    audit = project.cli("audit", original.last_line, "--segments", "1")
    assert audit.returncode == 2 and len(audit.stderr.strip().splitlines()) == 1, audit.stderr
    assert (f"run {original.last_line} has no checkpoint chain to audit (checkpoint_every was 4, but Accelerate's loop "
            "iterates a DataLoader of its own, not a ctx.loader: harness had no step boundary to save at).") \
        in audit.stderr, audit.stderr
    assert "Pass a ctx.loader(...) to accelerator.prepare" in audit.stderr and "ctx.steps" not in audit.stderr


def test_replay_is_bitwise_with_fingerprints(project: Project, original: Result) -> None:
    assert original.returncode == 0, original.stderr
    replay = project.harness("replay", original.last_line)
    assert replay.returncode == 0, replay.stderr
    verdict = replay.stdout.strip().splitlines()[-2]
    assert verdict.startswith("verdict: BITWISE") and "fingerprints equal" in verdict, replay.stdout


def test_replay_at_world_size_1_trains_on_all_the_data(project: Project, original: Result, tmp_path: Path) -> None:
    """Accelerate reads the world size of the job harness launched: at 1 rank it sees 1 process and trains on every
    sample, twice as many steps - never half the data. The verdict is not BITWISE (the world size changed), and
    says why."""
    assert original.returncode == 0, original.stderr
    replay = project.harness("replay", original.last_line, "--world-size", "1")
    assert "A bitwise match is impossible" in replay.stdout and "world size changed" in replay.stdout, replay.stdout
    run_id = replay.last_line
    assert project.client().get_run(run_id).info.status == "FINISHED", replay.stderr
    assert_sharded_once(seen(project, run_id, tmp_path), 1)
    history = project.client().get_metric_history(run_id, "loss")
    assert sorted(m.step for m in history) == list(range(SAMPLES // BATCH * EPOCHS))


def test_a_study_over_ctx_loader_has_distinct_members_each_sharded_once(project: Project, experiment: str,
                                                                         tmp_path: Path) -> None:
    """ctx.loader through accelerator.prepare comes back unsharded (it already is this rank's shard; Accelerate
    would shard it again, each rank seeing a quarter of the data); three seeds train three different models."""
    study = project.harness("run", experiment, "train.loader=ctx", "seeds=[0,1,2]")
    assert study.returncode == 0, study.stderr
    members = [r for r in project.all_runs() if r.data.tags.get("harness.study") == study.last_line]
    assert sorted(r.data.tags["harness.seed"] for r in members) == ["0", "1", "2"]
    assert all(r.info.status == "FINISHED" and r.data.tags["harness.fingerprint.of"] == "model" for r in members)
    assert len({r.data.tags["harness.fingerprint"] for r in members}) == 3
    # The way out the notice names: over a ctx.loader, checkpoint_every saves (steps 0 and 4 of 8).
    assert {r.data.tags["harness.loop"] for r in members} == {"ctx.loader"}
    assert not any("checkpoint_every" in r.data.tags["harness.notices"] for r in members)
    fingerprints = json.loads(Path(project.client().download_artifacts(
        members[0].info.run_id, "fingerprints.json", str(tmp_path))).read_text())
    assert sorted(fingerprints["checkpoints"]) == ["0", "4"]
    orders = []
    for member in members:
        every = seen(project, member.info.run_id, tmp_path / member.info.run_id)
        assert_sharded_once(every, 2)
        orders.append(every)
    assert len({json.dumps(o) for o in orders}) == 3  # ctx.loader's permutation follows each member's seed


def test_a_plain_accelerator_on_the_cpu_is_refused_in_one_line(project: Project, experiment: str) -> None:
    """accelerate.Accelerator() on a machine without a GPU sees no distributed job: each rank would train alone on
    all the data. The tracker refuses it before training, with the fix (on every rank: each is its own main process)."""
    result = project.harness("run", experiment, "train.unconverted=true")
    assert result.returncode == 1, result.stderr
    failed = [line for line in result.stderr.splitlines() if line.startswith("FAILED:")]
    # Both ranks refuse alike; which of them reports before the launcher stops the other is a race. Ranks that
    # failed alike are named by the lowest, with the other as "failed the same way" when it got to say so.
    line = ("Accelerate sees 1 process(es) in a job of 2 ranks: each would train alone. "
            "Use accelerator = harness.accelerate.Accelerator(ctx, ...) (it passes cpu=True on the CPU).")
    assert failed in ([f"FAILED: rank 0: {line}"], [f"FAILED: rank 0: {line} (rank 1 failed the same way)"],
                      [f"FAILED: rank 1: {line}"]), result.stderr
