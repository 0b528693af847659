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
        digest.update(raw_bytes(tensor))
    return digest.hexdigest()


def tensor_sha256(tensor: torch.Tensor) -> str:
    """sha256 of `dtype|shape|` then the tensor's raw bytes: equal digest = equal tensor (per-tensor checkpoint digests)."""
    digest = hashlib.sha256(f"{tensor.dtype}|{tuple(tensor.shape)}|".encode())
    digest.update(raw_bytes(tensor))
    return digest.hexdigest()


def raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes in row-major order (a contiguous CPU copy), whatever the dtype: bf16 has no numpy
    twin, so the elements are viewed as uint8; a 0-d tensor is reshaped first. Handed to sha256 as a buffer."""
    return tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().data
