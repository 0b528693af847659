"""World-size-invariant mode inside a rank, as the runtime asks for it (the registry's INVARIANT point)."""

from __future__ import annotations

from types import ModuleType

from harness.extras.invariant import training


def mode() -> ModuleType:
    """The mode's rank-side parts (training.py): the model's wrapper and its step (InvariantModule, InvariantStep,
    broadcast_parameters), and its data (KeyedDataset, ShardBatchSampler, EvalSampler)."""
    return training
