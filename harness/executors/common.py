"""What the backends that run ranks on this machine share: the ranks' spec, the image tags, node 0's recording.

The local backend (mp.spawn, one launcher per node) and torchrun's (this process is one rank) supervise
their ranks differently; both feed rank 0's messages to the one recorder (record/recorder.py) through
`record_ranks`, and on every other node or rank run theirs through `ranks_only`. Docker and Slurm tag
the image the same way.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import signal
from abc import abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness import events, tags as T
from harness.config import is_no_image, split_entry, to_container, to_yaml
from harness.configschema import ExperimentConfig
from harness.errors import EXIT_FAILED, EXIT_OK, Interrupted, RunFailed
from harness.executors.base import (
    FAILED,
    FINISHED,
    KILLED,
    PENDING,
    RUNNING,
    Handle,
    Here,
    Job,
    JobEvent,
    Outcome,
    Topology,
)
from harness.executors.failures import failure_details, killed_by
from harness.executors.follow import Follower
from harness.executors.launch import capacity_warning, resolve_device
from harness.executors.multinode import Node, differing
from harness.messages import Message, SegmentStart, UserSeeds
from harness.record.recorder import Failed, Killed, Recorder, checkpoint_plan, lock_lines, open_checkpoints
from harness.runtime.rank.spec import LaunchSpec
from harness.secrets import known_values
from harness.systems import docker

if TYPE_CHECKING:
    from harness.executors.launch import Ranks
    from harness.runtime.plan import CheckpointPlan

# (device, backend, log folder, checkpoint plan) -> this node's LaunchSpec
SpecFor = Callable[[str, str, Path, "CheckpointPlan | None"], LaunchSpec]
# Run this node's ranks with `spec`, rank 0's messages to `on_message`; `on_ranks` gets the started ranks.
RunRanks = Callable[[LaunchSpec, Callable[[Message], None], "Callable[[Ranks], None] | None"], None]


def local_image_tags(image: str) -> dict[str, str]:
    """A job whose ranks run on the host, in no image: its digest says so (T.HOST), and the pinned image's registry
    digest, when a local engine knows it, is what the pinned tag resolved to (else why not) - the image a replay
    with --executor docker runs it in."""
    digest: str | None
    image_id: str | None
    reason: str | None
    if is_no_image(image):
        digest, image_id, reason = None, None, "no image pinned (image: none): a local-only experiment"
    else:
        digest, image_id, reason = docker.local_digest_or_reason(image)
    facts = {
        T.IMAGE: image,
        T.IMAGE_DIGEST: T.HOST,
        T.EXECUTOR: "local",
        T.IMAGE_NOTE: "ran outside the pinned image (local executor): the environment is this machine's",
    }
    if digest:
        facts[T.IMAGE_TAG_DIGEST] = digest
    if image_id:
        facts[T.IMAGE_ID] = image_id
    if reason:
        facts[T.IMAGE_DIGEST_REASON] = reason
    return facts


def launch_spec(
    cfg: ExperimentConfig, code_dir: Path, device: str, backend: str, log_dir: Path,
    checkpoints: CheckpointPlan | None = None, data: dict[str, str] | None = None,
) -> LaunchSpec:
    """The plain-values description of the ranks for this experiment (see runtime/rank/spec.py: LaunchSpec)."""
    from harness.runtime.plan import ProfilePlan

    entry_file, entry_func = split_entry(cfg.entry)
    return LaunchSpec(
        code_dir=str(Path(code_dir).resolve()),
        entry_file=entry_file,
        entry_func=entry_func,
        world_size=cfg.world_size,
        device=device,
        backend=backend,
        seed=cfg.seed,
        rank_seeds=list(cfg.rank_seeds),
        threads_per_rank=cfg.threads_per_rank,
        determinism=cfg.determinism.level.value,
        fingerprint_every=cfg.fingerprint_every,
        train_cfg=to_container(cfg)["train"],
        log_dir=str(log_dir),
        checkpoints=checkpoints,
        invariant_shards=cfg.determinism.shards if cfg.determinism.world_size_invariant else 0,
        timeout_s=cfg.timeout_s,
        stall_s=cfg.stall_s,
        launcher=cfg.launcher.value,
        output_dir=str(Path(log_dir).parent / "outputs"),
        data=dict(data or {}),
        profile=ProfilePlan(str(Path(log_dir).parent / T.ARTIFACT_PROFILE_DIR), tuple(cfg.profile.steps),
                            tuple(cfg.profile.ranks), cfg.profile.samples_per_step),
    )


def check_runnable(cfg: ExperimentConfig, nproc: int | None = None) -> tuple[str, str]:
    """This machine can run `nproc` ranks (default: all of world_size) of `cfg`: (device, backend), or HarnessError."""
    return resolve_device(cfg.device.value, cfg.backend.value, cfg.world_size if nproc is None else nproc)


def check_device_here(cfg: ExperimentConfig, topology: Topology) -> Here:
    """Executor.check_here of a backend whose ranks run on this machine: this node's share of the ranks has the device
    it asks for (refused before anything is recorded), and a warning when they are more threads than cores."""
    nproc = max(cfg.world_size // topology.nnodes, 1)
    device, backend = resolve_device(cfg.device.value, cfg.backend.value, nproc)
    warning = capacity_warning(device, nproc, cfg.threads_per_rank)
    return Here(device, backend, (warning,) if warning else ())


def device_of(job: Job, nproc: int) -> tuple[str, str]:
    """This node's device and backend: as decided before the record (Job.here), else checked now and kept there, so
    that a job resolves its device once."""
    here = job.here
    if here is None or here.device is None or here.backend is None:
        device, backend = check_runnable(job.cfg, nproc)
        job.here = here = dataclasses.replace(here or Here(), device=device, backend=backend)
    assert here.device is not None and here.backend is not None
    return here.device, here.backend


def config_id(cfg: ExperimentConfig) -> str:
    """The resolved config's digest: every node of a job must run the same one."""
    return hashlib.sha256(to_yaml(cfg).encode()).hexdigest()


