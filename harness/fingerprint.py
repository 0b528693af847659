"""A sha256 over a model's parameter and buffer bytes, in a fixed order: equal hash = equal weights."""

from __future__ import annotations

import hashlib

import torch


def fingerprint(module: torch.nn.Module, *, buffers: bool = True) -> str:
    """sha256 of the parameters and (unless buffers=False) buffers, by sorted name."""
    digest = hashlib.sha256()
    # state_dict covers buffers too (BatchNorm statistics decide results as much as weights do).
    state = module.state_dict() if buffers else dict(module.named_parameters())
    for name in sorted(state):
        tensor = state[name].detach()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        # Raw bytes, whatever the dtype (bf16 has no numpy equivalent): view as uint8.
        raw = tensor.to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        digest.update(raw.tobytes())
    return digest.hexdigest()
