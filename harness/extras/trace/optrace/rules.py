"""Likely-cause rules for a localised op-trace difference: each a small function that reads the
culprit and the two traces' meta and returns one sentence, or None when it does not apply."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from harness.extras.trace.optrace.trace import ACCUMULATION_OPS, Localization, Trace

RANDOM_OPS = frozenset({
    "normal", "normal_", "uniform", "uniform_", "bernoulli", "bernoulli_", "rand", "rand_like",
    "randn", "randn_like", "randint", "randint_like", "randperm", "random", "random_",
    "multinomial", "exponential", "exponential_", "geometric", "geometric_", "cauchy", "cauchy_",
    "log_normal", "log_normal_", "native_dropout", "poisson", "rrelu_with_noise",
    "rrelu_with_noise_", "_standard_gamma", "_sample_dirichlet", "binomial",
})
MATMUL_OPS = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "addmv", "mv", "dot", "vdot", "addbmm",
    "_addmm_activation", "convolution", "_convolution", "conv1d", "conv2d", "conv3d",
    "mkldnn_convolution", "convolution_backward", "_convolution_double_backward",
    "mkldnn_linear", "_mkldnn_linear", "_scaled_mm", "_int_mm", "einsum", "tensordot",
    "cudnn_convolution", "cudnn_convolution_transpose", "slow_conv2d_forward",
    "slow_conv_transpose2d", "_slow_conv2d_forward", "_slow_conv2d_backward",
})
# scaled_dot_product_attention's kernels and their backward (aten._scaled_dot_product_flash_attention,
# _scaled_dot_product_efficient_attention_backward, _scaled_dot_product_flash_attention_for_cpu_backward,
# _scaled_dot_product_cudnn_attention, _flash_attention_forward, _efficient_attention_backward, ...): matmuls
# inside, under the same precision settings, plus the choice of kernel.
_ATTENTION_OP = re.compile(r"_?scaled_dot_product_\w*attention\w*|_(flash|efficient|cudnn)_attention_(forward|backward)")
# Meta keys (harness.optrace.environment.settings) that change a matmul's or convolution's arithmetic.
PRECISION_KEYS = (
    "float32_matmul_precision", "cuda_matmul_allow_tf32", "cudnn_allow_tf32",
    "cuda_matmul_allow_fp16_reduced_precision_reduction",
    "cuda_matmul_allow_bf16_reduced_precision_reduction", "mkldnn_enabled",
    "mkldnn_matmul_fp32_precision", "mkldnn_conv_fp32_precision",
    "fp32_precision", "cuda_matmul_fp32_precision", "cudnn_fp32_precision", "cudnn_conv_fp32_precision",
    "cudnn_rnn_fp32_precision", "mkldnn_fp32_precision", "flush_denormal",
)
# Meta keys that decide which attention kernel scaled_dot_product_attention runs.
ATTENTION_KEYS = ("flash_sdp_enabled", "mem_efficient_sdp_enabled", "math_sdp_enabled", "cudnn_sdp_enabled")
# Meta keys that decide whether kernels are deterministic or how CPU reductions are split.
DETERMINISM_KEYS = (
    "deterministic_algorithms", "deterministic_warn_only", "fill_uninitialized_memory", "cudnn_deterministic",
    "cudnn_benchmark", "num_threads",
)
# Meta keys (harness.optrace.environment.device_facts) naming the hardware: another GPU, or another generation of
# one, or a CPU whose vector units torch uses differently, runs other kernels on the same settings.
DEVICE_KEYS = ("device", "device_name", "compute_capability", "cpu_capability")
# Meta keys naming the numerical libraries, with the name a sentence gives them.
LIBRARY_KEYS = {"cuda_version": "CUDA", "cudnn_version": "cuDNN", "cublas_version": "cuBLAS", "nccl_version": "NCCL"}


def _base(op: str) -> str:
    parts = op.split(".")
    return parts[1] if len(parts) >= 2 else op


def is_attention(op: str) -> bool:
    return _ATTENTION_OP.fullmatch(_base(op)) is not None


def is_matmul(op: str) -> bool:
    """A matmul, convolution or attention kernel (forward or backward): precision settings change its bits."""
    return _base(op) in MATMUL_OPS or is_attention(op)


def _meta_delta(a: Trace, b: Trace, keys: tuple[str, ...]) -> list[str]:
    # A key one trace lacks was not recorded by the harness that made it (an older one): it says nothing.
    return [f"{k} {a.meta.get(k)!r} vs {b.meta.get(k)!r}" for k in keys
            if k in a.meta and k in b.meta and a.meta[k] != b.meta[k]]


_GENERATORS = {"rng_torch": "torch's default generator", "rng_cuda": "the CUDA generator",
               "rng_numpy": "numpy's global generator", "rng_python": "Python's random module"}


def generator_state(loc: Localization, a: Trace, b: Trace, hints: dict | None) -> str | None:
    """A global generator whose state differed before the traced step began: reseeded or drawn from otherwise."""
    if not _localized(loc):
        return None
    differ = [name for key, name in _GENERATORS.items()
              if key in a.meta and key in b.meta and a.meta[key] != b.meta[key]]
    if not differ:
        return None
    step = a.meta.get("step")
    when = f"the start of step {step}" if step is not None else "the start of the traced step"
    return (f"{', '.join(differ)} already differed at {when} (state digests): it was seeded differently, or drawn "
            "from a different number of times, before this step - the difference began earlier")


def random_generator(loc: Localization, a: Trace, b: Trace, hints: dict | None) -> str | None:
    if loc.status != "CULPRIT" or loc.a is None or _base(loc.a.op) not in RANDOM_OPS:
        return None
    return ("a random op drew different values from identical inputs: its generator was unseeded "
            "or seeded differently (seed the torch.Generator it uses, or use the run's seeded "
            "generator)")


def accumulation_order(loc: Localization, a: Trace, b: Trace, hints: dict | None) -> str | None:
    if loc.status != "CULPRIT" or loc.a is None or _base(loc.a.op) not in ACCUMULATION_OPS:
        return None
    if loc.order_only:
        return ("the same contributions were accumulated in a different order, and floating-point "
                "addition is not associative: an accumulation order that depends on how the data "
                "were split (e.g. on the world size)")
    return ("a nondeterministic accumulation: identical inputs, different sums, as from a kernel "
            "that adds with atomics in a varying order (torch.use_deterministic_algorithms(True) "
            "picks a deterministic kernel or says there is none)")


def _settings_differ(applies: bool, a: Trace, b: Trace, keys: tuple[str, ...], said: str) -> str | None:
    """`said` followed by the meta keys that differ between the traces, when the rule applies and any does."""
    delta = _meta_delta(a, b, keys) if applies else []
    return said + ", ".join(delta) if delta else None


def _culprit_is(loc: Localization, kind: Callable[[str], bool]) -> bool:
    return loc.status == "CULPRIT" and loc.a is not None and kind(loc.a.op)


def _localized(loc: Localization) -> bool:
    return loc.status in ("CULPRIT", "NOT_ALIGNED")


def precision_setting(loc: Localization, a: Trace, b: Trace, hints: dict | None) -> str | None:
    return _settings_differ(_culprit_is(loc, is_matmul), a, b, PRECISION_KEYS,
                            "a precision setting differs between the traces: ")


def attention_backend(loc: Localization, a: Trace, b: Trace, hints: dict | None) -> str | None:
    return _settings_differ(_culprit_is(loc, is_attention), a, b, ATTENTION_KEYS,
                            "the attention kernels allowed differ between the traces, so scaled_dot_product_attention "
                            "may have run another one: ")


def device_change(loc: Localization, a: Trace, b: Trace, hints: dict | None) -> str | None:
    return _settings_differ(_localized(loc), a, b, DEVICE_KEYS,
                            "the traces ran on different hardware, whose kernels need not give the same bits: ")


def determinism_setting(loc: Localization, a: Trace, b: Trace, hints: dict | None) -> str | None:
    return _settings_differ(_localized(loc), a, b, DETERMINISM_KEYS, "determinism settings differ between the traces: ")


def library_version(loc: Localization, a: Trace, b: Trace, hints: dict | None) -> str | None:
    if not _localized(loc):
        return None
    packages: dict[str, Any] = dict((hints or {}).get("packages") or {})
    if a.meta.get("torch") != b.meta.get("torch") and "torch" not in packages:
        packages["torch"] = (a.meta.get("torch"), b.meta.get("torch"))
    for key, name in LIBRARY_KEYS.items():
        if key in a.meta and key in b.meta and a.meta[key] != b.meta[key] and name not in packages:
            packages[name] = (a.meta[key], b.meta[key])
    if not packages:
        return None
    shown = ", ".join(f"{name} {pair[0]} vs {pair[1]}" for name, pair in sorted(packages.items()))
    return f"a different library version: {shown}"


def collective_peer(loc: Localization, a: Trace, b: Trace, hints: dict | None) -> str | None:
    if loc.status != "CULPRIT" or loc.a is None or not loc.a.op.startswith(("c10d.", "_c10d_functional.")):
        return None
    return ("a collective returned different values for identical local inputs: another rank "
            "sent different values (trace the other ranks) or the world size differs "
            f"({a.meta.get('world_size')!r} vs {b.meta.get('world_size')!r})")


def optimizer_arguments(loc: Localization, a: Trace, b: Trace, hints: dict | None) -> str | None:
    """An optimizer op whose tensors are equal and whose arguments are not: a hyper-parameter differs (an lr x2)."""
    if not (loc.status == "INPUTS_DIFFER_FROM_START" and loc.arguments_only and loc.a is not None and loc.b is not None
            and loc.a.phase == "optimizer"):
        return None
    said = (f"the optimizer step ran with other hyper-parameters ({loc.a.params} vs {loc.b.params}): a learning "
            "rate, momentum or weight decay differs")
    config = (hints or {}).get("config") or {}
    if config:
        said += "; the configs differ in " + ", ".join(f"{k} ({v[0]} vs {v[1]})" for k, v in sorted(config.items()))
    return said


# Most specific first; every rule that applies contributes its sentence.
RULES: tuple[Callable[[Localization, Trace, Trace, dict | None], str | None], ...] = (
    generator_state, random_generator, accumulation_order, collective_peer, optimizer_arguments, precision_setting,
    attention_backend, determinism_setting, device_change, library_version,
)


def likely_cause(loc: Localization, a: Trace, b: Trace, hints: dict | None) -> str | None:
    found = [s for rule in RULES if (s := rule(loc, a, b, hints)) is not None]
    return "; ".join(found) if found else None
