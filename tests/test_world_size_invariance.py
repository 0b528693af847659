"""World-size-invariant mode end to end: digits_cnn (dropout, DataLoader workers) trained on 4 ranks
replays bit for bit on 2 and on 1 (real gloo ranks, real store)."""

from __future__ import annotations

import pytest

from conftest import Project

INVARIANT = ["determinism.world_size_invariant=true", "determinism.shards=8", "train.batch_size=8", "train.epochs=1"]


@pytest.fixture(scope="module")
def four_ranks(project: Project) -> str:
    result = project.harness("run", "experiments/digits_cnn", "world_size=4", *INVARIANT)
    assert result.returncode == 0, result.stderr
    return result.last_line


@pytest.mark.parametrize("world_size", [2, 1])
def test_invariant_run_on_4_ranks_replays_bitwise_on_fewer(project: Project, four_ranks: str, world_size: int) -> None:
    result = project.harness("replay", four_ranks, "--world-size", str(world_size))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().splitlines()[-2].startswith("verdict: BITWISE"), result.stdout
    assert f"harness.world_size: 4 -> {world_size}" in result.stdout
    assert "world-size-invariant mode" in result.stdout
    # The global batches are the same samples whatever the world size: the data order says so too.
    assert "data order: identical at the 22 common steps" in result.stdout, result.stdout
    tags = project.client().get_run(result.last_line).data.tags
    assert tags["harness.world_size"] == str(world_size)
    assert tags["harness.determinism.world_size_invariant"] == "True"


def test_invariant_mode_records_its_settings(project: Project, four_ranks: str) -> None:
    client = project.client()
    tags = client.get_run(four_ranks).data.tags
    assert tags["harness.determinism.world_size_invariant"] == "True"
    assert tags["harness.determinism.shards"] == "8"
    # 1437 training images / (8 shards x 8) = 22 full global batches; the tail is dropped.
    assert len(client.get_metric_history(four_ranks, "train_loss")) == 22


def test_bad_invariant_layout_is_refused(project: Project) -> None:
    result = project.cli("run", "experiments/digits_cnn", "world_size=3", "determinism.world_size_invariant=true")
    assert result.returncode == 2
    assert result.stderr.startswith("Error: ") and "power-of-two world_size" in result.stderr


# nanoGPT's gradient accumulation, on DDP's two switches: in invariant mode ctx.backward overwrites the gradient
# it reduced, so accumulating around it would silently train on the last micro-batch only.
ACCUMULATING = '''
import contextlib

import torch
from torch import nn


def train(ctx):
    data = torch.randn(ctx.cfg.samples, 10, generator=torch.Generator().manual_seed(ctx.seed))
    loader = ctx.loader(data, batch_size=ctx.cfg.batch_size)
    model = ctx.ddp(nn.Linear(10, 5))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in ctx.epochs(1):
        for batch in loader:
            optimizer.zero_grad()
            for micro in range(2):
                last = micro == 1
                if ctx.cfg.switch == "flag":
                    model.require_backward_grad_sync = last
                    context = contextlib.nullcontext()
                else:
                    context = contextlib.nullcontext() if last else model.no_sync()
                with context:
                    loss = ctx.backward(batch, lambda b: (model(b) ** 2).mean())
            optimizer.step()
            ctx.log({"loss": loss}, ctx.step)
'''


@pytest.mark.parametrize("switch,said", [
    ("no_sync", "model.no_sync() does not apply in world-size-invariant mode"),
    ("flag", "model.require_backward_grad_sync = False does not apply in world-size-invariant mode"),
])
def test_ddp_gradient_accumulation_switches_are_refused_where_used(project: Project, switch: str, said: str) -> None:
    project.add_experiment("invariant_accumulating", train_py=ACCUMULATING, yaml_extra="  switch: no_sync\n")
    result = project.harness("run", "experiments/invariant_accumulating", f"train.switch={switch}",
                             "determinism.world_size_invariant=true", "determinism.shards=2", "train.batch_size=10")
    assert result.returncode == 1, result.stdout + result.stderr
    failed = [line for line in result.stderr.splitlines() if line.startswith("FAILED: ")]
    assert len(failed) == 1 and said in failed[0] and "Accumulate through ctx.backward" in failed[0], result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    run = project.client().get_run(result.last_line)
    assert run.info.status == "FAILED" and said in run.data.tags["harness.status_reason"]
