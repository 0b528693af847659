"""A sketch of a model's weights: small enough to record with every calibration member, exact enough to say how far
two runs' weights lie apart (harness/judge/weightdistance.py reads it).

A fingerprint says whether weights are equal, not how far apart they are; keeping every member's weights would cost
the model's size per member. So each floating-point tensor of the state dict is folded into WIDTH float64 sums: element
i goes, with a sign drawn from its index, into bucket i mod WIDTH. The difference of two sketches is the sketch of the
difference, and random signs make its squared norm an unbiased estimate of the squared distance (relative error about
sqrt(2 / WIDTH), 9%, for a difference spread over the tensor); a tensor of WIDTH elements or fewer is kept whole, so
its distance is exact. The signs come from integer arithmetic on the element's index (no generator): the same on
every device, so a sketch taken on a GPU compares with one taken on a CPU. Sums are in float64, so a difference of one
float32 ulp per element stays far above the sums' own rounding.
"""

from __future__ import annotations

import zlib

import torch

from harness.messages import WeightsSketch

WIDTH = 256
_CHUNK = WIDTH * 4096  # elements folded at once: 8 MB of float64, whatever the tensor's size
_M32 = 0xFFFFFFFF


def sketch(module: torch.nn.Module, step: int) -> WeightsSketch:
    """The sketch of `module`'s floating-point state (parameters and buffers, by sorted name) after `step` steps."""
    names, counts, norms, values = [], [], [], []
    state = module.state_dict()
    with torch.no_grad():
        for name in sorted(state):
            tensor = state[name].detach()
            if not tensor.is_floating_point() or tensor.numel() == 0:
                continue
            flat = tensor.reshape(-1)
            names.append(name)
            counts.append(flat.numel())
            norms.append(float(torch.linalg.vector_norm(flat.to(torch.float64))))
            values.append(_fold(flat, zlib.crc32(name.encode())).cpu())
    flat_values = torch.cat(values) if values else torch.zeros(0, dtype=torch.float64)
    return WeightsSketch(step, tuple(names), tuple(counts), tuple(norms), tuple(v.numel() for v in values),
                         flat_values.numpy().tobytes())


def _fold(flat: torch.Tensor, salt: int) -> torch.Tensor:
    """WIDTH signed float64 sums of `flat` (the elements themselves when there are WIDTH or fewer)."""
    if flat.numel() <= WIDTH:
        return flat.to(torch.float64)
    out = torch.zeros(WIDTH, dtype=torch.float64, device=flat.device)
    for start in range(0, flat.numel(), _CHUNK):
        part = flat[start:start + _CHUNK].to(torch.float64)
        index = torch.arange(start, start + part.numel(), dtype=torch.int64, device=flat.device)
        part = part * _signs(index, salt)
        pad = (-part.numel()) % WIDTH  # the last chunk: zeros fold into nothing
        if pad:
            part = torch.cat([part, part.new_zeros(pad)])
        out += part.reshape(-1, WIDTH).sum(0)
    return out


def _signs(index: torch.Tensor, salt: int) -> torch.Tensor:
    """+1 or -1 per index: a 32-bit integer mix of the index and the tensor's salt (exact on every device; every
    product stays below 2**59, so int64 never overflows)."""
    x = ((index ^ (index >> 32)) ^ salt) & _M32
    for _ in range(2):
        x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M32
    x = x ^ (x >> 16)
    return 1.0 - 2.0 * (x & 1).to(torch.float64)
