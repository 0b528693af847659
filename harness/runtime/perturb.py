"""A calibration member's start: every floating-point parameter one ulp away from where the run started.

`harness calibrate` measures how far rounding alone carries a run: another machine's kernels round the same
arithmetic differently by about one unit in the last place, and training carries that on. A member replays the run
with the same seed, config and data, its weights nudged before the first step by exactly that much, up or down per
element as a generator of the member's seed draws it. Everything else is the run's own: the nudge draws from its own
generator, never the global RNG that the data order, dropout and initialisation draw from.

Every rank draws the same nudges (same seed, same parameter order), so the replicas stay equal whether the nudge
comes before DDP's broadcast (ctx.ddp) or after a framework's wrap (ctx.register).
"""

from __future__ import annotations

import torch


def nudge(model: torch.nn.Module, seed: int) -> int:
    """Move every floating-point parameter of `model` by one ulp towards +inf or -inf, drawn per element. Returns how
    many elements moved."""
    generator = torch.Generator().manual_seed(seed)
    moved = 0
    with torch.no_grad():
        for _, param in sorted(model.named_parameters(), key=lambda item: item[0]):
            if not param.is_floating_point() or param.numel() == 0:
                continue
            up = torch.rand(param.shape, generator=generator) < 0.5  # drawn on the CPU: the same on every device
            towards = torch.where(up, torch.tensor(float("inf")), torch.tensor(float("-inf"))).to(param.device, param.dtype)
            param.copy_(torch.nextafter(param, towards))
            moved += param.numel()
    return moved
