"""Deterministic checkpoints and `harness resume`: a run whose rank is SIGKILLed, resumed, equals an
uninterrupted run bit for bit (real gloo ranks, real store, real checkpoint files)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import Project

KILL_HOOK = '''
            if ctx.rank == min(1, ctx.world_size - 1) and ctx.step == int(os.environ.get("KILL_AT", "-1")):
                os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no goodbye: a real crash
'''


def with_kill_hook(source: Path, after: str) -> str:
    text = source.read_text()
    assert after in text
    return "import os\nimport signal\n" + text.replace(after, after + KILL_HOOK, 1)


def history(project: Project, run_id: str, key: str) -> list[tuple[int, str]]:
    return sorted((m.step, m.value.hex()) for m in project.client().get_metric_history(run_id, key))


@pytest.fixture(scope="module")
def killable(project: Project) -> tuple[str, str]:
    from conftest import EXPERIMENTS

    project.add_experiment("linear_kill", train_py=with_kill_hook(
        EXPERIMENTS / "linear_ddp/train.py", '            ctx.log({"loss": loss}, ctx.step)\n'))
    project.add_experiment("digits_kill", source="digits_cnn", train_py=with_kill_hook(
        EXPERIMENTS / "digits_cnn/train.py", '            ctx.log({"train_loss": loss}, ctx.step)\n'))
    return "experiments/linear_kill", "experiments/digits_kill"


@pytest.mark.parametrize(
    "which,overrides,kill_at,keys",
    [
        (0, ["checkpoint_every=5"], 13, ["loss"]),
        # Workers, augmentation, dropout, momentum; killed mid-epoch so the resume replays the epoch's
        # first batches through the DataLoader workers.
        (1, ["checkpoint_every=10", "train.epochs=3"], 37, ["train_loss", "val_acc"]),
        # Every world size resumes bit for bit, not merely refused: from 3 ranks on, DDP's bucket layout
        # decides the sums, and a process that starts from a checkpoint must lay them out as the original did
        # (4 ranks stand for every size from 3: one case fewer keeps the suite's time).
        (0, ["checkpoint_every=5", "world_size=1"], 13, ["loss"]),
        (0, ["checkpoint_every=5", "world_size=4"], 9, ["loss"]),
        (1, ["checkpoint_every=8", "train.epochs=2", "world_size=4"], 20, ["train_loss", "val_acc"]),
    ],
    ids=["linear_ddp", "digits_cnn", "linear_ws1", "linear_ws4", "digits_ws4"],
)
def test_sigkilled_rank_then_resume_equals_uninterrupted(
    project: Project, killable, which: int, overrides: list[str], kill_at: int, keys: list[str]
) -> None:
    exp = killable[which]
    crashed = project.harness("run", exp, *overrides, env={"KILL_AT": str(kill_at)})
    assert crashed.returncode == 1 and "was killed by SIGKILL" in crashed.stderr, crashed.stderr
    run_id = crashed.last_line
    assert project.client().get_run(run_id).info.status == "FAILED"
    resumed = project.harness("resume", run_id)
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.last_line == run_id  # the same MLflow run continues
    assert "Proved: steps" in resumed.stderr  # it re-executed the segment before the checkpoint first
    clean = project.harness("run", exp, *overrides)
    assert clean.returncode == 0, clean.stderr
    client = project.client()
    a, b = client.get_run(run_id), client.get_run(clean.last_line)
    assert a.info.status == "FINISHED"
    assert a.data.tags["harness.fingerprint"] == b.data.tags["harness.fingerprint"]
    every = int(overrides[0].split("=")[1])
    assert a.data.tags["harness.resumed_from"] == str(kill_at // every * every)
    for key in keys + ["harness.lr"]:
        # Same steps, same bits, and no step logged twice although steps after the checkpoint ran twice.
        assert history(project, run_id, key) == history(project, clean.last_line, key)
    # Every step's samples, those before the kill too (the killed ranks sent none: they came in the checkpoint).
    from harness.store.tracking import Tracker

    tracker = Tracker(project.uri)
    resumed_order, clean_order = (tracker.load_record(r).data_order for r in (run_id, clean.last_line))
    assert resumed_order == clean_order and sorted(resumed_order) == list(range(int(b.data.tags["harness.data_order.steps"])))
    assert a.data.tags["harness.data_order.steps"] == b.data.tags["harness.data_order.steps"]
    assert a.data.tags["harness.optimizer"] == b.data.tags["harness.optimizer"] == "torch.optim.sgd.SGD"


def test_checkpoints_load_with_weights_only(project: Project, killable) -> None:
    run = project.harness("run", killable[0], "checkpoint_every=10", "train.epochs=2")
    assert run.returncode == 0, run.stderr
    client = project.client()
    root = Path(client.get_run(run.last_line).info.artifact_uri.removeprefix("file://")) / "checkpoints"
    steps = sorted(p.name for p in root.iterdir())
    assert steps == ["step-00000000"]  # 10 steps in all: step 10 is the end, not a checkpoint
    files = sorted((root / "step-00000000").iterdir())
    assert [f.name for f in files] == ["COMPLETE", "rank0.pt", "rank1.pt"]
    state = torch.load(files[1], weights_only=True)
    assert state["position"]["step"] == 0 and isinstance(state["rng"]["numpy"]["key"], torch.Tensor)
    import json

    fps = json.loads(Path(client.download_artifacts(run.last_line, "fingerprints.json")).read_text())
    assert fps["checkpoints"] == {"0": state["fingerprint"]}  # logged at that step


def test_resume_refuses_finished_and_checkpointless_runs(project: Project, killable) -> None:
    done = project.harness("run", killable[0], "train.epochs=1")
    assert done.returncode == 0
    refused = project.cli("resume", done.last_line)
    assert refused.returncode == 2 and "only FAILED or KILLED runs are resumed" in refused.stderr
    crashed = project.harness("run", killable[0], "train.epochs=2", env={"KILL_AT": "3"})
    assert crashed.returncode == 1
    none = project.cli("resume", crashed.last_line)
    assert none.returncode == 2 and "has no complete checkpoint" in none.stderr
    assert len(none.stderr.strip().splitlines()) == 1
    # The way out it names works: the suggested command, run as given.
    suggested = none.stderr.split("`")[1]
    assert suggested == f"harness replay {crashed.last_line} --allow-incomplete", none.stderr
    rerun = project.harness(*suggested.split()[1:])
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert "the FAILED original reached" in rerun.stdout, rerun.stdout
