"""Linear(10, 5) on random data with MSE and SGD: the smallest DDP job that still all-reduces."""

import torch
from torch import nn


def train(ctx):
    cfg = ctx.cfg
    # The data set is drawn from the base seed so every rank sees the same 100 samples.
    data = torch.randn(cfg.samples, 10, generator=torch.Generator().manual_seed(ctx.seed))
    loader = ctx.loader(data, batch_size=cfg.batch_size)
    model = ctx.ddp(nn.Linear(10, 5))
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    ctx.track(optimizer)  # part of every checkpoint
    loss_fn = nn.MSELoss()

    def batch_loss(batch):
        output = model(batch)
        target = torch.randn_like(output)  # random targets, from the seeded generator
        return loss_fn(output, target)

    for epoch in ctx.epochs(cfg.epochs):
        model.train()
        for batch in loader:
            optimizer.zero_grad()
            loss = ctx.backward(batch.to(ctx.device), batch_loss)
            optimizer.step()
            ctx.log({"loss": loss}, ctx.step)
        ctx.print(f"epoch {epoch + 1}/{cfg.epochs} loss {loss.item():.4f}")
