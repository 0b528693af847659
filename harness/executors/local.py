"""The local backend: this machine's ranks, started by mp.spawn; several machines with one launcher each.

This module only supervises ranks: it starts them, pumps rank 0's messages into the job's recorder
(record/recorder.py, through executors/common.record_ranks) on the launcher that runs global rank 0,
and joins or cancels them. On other nodes the launcher only runs its ranks and reports to node 0
through the rendezvous (executors/multinode.py).
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import events, scratch, tags as T
from harness.config import check_nodes
from harness.configschema import ExperimentConfig, Launcher
from harness.errors import Interrupted, RunFailed
from harness.executors import procs
from harness.executors.base import (
    Backend,
    Executor,
    Handle,
    Here,
    Job,
    JobEvent,
    Topology,
)
from harness.executors.common import (
    RanksHandle,
    check_device_here,
    check_runnable,
    config_id,
    device_of,
    launch_spec,
    local_image_tags,
    node_tags,
    record_and_publish,
)
from harness.executors.failures import failure_details, is_peer_failure
from harness.executors.launch import Ranks, launch, start_ranks
from harness.executors.multinode import check_topology
from harness.messages import Message
from harness.runtime.rank.spec import LaunchSpec


def early_ranks(cfg: ExperimentConfig) -> Ranks:
    """This node's ranks started now (in a fresh work folder: Here.stop ends them and removes it), before the run is
    recorded, so that they import torch meanwhile; they run the entry once the job's spec reaches them."""
    work = scratch.make("run")
    try:
        return start_ranks(cfg.world_size, work / "logs", method=procs.Method(cfg.launcher))
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise


def run_segments(
    cfg: ExperimentConfig, exp_dir: Path, plans: list[Any], on_message: Callable[[Message], None],
    data: dict[str, str] | None = None,
) -> None:
    """Run the entry once per checkpoint plan in one set of local ranks (audit: start-up is paid once).

    Nothing is recorded here; the caller judges the segments from the messages.
    """
    device, backend = check_runnable(cfg)
    work = scratch.make("audit")
    try:
        spec = launch_spec(cfg, exp_dir, device, backend, work / "logs", data=data)
        spec.segments = plans
        launch(spec, on_message)
    finally:
        shutil.rmtree(work, ignore_errors=True)


