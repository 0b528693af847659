"""The per-rank seeds a job's base seed decides: one derivation, used where the run is recorded (the launcher, which
does not import torch) and where it is checked (the ranks)."""

from __future__ import annotations

import numpy as np


def derive_rank_seeds(seed: int, world_size: int) -> list[int]:
    """One independent 32-bit seed per rank, derived from the base seed (recorded with the run)."""
    children = np.random.SeedSequence(seed).spawn(world_size)
    return [int(child.generate_state(1)[0]) for child in children]
