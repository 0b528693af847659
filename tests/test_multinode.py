"""Multi-node jobs for real: two hosts as network namespaces (198.51.100.1 and .2, tests/infra.py),
one `harness run --nnodes 2` launcher in each, gloo between them over the bridge. The SQLite store
and the repository are on the filesystem both hosts share, as a cluster's shared home would be."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import Project, on_cpu, pid_alive
from snippets import CRASHING

MASTER = "198.51.100.1"


def _node(two_hosts, project: Project, ns: str, rank: int, port: int, *args: str, env: dict | None = None,
          command: str = "run"):
    argv = [sys.executable, "-m", "harness", *on_cpu([command, *args]), "--nnodes", "2", "--node-rank", str(rank),
            "--master-addr", MASTER, "--master-port", str(port)]
    environ = {**os.environ, "MLFLOW_TRACKING_URI": project.uri, "PYTHONUNBUFFERED": "1", **(env or {})}
    return two_hosts.ns_popen(ns, argv, environ, cwd=project.root, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True)


def _session_gone(pgid: int, within_s: float = 10.0) -> bool:
    """No process of the launcher's session is left (multiprocessing's helpers exit just after it)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def test_two_nodes_are_one_run_bit_identical_to_one_node(project: Project, two_hosts, reference_run: str) -> None:
    client = project.client()
    before = {r.info.run_id for r in project.all_runs()}

    nodes = [_node(two_hosts, project, ns, rank, 29611, "experiments/linear_ddp", "train.epochs=1")
             for rank, ns in enumerate(two_hosts.namespaces)]
    outs = [p.communicate(timeout=300) for p in nodes]
    for p, (out, err) in zip(nodes, outs):
        assert p.returncode == 0, err
    run_id = outs[0][0].strip().splitlines()[-1]
    assert outs[1][0].strip().splitlines()[-1] == run_id  # node 1 attached to node 0's run
    new = {r.info.run_id for r in project.all_runs()} - before
    assert new == {run_id}, "exactly one MLflow run for the two-node job"

    run = client.get_run(run_id)
    tags = run.data.tags
    assert run.info.status == "FINISHED"
    assert tags["harness.world_size"] == "2" and tags["harness.nnodes"] == "2"
    assert tags["harness.nproc_per_node"] == "1" and tags["harness.master"] == f"{MASTER}:29611"
    assert "harness.node.1.hostname" in tags and "harness.nodes.differ" not in tags
    nodes_json = Path(client.download_artifacts(run_id, "environment/nodes.json"))
    assert sorted(__import__("json").loads(nodes_json.read_text())) == ["0", "1"]
    logs = {a.path for a in client.list_artifacts(run_id, "logs")}
    assert {"logs/rank0.log", "logs/rank1.log"} <= logs  # node 1 sent its rank's log to node 0, in the seal

    cmp = project.harness("compare", reference_run, run_id)
    assert cmp.returncode == 0, cmp.stdout + cmp.stderr
    assert "verdict: BITWISE" in cmp.stdout
    assert "harness.nnodes: 1 -> 2" in cmp.stdout  # the topology is in the delta, and does not break bitwise

    # Replayed as a two-node job too: one replay run, judged once, by node 0.
    before = {r.info.run_id for r in project.all_runs()}
    nodes = [_node(two_hosts, project, ns, rank, 29615, run_id, command="replay")
             for rank, ns in enumerate(two_hosts.namespaces)]
    outs = [p.communicate(timeout=300) for p in nodes]
    for p, (out, err) in zip(nodes, outs):
        assert p.returncode == 0, err
    replay_id = outs[0][0].strip().splitlines()[-1]
    assert "verdict: BITWISE" in outs[0][0] and "node 0 judges it" in outs[1][1]
    assert {r.info.run_id for r in project.all_runs()} - before == {replay_id}
    replay_tags = client.get_run(replay_id).data.tags
    assert replay_tags["harness.replay_of"] == run_id and replay_tags["harness.nnodes"] == "2"


