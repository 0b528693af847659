"""Multi-node jobs on top of the local executor: one launcher per node, met through node 0's TCPStore.

Node 0's launcher hosts the job's store at --master-addr:--master-port. Every launcher writes its
node's provenance there; node 0 waits for all of them (up to rendezvous_timeout_s, then names the
nodes that never came), refuses nodes whose code or config differ, records the one MLflow run and
publishes its id. Then each node spawns its own ranks, which meet in the same store. While they run,
every launcher beats a counter in the store and watches for a failure posted by another node: any
node failing ends the whole job, and node 0 records which node and rank it was.
"""

from __future__ import annotations

import datetime
import io
import json
import os
import tarfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.errors import BackendError, HarnessError, Interrupted, RunFailed, UsageError
from harness.executors.base import Topology
from harness.executors.failures import failed
from harness.executors.launch import host_store
from harness.record.provenance import env_vars, runtime_facts

_KEYS = "launchers/"  # beside the ranks' own prefix in the same store
POLL_S = 0.2
_LOST_AFTER_S = 10.0  # a node whose beat counter stood still this long is gone
LAST_WORD_S = 5.0  # after a peer error, how long node 0 waits for the node at fault to say what happened
_LOGS_WAIT_S = 30.0  # how long node 0 waits for another node's rank logs before it closes the run without them
_LOG_TAIL = 4 << 20  # bytes of each rank log a node sends (its end, where a failure is)


class NodeFailed(RunFailed):
    """Another node of the job failed, or stopped answering."""


def _last_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[-1] if text else type(err).__name__


def topology_from_env(environ: Mapping[str, str] | None = None) -> Topology | None:
    """The job's layout from the plain variables any scheduler can set (NODE_RANK, NNODES, MASTER_ADDR,
    MASTER_PORT), else None. A backend whose scheduler has variables of its own reads them itself (its
    `Backend.place`; harness.executors.topology_from_env asks those first)."""
    env = os.environ if environ is None else environ
    if "NODE_RANK" not in env or "NNODES" not in env:
        return None
    return node_topology(env, env["NODE_RANK"], env["NNODES"])


def node_topology(
    env: Mapping[str, str], node_rank: str, nnodes: str, launcher: str = "spawn", scheduler: dict[str, str] | None = None,
) -> Topology:
    """This node's Topology from a scheduler's node variables and the MASTER_ADDR/MASTER_PORT the job script set."""
    try:
        topo = Topology(
            nnodes=int(nnodes), node_rank=int(node_rank), master_addr=env.get("MASTER_ADDR") or None,
            master_port=int(env.get("MASTER_PORT") or 0), launcher=launcher, scheduler=scheduler or {},
        )
    except ValueError as err:
        raise BackendError(f"the scheduler's node variables are not numbers ({err}).") from err
    if topo.nnodes > 1 and (topo.master_addr is None or not topo.master_port):
        raise BackendError(
            f"this is node {topo.node_rank} of {topo.nnodes} but MASTER_ADDR/MASTER_PORT are not set: export the "
            "first node's address and a free port in the job script."
        )
    return topo


def check_topology(topo: Topology) -> None:
    if topo.nnodes < 1 or not 0 <= topo.node_rank < topo.nnodes:
        raise UsageError(f"--node-rank must be within 0..{topo.nnodes - 1} for --nnodes {topo.nnodes}, got {topo.node_rank}.")
    if topo.multi_node and (not topo.master_addr or not 0 < topo.master_port < 65536):
        raise UsageError(
            "a multi-node job needs --master-addr (node 0's address, reachable from every node) and "
            "--master-port (a free TCP port there)."
        )


@dataclass
class Joined:
    """What node 0 learned at the rendezvous: every node's facts, by node rank."""

    nodes: dict[int, dict[str, Any]]


