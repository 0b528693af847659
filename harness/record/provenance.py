"""What decides a result besides code and config: versions, hardware, variables, packages.

What a rank measures (torch, its device, the variables, NCCL's files) lives with the rank, under its contract
(harness/runtime/rank/facts.py); it is named here too, where the record's callers look for it.
"""

from __future__ import annotations

import os
import platform
import socket
import subprocess
from collections.abc import Mapping
from importlib import metadata

from harness.runtime.rank.facts import (
    REDACTED as REDACTED,
    env_vars as env_vars,
    nccl_conf as nccl_conf,
    torch_facts,
)
from harness.version import __version__


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpu_driver() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.split()
        return out[0] if out else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "none"


def runtime_facts(measured: Mapping[str, str] | None = None) -> dict[str, str]:
    """Measured on the machine that runs the ranks (inside the container when there is one). `measured`: the
    torch_facts() one of its ranks took; without them they are measured here (importing torch)."""
    facts = dict(measured) if measured is not None else torch_facts()
    cpus = os.cpu_count() or 0
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        pass
    return {
        "harness": __version__,
        "python": platform.python_version(),
        "torch": facts["torch"],
        "cuda": facts["cuda"],
        "cudnn": facts["cudnn"],
        "nccl": facts["nccl"],
        "gpu": facts["gpu"],
        "gpu_count": facts["gpu_count"],
        "cpu_capability": facts.get("cpu_capability", "unknown"),
        "gpu_driver": _gpu_driver() if facts["gpu_count"] != "0" else "none",
        "cpu": _cpu_model(),
        "cpu_count": str(cpus),
        "hostname": socket.gethostname(),
        "os": platform.platform(),
        "numpy": metadata.version("numpy"),
    }


def package_lock() -> list[str]:
    """Every installed distribution as name==version, sorted: the environment's pip-freeze."""
    seen: dict[str, str] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            seen.setdefault(name.lower(), f"{name}=={dist.version}")
    return [seen[k] for k in sorted(seen)]
