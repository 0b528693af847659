"""Experiment code shared by several test modules: training scripts written into a test project."""

from __future__ import annotations

from conftest import Project

# Each rank writes its pid under $PID_DIR, then trains cfg.steps steps; rank cfg.fail_rank raises at cfg.fail_step.
CRASHING = '''
import os, pathlib, time
import torch
from torch import nn


def train(ctx):
    pathlib.Path(os.environ["PID_DIR"], f"rank{ctx.rank}").write_text(str(os.getpid()))
    model = ctx.ddp(nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(ctx.cfg.steps):
        if ctx.rank == ctx.cfg.fail_rank and step == ctx.cfg.fail_step:
            raise RuntimeError("boom at step %d" % step)
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        ctx.log({"loss": float(step)}, step)
        time.sleep(ctx.cfg.sleep)
'''


def crash_experiment(project: Project, name: str, steps: int, fail_rank: int, fail_step: int,
                     sleep: float) -> tuple[str, str]:
    """Add the CRASHING experiment as `name`; (its folder, the `train={...}` override that sets it up)."""
    project.add_experiment(name, train_py=CRASHING)
    train = f"train={{steps: {steps}, fail_rank: {fail_rank}, fail_step: {fail_step}, sleep: {sleep}}}"
    return f"experiments/{name}", train


# Seeded for its first three steps; from step 3 on its targets come from os.urandom, so no replay reproduces it.
UNSEEDED = '''
import os
import torch
from torch import nn


def train(ctx):
    data = torch.randn(100, 10, generator=torch.Generator().manual_seed(ctx.seed))
    loader = ctx.loader(data, batch_size=10)
    model = ctx.ddp(nn.Linear(10, 5))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ctx.track(opt)
    for _ in ctx.epochs(2):
        for batch in loader:
            opt.zero_grad()
            out = model(batch)
            if ctx.step >= 3:  # from step 3 on, targets come from the OS: nothing can replay them
                target = torch.randn(out.shape, generator=torch.Generator().manual_seed(
                    int.from_bytes(os.urandom(4), "little")))
            else:
                target = torch.randn_like(out)
            loss = nn.functional.mse_loss(out, target)
            loss.backward()
            opt.step()
            ctx.log({"loss": loss}, ctx.step)
'''


# A loop of its own (no ctx.loader, no ctx.steps): batches from get_batch(), every step inside the user's own
# `except Exception`, then a final evaluation and an MLflow call of its own. Each rank writes its pid under
# cfg.pid_dir. replay --steps must stop it at a step (the step's training forward) and leave no rank behind.
OWN_LOOP = '''
import os, pathlib
import torch
from torch import nn


def train(ctx):
    pathlib.Path(ctx.cfg.pid_dir, f"rank{ctx.rank}").write_text(str(os.getpid()))
    generator = torch.Generator().manual_seed(ctx.seed + ctx.rank)

    def get_batch():
        return torch.randn(8, 4, generator=generator)

    model = ctx.ddp(nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(ctx.cfg.iters):
        try:
            loss = model(get_batch()).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        except Exception as err:  # a loop that carries on past its own errors
            print("step skipped:", err)
            continue
        ctx.log({"loss": loss.item()}, ctx.step)
    model.eval()
    with torch.no_grad():
        ctx.log({"eval": model(get_batch()).pow(2).mean().item()}, ctx.step)
    if ctx.rank == 0:
        import mlflow

        mlflow.log_metric("own_eval", 1.0, step=0)
'''
