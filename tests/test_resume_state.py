"""State a step depends on that the model, optimizer and scheduler do not hold, across `harness resume`: an EMA of
the weights (torch's AveragedModel, the shape of torchvision's ExponentialMovingAverage and timm's ModelEmaV2)
updated every step and evaluated at each epoch's end. Tracked (`ctx.track(ema=ema)`), a resume continues it bit for
bit; untracked, the checkpoint says so and the resume refuses with the line to add; state that is no model copy (a
running mean of the loss) is caught by the proof, which re-executes through the next value it feeds. Real gloo ranks,
a real SIGKILL, a real store."""

from __future__ import annotations

import pytest
from conftest import EXPERIMENTS, Project

EMA_TRAIN = '''"""Linear(10, 5) with an EMA of its weights, evaluated at each epoch's end."""

import os
import signal
import time

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn


def train(ctx):
    cfg = ctx.cfg
    data = torch.randn(cfg.samples, 10, generator=torch.Generator().manual_seed(ctx.seed))
    probe = data[:8]
    loader = ctx.loader(data, batch_size=cfg.batch_size)
    net = nn.Linear(10, 5)
    model = ctx.ddp(net)
    ema = None if cfg.ema == "running" else AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(0.5))
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    if cfg.ema == "tracked":
        ctx.track(optimizer, ema=ema)
    else:
        ctx.track(optimizer)
    running = 0.0  # "loss_mean": a running mean of the loss, state of the loop's own that no checkpoint holds
    for epoch in ctx.epochs(cfg.epochs):
        for batch in loader:
            optimizer.zero_grad()
            loss = (model(batch) - 1).pow(2).mean()
            loss.backward()
            optimizer.step()
            if ema is not None:
                ema.update_parameters(net)
            running = 0.5 * running + 0.5 * float(loss.detach())
            ctx.log({"loss": loss}, ctx.step)
            if ctx.rank == 1 and ctx.step == int(os.environ.get("KILL_AT", "-1")):
                os.kill(os.getpid(), signal.SIGKILL)
        if ema is None:
            ctx.log({"loss_mean": running}, ctx.step)
        else:
            with torch.no_grad():
                ctx.log({"ema_out": ema(probe).pow(2).mean()}, ctx.step)
        ctx.log({"epoch_time": time.perf_counter()}, ctx.step)  # a clock: no two executions log it alike
'''

# 40 samples, batches of 5 on each of 2 ranks: 4 steps an epoch, a checkpoint at each epoch's start.
RUN = ("experiments/ema_resume", "checkpoint_every=4", "train.epochs=3", "train.samples=40", "train.batch_size=5")


@pytest.fixture(scope="module")
def ema_project(project: Project) -> Project:
    project.add_experiment("ema_resume", train_py=EMA_TRAIN, yaml_extra="  ema: untracked\n")
    assert (EXPERIMENTS / "linear_ddp/experiment.yaml").read_text().rstrip().endswith("samples: 100")
    return project


def _killed(project: Project, mode: str) -> str:
    """A run killed in its second epoch (step 5), after the checkpoint of step 4."""
    crashed = project.harness("run", *RUN, f"train.ema={mode}", env={"KILL_AT": "5"})
    assert crashed.returncode == 1 and "was killed by SIGKILL" in crashed.stderr, crashed.stderr
    return crashed.last_line


def test_untracked_ema_is_named_by_the_checkpoint_and_refused_by_the_resume(ema_project: Project) -> None:
    run = ema_project.harness("run", *RUN, env={"KILL_AT": "5"})
    assert run.returncode == 1, run.stderr
    assert ("the checkpoint of step 4 does not hold `ema` (an AveragedModel), a live copy of the registered Linear"
            in run.stderr), run.stderr
    refused = ema_project.cli("resume", run.last_line)  # refused before any rank starts
    assert refused.returncode == 2, refused.stderr
    assert "Add `ctx.track(ema=ema)` to train() after the line that makes it" in refused.stderr, refused.stderr
    assert ema_project.client().get_run(run.last_line).info.status == "FAILED"


def test_tracked_ema_resumes_bit_for_bit(ema_project: Project) -> None:
    run_id = _killed(ema_project, "tracked")
    resumed = ema_project.harness("resume", run_id)
    assert resumed.returncode == 0, resumed.stderr
    assert "Proved: steps 0-8 from the checkpoint of step 0 and steps 4-7" in resumed.stderr, resumed.stderr
    # The epoch's clock differs in every re-execution: said, never a refusal of the resume.
    assert "epoch_time differed as re-executed and is not held" in resumed.stderr, resumed.stderr
    replayed = ema_project.harness("replay", run_id)
    assert replayed.returncode == 0 and "BITWISE" in replayed.stdout, replayed.stdout + replayed.stderr
    assert "epoch_time differs: not determined by the training" in replayed.stdout, replayed.stdout


def test_state_of_the_loops_own_is_caught_by_the_proof(ema_project: Project) -> None:
    run_id = _killed(ema_project, "running")
    refused = ema_project.harness("resume", run_id)
    assert refused.returncode == 2, refused.stderr
    assert ("logged loss_mean=" in refused.stderr and "at step 7, where the re-execution that ran through step 4"
            in refused.stderr and "does not hold everything the steps after it depend on" in refused.stderr), \
        refused.stderr


def test_a_tracked_state_round_trips_and_an_untracked_copy_is_found(tmp_path) -> None:
    """In one process: a checkpoint holds what ctx.track took by name (digested as `ema:...`) and loads it back, refuses
    a mismatch of names either way, and rank 0's scan finds a deepcopy the loop changed, named as the loop names it."""
    import copy

    import torch
    from torch import nn
    from torch.optim.swa_utils import AveragedModel

    from harness.errors import ExperimentError, HarnessError
    from harness.runtime import checkpoint as ckpt, states
    from harness.runtime.fingerprint import fingerprint

    class Net(nn.Linear):  # a class of this test's own: no module elsewhere in the process is of it
        pass

    model = Net(3, 2)
    initial = fingerprint(model)
    ema = AveragedModel(model)
    with torch.no_grad():
        model.weight.add_(1.0)
    ema.update_parameters(model)
    built = ckpt.build(model=model, position=ckpt.TrainingPosition(4, 1, 0), states={"ema": ema})
    assert "ema:module.weight" in ckpt.tensor_fingerprints(built, model)
    ckpt.save_atomic(built, tmp_path / "rank0.pt")
    loaded = ckpt.load(tmp_path / "rank0.pt")
    fresh = AveragedModel(model)
    ckpt.restore(loaded, model=model, states={"ema": fresh})
    assert fingerprint(fresh.module) == fingerprint(ema.module) and int(fresh.n_averaged) == 1
    with pytest.raises(HarnessError, match=r"holds the state of 'ema' \(ctx.track\(ema=...\)\)"):
        ckpt.restore(loaded, model=model)
    with pytest.raises(HarnessError, match=r"ctx.track\(swa=...\) is tracked but the checkpoint holds no state"):
        ckpt.restore(loaded, model=model, states={"ema": fresh, "swa": fresh})
    with pytest.raises(ExperimentError, match="has no state_dict"):
        states.check_trackable({"position": 3})

    shadow = copy.deepcopy(model)  # found by the scan, and named through this frame's locals
    copies = states.Copies()
    assert copies.untracked(model, [ema, fresh], initial) == [{"name": "shadow", "type": "Net", "of": "Net"}]
    assert copies.untracked(model, [ema, fresh], initial) == []  # unchanged since the last checkpoint: not updated
    assert states.Copies().untracked(model, [ema, fresh, shadow], initial) == []
