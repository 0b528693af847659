"""What a rank measures of its machine for the record, where torch is imported anyway (the launcher never imports
it): torch and the GPUs, the device it trains on, the variables that change numerics or communication, NCCL's
configuration files. harness/record/provenance.py records them with what the launcher measures itself."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from harness.secrets import env_name_is_secret, scrub

# Variables that change numerics or communication; recorded when set.
# ATEN_CPU_CAPABILITY and oneDNN's DNNL_/ONEDNN_MAX_CPU_ISA choose the CPU's vector kernels.
_VAR_PREFIXES = ("NCCL_", "OMP_", "MKL_", "CUBLAS_", "CUBLASLT_", "CUDA_", "GLOO_", "TORCH_", "KMP_", "OPENBLAS_",
                 "ATEN_", "DNNL_", "ONEDNN_")
# NVIDIA_TF32_OVERRIDE=0 turns TF32 off under every library; DISABLE_ADDMM_CUDA_LT=1 keeps addmm off cuBLASLt.
_VAR_NAMES = ("PYTHONHASHSEED", "CUDA_VISIBLE_DEVICES", "NVIDIA_TF32_OVERRIDE", "DISABLE_ADDMM_CUDA_LT")
# NCCL also reads KEY=VALUE lines from these files (a variable already set wins): $NCCL_CONF_FILE, else
# ~/.nccl.conf, then /etc/nccl.conf (NCCL's src/misc/param.cc, initEnvFunc).
NCCL_SYSTEM_CONF = "/etc/nccl.conf"
ABSENT = "absent"
# A captured variable whose name says it holds a credential (TORCH_TOKEN, NCCL_AUTH_KEY, TORCH_HUB_PAT...)
# is recorded by name only: its presence can matter to a delta, its value must never reach the store.
REDACTED = "<redacted>"


def torch_facts() -> dict[str, str]:
    """What torch says about itself and the GPUs: measured where torch is imported anyway (a rank, see
    harness/runtime/rank/process.py), since the launcher does not import it."""
    import torch

    cuda = torch.cuda.is_available()
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else []
    nccl = "none"
    if cuda and hasattr(torch.cuda, "nccl"):
        try:
            v = torch.cuda.nccl.version()
            nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception:  # nccl not built in
            nccl = "none"
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "cudnn": str(torch.backends.cudnn.version()) if torch.backends.cudnn.is_available() else "none",
        "nccl": nccl,
        "gpu": ", ".join(gpus) if gpus else "none",
        "gpu_count": str(len(gpus)),
        # Which vector kernels ATen dispatches to on this CPU (DEFAULT, AVX2, AVX512, ...): ATEN_CPU_CAPABILITY or an
        # older CPU lowers it, and the lower level's kernels round differently.
        "cpu_capability": _cpu_capability(torch),
    }


def _cpu_capability(torch: Any) -> str:
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # a torch without the call
        return "unknown"


def env_vars(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables that change numerics or communication, secrets' values replaced by REDACTED."""
    env = os.environ if environ is None else environ
    return {
        k: REDACTED if env_name_is_secret(k) else scrub(v)  # OMP_PROXY=http://u:pw@proxy: the password goes
        for k, v in sorted(env.items())
        if k.startswith(_VAR_PREFIXES) or k in _VAR_NAMES
    }


def device_facts(device: Any) -> dict[str, str]:
    """The device this process trains on (`device`: a torch.device or its name), measured here: what decides the
    kernels, where the host's GPU list (runtime_facts' gpu) only says what else was there."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return {"name": device.type, "capability": "none", "sm_count": "none", "memory": "none"}
    props = torch.cuda.get_device_properties(device)
    return {"name": props.name, "capability": f"{props.major}.{props.minor}",
            "sm_count": str(props.multi_processor_count), "memory": str(props.total_memory)}


def _conf_file(path: Path) -> dict[str, str]:
    """One NCCL configuration file: "" -> "absent" or "<path> sha256:<hex>", and KEY -> VALUE as NCCL parses
    it (lines starting with # skipped, split at the first =, the value verbatim); secrets' values redacted."""
    try:
        raw = path.read_bytes()
    except OSError:  # missing or unreadable: NCCL skips it too
        return {"": ABSENT}
    out = {"": f"{path} sha256:{hashlib.sha256(raw).hexdigest()}"}
    for line in raw.decode(errors="replace").splitlines():
        key, eq, value = line.partition("=")
        if line.startswith("#") or not eq or not key:
            continue
        out[key] = REDACTED if env_name_is_secret(key) else scrub(value)
    return out


def nccl_conf(environ: Mapping[str, str] | None = None, system: str = NCCL_SYSTEM_CONF,
              home: str | None = None) -> dict[str, str]:
    """The NCCL configuration files this process's NCCL reads, as flat facts: "system" and "user" ("absent" or
    path and digest), "system.KEY" and "user.KEY" for their settings. `system` and `home` (default: the user's
    home) are parameters so that tests need not write /etc."""
    env = os.environ if environ is None else environ
    user_file = env.get("NCCL_CONF_FILE") or str(Path(home or os.path.expanduser("~")) / ".nccl.conf")
    out: dict[str, str] = {}
    for which, path in (("system", system), ("user", user_file)):
        for key, value in _conf_file(Path(path)).items():
            out[f"{which}.{key}" if key else which] = value
    return out