def test_a_node_killed_mid_run_fails_the_job_within_seconds(project: Project, two_hosts, tmp_path: Path) -> None:
    project.add_experiment("crashing", train_py=CRASHING)
    train = "train={steps: 100000, fail_rank: -1, fail_step: -1, sleep: 0.05}"
    env = {"PID_DIR": str(tmp_path)}
    nodes = [_node(two_hosts, project, ns, rank, 29612, "experiments/crashing", train, env=env)
             for rank, ns in enumerate(two_hosts.namespaces)]
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"rank{r}").exists() for r in (0, 1)):
        assert time.monotonic() < deadline, "ranks never started: " + nodes[0].stderr.read() if nodes[0].poll() else ""
        time.sleep(0.2)
    time.sleep(2)  # a few steps on both nodes
    os.killpg(nodes[1].pid, signal.SIGKILL)  # the whole node 1: its launcher and its rank
    killed = time.monotonic()
    out, err = nodes[0].communicate(timeout=120)
    elapsed = time.monotonic() - killed
    nodes[1].communicate(timeout=30)
    assert nodes[0].returncode == 1, err
    assert elapsed < 20, f"node 0 took {elapsed:.1f} s to notice"
    run_id = out.strip().splitlines()[-1]
    run = project.client().get_run(run_id)
    assert run.info.status == "FAILED"
    assert "node 1" in run.data.tags["harness.status_reason"], run.data.tags["harness.status_reason"]
    for rank in (0, 1):
        assert not pid_alive(int((tmp_path / f"rank{rank}").read_text())), f"rank {rank} left behind"
    assert _session_gone(nodes[0].pid) and _session_gone(nodes[1].pid)


def test_a_node_that_never_joins_is_named(project: Project, two_hosts) -> None:
    before = {r.info.run_id for r in project.all_runs()}
    node0 = _node(two_hosts, project, "hn1", 0, 29613, "experiments/linear_ddp", "train.epochs=1",
                  "rendezvous_timeout_s=3")
    out, err = node0.communicate(timeout=120)
    assert node0.returncode == 2, err
    assert "node 1 of 2 never joined within 3 s" in err
    assert {r.info.run_id for r in project.all_runs()} == before  # nothing recorded


def test_nodes_with_different_code_are_refused(project: Project, two_hosts) -> None:
    node0 = _node(two_hosts, project, "hn1", 0, 29614, "experiments/linear_ddp", "train.epochs=1")
    node1 = _node(two_hosts, project, "hn2", 1, 29614, "experiments/linear_ddp", "train.epochs=1", "seed=7")
    (_, err0), (_, err1) = node0.communicate(timeout=120), node1.communicate(timeout=120)
    assert node0.returncode == 2 and node1.returncode == 2, err0 + err1
    assert "node 1" in err0 and "another resolved config" in err0
    assert "another resolved config" in err1  # node 1 is told why, in one line
    assert "Traceback" not in err0 + err1


def test_other_nodes_logs_reach_node_0_before_it_seals_and_stay_in_their_folder(tmp_path: Path) -> None:
    """Node 1 sends its rank logs through the job's store (a real TCPStore here); node 0 waits for them, so
    nothing writes to the run after node 0 has closed and sealed it. Names that would land outside the log
    folder are dropped; a node that never sends is named, after the wait."""
    import io
    import tarfile
    import threading

    from harness.executors.base import Topology
    from harness.executors.multinode import Node

    def node(rank: int, port: int, nnodes: int = 2) -> Node:
        return Node(Topology(nnodes=nnodes, node_rank=rank, master_addr="127.0.0.1", master_port=port,
                             launcher="spawn"), 10.0)

    master = node(0, 0)
    port = master.raw.port
    follower = node(1, port)
    sent = tmp_path / "node1"
    sent.mkdir()
    (sent / "rank1.log").write_text("step 1\nstep 2\n")
    got = tmp_path / "node0"
    got.mkdir()
    (got / "rank0.log").write_text("node 0's own\n")
    late = threading.Timer(1.0, follower.send_logs, args=(sent,))  # sent after node 0 began to wait
    late.start()
    assert master.collect_logs(got, timeout_s=20) == []
    late.join()
    assert (got / "rank1.log").read_text() == "step 1\nstep 2\n"
    assert (got / "rank0.log").read_text() == "node 0's own\n"

    hostile = io.BytesIO()
    with tarfile.open(fileobj=hostile, mode="w") as tar:
        for name in ("../escaped.log", "rank0.log", "sub/rank3.log"):
            info = tarfile.TarInfo(name)
            info.size = 4
            tar.addfile(info, io.BytesIO(b"evil"))
    follower.store.set("logs/1", hostile.getvalue())
    again = tmp_path / "again"
    again.mkdir()
    (again / "rank0.log").write_text("kept\n")
    assert master.collect_logs(again, timeout_s=5) == []
    assert sorted(p.name for p in again.iterdir()) == ["rank0.log"] and (again / "rank0.log").read_text() == "kept\n"
    assert not (tmp_path / "escaped.log").exists()

    lonely = node(0, 0, nnodes=3)
    start = time.monotonic()
    assert lonely.collect_logs(tmp_path, timeout_s=2) == [1, 2]
    assert time.monotonic() - start < 10
