"""Ranks started by torchrun: this process is one rank, and the job is still exactly one MLflow run.

torchrun (one agent per node) starts every rank as `harness run ...` with RANK, WORLD_SIZE,
LOCAL_RANK, ... in its environment, so nothing is spawned here. The rank processes meet in the job's
TCPStore (the agent's when TORCHELASTIC_USE_AGENT_STORE=True, else one that global rank 0 hosts at
MASTER_ADDR:MASTER_PORT) with the multi-node protocol of executors/multinode.py, each rank a "node" of
one rank: rank 0 records the run once every rank has joined with the same code and config and
publishes its id; the others attach to it. Then each process runs its rank's body in place
(runtime/rank/body.py: run_rank), and rank 0 feeds the job's recorder as the local backend does (common.record_ranks).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from harness import scratch, tags as T
from harness.configschema import ExperimentConfig
from harness.errors import BackendError, HarnessError, Interrupted, RunFailed
from harness.executors.base import (
    Executor,
    Handle,
    Here,
    Job,
    JobEvent,
    Topology,
    TorchrunEnv as TorchrunEnv,  # defined beside Topology, which carries it; its public name is this module's too
)
from harness.executors.common import (
    RanksHandle,
    check_device_here,
    config_id,
    device_of,
    launch_spec,
    local_image_tags,
    node_tags,
    record_and_publish,
)
from harness.executors.failures import failed, failure_details, is_peer_failure, rank_failed
from harness.executors.launch import host_store
from harness.executors.multinode import LAST_WORD_S, POLL_S, Node, node_facts
from harness.messages import Message
from harness.runtime import usermlflow
from harness.runtime.rank.body import run_rank
from harness.runtime.rank.failure import failure_record

LAUNCHER = "torchrun"


def torchrun_env(environ: Mapping[str, str] | None = None) -> TorchrunEnv | None:
    """This process's rank as torchrun set it up, or None when torchrun did not start it.

    Refuses (HarnessError) variables that are not numbers, and a layout harness cannot record as
    nodes x ranks per node (different --nproc-per-node on different nodes).
    """
    env = os.environ if environ is None else environ
    if not env.get("TORCHELASTIC_RUN_ID") and not all(k in env for k in ("LOCAL_WORLD_SIZE", "RANK", "WORLD_SIZE")):
        return None
    missing = [k for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
               if not env.get(k)]
    if missing:
        raise BackendError(f"torchrun started this process but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                           "not set. Start it with torchrun (`torchrun --nproc-per-node N --no-python harness run ...`).")
    try:
        rank, world, local_rank, local_world = (int(env[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"))
        group = int(env.get("GROUP_RANK") or env.get("NODE_RANK") or rank // max(local_world, 1))
        port, restart = int(env["MASTER_PORT"]), int(env.get("TORCHELASTIC_RESTART_COUNT") or 0)
    except ValueError as err:
        raise BackendError(f"torchrun's rank variables are not numbers ({err}).") from None
    if local_world < 1 or world % local_world:
        raise BackendError(
            f"torchrun started {world} ranks with {local_world} on this node: harness needs the same number of "
            "ranks on every node. Pass the same --nproc-per-node to torchrun on every node."
        )
    if rank != group * local_world + local_rank:
        raise BackendError(
            f"torchrun made this process rank {rank}, but node {group} with {local_world} ranks per node holds ranks "
            f"{group * local_world}..{(group + 1) * local_world - 1}. Pass the same --nproc-per-node to torchrun on "
            "every node."
        )
    return TorchrunEnv(rank, world, local_rank, local_world, group, env["MASTER_ADDR"], port,
                       env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
                       env.get("TORCHELASTIC_RUN_ID", ""), restart)


def topology(env: TorchrunEnv) -> Topology:
    """The job's nodes as torchrun laid them out (node_rank: this node's group rank)."""
    return Topology(nnodes=env.nnodes, node_rank=env.group_rank, master_addr=env.master_addr,
                    master_port=env.master_port, launcher=LAUNCHER, torchrun=env)


def check_config(env: TorchrunEnv, world_size: int) -> None:
    """The config must ask for the ranks torchrun started: a job has one world size."""
    if world_size != env.world_size:
        raise BackendError(
            f"torchrun started {env.world_size} ranks but world_size is {world_size}: pass world_size={env.world_size} "
            f"as an override, or start {world_size} ranks with torchrun (--nnodes x --nproc-per-node)."
        )


class TorchrunExecutor(Executor):
    name = LAUNCHER

    def check_here(self, cfg: ExperimentConfig, topology: Topology) -> Here:
        return check_device_here(cfg, topology)

    def start_here(self, cfg: ExperimentConfig, topology: Topology, here: Here) -> Here:
        # Before the store is opened (one rank at a time on a fresh one): every rank gets to say why it refuses
        # before torchrun stops the others.
        env = topology.torchrun or torchrun_env()
        if env is not None:
            check_config(env, int(cfg.world_size))
        return here

    def prepare(self, job: Job) -> dict[str, str]:
        env = job.topology.torchrun or torchrun_env()
        if env is None:
            raise BackendError("the torchrun launch style needs a process started by torchrun (RANK, WORLD_SIZE, "
                               "LOCAL_WORLD_SIZE are not set).")
        if job.executor != "local":
            raise BackendError(
                f"torchrun started this process, so its rank runs here: executor {job.executor} does not apply. Set "
                f"executor=local, or run `harness run --executor {job.executor} ...` without torchrun."
            )
        check_config(env, int(job.cfg.world_size))
        device_of(job, env.local_world_size)
        self.env = env
        return local_image_tags(str(job.cfg.image))

    def start(self, job: Job, on_event: Callable[[JobEvent], None]) -> Handle:
        handle = TorchrunHandle(job, on_event, job.placement, self.env)
        handle.start()
        return handle


EXECUTOR = TorchrunExecutor


class _Channel:
    """Global rank 0's messages, handed straight to the recorder in this process."""

    def __init__(self, on_message: Callable[[Message], None]) -> None:
        self._on_message: Callable[[Message], None] | None = on_message

    def send(self, message: Message) -> None:
        if self._on_message is None:
            return
        try:
            self._on_message(message)
        except Exception:  # a sink error must not stop training (as with the spawned ranks' pipe)
            traceback.print_exc()

    def close(self) -> None:
        self._on_message = None


