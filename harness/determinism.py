"""Seeds and determinism settings for one rank, applied in one place and read back for the record."""

from __future__ import annotations

import os
import random

import numpy as np
import torch

from harness.config import Level

# cuBLAS needs a fixed workspace to be deterministic; must be in the environment before CUDA starts.
CUBLAS_WORKSPACE = ":4096:8"


def derive_rank_seeds(seed: int, world_size: int) -> list[int]:
    """One independent 32-bit seed per rank, derived from the base seed (recorded with the run)."""
    children = np.random.SeedSequence(seed).spawn(world_size)
    return [int(child.generate_state(1)[0]) for child in children]


def seed_everything(seed: int) -> None:
    """Seed every RNG a training step may draw from in this process."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def set_determinism(level: Level) -> dict[str, str]:
    """Apply `level` to this process and return the effective settings, read back from torch."""
    if level in (Level.strict, Level.warn):
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
        torch.use_deterministic_algorithms(True, warn_only=level == Level.warn)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        # TF32 changes results with the GPU generation; strict runs keep full fp32.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    return read_determinism(level)


def read_determinism(level: Level) -> dict[str, str]:
    return {
        "level": level.value,
        "deterministic_algorithms": str(torch.are_deterministic_algorithms_enabled()),
        "deterministic_warn_only": str(torch.is_deterministic_algorithms_warn_only_enabled()),
        "cudnn_deterministic": str(torch.backends.cudnn.deterministic),
        "cudnn_benchmark": str(torch.backends.cudnn.benchmark),
        "cuda_matmul_tf32": str(torch.backends.cuda.matmul.allow_tf32),
        "cudnn_tf32": str(torch.backends.cudnn.allow_tf32),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG", "unset"),
        "intra_op_threads": str(torch.get_num_threads()),
    }
