"""scripts/gpu-check.sh stage 3: FSDP2 (fully_shard per block, then the root; AdamW) on cuda/nccl; KILL_AT kills
rank 1 after that step (the crash + resume check)."""
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