class Node:
    """This launcher's end of the job's rendezvous store."""

    def __init__(self, topo: Topology, timeout_s: float, store: Any = None) -> None:
        """`store`: the job's store when this process already holds it (torchrun's agent hosts one);
        otherwise node 0 hosts it at the topology's master address and the others connect."""
        import torch.distributed as dist

        self.topo = topo
        self.timeout_s = timeout_s
        addr, port = str(topo.master_addr), int(topo.master_port)
        if store is not None:
            self.raw = store
        elif topo.node_rank == 0:
            self.raw = host_store(addr, port, timeout_s)
        else:
            try:  # the client retries until node 0 listens, up to the deadline
                self.raw = dist.TCPStore(addr, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
            except Exception as err:
                raise BackendError(
                    f"node {topo.node_rank}: node 0 did not answer at {addr}:{port} within {timeout_s:g} s "
                    "(rendezvous_timeout_s). Start node 0 with the same --master-addr/--master-port, and check "
                    "that this host can reach it."
                ) from err
        self.store = dist.PrefixStore(_KEYS, self.raw)
        self.store.set_timeout(datetime.timedelta(seconds=30))
        self._seen: dict[int, tuple[int, float]] = {}  # node -> (last beat count, when it last changed)

    @property
    def is_master(self) -> bool:
        return self.topo.node_rank == 0

    # -- rendezvous --------------------------------------------------------------------------------
    def join(self, facts: dict[str, Any]) -> Joined | None:
        """Announce this node; node 0 waits for all and returns their facts (others return None)."""
        try:
            self.store.set(f"node/{self.topo.node_rank}", json.dumps(facts))
            self.beat()
        except Exception as err:
            raise BackendError(f"node {self.topo.node_rank}: the rendezvous at {self.topo.master_addr}:"
                               f"{self.topo.master_port} failed ({_last_line(err)}).") from None
        if not self.is_master:
            return None
        deadline = time.monotonic() + self.timeout_s
        missing = list(range(1, self.topo.nnodes))
        while missing and time.monotonic() < deadline:
            missing = [n for n in missing if not self.store.check([f"node/{n}"])]
            if missing:
                time.sleep(POLL_S)
        if missing:
            line = (
                f"node{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} of {self.topo.nnodes} never "
                f"joined within {self.timeout_s:g} s (rendezvous_timeout_s). Start `harness run ... --node-rank N` "
                f"on every node with --master-addr {self.topo.master_addr} --master-port {self.topo.master_port}."
            )
            self.fail(line)
            self._linger(missing)
            raise BackendError(line)
        nodes = {n: json.loads(self.store.get(f"node/{n}")) for n in range(self.topo.nnodes)}
        for n in range(1, self.topo.nnodes):
            for key, what in (("code", "code"), ("config", "resolved config")):
                if nodes[n].get(key) != nodes[0].get(key):
                    line = (
                        f"node {n} ({nodes[n]['facts'].get('hostname', '?')}) runs another {what} than node 0 "
                        f"({nodes[n].get(key)} vs {nodes[0].get(key)}). Check out the same commit and pass the same "
                        "overrides on every node."
                    )
                    self.fail(line)
                    self._linger()
                    raise BackendError(line)
        return Joined(nodes)

    def _linger(self, absent: Sequence[int] = ()) -> None:
        """Node 0 keeps the store up until the other nodes have read its refusal (a few seconds at most)."""
        deadline = time.monotonic() + LAST_WORD_S
        waiting = [n for n in range(1, self.topo.nnodes) if n not in absent]
        while waiting and time.monotonic() < deadline:
            waiting = [n for n in waiting if not self.store.check([f"ack/{n}"])]
            time.sleep(POLL_S)

    def publish(self, run_id: str) -> None:
        self.store.set("run", run_id)

    def attach(self) -> str:
        """The run id node 0 recorded (or its refusal, raised here too)."""
        deadline = time.monotonic() + self.timeout_s
        try:
            while time.monotonic() < deadline:
                if self.store.check(["failed"]):
                    line = self._failure()["line"]
                    self.store.set(f"ack/{self.topo.node_rank}", "1")
                    raise BackendError(line)
                if self.store.check(["run"]):
                    return self.store.get("run").decode()
                time.sleep(POLL_S)
        except HarnessError:
            raise
        except Exception as err:  # node 0's launcher went away before it recorded the run
            raise BackendError(
                f"node {self.topo.node_rank}: node 0 ({self.topo.master_addr}:{self.topo.master_port}) went away before "
                f"it recorded the run ({_last_line(err)}); see node 0's output."
            ) from None
        raise BackendError(f"node 0 recorded no run within {self.timeout_s:g} s (rendezvous_timeout_s).")

    # -- while the ranks run -----------------------------------------------------------------------
    def beat(self) -> None:
        self.store.add(f"beat/{self.topo.node_rank}", 1)

    def fail(self, line: str, rank: int | None = None, signum: int | None = None, traceback: str | None = None) -> None:
        """Post this node's failure (or interruption: `signum`) for the others; the first one posted is the job's."""
        record = json.dumps({"node": self.topo.node_rank, "rank": rank, "line": line, "signum": signum,
                             "traceback": traceback})
        try:
            self.store.compare_set("failed", "", record)
        except Exception:  # node 0 is gone: there is no one left to tell
            pass

    def posted(self) -> dict[str, Any] | None:
        """The failure another node posted, if any (None when there is none, or the store is gone)."""
        try:
            if self.store.check(["failed"]):
                failure = self._failure()
                return failure if failure["node"] != self.topo.node_rank else None
        except Exception:
            pass
        return None

    def _failure(self) -> dict[str, Any]:
        return json.loads(self.store.get("failed"))

    def check(self) -> None:
        """Raise NodeFailed when another node failed or stopped answering; called every ~0.5 s."""
        try:
            self.beat()
            if self.store.check(["failed"]):
                failure = self._failure()
                if failure["node"] != self.topo.node_rank:
                    raise self._remote(failure)
            if self.is_master:
                lost = self._lost_nodes()
                if lost:
                    raise failed(self._lost_line(lost), None, NodeFailed)
        except (NodeFailed, Interrupted):
            raise
        except Exception as err:  # the store itself is gone: node 0's launcher died
            line = f"node {self.topo.node_rank} lost contact with node 0 ({self.topo.master_addr}:{self.topo.master_port})"
            raise failed(f"{line}: {_last_line(err)}", None, NodeFailed) from None

    def blame(self, err: RunFailed, peer_error: bool) -> HarnessError:
        """What ended the job after this node's ranks failed: another node's cause wins over a peer error."""
        if peer_error:
            deadline = time.monotonic() + LAST_WORD_S
            while time.monotonic() < deadline:
                try:
                    if self.store.check(["failed"]):
                        failure = self._failure()
                        if failure["node"] != self.topo.node_rank:
                            return self._remote(failure)
                        break
                    lost = self._lost_nodes(LAST_WORD_S / 2) if self.is_master else []
                except Exception:
                    break
                if lost:
                    return failed(f"{self._lost_line(lost)}; node {self.topo.node_rank}'s ranks stopped as a consequence",
                                  None, NodeFailed)
                time.sleep(POLL_S)
        own = RunFailed(f"node {self.topo.node_rank}: {err}")
        own.__cause__ = err.__cause__
        return own

    def _remote(self, failure: dict[str, Any]) -> HarnessError:
        """Another node's posted failure, as the error that ends this node too."""
        if failure.get("signum"):  # cancelled there (scancel, Ctrl-C): the job was killed, it did not fail
            return Interrupted(int(failure["signum"]))
        line = failure["line"]
        return failed(line if line.startswith("node ") else f"node {failure['node']}: {line}", failure.get("rank"), NodeFailed)

    def _lost_nodes(self, after_s: float = _LOST_AFTER_S) -> list[int]:
        now = time.monotonic()
        lost = []
        for n in range(1, self.topo.nnodes):
            count = self.store.add(f"beat/{n}", 0)
            last = self._seen.get(n)
            if last is None or last[0] != count:
                self._seen[n] = (count, now)
            elif now - last[1] > after_s:
                lost.append(n)
        return lost

    def _lost_line(self, lost: list[int]) -> str:
        which = ", ".join(map(str, lost))
        return (f"node {which} stopped answering (no sign of life for {_LOST_AFTER_S:g} s): its launcher died or "
                "the network between the nodes failed")

    def done(self) -> None:
        self.store.set(f"done/{self.topo.node_rank}", "1")

    def wait_done(self, timeout_s: float = 30.0) -> list[int]:
        """Node 0 keeps the store up until every node has finished with it; returns nodes that did not say so."""
        deadline = time.monotonic() + timeout_s
        pending = list(range(1, self.topo.nnodes))
        while pending and time.monotonic() < deadline:
            pending = [n for n in pending if not self.store.check([f"done/{n}"]) and not self.store.check(["failed"])]
            if pending:
                time.sleep(POLL_S)
        return pending


    # -- rank logs: node 0 writes the one record, so the others send it their logs rather than upload them.
    # An upload of their own would land after node 0 had closed and sealed the run, and break its seal.
    def send_logs(self, log_dir: Path) -> None:
        """This node's rank logs, to node 0 (each file's last _LOG_TAIL bytes); node 0 gone: nothing to do."""
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for path in sorted(p for p in log_dir.iterdir() if p.is_file()):
                try:
                    data = path.read_bytes()
                except OSError as err:  # the record says so, in the log's place, rather than this node's stderr
                    data = f"[this rank log could not be read on node {self.topo.node_rank}: {err.strerror}]\n".encode()
                if len(data) > _LOG_TAIL:
                    data = f"[first {len(data) - _LOG_TAIL} bytes left out]\n".encode() + data[-_LOG_TAIL:]
                info = tarfile.TarInfo(path.name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        try:
            # The store takes bytes as well as str; torch's hints name str only.
            self.store.set(f"logs/{self.topo.node_rank}", buf.getvalue())  # type: ignore[arg-type]
        except Exception:
            pass

    def collect_logs(self, log_dir: Path, timeout_s: float = _LOGS_WAIT_S) -> list[int]:
        """Node 0: every other node's rank logs into log_dir; returns the nodes whose logs did not come."""
        deadline = time.monotonic() + timeout_s
        pending = list(range(1, self.topo.nnodes))
        while pending:
            try:
                for n in [n for n in pending if self.store.check([f"logs/{n}"])]:
                    pending.remove(n)
                    with tarfile.open(fileobj=io.BytesIO(self.store.get(f"logs/{n}")), mode="r") as tar:
                        for member in tar.getmembers():
                            name = Path(member.name).name  # plain file names only: nothing lands outside log_dir
                            target = log_dir / name
                            if member.isfile() and name == member.name and not target.exists():
                                target.write_bytes(tar.extractfile(member).read())  # type: ignore[union-attr]
            except Exception:  # the store is gone or a node sent garbage: what came is kept
                break
            try:  # a node that stopped beating without sending them (killed) is not waited for
                gone = set(self._lost_nodes(LAST_WORD_S))
            except Exception:
                break
            pending = [n for n in pending if n not in gone]
            if pending and time.monotonic() >= deadline:
                break
            if pending:
                time.sleep(POLL_S)
        return pending


def node_facts(code: str, config: str) -> dict[str, Any]:
    """This node's provenance, sent to node 0: host, hardware, versions, communication variables."""
    comm = {k: v for k, v in env_vars().items() if k.startswith(("NCCL_", "GLOO_", "TP_", "MASTER_"))}
    return {"facts": runtime_facts(), "vars": comm, "code": code, "config": config}


# Facts and variables expected to differ between nodes: they say which node or which network
# interface, not what it computes with.
_PER_NODE = {"hostname"}
_PER_NODE_VARS = ("MASTER_", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME")


def differing(nodes: dict[int, dict[str, Any]]) -> dict[int, list[str]]:
    """For each node other than 0, the facts and variables that differ from node 0's."""
    base = nodes[0]
    out: dict[int, list[str]] = {}
    for n, node in sorted(nodes.items()):
        if n == 0:
            continue
        keys = [k for k in sorted(set(base["facts"]) | set(node["facts"]))
                if k not in _PER_NODE and base["facts"].get(k) != node["facts"].get(k)]
        keys += [k for k in sorted(set(base["vars"]) | set(node["vars"]))
                 if not k.startswith(_PER_NODE_VARS) and base["vars"].get(k) != node["vars"].get(k)]
        if keys:
            out[n] = keys
    return out
