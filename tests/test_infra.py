"""The multi-host fixtures work for real: a Slurm job spans both namespace nodes, and two ranks in
different namespaces form a gloo group over the bridge."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from infra import Slurm, TwoHosts

ALL_REDUCE = """\
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")  # MASTER_ADDR/PORT, RANK, WORLD_SIZE from the environment
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(f"rank {dist.get_rank()} sum {t.item()}", flush=True)
dist.destroy_process_group()
"""


def test_sbatch_runs_one_task_on_each_node(slurm: Slurm, tmp_path: Path) -> None:
    out = tmp_path / "job.out"
    job = slurm.sbatch("--nodes=2", "--ntasks-per-node=1", f"--output={out}",
                       "--wrap", "srun sh -c 'echo $(hostname) $SLURM_PROCID'", cwd=tmp_path)
    assert slurm.wait(job, timeout=30) == "COMPLETED", out.read_text() if out.exists() else ""
    assert sorted(out.read_text().split("\n")[:-1]) == ["node1 0", "node2 1"]


def test_gloo_all_reduce_between_the_two_hosts(two_hosts: TwoHosts, tmp_path: Path) -> None:
    script = tmp_path / "all_reduce.py"
    script.write_text(ALL_REDUCE)
    master = two_hosts.addresses[two_hosts.namespaces[0]]
    procs = []
    for rank, ns in enumerate(two_hosts.namespaces):
        # Without GLOO_SOCKET_IFNAME gloo resolves the hostname and binds 127.0.0.1.
        env = {**os.environ, "MASTER_ADDR": master, "MASTER_PORT": "29500", "RANK": str(rank),
               "WORLD_SIZE": "2", "GLOO_SOCKET_IFNAME": two_hosts.ifname}
        procs.append(two_hosts.ns_popen(ns, [sys.executable, str(script)], env,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=60)
            assert proc.returncode == 0, stderr
            outputs.append(stdout.strip())
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert outputs == ["rank 0 sum 3.0", "rank 1 sum 3.0"]
