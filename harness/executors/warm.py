"""The rank server's preload: importing this module is what the warm rank server (executors/procs.py) does once,
for every rank it forks.

Only what every rank imports anyway, and nothing that starts a thread, opens a store or a connection, or touches
CUDA: a forked process keeps its parent's memory but none of its threads, and CUDA initialised before a fork cannot
be used after it. torch's import leaves CUDA alone (it initialises lazily, at the first CUDA call); numpy's OpenBLAS
pool, the one thread the import starts, is stopped and restarted around a fork by OpenBLAS itself (pthread_atfork).
The standard library's server ignores an ImportError here and dies of anything else, so nothing may raise: a rank
then imports what is missing itself, as a spawned one does.
"""

from __future__ import annotations

import contextlib

with contextlib.suppress(Exception):
    # Imported for their side effect (the modules load now, in the server), never used by name. DDP's constructor
    # imports torch._dynamo (with inductor: 2-3 s of a core), the ranks' body the rest.
    import torch
    import torch._dynamo.utils
    import torch.distributed
    import torch.nn.parallel
    import torch.utils.data  # noqa: F401
    from omegaconf import OmegaConf  # noqa: F401

    from harness.runtime import checkpoint, context, determinism, groupkeep  # noqa: F401
    from harness.runtime.rank import child, process  # noqa: F401  (each rank's process entry; its body)
