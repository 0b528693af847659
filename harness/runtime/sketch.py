"""A sketch of a model's weights: small enough to record with every calibration member, exact enough to say how far
two runs' weights lie apart (harness/judge/weightdistance.py reads it).

A fingerprint says whether weights are equal, not how far apart they are; keeping every member's weights would cost
the model's size per member. So each floating-point tensor of the state dict is folded into WIDTH float64 sums: element
i goes, with a sign drawn for it, into sum i mod WIDTH. The difference of two sketches is the sketch of the
difference, and random signs make its squared norm an unbiased estimate of the squared distance (relative error about
sqrt(2 / WIDTH), 9%; measured within 8% for one-ulp nudges and for constant, strided and sparse changes); a tensor of
WIDTH elements or fewer is kept whole, so its distance is exact. The signs come from an integer mixer of the element's
position (no random generator), computed on the CPU: the same on every device, so a sketch taken on a GPU compares
with one taken on a CPU. Sums are in float64, so a difference of one float32 ulp per element stays far above the
sums' own rounding. Cost: about one multiply-add per element (16M float32 parameters: under a second on one CPU core).
"""

from __future__ import annotations

import zlib

import numpy as np
import torch

from harness.messages import WeightsSketch

# A prime: a weight matrix's strides (powers of two, mostly) then spread over all the sums instead of piling into one.
WIDTH = 257
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
            tensor = _whole(name, tensor)
            flat = tensor.reshape(-1)
            names.append(name)
            counts.append(flat.numel())
            norms.append(float(torch.linalg.vector_norm(flat.to(torch.float64))))
            values.append(_fold(flat, zlib.crc32(name.encode())).cpu())
    flat_values = torch.cat(values) if values else torch.zeros(0, dtype=torch.float64)
    return WeightsSketch(step, tuple(names), tuple(counts), tuple(norms), tuple(v.numel() for v in values),
                         flat_values.numpy().tobytes())


def _whole(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as rank 0 holds it whole: a replicated DTensor's local copy; a sharded one is refused, since its
    whole lives on every rank and gathering it in rank 0 alone (the sketch runs there only) would hang the job."""
    import torch.distributed

    if not torch.distributed.is_available():
        return tensor
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(tensor, DTensor):
        return tensor
    if all(isinstance(p, Replicate) for p in tensor.placements):
        return tensor.to_local()
    raise ValueError(f"{name} is sharded across the ranks (a DTensor, {tuple(tensor.placements)}): rank 0 holds only "
                     "its shard")

def _fold(flat: torch.Tensor, salt: int) -> torch.Tensor:
    """WIDTH signed float64 sums of `flat` (the elements themselves when there are WIDTH or fewer).

    Element i of chunk c takes the sign of a fixed random pattern at position i shifted by a random offset of (tensor,
    c), times a random sign of (tensor, c): elements in one chunk take different pattern positions, elements of
    different chunks independent offsets, so no two elements' signs are correlated and the estimate stays unbiased -
    for one multiplication per element (an integer mixer per element would cost ten)."""
    if flat.numel() <= WIDTH:
        return flat.to(torch.float64)
    out = torch.zeros(WIDTH, dtype=torch.float64, device=flat.device)
    pattern = _pattern(flat.device)
    for chunk, start in enumerate(range(0, flat.numel(), _CHUNK)):
        n = min(_CHUNK, flat.numel() - start)
        mixed = int(_splitmix64(np.array([(salt << 32) | (chunk & _M32)], dtype=np.uint64))[0])
        offset, sign = mixed % _CHUNK, 1.0 - 2.0 * (mixed >> 63)
        part = flat[start:start + n].to(torch.float64) * pattern[offset:offset + n]
        pad = (-n) % WIDTH  # the last chunk: zeros fold into nothing
        if pad:
            part = torch.cat([part, part.new_zeros(pad)])
        out += sign * part.reshape(-1, WIDTH).sum(0)
    return out


_PATTERNS: dict[torch.device, torch.Tensor] = {}


def _pattern(device: torch.device) -> torch.Tensor:
    """+1 or -1 per position of two chunks (an offset into it is a view): the top bit of splitmix64 of the position,
    computed once on the CPU in numpy's wrapping uint64 arithmetic (so the same on every machine), copied once to
    `device`."""
    if device not in _PATTERNS:
        bits = _splitmix64(np.arange(2 * _CHUNK, dtype=np.uint64)) >> np.uint64(63)
        _PATTERNS[device] = torch.from_numpy(1.0 - 2.0 * bits.astype(np.float64)).to(device)
    return _PATTERNS[device]


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser (uint64 in, uint64 out; the products wrap modulo 2**64, as the mixer intends)."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))