class TorchrunHandle(RanksHandle):
    """This process's one rank; on global rank 0, its messages go to the job's recorder."""

    def __init__(self, job: Job, on_event: Callable[[JobEvent], None], placement: dict[str, str], env: TorchrunEnv) -> None:
        super().__init__(job, on_event, placement, scratch.make("run"))
        self.env = env
        self.training = False  # the rank's body runs in this thread: a signal now interrupts it
        self.peers: dict[int, tuple[str, int]] = {}  # rank 0: each rank's machine (boot id) and pid

    def _records_here(self) -> bool:
        return self.env.rank == 0

    def cancel(self, signum: int) -> None:
        if self.recording:  # a signal now would cut the record short: it waits until the run is closed
            self.deferred.append(signum)
            return
        self.cancelled = signum
        if self.training:  # called from the signal handler: this raises where the rank is now
            self.training = False
            raise Interrupted(signum)

    def start(self) -> None:
        """Every rank joins; rank 0 records the run and publishes its id, the others attach to it."""
        job, env = self.job, self.env
        try:
            ranks = Topology(nnodes=env.world_size, node_rank=env.rank, master_addr=env.master_addr,
                             master_port=env.master_port, launcher=LAUNCHER)
            self.node = Node(ranks, float(job.cfg.rendezvous_timeout_s), store=self._store())
            facts = {**node_facts(job.code_id, config_id(job.cfg)), "group_rank": env.group_rank,
                     "local_rank": env.local_rank, "pid": os.getpid(), "boot": _boot_id()}
            joined = self.node.join(facts)
            if joined is None:
                job.run_id = self.node.attach()
                return
            # Where each rank's process is: rank 0 names the one that died without a word (killed_peer).
            self.peers = {r: (f.get("boot", ""), int(f.get("pid", 0))) for r, f in joined.nodes.items()}
            nodes = {r["group_rank"]: r for r in joined.nodes.values() if r["local_rank"] == 0}
            tags = {**self.placement, T.NNODES: str(env.nnodes), T.NPROC_PER_NODE: str(env.local_world_size),
                    T.LAUNCHER: LAUNCHER, T.RANK_START: LAUNCHER, T.MASTER: f"{env.master_addr}:{env.master_port}", **node_tags(nodes)}
            record_and_publish(job, self.node, tags, nodes if env.nnodes > 1 else None, "rank 0")
        except BaseException:
            shutil.rmtree(self.work, ignore_errors=True)
            raise

    def _store(self) -> Any:
        """The job's store: a client of the agent's, or (no agent store) hosted by rank 0, its client elsewhere."""
        import datetime

        import torch.distributed as dist

        env, timeout_s = self.env, float(self.job.cfg.rendezvous_timeout_s)
        if env.rank == 0 and not env.agent_store:
            raw = host_store(env.master_addr, env.master_port, timeout_s)
        else:
            try:  # the client retries until the store listens, up to the deadline
                raw = dist.TCPStore(env.master_addr, env.master_port, is_master=False,
                                    timeout=datetime.timedelta(seconds=timeout_s))
            except Exception as err:
                whose = "torchrun's agent" if env.agent_store else "rank 0"
                raise BackendError(f"rank {env.rank}: {whose} did not answer at {env.master_addr}:{env.master_port} "
                                   f"within {timeout_s:g} s (rendezvous_timeout_s).") from err
        # The agent's store outlives one attempt: each attempt's keys are its own.
        return dist.PrefixStore(f"harness/{env.run_id}/{env.restart}/", raw)

    def _spec(self, device: str, backend: str, log_dir: Path, plan: Any) -> Any:
        spec = launch_spec(self.job.cfg, self.job.exp_dir, device, backend, log_dir, plan, self.job.data)
        spec.node_rank, spec.nproc = self.env.group_rank, self.env.local_world_size
        spec.master_addr, spec.port = self.env.master_addr, self.env.master_port
        return spec

    def _launch(self, spec: Any, on_message: Callable[[Message], None],
                on_ranks: Callable[[Any], None] | None = None) -> None:
        """Run this rank here; a failure anywhere is the job's, named once (the first rank to post it).

        `on_ranks` is unused: this process is a rank itself, with no progress array for the bar to read."""
        node, rank = self.node, self.env.rank
        try:
            self._run_here(spec, on_message)
        except RunFailed as err:
            if is_peer_failure(err):  # this rank lost a peer: the rank at fault says why
                import time

                deadline = time.monotonic() + LAST_WORD_S
                while time.monotonic() < deadline and (posted := node.posted()) is None:
                    time.sleep(POLL_S)
                if posted is not None:
                    raise self._remote(posted)  # noqa: B904 - its __cause__ is the rank's RankError (failures.failed); `from` would replace it
                # No rank said why: one whose process is gone already ended without a word (SIGKILL: the OOM killer,
                # kill -9), and this rank's collective broke on its closed connection before torchrun's SIGTERM came.
                killed = killed_peer(self.peers, rank)
                if killed is not None:
                    raise self._killed(killed)  # noqa: B904 - its __cause__ is the rank's RankError (failures.failed)
            failing, tb, expected = failure_details(err)
            node.fail(str(err), failing, traceback=None if expected else tb)
            raise
        except Interrupted as err:
            # torchrun stops the other ranks when one fails: that rank's failure, not the signal, ended the job.
            posted = node.posted()
            if posted is not None and not posted.get("signum"):
                raise self._remote(posted)  # noqa: B904 - its __cause__ is the rank's RankError (failures.failed); `from` would replace it
            killed = killed_peer(self.peers, rank) if posted is None and err.signum == signal.SIGTERM else None
            if killed is not None and node.posted() is None:
                # A rank SIGKILLed (the OOM killer, kill -9) says nothing, and torchrun answers by stopping the others;
                # a rank that ended of a signal it could catch has posted it before its process ended.
                raise self._killed(killed)  # noqa: B904 - its __cause__ is the rank's RankError
            node.fail(f"rank {rank} was interrupted", rank, signum=err.signum)
            raise
        node.done()
        if node.is_master:
            late = node.wait_done()
            if late:
                raise RunFailed(f"rank {', '.join(map(str, late))} did not finish (rank 0 finished)")

    def _killed(self, killed: int) -> HarnessError:
        """The job's failure where rank `killed` ended without a word (SIGKILL), posted for the other ranks."""
        line = (f"rank {killed} was killed by SIGKILL (its process ended without a word; torchrun then stopped the "
                "other ranks)")
        self.node.fail(line, killed)
        return failed(line, killed, signal_name="SIGKILL")

    def _run_here(self, spec: Any, on_message: Callable[[Message], None]) -> None:
        """The rank's body in this process (runtime/rank/body.py: run_rank); its failure as RunFailed naming the rank and line."""
        import signal

        if self.cancelled:
            raise Interrupted(self.cancelled)
        cwd, path = os.getcwd(), list(sys.path)  # the body runs in the experiment folder; the record does not
        # ...and with the user's MLflow routed (harness/runtime/usermlflow.py); the record keeps the job's store. Not in
        # run_rank: a spawned rank's MLflow (its atexit end_run) must stay routed until the process is gone.
        mlflow_env = usermlflow.snapshot(os.environ)
        try:
            self.training = True
            run_rank(spec, self.env.local_rank, _Channel(on_message) if self.env.rank == 0 else None,
                     store=self.node.raw)
        except Interrupted:
            raise
        except KeyboardInterrupt:
            raise Interrupted(signal.SIGINT) from None
        except BaseException as err:
            raise rank_failed(failure_record(spec, self.env.rank, err))  # noqa: B904 - its __cause__ is the rank's RankError (failures.rank_failed); `from` would replace it
        finally:
            self.training = False
            os.chdir(cwd)
            sys.path[:] = path
            usermlflow.restore(os.environ, mlflow_env)

    def _remote(self, posted: dict[str, Any]) -> HarnessError:
        """Another rank's posted failure, as the error that ends this rank too."""
        if posted.get("signum"):
            return Interrupted(int(posted["signum"]))
        return failed(posted["line"], posted.get("rank"), traceback_text=posted.get("traceback"))


def _boot_id() -> str:
    """This machine's boot id: ranks on one machine share it, so a peer's pid means something here."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def killed_peer(peers: dict[int, tuple[str, int]], me: int) -> int | None:
    """The first rank on this machine whose process is gone already: torchrun stops the other ranks (SIGTERM) once one
    has ended, so a rank gone before them is the one that ended first. Ranks on other machines cannot be looked at."""
    import psutil

    here = _boot_id()
    for rank, (boot, pid) in sorted(peers.items()):
        if rank == me or not pid or not here or boot != here:
            continue
        try:
            gone = psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            gone = True
        except psutil.Error:
            gone = False
        if gone:
            return rank
    return None