def node_tags(nodes: dict[int, dict[str, Any]]) -> dict[str, str]:
    """The other nodes' facts (node 0's are the run's own), and which of them differ from node 0's."""
    tags: dict[str, str] = {}
    for n, node in nodes.items():
        if n == 0:
            continue
        for key in ("hostname", "cpu", "gpu", "gpu_driver", "torch", "cuda", "nccl", "python"):
            if key in node["facts"]:
                tags[f"{T.NODE_PREFIX}{n}.{key}"] = str(node["facts"][key])
    differ = differing(nodes)
    if differ:
        tags[T.NODES_DIFFER] = "; ".join(f"node {n}: {', '.join(keys)}" for n, keys in differ.items())
        events.emit(events.Warning(f"the nodes' environments differ ({tags[T.NODES_DIFFER]}); recorded, and a "
                                   "replay's delta will show it."))
    return tags


def record_and_publish(job: Job, node: Node, tags: dict[str, str], nodes: dict[int, dict[str, Any]] | None,
                       who: str) -> None:
    """Node 0 after the rendezvous: record the one run with every node's facts, then tell the others its id."""
    try:
        job.run_id = job.record(tags) if job.record else job.run_id
    except BaseException as err:
        node.fail(f"{who} could not record the run: {err}")
        raise
    if nodes:
        job.tracker.log_text(job.run_id, json.dumps({str(k): v for k, v in nodes.items()}, indent=2), T.ARTIFACT_NODES)
    node.publish(job.run_id)


def record_ranks(job: Job, work: Path, node: Node | None, spec_for: SpecFor, run: RunRanks,
                 on_event: Callable[[JobEvent], None], closing: Callable[[], None]) -> Outcome:
    """The side that runs rank 0: the ranks run by `run`, rank 0's messages fed to the job's recorder (and passed
    on to `on_event`), the run closed. `closing()` is called once the ranks have ended, before the record is
    closed; `node`: the job's rendezvous when it spans several nodes (or torchrun's ranks).

    A calibration's further members (`job.members`, their runs `job.member_ids`) run in the same ranks after the
    job's own, one segment each: each segment's messages go to its member's recorder, and each member's run is
    closed as a replay of its own would be (one that never started, as the segment that ended the ranks ended)."""
    log_dir = work / "logs"
    log_dir.mkdir(exist_ok=True)
    recorders = [Recorder(job.tracker, run_id, job.cfg, work, lambda shown: follower.show(shown), job.resume_step,
                          steering)
                 for run_id, steering in [(job.run_id, job.steering),
                                          *zip(job.member_ids, (s for s, _ in job.members))]]
    follower = _follower(job, log_dir, len(recorders))
    recorders[0].judge = _judging(job)
    ended: Failed | Killed | BaseException | None = None
    current = [0]  # the member whose segment rank 0 runs
    try:
        spec = _first_spec(job, recorders, spec_for, log_dir)
        # The bar counts rank 0's steps as its clock has them (optimizer steps), whatever it logs at.
        run(spec, _feeding(recorders, current, follower, on_event), lambda ranks: follower.follow_steps(ranks.progress))
        ended = next((done for done in (each.ranks_done() for each in recorders) if done is not None), None)
        changed = job.verify() if ended is None and job.verify is not None else None
        if changed is not None:  # no rank failed: the record would not hold what they read
            ended = Failed(changed, None, changed)
    except RunFailed as err:
        rank, tb, expected = failure_details(err)
        ended = Failed(str(err), rank, tb, expected, killed_by(err))
    except Interrupted as err:
        ended = Killed(str(err), err.exit_code)
    except BaseException as err:
        ended = err
        if node is not None:
            node.fail(f"node 0: {err}")
    finally:
        closing()
        follower.close(finished=ended is None, steps=recorders[0].final.get("steps_total"))
    return _close_records(job, recorders, ended, current[0], node, log_dir)


