"""What a traced step's process was set to when the step began: determinism and precision settings read back, the
device and its numerical libraries, and digests of the global generators' states (a trace's meta)."""

from __future__ import annotations

import hashlib
from importlib import metadata
from typing import Any

import torch


def _read(fn: Any) -> Any:
    """fn()'s answer as a JSON value; None where this torch (or its build) has no such setting."""
    try:
        value = fn()
    except (AttributeError, RuntimeError, AssertionError, ImportError):
        return None
    return value if isinstance(value, (bool, int, str, type(None))) else str(value)


def settings() -> dict[str, Any]:
    """Determinism and precision settings of this process, read back (not what was asked for)."""
    read = _read
    b = torch.backends
    return {
        "deterministic_algorithms": read(torch.are_deterministic_algorithms_enabled),
        "deterministic_warn_only": read(torch.is_deterministic_algorithms_warn_only_enabled),
        # torch fills the memory of torch.empty & co. with NaN (or the integer maximum) under deterministic
        # algorithms unless this is off: off, such memory holds whatever was there before.
        "fill_uninitialized_memory": read(lambda: torch.utils.deterministic.fill_uninitialized_memory),  # type: ignore[attr-defined]  # a module property torch's stubs do not declare
        "cudnn_deterministic": read(lambda: b.cudnn.deterministic),
        "cudnn_benchmark": read(lambda: b.cudnn.benchmark),
        "num_threads": read(torch.get_num_threads),
        "float32_matmul_precision": read(torch.get_float32_matmul_precision),
        "cuda_matmul_allow_tf32": read(lambda: b.cuda.matmul.allow_tf32),
        "cudnn_allow_tf32": read(lambda: b.cudnn.allow_tf32),
        "cuda_matmul_allow_fp16_reduced_precision_reduction":
            read(lambda: b.cuda.matmul.allow_fp16_reduced_precision_reduction),
        "cuda_matmul_allow_bf16_reduced_precision_reduction":
            read(lambda: b.cuda.matmul.allow_bf16_reduced_precision_reduction),
        "mkldnn_enabled": read(lambda: b.mkldnn.enabled),
        "mkldnn_matmul_fp32_precision": read(lambda: b.mkldnn.matmul.fp32_precision),  # type: ignore[attr-defined]  # newer torch only; read() answers None without it
        "mkldnn_conv_fp32_precision": read(lambda: b.mkldnn.conv.fp32_precision),  # type: ignore[attr-defined]  # newer torch only; read() answers None without it
        # The TF32 API of torch >= 2.9 ("ieee" | "tf32" | "none" = inherit from the level above); older torch has
        # none of these (read() answers None), and allow_tf32 above is then the whole story.
        "fp32_precision": read(lambda: b.fp32_precision),  # type: ignore[attr-defined]  # newer torch only
        "cuda_matmul_fp32_precision": read(lambda: b.cuda.matmul.fp32_precision),
        "cudnn_fp32_precision": read(lambda: b.cudnn.fp32_precision),
        "cudnn_conv_fp32_precision": read(lambda: b.cudnn.conv.fp32_precision),  # type: ignore[attr-defined]  # newer torch only
        "cudnn_rnn_fp32_precision": read(lambda: b.cudnn.rnn.fp32_precision),  # type: ignore[attr-defined]  # newer torch only
        "mkldnn_fp32_precision": read(lambda: b.mkldnn.fp32_precision),
        # Which scaled_dot_product_attention kernels may be picked: each computes attention in its own order.
        "flash_sdp_enabled": read(b.cuda.flash_sdp_enabled),
        "mem_efficient_sdp_enabled": read(b.cuda.mem_efficient_sdp_enabled),
        "math_sdp_enabled": read(b.cuda.math_sdp_enabled),
        "cudnn_sdp_enabled": read(b.cuda.cudnn_sdp_enabled),
        "flush_denormal": _flush_denormal(),
    }


# The global generators a step may draw from, as meta keys: their state digests at the start of the traced step
# tell a generator reseeded (or drawn from more often) before the step from arithmetic inside it.
GENERATOR_KEYS = ("rng_torch", "rng_cuda", "rng_numpy", "rng_python")


def generator_states() -> dict[str, str | None]:
    """sha256 (16 hex) of each global generator's state now; None for CUDA's before CUDA is in use."""
    import random

    import numpy as np

    def digest(data: bytes) -> str:
        return hashlib.sha256(data).hexdigest()[:16]

    kind, keys, pos, gauss, cached = np.random.get_state()
    return {
        "rng_torch": digest(torch.get_rng_state().numpy().tobytes()),
        "rng_cuda": digest(torch.cuda.get_rng_state().numpy().tobytes()) if torch.cuda.is_initialized() else None,
        "rng_numpy": digest(f"{kind}:{pos}:{gauss}:{cached}:".encode() + np.asarray(keys).tobytes()),
        "rng_python": digest(repr(random.getstate()).encode()),
    }


def device_facts(device: torch.device) -> dict[str, Any]:
    """The device the step ran on and the numerical libraries this process has loaded for it: a trace made on
    another GPU, or with another cuDNN, may differ without any setting having changed."""
    facts: dict[str, Any] = {"device": str(device), "device_name": None, "compute_capability": None,
                             "cpu_capability": _read(torch.backends.cpu.get_cpu_capability)}
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        facts["device_name"] = _read(lambda: torch.cuda.get_device_name(index))
        facts["compute_capability"] = _read(lambda: ".".join(map(str, torch.cuda.get_device_capability(index))))
    facts["cuda_version"] = torch.version.cuda  # the toolkit torch was built with: None on a CPU build
    facts["cudnn_version"] = _read(torch.backends.cudnn.version)  # None without cuDNN
    # A CPU build uses no cuBLAS, whatever nvidia-cublas package an earlier CUDA install left in site-packages.
    facts["cublas_version"] = _cublas_version() if torch.version.cuda is not None else None
    facts["nccl_version"] = _read(lambda: ".".join(map(str, torch.cuda.nccl.version())))  # no NCCL: None
    return facts


def _cublas_version() -> str | None:
    """The cuBLAS of torch's CUDA wheels (the nvidia-cublas package they depend on); None when it is not a
    package (a CPU build, or CUDA from the system, where torch.version.cuda is what there is to say)."""
    for name in ("nvidia-cublas-cu12", "nvidia-cublas-cu13", "nvidia-cublas", "nvidia-cublas-cu11"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _flush_denormal() -> bool:
    # torch has a setter (set_flush_denormal) but no getter: a denormal times one reads back as
    # zero exactly when the CPU flushes denormals (FTZ/DAZ).
    tiny = torch.tensor([1e-40], dtype=torch.float32)
    return bool((tiny * 1.0).item() == 0.0)

