"""What a rank is told: its LaunchSpec (plain values, pickled into each rank's process) and its rendezvous variables."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from harness.errors import HarnessError

if TYPE_CHECKING:
    from harness.runtime.plan import CheckpointPlan, ProfilePlan

MASTER_ADDR = "127.0.0.1"
RANKS_PREFIX = "ranks/"  # the ranks' keys in the job's store; the launchers' own keys live beside them
# The process group's own timeout is timeout_s plus this margin, so that the launcher's progress check,
# which can name the silent rank, fires before a waiting rank's collective gives up with a peer error.
PG_MARGIN_S = 30.0


@dataclass
class LaunchSpec:
    """Everything a rank needs, as plain values (it is pickled into each spawned process)."""

    code_dir: str  # the experiment folder: entry file lives here, ranks run with it as cwd
    entry_file: str
    entry_func: str
    world_size: int
    device: str  # effective: cpu | cuda
    backend: str  # effective: gloo | nccl
    seed: int
    rank_seeds: list[int]
    threads_per_rank: int
    determinism: str
    fingerprint_every: int
    train_cfg: dict[str, Any]
    log_dir: str
    port: int = 0
    env: dict[str, str] = field(default_factory=dict)
    checkpoints: CheckpointPlan | None = None
    invariant_shards: int = 0  # > 0: world-size-invariant mode with this many shards
    timeout_s: float = 1800.0  # no progress from a rank for this long ends the job (its teardown included)
    stall_s: float = 60.0  # no progress and no work by any process of the job for this long (at least) ends it
    launcher: str = "forkserver"  # how this node's ranks start: procs.Method
    output_dir: str = ""  # ctx.output_dir: files there become the run's artifacts
    data: dict[str, str] = field(default_factory=dict)  # ctx.data: declared name -> absolute path
    profile: ProfilePlan | None = None  # step times and torch.profiler (experiment.yaml's profile:)
    run_id: str = ""  # ctx.run_id: the MLflow run this job records ("" for a re-execution: audit, trace)
    # Audit: run the entry once per plan in the same ranks (start-up is paid once, not per segment).
    segments: list[Any] = field(default_factory=list)
    # harness calibrate: the segments are its members (each plan's perturb_seed), each recorded as a run of its own:
    # each starts on its own kernels, says its determinism settings again and ends as a replay --steps M ends.
    members: bool = False
    # Topology: this launcher spawns `nproc` ranks (0: all of world_size), global ranks from
    # node_rank * nproc. Every rank meets the others through the TCPStore at master_addr:port, which
    # this launcher hosts on a single node, and node 0's launcher hosts across nodes.
    node_rank: int = 0
    nproc: int = 0
    master_addr: str = MASTER_ADDR

    @property
    def local_ranks(self) -> int:
        return self.nproc or self.world_size

    def global_rank(self, local_rank: int) -> int:
        return self.node_rank * self.local_ranks + local_rank


def rank_env(spec: LaunchSpec, local_rank: int) -> dict[str, str]:
    """The standard rendezvous variables (user code may read them) and the per-rank thread settings."""
    env = {
        "MASTER_ADDR": spec.master_addr,
        "MASTER_PORT": str(spec.port),
        "RANK": str(spec.global_rank(local_rank)),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(spec.world_size),
        "LOCAL_WORLD_SIZE": str(spec.local_ranks),
        "OMP_NUM_THREADS": str(spec.threads_per_rank),
    }
    if spec.backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ:
        # gloo binds to the address the hostname resolves to unless told: on one node the loopback,
        # across nodes the interface that reaches the master.
        env["GLOO_SOCKET_IFNAME"] = "lo" if spec.master_addr == MASTER_ADDR else interface_to(spec.master_addr)
    env.update(spec.env)
    return env


def interface_to(host: str) -> str:
    """The name of this host's network interface that routes to `host` (no packet is sent)."""
    import psutil

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((host, 9))
            address = sock.getsockname()[0]
        except OSError as err:
            raise HarnessError(f"no route from this host to the master {host}: {err}. Check --master-addr.") from err
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == address for a in addrs):
            return name
    raise HarnessError(
        f"no interface of this host holds {address}, the address that reaches {host}. "
        "Set GLOO_SOCKET_IFNAME to the interface the nodes talk over."
    )

