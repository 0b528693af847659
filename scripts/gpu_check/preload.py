"""What the rank server's preload (harness/executors/warm.py) does to CUDA, imported step by step as the server does:
after which import the CUDA driver (libcuda) is mapped, whether the driver was initialised (cuInit: what a fork
cannot survive), and whether a fork of the result can then use the GPU, as a forked rank does.

usage: python scripts/gpu_check/preload.py
Prints one line; exit 0 when the driver was never initialised and the fork used the GPU, 1 otherwise.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# warm.py's imports, in its order (the last one is the module itself, in case it gains one).
STEPS = ("torch", "torch._dynamo.utils", "torch.distributed", "torch.nn.parallel", "torch.utils.data", "omegaconf",
         "harness.executors.procs", "harness.runtime.checkpoint", "harness.runtime.context",
         "harness.runtime.determinism", "harness.runtime.groupkeep", "harness.runtime.rank.process",
         "harness.executors.warm")
CUDA_ERROR_NOT_INITIALIZED = 3


def mapped() -> bool:
    return "libcuda.so" in Path("/proc/self/maps").read_text()


def driver_initialised() -> bool | None:
    """cuDeviceGetCount answers NOT_INITIALIZED until someone in this process called cuInit (None: no driver)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL)  # only if already loaded
    except OSError:
        return False if not mapped() else None
    count = ctypes.c_int()
    return lib.cuDeviceGetCount(ctypes.byref(count)) != CUDA_ERROR_NOT_INITIALIZED


def main() -> int:
    loaded_by = None
    for name in STEPS:
        importlib.import_module(name)
        if loaded_by is None and mapped():
            loaded_by = name
    initialised = driver_initialised()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # a forked rank: the first CUDA call must work
        os.close(r)
        try:
            import torch

            bad = torch.cuda._is_in_bad_fork()
            value = float(torch.ones(8, device="cuda").sum()) if torch.cuda.is_available() else None
            os.write(w, f"bad_fork={bad} cuda_sum={value}".encode())
        except Exception as err:  # noqa: BLE001 - reported, whatever it is
            os.write(w, f"error: {type(err).__name__}: {err}".encode()[:300])
        os._exit(0)
    os.close(w)
    child = os.read(r, 400).decode()
    os.waitpid(pid, 0)
    ok = not initialised and "bad_fork=False" in child and "cuda_sum=8.0" in child
    print(f"libcuda mapped after: {loaded_by or 'none of the imports'}; driver initialised (cuInit): {initialised}; "
          f"forked child: {child}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
