"""One Linear(4096, 4096): 16.8M fp32 parameters, a 64 MiB gradient summed across the ranks every step."""

import torch
from torch import nn


def train(ctx):
    cfg = ctx.cfg
    data = torch.randn(cfg.samples, cfg.width, generator=torch.Generator().manual_seed(ctx.seed))
    loader = ctx.loader(data, batch_size=cfg.batch_size)
    model = ctx.ddp(nn.Linear(cfg.width, cfg.width))
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    for _ in ctx.epochs(cfg.epochs):
        for batch in loader:
            optimizer.zero_grad()
            loss = ctx.backward(batch.to(ctx.device), lambda b: model(b).square().mean())
            optimizer.step()
            ctx.log({"loss": loss}, ctx.step)
