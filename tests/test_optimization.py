"""What trains the model, recorded: the optimizer and its param groups, the LR schedulers, the GradScaler, autocast, and
per step the learning rate in force and the GradScaler's scale. A rank's Context made in this process, its messages
read from a real pipe, then fed to the recorder over a real SQLite store; no ranks."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import harness
from harness import tags as T
from harness.config import Experiment, compose
from harness.executors import schema
from harness.errors import ExperimentError
from harness.executors import schema
from harness.judge.compare import compare_runs
from harness.judge.verdicts import Verdict
from harness.messages import Metrics, MetricsBatch, Optimization
from harness.record.recorder import Recorder
from harness.runtime.context import Context
from harness.store.tracking import Tracker

STEPS = 6


def mixed_precision_loop(ctx: Context) -> None:
    """An AMP recipe: two param groups (no weight decay on the bias), warm-up then step decay, bf16 autocast around
    the forward, a GradScaler around backward and step; an eval forward in autocast too."""
    torch.manual_seed(0)
    model = ctx.register(nn.Linear(4, 2))
    optimizer = torch.optim.SGD([{"params": [model.weight], "weight_decay": 1e-4},
                                 {"params": [model.bias], "weight_decay": 0.0, "lr": 0.05}], lr=0.1, momentum=0.9)

    def warmup(step: int) -> float:
        return min(1.0, (step + 1) / 3)

    scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [
        torch.optim.lr_scheduler.LambdaLR(optimizer, warmup),
        torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)], milestones=[3])
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    data = torch.randn(STEPS, 8, 4)
    for step in range(STEPS):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(data[step]).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        ctx.log({"loss": loss}, ctx.step)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        model(data[0])


def run_in_process(tmp_path: Path, loop: Any) -> list[Any]:
    """`loop(ctx)` in a Context of this process, as rank 0 of a recorded job; every message it sent, in order."""
    here, there = mp.Pipe()
    ctx = Context(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), cfg={}, seed=0, rank_seed=0,
                  fingerprint_every=100, channel=there, output_dir=str(tmp_path / "out"))
    try:
        loop(ctx)
        ctx.finish()
    finally:
        ctx.close()
    messages = []
    while here.poll():
        messages.append(here.recv())
    return messages


def logged(messages: list[Any], key: str) -> dict[int, float]:
    out: dict[int, float] = {}
    for msg in messages:
        if isinstance(msg, MetricsBatch):
            out.update((step, value) for k, step, value, _ in msg.points() if k == key)
        elif isinstance(msg, Metrics) and key in msg.values:
            out[msg.step] = msg.values[key]
    return out


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    return run_in_process(tmp_path_factory.mktemp("mixed"), mixed_precision_loop)


def test_the_learning_rate_and_scale_of_every_step_are_logged(mixed: list[Any]) -> None:
    # What the loop's schedule gives, computed here: warm-up 1/3, 2/3, 1 for 3 steps, then 1, 0.5, 0.5 (StepLR by 2).
    factors = [1 / 3, 2 / 3, 1.0, 1.0, 1.0, 0.5]
    lr = logged(mixed, T.METRIC_LR)
    assert sorted(lr) == list(range(STEPS))
    assert [lr[s] for s in range(3)] == [0.1 * f for f in factors[:3]]
    assert lr[5] == 0.05 and logged(mixed, "harness.lr.group1")[0] == 0.05 / 3  # the bias group's own lr
    scale = logged(mixed, T.METRIC_GRAD_SCALE)
    # growth_interval=2: the scale doubles after every 2 steps without inf, as the step's loss was scaled by.
    assert scale == {0: 1024.0, 1: 1024.0, 2: 2048.0, 3: 2048.0, 4: 4096.0, 5: 4096.0}
    assert sorted(logged(mixed, "loss")) == list(range(STEPS))


def test_the_set_up_is_sent_at_the_first_step_and_at_the_end(mixed: list[Any]) -> None:
    sent = [m for m in mixed if isinstance(m, Optimization)]
    assert len(sent) == 2
    first, last = sent
    assert first.optimizer == last.optimizer
    opt = last.optimizer
    assert opt is not None and opt["class"] == "torch.optim.sgd.SGD"
    g0, g1 = opt["groups"]
    assert (g0["lr"], g0["momentum"], g0["weight_decay"], g0["params"]) == (0.1 / 3, 0.9, 1e-4, "1 tensors, 8 elements")
    assert (g1["initial_lr"], g1["weight_decay"], g1["params"]) == (0.05, 0.0, "1 tensors, 2 elements")
    classes = [s["class"] for s in last.schedulers]
    assert classes == ["torch.optim.lr_scheduler.LambdaLR", "torch.optim.lr_scheduler.StepLR",
                       "torch.optim.lr_scheduler.SequentialLR"]
    lam, step, seq = last.schedulers
    assert lam["settings"]["lr_lambdas"] == ["mixed_precision_loop.<locals>.warmup"] * 2
    assert (step["settings"]["step_size"], step["settings"]["gamma"]) == (2, 0.5)
    assert seq["settings"]["milestones"] == [3] and seq["settings"]["schedulers"] == classes[:2]
    assert last.grad_scaler == {"class": "torch.amp.grad_scaler.GradScaler", "settings": {
        "enabled": True, "init_scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2}}
    # The eval forward's float16 region after the last step is seen too, at the step it came after.
    assert last.autocast == ({"device_type": "cpu", "dtype": "bfloat16", "first_step": 0},
                             {"device_type": "cpu", "dtype": "float16", "first_step": STEPS})
    assert first.autocast == last.autocast[:1]


def test_the_wrapped_classes_are_put_back_when_the_context_closes(mixed: list[Any]) -> None:
    # torch's own code again (by torch's folder: the checkout itself may live under a folder named harness).
    torch_dir = os.path.dirname(torch.__file__) + os.sep
    assert torch.amp.autocast_mode.autocast.__enter__.__code__.co_filename.startswith(torch_dir)
    assert torch.amp.GradScaler.step.__code__.co_filename.startswith(torch_dir)
    assert "__new__" not in torch.optim.lr_scheduler.LRScheduler.__dict__


def test_two_watches_stopped_first_to_last_put_torch_back_and_both_saw_the_region() -> None:
    """Two contexts in one process, closed in the order they were made (a fixture's list): the first one's wrapper
    must not stay installed behind the second's."""
    from harness.runtime import optimization

    torch_dir = os.path.dirname(torch.__file__) + os.sep
    first, second = optimization.Watch(lambda: 0).start(), optimization.Watch(lambda: 1).start()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pass
    first.stop()
    assert not torch.amp.autocast_mode.autocast.__enter__.__code__.co_filename.startswith(torch_dir)  # one still lives
    second.stop()
    assert torch.amp.autocast_mode.autocast.__enter__.__code__.co_filename.startswith(torch_dir)
    assert torch.amp.GradScaler.step.__code__.co_filename.startswith(torch_dir)
    assert "__new__" not in torch.optim.lr_scheduler.LRScheduler.__dict__
    assert first._autocast == {("cpu", "bfloat16"): 0} and second._autocast == {("cpu", "bfloat16"): 1}


def test_the_recorder_writes_the_set_up_as_tags_and_an_artifact(tmp_path: Path, mixed: list[Any]) -> None:
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = tracker.create_run("optimization", {T.VERSION: harness.__version__, T.EXECUTOR: "local"})
    (tmp_path / "work" / "logs").mkdir(parents=True)
    cfg = Experiment.of(compose([("test", {"image": "none", "entry": "train.py:train"})], schema())).config
    recorder = Recorder(tracker, run_id, cfg, tmp_path / "work", lambda shown: None)
    recorder.start("cpu", "gloo")
    for msg in mixed:
        recorder.feed(msg)
    # The training code's own MLflow call (rank 0's mlflow.log_metric lands in the run directly): an eval loss.
    tracker.client.log_metric(run_id, "eval_loss", 0.75, step=5)
    assert recorder.ranks_done() is None
    recorder.end()
    tags = tracker.get_run(run_id).tags
    assert tags[T.OPTIMIZER] == "torch.optim.sgd.SGD"
    # Each group's own settings first, then the optimizer's defaults it took; the parameters are not shown.
    assert tags[T.OPTIMIZER_SETTINGS].startswith("group 0: weight_decay=0.0001, lr=0.03333333333333333, momentum=0.9, "
                                                 "dampening=0, nesterov=False, ")
    assert "; group 1: weight_decay=0.0, lr=0.016666666666666666, momentum=0.9, " in tags[T.OPTIMIZER_SETTINGS]
    assert "params" not in tags[T.OPTIMIZER_SETTINGS]
    assert tags[T.LR_SCHEDULER] == (
        "torch.optim.lr_scheduler.LambdaLR(lr_lambdas=['mixed_precision_loop.<locals>.warmup', "
        "'mixed_precision_loop.<locals>.warmup'], base_lrs=[0.1, 0.05]); "
        "torch.optim.lr_scheduler.StepLR(step_size=2, gamma=0.5, base_lrs=[0.1, 0.05]); "
        "torch.optim.lr_scheduler.SequentialLR(schedulers=['torch.optim.lr_scheduler.LambdaLR', "
        "'torch.optim.lr_scheduler.StepLR'], milestones=[3])")
    assert tags[T.GRAD_SCALER] == ("torch.amp.grad_scaler.GradScaler(enabled=True, init_scale=1024.0, growth_factor=2.0, "
                                   "backoff_factor=0.5, growth_interval=2)")
    assert tags[T.AUTOCAST] == "cpu bfloat16 from step 0, cpu float16 from step 6"
    doc = json.loads(tracker.read_text(run_id, T.ARTIFACT_OPTIMIZATION) or "{}")
    assert doc["optimizer"]["groups"][1]["params"] == "1 tensors, 2 elements" and len(doc["schedulers"]) == 3

    # The record holds harness's values and the user's own MLflow metric; a replay is judged on all of them.
    record = tracker.load_record(run_id)
    assert {"loss", T.METRIC_LR, "harness.lr.group1", T.METRIC_GRAD_SCALE, "eval_loss"} == set(record.metrics)
    assert record.metrics["eval_loss"][0].tolist() == [5] and record.metrics["eval_loss"][1].tolist() == [0.75]
    assert tags[T.USER_MLFLOW_METRICS] == "eval_loss"
    replay = tracker.load_record(run_id)
    assert compare_runs(record, replay).verdict == Verdict.BITWISE
    assert compare_runs(record, replay).summary().startswith(
        "BITWISE: 2 metrics (7 values) + harness.amp.scale, harness.lr, harness.lr.group1 bit-identical")
    replay.metrics["eval_loss"] = (np.array([5]), np.array([0.5]))
    replay.final_fingerprint = "e" * 64  # weights that parted too (with them equal, eval_loss is no function of the training)
    judged = compare_runs(record, replay)
    # Its step is the script's own (an epoch, say), not a training step: the verdict says so.
    assert judged.verdict == Verdict.DIVERGED and judged.summary().startswith("DIVERGED at MLflow step 5: eval_loss 0.75 vs 0.5")
    # A training-step metric that differs too is the first divergence, wherever the script's own step lies.
    steps, loss = replay.metrics["loss"]
    replay.metrics["loss"] = (steps, np.where(steps == 5, loss + 1, loss))
    assert compare_runs(record, replay).summary().startswith("DIVERGED at step 5: loss ")


def test_a_run_without_optimizer_records_none_and_ctx_log_refuses_harness_names(tmp_path: Path) -> None:
    def own_update(ctx: Context) -> None:
        weight = torch.zeros(3, requires_grad=True)
        for it in ctx.steps(2):
            loss = (weight - 1).pow(2).sum()
            loss.backward()
            with torch.no_grad():
                weight -= 0.1 * weight.grad
                weight.grad = None
            ctx.log({"loss": loss}, it)
        with pytest.raises(ExperimentError, match=r"'harness.lr' is named like the metrics harness logs itself"):
            ctx.log({"harness.lr": 0.1}, 1)

    messages = run_in_process(tmp_path, own_update)
    assert [m for m in messages if isinstance(m, Optimization)] == [Optimization(None)]
    assert not logged(messages, T.METRIC_LR)
    from harness.record.results import optimization_tags

    assert optimization_tags(Optimization(None)) == {T.OPTIMIZER: "none", T.LR_SCHEDULER: "none",
                                                    T.GRAD_SCALER: "none", T.AUTOCAST: "none"}


def test_a_step_the_grad_scaler_skipped_ends_in_a_loader_loop(tmp_path: Path) -> None:
    """A scale so large that the first steps' scaled gradients overflow: GradScaler.step skips optimizer.step() and
    update() backs the scale off, as fp16 training does at its start. Each skipped batch is still a step of a
    ctx.loader loop - its loss is logged once at its own step, where the next batch once worked on the same step and
    the second ctx.log of `loss` failed the run - and harness.lr and the scale are logged only at the steps taken."""

    def loop(ctx: Context) -> None:
        torch.manual_seed(0)
        model = ctx.register(nn.Linear(4, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127, backoff_factor=2.0**-40)
        loader = ctx.loader(torch.randn(STEPS, 4) * 100, batch_size=1)
        for _ in ctx.epochs(1):
            for batch in loader:
                optimizer.zero_grad()
                loss = model(batch).pow(2).mean()
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
                ctx.log({"loss": loss}, ctx.step)

    messages = run_in_process(tmp_path, loop)
    assert sorted(logged(messages, "loss")) == list(range(STEPS))
    taken = sorted(logged(messages, T.METRIC_LR))
    assert taken and 0 not in taken and set(taken) < set(range(STEPS))  # the first step, at least, was skipped
    assert sorted(logged(messages, T.METRIC_GRAD_SCALE)) == taken
    assert torch.amp.GradScaler.step.__code__.co_filename.startswith(os.path.dirname(torch.__file__) + os.sep)
