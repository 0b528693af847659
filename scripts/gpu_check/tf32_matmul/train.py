"""A two-layer fp32 MLP regressing a fixed linear map; train.tf32 turns TF32 on for its matmuls."""

import torch
from torch import nn


def train(ctx):
    cfg = ctx.cfg
    if cfg.tf32:
        torch.set_float32_matmul_precision("high")  # TF32 for fp32 matmuls: what the trace pair must name
    width = cfg.width
    data = torch.randn(cfg.samples, width, generator=torch.Generator().manual_seed(ctx.seed))
    teacher = (torch.randn(width, width, generator=torch.Generator().manual_seed(1)) / width**0.5).to(ctx.device)
    loader = ctx.loader(data, batch_size=cfg.batch_size)
    model = ctx.ddp(nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width)))
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    ctx.track(optimizer)
    for _ in ctx.epochs(cfg.epochs):
        for batch in loader:
            optimizer.zero_grad()
            loss = ctx.backward(batch.to(ctx.device), lambda b: nn.functional.mse_loss(model(b), b @ teacher))
            optimizer.step()
            ctx.log({"loss": loss}, ctx.step)
