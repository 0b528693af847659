"""A sha256 over a model's parameter and buffer bytes, in a fixed order: equal hash = equal weights.

A sharded tensor (a DTensor: FSDP2's parameters and their optimizer state) is hashed as this rank holds it: its
placements, global shape and local shard, so hashing never waits for another rank; harness/runtime/sharding.py
combines every rank's digests into the whole's."""

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
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|{layout(tensor)}".encode())
        digest.update(raw_bytes(tensor))
    return digest.hexdigest()


def tensor_sha256(tensor: torch.Tensor) -> str:
    """sha256 of `dtype|shape|` then the tensor's raw bytes: equal digest = equal tensor (per-tensor checkpoint digests)."""
    digest = hashlib.sha256(f"{tensor.dtype}|{tuple(tensor.shape)}|{layout(tensor)}".encode())
    digest.update(raw_bytes(tensor))
    return digest.hexdigest()


def raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes in row-major order (a contiguous CPU copy), whatever the dtype: bf16 has no numpy
    twin, so the elements are viewed as uint8; a 0-d tensor is reshaped first. Handed to sha256 as a buffer."""
    return local(tensor).detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().data


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed support holds no sharded tensor
        return None
    return DTensor


def is_dtensor(tensor: object) -> bool:
    kind = _dtensor_type()
    return kind is not None and isinstance(tensor, kind)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """What this rank holds of `tensor`: a DTensor's local shard (its replica, when replicated), else `tensor`."""
    return tensor.to_local() if is_dtensor(tensor) else tensor  # type: ignore[attr-defined]


def layout(tensor: torch.Tensor) -> str:
    """`placements|local shape|` of a DTensor ("" for a plain tensor, whose digest stays what it always was)."""
    if not is_dtensor(tensor):
        return ""
    placements = ",".join(str(p) for p in tensor.placements)  # type: ignore[attr-defined]
    return f"{placements}|{tuple(local(tensor).shape)}|"
