"""The executor seam and the multi-node bookkeeping that needs no second host: registry, topology
from a scheduler's variables, per-node differences. The backends themselves run for real in
test_run.py (local), test_docker_executor.py, test_multinode.py, test_slurm.py and test_torchrun.py."""

from __future__ import annotations

import importlib

import pytest

from harness import executors
from harness.config import Executor as Backend
from harness.errors import HarnessError
from harness.executors import Topology
from harness.executors.base import Executor
from harness.executors.multinode import check_topology, differing, topology_from_env

# harness.cli exposes the function `main`, which shadows the module of that name.
cli = importlib.import_module("harness.cli.main")


def test_every_backend_is_one_module_with_an_executor_and_the_cli_offers_them_all() -> None:
    assert list(executors.BACKENDS) == [b.value for b in Backend] == cli._EXECUTORS
    for name in executors.BACKENDS:
        backend = executors.get(name)
        assert isinstance(backend, Executor) and backend.name == name
    assert executors.get("local") is not executors.get("local")  # per-job state never leaks between jobs
    with pytest.raises(ValueError, match="unknown executor 'k8s'"):
        executors.get("k8s")


def test_topology_from_slurm_variables() -> None:
    env = {"SLURM_JOB_ID": "42", "SLURM_NODEID": "1", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "node[1-2]",
           "MASTER_ADDR": "198.51.100.1", "MASTER_PORT": "20042"}
    topo = topology_from_env(env)
    assert topo == Topology(nnodes=2, node_rank=1, master_addr="198.51.100.1", master_port=20042, launcher="slurm",
                            scheduler={"job_id": "42", "nodelist": "node[1-2]"})


def test_topology_from_plain_variables_and_none_without_them() -> None:
    topo = topology_from_env({"NODE_RANK": "0", "NNODES": "3", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    assert (topo.nnodes, topo.node_rank, topo.launcher) == (3, 0, "spawn")
    assert topology_from_env({"MASTER_ADDR": "h", "RANK": "0"}) is None  # a torchrun-style rank, not a node


@pytest.mark.parametrize("env, message", [
    ({"NODE_RANK": "0", "NNODES": "2"}, "MASTER_ADDR/MASTER_PORT are not set"),
    ({"NODE_RANK": "x", "NNODES": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "not numbers"),
])
def test_bad_scheduler_variables_are_one_line(env: dict[str, str], message: str) -> None:
    with pytest.raises(HarnessError, match=message):
        topology_from_env(env)


@pytest.mark.parametrize("topo, message", [
    (Topology(nnodes=2, node_rank=2, master_addr="h", master_port=1), "--node-rank must be within 0..1"),
    (Topology(nnodes=2, node_rank=0), "needs --master-addr"),
    (Topology(nnodes=2, node_rank=0, master_addr="h", master_port=70000), "needs --master-addr"),
])
def test_impossible_topologies_are_refused(topo: Topology, message: str) -> None:
    with pytest.raises(HarnessError, match=message):
        check_topology(topo)


def test_nodes_that_differ_are_named_and_per_node_facts_are_not() -> None:
    base = {"facts": {"hostname": "a", "torch": "2.13", "cpu": "EPYC"}, "vars": {"GLOO_SOCKET_IFNAME": "eth0"}}
    same = {"facts": {"hostname": "b", "torch": "2.13", "cpu": "EPYC"}, "vars": {"GLOO_SOCKET_IFNAME": "ens5"}}
    other = {"facts": {"hostname": "c", "torch": "2.12", "cpu": "EPYC"}, "vars": {"NCCL_ALGO": "Ring"}}
    assert differing({0: base, 1: same, 2: other}) == {2: ["torch", "NCCL_ALGO"]}
