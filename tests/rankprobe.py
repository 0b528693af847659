"""A rank's view of its own process, for tests/test_startup.py: a module that imports nothing of harness (nor of the
test suite), so that what a rank has loaded when it runs is what its start gave it."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import sys
import tempfile
from pathlib import Path


def probe_rank(index: int, out_dir: str, marker_inode: int) -> None:
    """A rank's view of its own process, written as JSON (run by procs.start, forked or spawned)."""
    preloaded = {name: name in sys.modules for name in ("torch", "torch._dynamo", "harness.runtime.context",
                                                        "mlflow", "sqlalchemy")}
    import numpy as np
    import torch

    fds = {}
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            fds[fd] = os.readlink(f"/proc/self/fd/{fd}")
    report = {
        "preloaded": preloaded,
        "env": {k: os.environ.get(k) for k in ("HARNESS_PROBE_SET", "HARNESS_PROBE_GONE")},
        "cwd": os.getcwd(),
        "tmp": tempfile.gettempdir(),
        "sys_path": sys.path,
        "handlers": {s.name: str(signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD,
                                                                  signal.SIGUSR1, signal.SIGPIPE, signal.SIGHUP)},
        "threads": len(os.listdir("/proc/self/task")),
        "marker_held": any(str(marker_inode) in target for target in fds.values()),
        "numpy": float(np.random.random()),
        "random": random.random(),
        "torch_seed": torch.initial_seed(),
        "torch_draw": float(torch.rand(1)),
        "cuda_initialised": torch.cuda.is_initialized(),
        "ppid": os.getppid(),
    }
    Path(out_dir, f"{index}.json").write_text(json.dumps(report))