class LocalExecutor(Executor):
    name = "local"

    def warm(self, cfg: ExperimentConfig, topology: Topology, before: Callable[[], object] | None = None) -> bool:
        # One node's ranks fork from the rank server: its torch import overlaps git, the data's hashes, MLflow and
        # the record. Several nodes' ranks start once the rendezvous is made, which waits for every node anyway.
        if topology.nnodes != 1 or cfg.launcher is not Launcher.forkserver:
            return False
        if before is not None:
            before()
        procs.warm()
        return True

    def check_here(self, cfg: ExperimentConfig, topology: Topology) -> Here:
        return check_device_here(cfg, topology)

    def start_here(self, cfg: ExperimentConfig, topology: Topology, here: Here) -> Here:
        if topology.multi_node:  # the ranks start once the nodes have met; the main guard is checked in prepare()
            return here
        procs.check_main_guarded()  # a script that would run again in every rank: said before "recording"
        ranks = early_ranks(cfg) if topology.launcher == "spawn" else None
        return dataclasses.replace(here, starts_all=True, ranks=ranks)

    def prepare(self, job: Job) -> dict[str, str]:
        check_topology(job.topology)
        check_nodes(job.topology.nnodes, job.cfg.world_size, "--nnodes")
        device_of(job, job.cfg.world_size // job.topology.nnodes)
        procs.check_main_guarded()  # the ranks start in this process: before the run is recorded
        return local_image_tags(str(job.cfg.image))

    def start(self, job: Job, on_event: Callable[[JobEvent], None]) -> Handle:
        handle = LocalHandle(job, on_event, job.placement)
        handle.start()
        return handle

    def check_segments(self, cfg: ExperimentConfig) -> None:
        check_runnable(cfg)
        procs.check_main_guarded()

    def run_segments(self, job: Job, plans: list[Any], on_message: Callable[[Message], None]) -> None:
        run_segments(job.cfg, job.exp_dir, plans, on_message, job.data)


EXECUTOR = LocalExecutor
BACKEND = Backend(
    name="local", executor=LocalExecutor, runs_segments=True,
    ranks_here=True, early_ranks=True, parallel_members=True, runs_working_tree=True, runs_members=True,
    help="ranks run on this machine (or on several, one `harness run --nnodes` each)",
)


class LocalHandle(RanksHandle):
    """This node's ranks; on the node that runs rank 0, their messages go to the job's recorder."""

    def __init__(self, job: Job, on_event: Callable[[JobEvent], None], placement: dict[str, str]) -> None:
        # Ranks started before the record already write their logs into <work>/logs.
        work = Path(job.ranks.log_dir).parent if job.ranks is not None else scratch.make("run")
        super().__init__(job, on_event, placement, work)

    def cancel(self, signum: int) -> None:
        if self.recording:  # a signal now would cut the record short: it waits until the run is closed
            self.deferred.append(signum)
        else:
            self.cancelled = signum

    def start(self) -> None:
        """Rendezvous with the other nodes (if any), then record the run (node 0) or attach to it."""
        job, topo = self.job, self.job.topology
        tags = {**self.placement, T.NNODES: str(topo.nnodes), T.NPROC_PER_NODE: str(job.cfg.world_size // topo.nnodes),
                T.LAUNCHER: topo.launcher, T.RANK_START: job.cfg.launcher.value}
        tags.update(topo.scheduler)  # what the backend that placed this process tags the run with (Backend.place)
        try:
            if not topo.multi_node:
                job.run_id = job.record(tags) if job.record else job.run_id
                job.member_ids = [record(tags) for _, record in job.members]  # each member's run, as the job's
                return
            from harness.executors.multinode import Node, node_facts

            self.node = Node(topo, float(job.cfg.rendezvous_timeout_s))
            joined = self.node.join(node_facts(job.code_id, config_id(job.cfg)))
            if joined is None:
                job.run_id = self.node.attach()
                events.emit(events.Notice(f"node {topo.node_rank}: joined run {job.run_id}"))
                return
            tags[T.MASTER] = f"{topo.master_addr}:{topo.master_port}"
            record_and_publish(job, self.node, {**tags, **node_tags(joined.nodes)}, joined.nodes, "node 0")
        except BaseException:
            shutil.rmtree(self.work, ignore_errors=True)
            raise

    def _spec(self, device: str, backend: str, log_dir: Path, plan: Any) -> LaunchSpec:
        topo = self.job.topology
        spec = launch_spec(self.job.cfg, self.job.exp_dir, device, backend, log_dir, plan, self.job.data)
        if topo.multi_node:
            spec.node_rank, spec.nproc = topo.node_rank, self.job.cfg.world_size // topo.nnodes
            spec.master_addr, spec.port = str(topo.master_addr), int(topo.master_port)
        return spec

    def _launch(self, spec: LaunchSpec, on_message: Callable[[Message], None],
                on_ranks: Callable[[Any], None] | None = None) -> None:
        """Run the ranks; across nodes, a failure anywhere ends every node and is named once."""
        node = self.node
        if node is None:
            ranks = self.job.ranks  # started by start_here (early_ranks) before the run was recorded
            assert ranks is None or isinstance(ranks, Ranks), ranks
            launch(spec, on_message, cancelled=lambda: self.cancelled, ranks=ranks, on_ranks=on_ranks)
            return
        try:
            launch(spec, on_message, store=node.raw, cancelled=lambda: self.cancelled, check=node.check,
                   on_ranks=on_ranks)
        except RunFailed as err:
            from harness.executors.multinode import NodeFailed

            if isinstance(err, NodeFailed):
                raise
            cause = node.blame(err, is_peer_failure(err))
            if not isinstance(cause, Interrupted):
                node.fail(str(cause), failure_details(cause)[0])
            raise cause  # noqa: B904 - its __cause__ is the rank's RankError (multinode.blame); `from` would replace it
        except Interrupted as err:
            if self.cancelled:  # interrupted here, not told by another node
                node.fail(f"node {self.job.topology.node_rank} was interrupted", signum=err.signum)
            raise
        else:
            node.done()
            if node.is_master:
                late = node.wait_done()
                if late:
                    raise RunFailed(f"node {', '.join(map(str, late))} did not finish (its ranks ended on node 0's side)")
