"""FSDP2 (fully_shard per block, then the root; AdamW) under harness: it runs, replays bit for bit, resumes bit for
bit after a SIGKILLed rank, and a replay at another world size says it is not the same arithmetic (real gloo ranks
on the CPU, real store)."""

from __future__ import annotations

import pytest
from conftest import Project

FSDP_TRAIN = '''
import os
import signal

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.relu(self.fc(self.norm(x)))


def train(ctx):
    data = torch.randn(40, 12, generator=torch.Generator().manual_seed(ctx.seed))
    loader = ctx.loader(data, batch_size=4)
    model = nn.Sequential(nn.Linear(12, 16), Block(16), Block(16), nn.Linear(16, 3)).to(ctx.device)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    ctx.register(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    ctx.track(optimizer)
    for _ in ctx.epochs(2):
        for batch in loader:
            optimizer.zero_grad()
            out = model(batch.to(ctx.device))
            loss = nn.functional.mse_loss(out, torch.randn_like(out))
            loss.backward()
            optimizer.step()
            ctx.log({"loss": loss}, ctx.step)
            if ctx.rank == 1 and ctx.step == int(os.environ.get("KILL_AT", "-1")):
                os.kill(os.getpid(), signal.SIGKILL)  # a real crash
'''
EXP = "experiments/fsdp_mlp"
SETTINGS = ("fingerprint_every=2", "checkpoint_every=3")


@pytest.fixture(scope="module")
def fsdp_run(project: Project) -> str:
    """One uninterrupted FSDP2 run (2 ranks, 10 steps, a checkpoint every 3 steps), shared by the tests."""
    project.add_experiment("fsdp_mlp", train_py=FSDP_TRAIN)
    result = project.harness("run", EXP, *SETTINGS)
    assert result.returncode == 0, result.stderr
    return result.last_line


def test_fsdp_run_replays_bitwise(project: Project, fsdp_run: str) -> None:
    replay = project.harness("replay", fsdp_run)
    assert replay.returncode == 0, replay.stderr
    assert "verdict: BITWISE" in replay.stdout + replay.stderr


def test_fsdp_replay_at_another_world_size_is_never_bitwise(project: Project, fsdp_run: str) -> None:
    replay = project.harness("replay", fsdp_run, "--world-size", "1")
    out = replay.stdout + replay.stderr
    assert "verdict: BITWISE" not in out and "verdict: DIVERGED" in out, out
    assert "world size changed: the batch split and the gradients' reduction differ (DDP all-reduce; FSDP shards)" in out


def test_fsdp_sigkilled_rank_resumes_bit_identically(project: Project, fsdp_run: str) -> None:
    crashed = project.harness("run", EXP, *SETTINGS, env={"KILL_AT": "7"})
    assert crashed.returncode == 1 and "was killed by SIGKILL" in crashed.stderr, crashed.stderr
    resumed = project.harness("resume", crashed.last_line)
    assert resumed.returncode == 0, resumed.stderr
    assert "Proved: steps" in resumed.stderr
    client = project.client()
    a, b = client.get_run(crashed.last_line), client.get_run(fsdp_run)
    assert a.info.status == "FINISHED" and a.data.tags["harness.resumed_from"] == "6"
    assert a.data.tags["harness.fingerprint"] == b.data.tags["harness.fingerprint"]
    losses = [sorted((m.step, m.value) for m in client.get_metric_history(r, "loss")) for r in (a.info.run_id, fsdp_run)]
    assert losses[0] == losses[1] and len(losses[0]) == 10