def _follower(job: Job, log_dir: Path, count: int) -> Follower:
    """The progress view of rank 0's log: the job's steps, or a calibration's members one segment after another."""
    steps = job.steering.stop_at or 0
    label = f"{Path(job.exp_dir).resolve().name} x{job.cfg.world_size}"
    return Follower(log_dir / "rank0.log", f"calibrating {label}, {count} x {steps} steps" if job.members else label,
                    show=not job.options.quiet, hidden=known_values(to_container(job.cfg), os.environ),
                    segments=(count, steps) if job.members and steps else None)


def _first_spec(job: Job, recorders: list[Recorder], spec_for: SpecFor, log_dir: Path) -> LaunchSpec:
    """Each run's record started on the device decided for this node, and the ranks' spec that feeds the first."""
    device, backend = device_of(job, job.cfg.world_size // job.topology.nnodes)
    # Ranks started before the record measured torch's facts there; the launcher never imports torch for them.
    measured = job.ranks.torch_facts() if job.ranks is not None else None
    lock = lock_lines()
    for each in recorders:
        each.start(device, backend, measured, lock)
    spec = spec_for(device, backend, log_dir, recorders[0].plan)
    spec.run_id = job.run_id
    spec.env.update(recorders[0].rank_env())
    if job.members:
        spec.segments, spec.members = [each.plan for each in recorders], True
    return spec


def _feeding(recorders: list[Recorder], current: list[int], follower: Follower,
             on_event: Callable[[JobEvent], None]) -> Callable[[Message], None]:
    """Rank 0's messages to the recorder of the segment it runs (`current[0]`, which a SegmentStart moves on)."""
    def on_message(msg: Message) -> None:
        if isinstance(msg, SegmentStart):
            current[0] = msg.index
            follower.segment(msg.index)
        elif isinstance(msg, UserSeeds):  # sent once, at the ranks' end: every member ran the same code
            for each in recorders:
                each.feed(msg)
        else:
            recorders[current[0]].feed(msg)
        on_event(msg)

    return on_message


def _close_records(job: Job, recorders: list[Recorder], ended: Failed | Killed | BaseException | None, current: int,
                   node: Node | None, log_dir: Path) -> Outcome:
    """Close every run the ranks fed, the job's own first in the outcome; a calibration's members' outcomes beside."""
    recorder = recorders[0]

    def collect_logs() -> None:  # the other nodes' rank logs, before the record is closed and sealed
        assert node is not None
        missing = node.collect_logs(log_dir)
        if missing:
            recorder.note("logs", f"the rank logs of node {', '.join(map(str, missing))} did not reach node 0: the "
                          "record holds node 0's logs only for them")

    outcomes: dict[int, Outcome] = {}
    # The segment that ended the ranks last: a launcher's own error is raised again once its run is closed.
    for index in sorted(range(len(recorders)), key=lambda i: i == current):
        each = recorders[index]
        this = ended if ended is None or index == current else _member_ended(ended, index, current)
        closed = each.end(this, collect=None if node is None else collect_logs)
        outcomes[index] = Outcome(each.run_id, closed.status, closed.exit_code, closed.message, closed.fingerprints)
    job.member_outcomes = [outcomes[i] for i in range(1, len(recorders))]
    return outcomes[0]


def _member_ended(ended: Failed | Killed | BaseException, index: int, current: int) -> Failed | Killed | None:
    """How a calibration member's run ends when another member's segment ended the ranks: one that ran before it
    finished; one after it never started, and ends as that one did, saying so."""
    if index < current:
        return None
    if isinstance(ended, Killed):
        return Killed(f"never started: interrupted while calibration member {current} ran", ended.exit_code)
    line = f"never started: the ranks ended while calibration member {current} ran"
    return Failed(line, None, line)


def ranks_only(job: Job, work: Path, node: Node, spec_for: SpecFor, run: RunRanks,
               on_event: Callable[[JobEvent], None], closing: Callable[[], None]) -> Outcome:
    """Any other node (or torchrun rank): its ranks run by `run` against the run node 0 records; their logs
    go to node 0, which writes the one record."""
    cfg = job.cfg
    log_dir = work / "logs"
    log_dir.mkdir()
    device, backend = device_of(job, cfg.world_size // job.topology.nnodes)
    # Node 0's launcher uploads the steps: it reads this node's rank files from the shared staging folder.
    plan = checkpoint_plan(open_checkpoints(job.tracker, job.run_id, cfg, job.resume_step), cfg, job.resume_step,
                           job.steering)
    spec = spec_for(device, backend, log_dir, plan)
    spec.run_id = job.run_id
    status, code, message = T.FINISHED, EXIT_OK, ""
    try:
        run(spec, on_event, None)
    except RunFailed as err:
        status, code, message = T.FAILED, EXIT_FAILED, str(err)
    except Interrupted as err:
        status, code, message = T.KILLED, err.exit_code, str(err)
    finally:
        closing()
        # Every rank's log belongs to the one run (names carry the global rank): node 0 records them.
        node.send_logs(log_dir)
    return Outcome(job.run_id, status, code, message)


def after_deferred(outcome: Outcome, deferred: list[int]) -> Outcome:
    """A signal that arrived while the run was being recorded waited for it: the exit code says it came."""
    if deferred:
        events.emit(events.Notice(f"{signal.Signals(deferred[0]).name} arrived while the run was being recorded; "
                                  "it was recorded in full first."))
        outcome.exit_code = 128 + deferred[0]
    return outcome


class RanksHandle(Handle):
    """What the handles that supervise this node's own ranks (local, torchrun) share: the state `status()` reports,
    signals held while the run is recorded, and `wait()` - the node that runs global rank 0 feeds the recorder
    (record_ranks), any other only runs its ranks (ranks_only). A backend says which node this is and how its
    ranks start (`_spec`, `_launch`)."""

    def __init__(self, job: Job, on_event: Callable[[JobEvent], None], placement: dict[str, str], work: Path) -> None:
        self.job = job
        self.on_event = on_event
        self.placement = placement
        self.work = work
        self.node: Any = None
        self.cancelled: int | None = None
        self.deferred: list[int] = []  # signals that arrived while the run was being recorded
        self.recording = False
        self.state = PENDING

    def status(self) -> str:
        return self.state

    def _records_here(self) -> bool:
        """Whether this process runs global rank 0, and so records the job."""
        return self.job.topology.node_rank == 0

    @abstractmethod
    def _spec(self, device: str, backend: str, log_dir: Path, plan: Any) -> LaunchSpec:
        """This node's ranks' LaunchSpec."""

    @abstractmethod
    def _launch(self, spec: LaunchSpec, on_message: Callable[[Message], None],
                on_ranks: Callable[[Any], None] | None = None) -> None:
        """Run this node's ranks to their end (launch.launch, with the backend's store, checks and cancel)."""

    def _closing(self) -> None:
        self.recording = True

    def wait(self) -> Outcome:
        self.state = RUNNING
        outcome: Outcome | None = None
        try:
            if self._records_here():
                outcome = after_deferred(record_ranks(self.job, self.work, self.node, self._spec, self._launch,
                                                      self.on_event, self._closing), self.deferred)
            else:
                outcome = ranks_only(self.job, self.work, self.node, self._spec, self._launch, self.on_event,
                                     self._closing)
            return outcome
        finally:
            self.state = outcome.status if outcome is not None and outcome.status in (FINISHED, KILLED) else FAILED
            shutil.rmtree(self.work, ignore_errors=True)


def _judging(job: Job) -> Callable[[str, str, str], None] | None:
    """The job's judge, which marks the job judged once it has run (Job.judge)."""
    judge = job.judge
    if judge is None:
        return None

    def run(run_id: str, status: str, message: str) -> None:
        judge(run_id, status, message)
        job.judged = True
    return run
