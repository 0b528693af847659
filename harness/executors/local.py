"""The local backend: this machine's ranks, started by mp.spawn; several machines with one launcher each.

The launcher process that runs global rank 0 records the job: runtime facts, rank 0's messages
(metrics, fingerprints, checkpoints), logs, and how it ended. On other nodes the launcher only runs
its ranks and reports to node 0 through the rendezvous (executors/multinode.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from harness import scratch, tags as T
from harness.config import check_nodes, is_no_image, split_entry, to_container, to_yaml
from harness.errors import EXIT_FAILED, EXIT_OK, HarnessError, Interrupted, RunFailed
from harness.executors.base import (
    FAILED,
    FINISHED,
    KILLED,
    PENDING,
    RUNNING,
    Backend,
    Event,
    Executor,
    Handle,
    Job,
    Outcome,
)
from harness.executors.launch import LaunchSpec, failed, failure_details, is_peer_failure, launch, resolve_device
from harness.executors.multinode import check_topology, differing
from harness.judge.delta import setting_risk
from harness.messages import (
    Checkpoint,
    Determinism,
    DeterminismChanged,
    Final,
    Fingerprint,
    Initial,
    Message,
    Metrics,
    MetricsBatch,
    Notice,
    SettingChange,
    Total,
    UserSeeds,
)
from harness.record.provenance import package_lock, runtime_facts
from harness.runtime import usermlflow, userseed
from harness.store.reach import absolute_uri, reason_of
from harness.store.tracking import Outages, Patient, Tracker, save_series, transient, unwritable
from harness.systems import docker

ENV_DIGEST = "HARNESS_IMAGE_DIGEST"  # a container cannot learn its own digest: the docker backend tells it


def local_image_tags(image: str) -> dict[str, str]:
    """The pinned image and, when a local engine knows it, its registry digest (else why not)."""
    digest: str | None
    image_id: str | None
    reason: str | None
    if is_no_image(image):
        digest, image_id, reason = None, None, "no image pinned (image: none): a local-only experiment"
    else:
        digest, image_id, reason = docker.local_digest_or_reason(image)
    facts = {
        T.IMAGE: image,
        T.IMAGE_DIGEST: digest or "unknown",
        T.EXECUTOR: "local",
        T.IMAGE_NOTE: "ran outside the pinned image (local executor): the environment is this machine's",
    }
    if image_id:
        facts[T.IMAGE_ID] = image_id
    if reason:
        facts[T.IMAGE_DIGEST_REASON] = reason
    return facts


def launch_spec(
    cfg: DictConfig, code_dir: Path, device: str, backend: str, log_dir: Path, checkpoints: Any = None,
    data: dict[str, str] | None = None,
) -> Any:
    """The plain-values description of the ranks for this config (see launch.LaunchSpec)."""
    from harness.runtime.determinism import derive_rank_seeds

    entry_file, entry_func = split_entry(str(cfg.entry))
    return LaunchSpec(
        code_dir=str(Path(code_dir).resolve()),
        entry_file=entry_file,
        entry_func=entry_func,
        world_size=cfg.world_size,
        device=device,
        backend=backend,
        seed=cfg.seed,
        rank_seeds=derive_rank_seeds(cfg.seed, cfg.world_size),
        threads_per_rank=cfg.threads_per_rank,
        determinism=cfg.determinism.level.value,
        fingerprint_every=cfg.fingerprint_every,
        train_cfg=to_container(cfg)["train"],
        log_dir=str(log_dir),
        checkpoints=checkpoints,
        invariant_shards=cfg.determinism.shards if cfg.determinism.world_size_invariant else 0,
        timeout_s=float(cfg.timeout_s),
        output_dir=str(Path(log_dir).parent / "outputs"),
        data=dict(data or {}),
    )


def checkpoint_store(tracker: Tracker, run_id: str, cfg: DictConfig, resume_step: int | None) -> Any:
    """The run's checkpoints (checkpoint_store.CheckpointStore), None when it neither saves nor loads any."""
    from harness.record import checkpoints as checkpoint_store

    if cfg.checkpoint_every <= 0 and resume_step is None:
        return None
    return checkpoint_store.open_for(tracker, run_id)


def checkpoint_plan(store: Any, cfg: DictConfig, **kwargs: Any) -> Any:
    """Checkpoints live in the run's own artifacts (through a staging folder for a server's), so the MLflow UI
    lists them with the run."""
    from harness.runtime.context import CheckpointPlan

    if store is None:
        return None
    return CheckpointPlan(str(store.directory), cfg.checkpoint_every, **kwargs)


def check_runnable(cfg: DictConfig, nproc: int | None = None) -> tuple[str, str]:
    """This machine can run `nproc` ranks (default: all of world_size) of `cfg`: (device, backend), or HarnessError."""
    return resolve_device(cfg.device.value, cfg.backend.value, cfg.world_size if nproc is None else nproc)


def run_segments(
    cfg: DictConfig, exp_dir: Path, plans: list[Any], on_message: Callable[[Message], None],
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


def config_id(cfg: DictConfig) -> str:
    return hashlib.sha256(to_yaml(cfg).encode()).hexdigest()


class LocalExecutor(Executor):
    name = "local"

    def prepare(self, job: Job) -> dict[str, str]:
        check_topology(job.topology)
        check_nodes(job.topology.nnodes, job.cfg.world_size, "--nnodes")
        check_runnable(job.cfg, job.cfg.world_size // job.topology.nnodes)
        return local_image_tags(str(job.cfg.image))

    def start(self, job: Job, on_event: Callable[[Event], None]) -> Handle:
        handle = LocalHandle(job, on_event, job.placement)
        handle.start()
        return handle

    def check_segments(self, cfg: DictConfig) -> None:
        check_runnable(cfg)

    def run_segments(self, job: Job, plans: list[Any], on_message: Callable[[Message], None]) -> None:
        run_segments(job.cfg, job.exp_dir, plans, on_message, job.data)


EXECUTOR = LocalExecutor
BACKEND = Backend(
    name="local", executor=LocalExecutor, runs_segments=True,
    help="ranks run on this machine (or on several, one `harness run --nnodes` each)",
)


class LocalHandle(Handle):
    """This node's ranks; on the node that runs rank 0, also the job's record."""

    def __init__(self, job: Job, on_event: Callable[[Event], None], placement: dict[str, str]) -> None:
        self.job = job
        self.on_event = on_event
        self.placement = placement
        self.node: Any = None
        self.cancelled: int | None = None
        self.deferred: list[int] = []  # signals that arrived while the run was being recorded
        self.recording = False
        self.state = PENDING
        # Ranks started before the record already write their logs into <work>/logs.
        self.work = Path(job.ranks.log_dir).parent if job.ranks is not None else scratch.make("run")

    @property
    def records(self) -> bool:
        return self.job.topology.node_rank == 0

    def status(self) -> str:
        return self.state

    def cancel(self, signum: int) -> None:
        if self.recording:  # a signal now would cut the record short: it waits until the run is closed
            self.deferred.append(signum)
        else:
            self.cancelled = signum

    def start(self) -> None:
        """Rendezvous with the other nodes (if any), then record the run (node 0) or attach to it."""
        job, topo = self.job, self.job.topology
        tags = {**self.placement, T.NNODES: str(topo.nnodes), T.NPROC_PER_NODE: str(job.cfg.world_size // topo.nnodes),
                T.LAUNCHER: topo.launcher}
        if topo.scheduler.get("job_id"):
            tags[T.SLURM_JOB_ID] = topo.scheduler["job_id"]
            tags[T.SLURM_NODELIST] = topo.scheduler.get("nodelist", "")
        try:
            if not topo.multi_node:
                job.run_id = job.record(tags) if job.record else job.run_id
                return
            from harness.executors.multinode import Node, node_facts

            self.node = Node(topo, float(job.cfg.rendezvous_timeout_s))
            joined = self.node.join(node_facts(job.code_id, config_id(job.cfg)))
            if joined is None:
                job.run_id = self.node.attach()
                print(f"node {topo.node_rank}: joined run {job.run_id}", file=sys.stderr, flush=True)
                return
            tags[T.MASTER] = f"{topo.master_addr}:{topo.master_port}"
            self._record_and_publish({**tags, **_node_tags(joined.nodes)}, joined.nodes, "node 0")
        except BaseException:
            shutil.rmtree(self.work, ignore_errors=True)
            raise

    def _record_and_publish(self, tags: dict[str, str], nodes: dict[int, dict[str, Any]] | None, who: str) -> None:
        """Node 0 after the rendezvous: record the one run with every node's facts, then tell the others its id."""
        job = self.job
        try:
            job.run_id = job.record(tags) if job.record else job.run_id
        except BaseException as err:
            self.node.fail(f"{who} could not record the run: {err}")
            raise
        if nodes:
            job.tracker.log_text(job.run_id, json.dumps({str(k): v for k, v in nodes.items()}, indent=2), T.ARTIFACT_NODES)
        self.node.publish(job.run_id)

    def wait(self) -> Outcome:
        self.state = RUNNING
        outcome: Outcome | None = None
        try:
            outcome = self._run_and_record() if self.records else self._run_ranks_only()
            return outcome
        finally:
            self.state = outcome.status if outcome is not None and outcome.status in (FINISHED, KILLED) else FAILED
            shutil.rmtree(self.work, ignore_errors=True)

    # -- the node that runs rank 0 -----------------------------------------------------------------
    def _run_and_record(self) -> Outcome:
        from harness.executors.console import Console

        job, tracker, run_id, cfg = self.job, self.job.tracker, self.job.run_id, self.job.cfg
        resume_step = job.resume_step
        log_dir = self.work / "logs"
        log_dir.mkdir(exist_ok=True)
        writer = console = heartbeat = ckpts = lock = None
        outages = Outages()  # the store going away mid-run: writes are retried, the run records it
        failure_text = ""  # the failing rank's traceback, printed once the progress view is closed
        fingerprints: dict[int, str] = {}
        notices: dict[str, str] = {}  # the ranks' warnings about the record, by kind
        final: dict[str, Any] = {"checkpoints": {}, "checkpoint_tensors": {}, "notices": notices, "determinism_changes": []}
        warned: set[tuple[str | None, str]] = set()  # strict: each call that broke bitwise is warned about once
        prior = None
        if resume_step is not None:
            prior = tracker.load_record(run_id)
            fingerprints = {k: v for k, v in prior.fingerprints.items() if k < resume_step}
            final["checkpoints"] = {k: v for k, v in prior.checkpoints.items() if k <= resume_step}
            final["checkpoint_tensors"] = {k: v for k, v in (prior.checkpoint_tensors or {}).items() if k <= resume_step}
            # Changes made before the resumed step stay on record; the resumed ranks' own readings follow them.
            earlier = (SettingChange.from_line(line) for line in prior.facts.get(T.DETERMINISM_CHANGES, "").splitlines())
            final["determinism_changes"] = [c for c in earlier if c is not None and c.step < resume_step]
        status, code, message = T.FAILED, EXIT_FAILED, ""
        try:
            nproc = cfg.world_size // job.topology.nnodes
            device, backend = check_runnable(cfg, nproc)
            facts = {T.ENV_PREFIX + k: v for k, v in runtime_facts().items()}
            facts.update({T.DEVICE: device, T.BACKEND: backend})
            # Where the ranks run: inside the pinned image only if the docker backend said so.
            in_image = bool(os.environ.get(ENV_DIGEST))
            facts[T.IN_IMAGE] = str(in_image).lower()
            if in_image:
                facts[T.IMAGE_NOTE] = f"ran inside the pinned image {os.environ[ENV_DIGEST]}"
            tracker.set_tags(run_id, facts)
            # Where the ranks run: every installed distribution (seconds to read), written while they start.
            lock = _in_thread(lambda: tracker.log_text(run_id, "\n".join(package_lock()) + "\n", T.ARTIFACT_LOCK))

            heartbeat = tracker.heartbeat(run_id, cfg.heartbeat_s, outages)
            ckpts = checkpoint_store(tracker, run_id, cfg, resume_step)
            if ckpts is not None:
                if resume_step is not None and not ckpts.fetch(resume_step, cfg.world_size):
                    raise HarnessError(f"run {run_id} has no complete checkpoint of step {resume_step} in its artifacts.")
                ckpts.start_uploads(outages)
            plan = checkpoint_plan(ckpts, cfg, **({} if resume_step is None else {"resume_step": resume_step}))
            spec = self._spec(device, backend, log_dir, plan)
            spec.run_id = run_id
            # The user's own mlflow calls in rank 0 land in this run, never in a store of the code folder.
            experiment_id = tracker.get_run(run_id).experiment_id
            spec.env.update(usermlflow.run_env(absolute_uri(tracker.client_uri), run_id, experiment_id))
            writer = tracker.metric_writer(run_id, cfg.flush_interval_s, outages)
            if prior is not None:
                writer.prime(prior.metrics)
            console = Console(log_dir / "rank0.log", f"{Path(job.exp_dir).resolve().name} x{cfg.world_size}",
                              show=not job.options.quiet)

            def on_message(msg: Message) -> None:
                match msg:
                    case Metrics(step, values, unix_ms):
                        writer.add(step, values, unix_ms)
                    case MetricsBatch():
                        writer.add_batch(msg)
                    case Fingerprint(step, sha256):
                        fingerprints[step] = sha256
                    case Final(sha256, steps, of):
                        final["fingerprint"], final["steps_total"], final["of"] = sha256, steps, of
                    case Notice(key, text):
                        notices.setdefault(key, text)
                        console.write(f"Warning: {text}")
                    case Initial(sha256):
                        final["initial"] = sha256
                    case Determinism(settings, env):
                        final["determinism"], final["vars"] = dict(settings), env
                        final["determinism_start"] = dict(settings)
                    case DeterminismChanged(changes):
                        # The tags say what was in force: the last reading (the start values stay in the changes).
                        final["determinism"].update({c.setting: c.after for c in changes})
                        if prior is not None:
                            # A resumed process runs train()'s own switches again: the same transition by the same
                            # line before the resume step is the change already recorded, not a second one.
                            known = {(c.setting, c.before, c.after, c.where) for c in final["determinism_changes"]}
                            changes = tuple(c for c in changes if (c.setting, c.before, c.after, c.where) not in known)
                        final["determinism_changes"].extend(changes)
                        for line in strict_warnings(cfg.determinism.level.value, changes, warned):
                            console.write(line)
                    case UserSeeds(calls):
                        final["user_seeds"] = calls
                    case Total(steps):
                        console.total(steps)
                    case Checkpoint(step, sha256, tensors, ranks):
                        final["checkpoints"][step] = sha256
                        final["checkpoint_tensors"][step] = {"tensors": tensors, "ranks": list(ranks)}
                        ckpts.completed(step)
                self.on_event(msg)

            try:
                # The bar counts rank 0's steps as its clock has them (optimizer steps), whatever it logs at.
                self._launch(launch, spec, on_message, on_ranks=lambda ranks: console.follow_steps(ranks.progress))
                lock.result()
                if writer.conflict is not None:
                    key, at, was, now = writer.conflict
                    raise failed(
                        f"the resumed run logged {key}={now!r} at step {at}, where the run it continues had logged {was!r}: "
                        "it is not the uninterrupted run's continuation (both values are kept in MLflow's history). "
                        f"Replay the run from its start instead: harness replay {run_id} --allow-incomplete.", None
                    )
                status, code = T.FINISHED, EXIT_OK
            except RunFailed as err:
                rank, tb, expected = failure_details(err)
                failure_text = "" if expected else tb
                message = str(err)
                tracker.log_text(run_id, f"rank: {rank}\n\n{tb}", T.ARTIFACT_FAILURE)
                tracker.set_tags(run_id, {T.FAILED_RANK: str(rank), T.STATUS_REASON: message})
            except Interrupted as err:
                status, code, message = T.KILLED, err.exit_code, str(err)
                tracker.set_tags(run_id, {T.STATUS_REASON: message})
        except BaseException as err:
            message = str(err)
            if self.node is not None:
                self.node.fail(f"node 0: {message}")
            tracker.set_tags(run_id, {T.STATUS_REASON: message[:500]})
            raise
        finally:
            self.recording = True
            if lock is not None:  # the lock's write ends before the run is closed, whatever happened
                from concurrent.futures import wait

                wait([lock])
            if console is not None:
                console.close()
            if failure_text:
                print(failure_text.rstrip(), file=sys.stderr)
            # End-of-run writes wait for a store that is briefly away (HARNESS_STORE_OUTAGE_S); past that,
            # the outcome is kept on disk and the error says where.
            patient = Patient(tracker, outages)
            outages.closing()
            failed_write: Exception | None = None
            try:
                if heartbeat is not None:
                    heartbeat.close()
                if writer is not None:
                    writer.close()
                    save_series(writer.series, self.work / "series.npz")
                if ckpts is not None:
                    ckpts.close()
                if self.node is not None:  # the other nodes' rank logs, before the record is closed and sealed
                    missing = self.node.collect_logs(log_dir)
                    if missing:
                        notices.setdefault("logs", f"the rank logs of node {', '.join(map(str, missing))} did not "
                                           "reach node 0: the record holds node 0's logs only for them")
                logs = T.ARTIFACT_LOGS_DIR if resume_step is None else f"{T.ARTIFACT_LOGS_DIR}/resume-from-{resume_step}"
                _record_results(patient, run_id, fingerprints, final, self.work, logs)
                if writer is not None:
                    _note_direct_metrics(patient, run_id, set(writer.series))
                if status == T.FINISHED:
                    _warn_if_vacuous(patient, run_id, writer, final)
                patient.set_tags(run_id, outages.tags())
                if ckpts is not None:
                    ckpts.cleanup()
            except Exception as err:  # the record is incomplete: whatever ran, the run cannot be FINISHED
                failed_write = err
            self._close_run(patient, status, message, failed_write, fingerprints, final, writer, outages)
        if self.deferred:
            import signal

            print(f"{signal.Signals(self.deferred[0]).name} arrived while the run was being recorded; it was recorded "
                  "in full first.", file=sys.stderr)
            code = 128 + self.deferred[0]
        return Outcome(run_id, status, code, message, fingerprints)

    def _close_run(self, patient: Patient, status: str, message: str, failed_write: Exception | None,
                   fingerprints: dict[int, str], final: dict[str, Any], writer: Any, outages: Outages) -> None:
        """End the run in the store as `status` when every closing write went through. When one failed the record
        is incomplete: the run is FAILED with the reason (if the store still takes that), else it stays RUNNING;
        either way its outcome is kept on disk and one line says which, as the store has it."""
        run_id, shown = self.job.run_id, self.job.tracker.display_uri
        if failed_write is None:
            try:
                patient.end_run(run_id, status)
                return
            except Exception as end_err:
                failed_write = end_err
        err = failed_write
        root: BaseException = err
        while root.__cause__ is not None:  # the store's own words, not a wrapper's
            root = root.__cause__
        full = unwritable(err)
        if full:
            cause = f"the tracking store {shown} {full} ({reason_of(root)})"
            fix = ("Free space on its disk" if full == "is full" else "Make it writable") + \
                " (or use another store with --tracking-uri), then rerun"
        elif transient(err):
            cause = (f"the tracking store {shown} stayed unreachable for over {outages.limit_s:g} s "
                     f"(HARNESS_STORE_OUTAGE_S): {reason_of(err)}")
            fix = "Check the store, then rerun"
        else:
            cause = f"recording run {run_id} failed: {reason_of(err)}"
            fix = "Check the store and the message above, then rerun"
        reason = f"{cause} while the run was being closed ({status}): its record is incomplete"
        with contextlib.suppress(Exception):
            patient.set_tags(run_id, {T.STATUS_REASON: reason[:500]})
        try:  # tried even when the reason did not fit: a full disk may take an update when it takes no new rows
            patient.end_run(run_id, T.FAILED)
            ended = True
        except Exception:
            ended = False
        try:
            kept: str = f"kept in {self._keep_outcome(status, message, fingerprints, final, writer, outages)}"
        except OSError as keep_err:
            kept = f"not kept either ({keep_err.strerror})"
        state = (f"so it is {T.FAILED} in the store" + ("" if status == T.FAILED else f", not {status}") if ended else
                 f"and the store took no status either: run {run_id} stays {T.RUNNING} in the store until "
                 f"`harness mark {run_id} --status {T.FAILED}` (once its heartbeat is stale)")
        raise HarnessError(f"{cause} while run {run_id} was being closed, {state}. Its outcome, metrics and logs are "
                           f"{kept}. {fix}.", exit_code=EXIT_FAILED) from err

    def _keep_outcome(self, status: str, message: str, fingerprints: dict[int, str], final: dict[str, Any],
                      writer: Any, outages: Outages) -> Path:
        """What the store could not take, moved out of the work folder (which is removed) to a lasting one."""
        work = self.work
        if writer is not None:
            save_series(writer.series, work / "series.npz")
        doc = {
            "run_id": self.job.run_id, "status": status, "status_reason": message, "tags": outages.tags(),
            "metrics_not_written": writer.pending if writer is not None else 0,
            "fingerprints": {str(k): v for k, v in sorted(fingerprints.items())},
            "final": final,  # fingerprints, checkpoints, determinism settings and variables: the tags not written
        }
        (work / "outcome.json").write_text(json.dumps(doc, indent=2, default=str))
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "harness" / "unsent"
        base.mkdir(parents=True, exist_ok=True)
        kept = base / self.job.run_id
        shutil.rmtree(kept, ignore_errors=True)
        shutil.move(str(work), str(kept))
        return kept

    # -- another node --------------------------------------------------------------------------------
    def _run_ranks_only(self) -> Outcome:
        job, cfg = self.job, self.job.cfg
        log_dir = self.work / "logs"
        log_dir.mkdir()
        device, backend = check_runnable(cfg, cfg.world_size // job.topology.nnodes)
        # Node 0's launcher uploads the steps: it reads this node's rank files from the shared staging folder.
        plan = checkpoint_plan(checkpoint_store(job.tracker, job.run_id, cfg, job.resume_step), cfg,
                               **({} if job.resume_step is None else {"resume_step": job.resume_step}))
        spec = self._spec(device, backend, log_dir, plan)
        spec.run_id = job.run_id
        status, code, message = T.FINISHED, EXIT_OK, ""
        try:
            self._launch(launch, spec, self.on_event)
        except RunFailed as err:
            status, code, message = T.FAILED, EXIT_FAILED, str(err)
        except Interrupted as err:
            status, code, message = T.KILLED, err.exit_code, str(err)
        finally:
            self.recording = True
            # Every rank's log belongs to the one run (names carry the global rank): node 0 records them.
            self.node.send_logs(log_dir)
        return Outcome(job.run_id, status, code, message)

    # -- shared --------------------------------------------------------------------------------------
    def _spec(self, device: str, backend: str, log_dir: Path, plan: Any) -> Any:
        topo = self.job.topology
        spec = launch_spec(self.job.cfg, self.job.exp_dir, device, backend, log_dir, plan, self.job.data)
        if topo.multi_node:
            spec.node_rank, spec.nproc = topo.node_rank, self.job.cfg.world_size // topo.nnodes
            spec.master_addr, spec.port = str(topo.master_addr), int(topo.master_port)
        return spec

    def _launch(self, launch: Any, spec: Any, on_message: Callable[[Message], None],
                on_ranks: Callable[[Any], None] | None = None) -> None:
        """Run the ranks; across nodes, a failure anywhere ends every node and is named once."""
        node = self.node
        if node is None:
            launch(spec, on_message, cancelled=lambda: self.cancelled, ranks=self.job.ranks, on_ranks=on_ranks)
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
            raise cause  # noqa: B904 - its __cause__ is the rank's _RankError (multinode.blame); `from` would replace it
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


def _in_thread(fn: Callable[[], Any]) -> Any:
    """A future of fn(), run in a thread of its own (a store write that need not hold up the ranks)."""
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(1, thread_name_prefix="harness-lock")
    try:
        return pool.submit(fn)
    finally:
        pool.shutdown(wait=False)


def _node_tags(nodes: dict[int, dict[str, Any]]) -> dict[str, str]:
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
        print(f"Warning: the nodes' environments differ ({tags[T.NODES_DIFFER]}); recorded, and a replay's delta "
              "will show it.", file=sys.stderr)
    return tags


def _record_results(
    tracker: Tracker | Patient, run_id: str, fingerprints: dict[int, str], final: dict[str, Any], work: Path, logs: str
) -> None:
    tags: dict[str, str] = {}
    if "determinism" in final:
        tags.update({T.DETERMINISM_PREFIX + k: v for k, v in final["determinism"].items()})
        tags.update({T.VAR_PREFIX + k: v for k, v in final["vars"].items()})
        changes = final.get("determinism_changes", [])
        tags[T.DETERMINISM_CHANGES] = changes_tag(changes)
        doc = {"start": final.get("determinism_start", {}), "in_force": final["determinism"],
               "changes": [asdict(c) for c in changes]}
        tracker.log_text(run_id, json.dumps(doc, indent=1), T.ARTIFACT_DETERMINISM)
    if final.get("fingerprint"):
        tags[T.FINGERPRINT] = final["fingerprint"]
    if final.get("of"):
        tags[T.FINGERPRINT_OF] = final["of"]
    if final.get("notices"):
        tags[T.NOTICES] = "\n".join(final["notices"].values())[:4900]
    if final.get("user_seeds"):
        tags[T.USER_SEEDS] = userseed.describe(final["user_seeds"])
    tracker.set_tags(run_id, tags)
    if fingerprints or final.get("fingerprint") or final["checkpoints"]:
        doc = {
            "steps": {str(k): v for k, v in sorted(fingerprints.items())},
            "final": final.get("fingerprint"),
            "steps_total": final.get("steps_total"),
            "checkpoints": {str(k): v for k, v in sorted(final["checkpoints"].items())},
        }
        tracker.log_text(run_id, json.dumps(doc, indent=2), T.ARTIFACT_FINGERPRINTS)
    if final.get("checkpoint_tensors"):
        tracker.log_text(run_id, checkpoint_fingerprints_json(final["checkpoint_tensors"]),
                         T.ARTIFACT_CHECKPOINT_FINGERPRINTS)
    if (work / "series.npz").exists():
        tracker.log_file(run_id, work / "series.npz", str(Path(T.ARTIFACT_SERIES).parent))
    if any((work / "logs").iterdir()):
        tracker.log_dir(run_id, work / "logs", logs)
    outputs = work / "outputs"
    if outputs.is_dir() and any(outputs.iterdir()):
        tracker.log_dir(run_id, outputs, T.ARTIFACT_OUTPUTS_DIR)


_CHANGES_SHOWN = 40  # lines in the changes tag (MLflow keeps 8,000 characters); the artifact holds them all


def changes_tag(changes: list[SettingChange]) -> str:
    """The harness.determinism.changes tag: one line per change, "none" when the training code changed nothing."""
    if not changes:
        return "none"
    lines = [c.line() for c in changes[:_CHANGES_SHOWN]]
    if len(changes) > _CHANGES_SHOWN:
        lines.append(f"... {len(changes) - _CHANGES_SHOWN} more in {T.ARTIFACT_DETERMINISM}")
    return "\n".join(lines)


def strict_warnings(level: str, changes: tuple[SettingChange, ...], warned: set[tuple[str | None, str]]) -> list[str]:
    """Under strict, one warning per call of the training code that made bitwise results impossible (`warned`:
    the calls already warned about, updated)."""
    if level != "strict":
        return []
    lines = []
    for c in changes:
        risk = setting_risk(c.setting, c.after)
        what = c.call or f"{c.setting} = {c.after}"
        if risk is None or (c.where, what) in warned:
            continue
        warned.add((c.where, what))
        who = c.where or f"the training code (seen at step {c.step}, {c.when})"
        lines.append(f"Warning: {who} set {what} under determinism.level=strict: {risk}. Recorded in "
                     f"{T.DETERMINISM_CHANGES}; remove that line to keep strict's guarantee, or set determinism.level=off.")
    return lines


def checkpoint_fingerprints_json(steps: dict[int, dict[str, Any]]) -> str:
    """The per-tensor checkpoint fingerprints artifact: step -> {"tensors": name -> sha256, "ranks": [sha256]}."""
    from harness.runtime.checkpoint import FINGERPRINT_FORMAT

    doc = {"format": FINGERPRINT_FORMAT, "steps": {str(k): v for k, v in sorted(steps.items())}}
    return json.dumps(doc, indent=1, sort_keys=True)


def _note_direct_metrics(tracker: Tracker | Patient, run_id: str, ctx_keys: set[str]) -> None:
    """Metrics the training code logged through MLflow itself: kept in the run, named in a tag, and said once
    to be outside what replay compares (series.npz holds only ctx.log's values)."""
    keys = usermlflow.direct_keys(tracker.get_run(run_id).metric_keys, ctx_keys)
    if keys:
        tracker.set_tags(run_id, {T.USER_MLFLOW_METRICS: ",".join(keys)})
        print(usermlflow.direct_keys_warning(keys), file=sys.stderr)


def _warn_if_vacuous(tracker: Tracker | Patient, run_id: str, writer: Any, final: dict[str, Any]) -> None:
    """A finished run that logged nothing, or whose model never changed, proves nothing: say so, and record it."""
    initial, last = final.get("initial"), final.get("fingerprint")
    if writer is not None and not writer.series:
        if initial or last:
            print("Warning: the run logged no metrics (call ctx.log(...) in train); a replay can only compare "
                  "the model's fingerprints.", file=sys.stderr)
        else:
            print("Warning: the run logged no metrics and registered no model (ctx.log(...), ctx.ddp(model)): a "
                  "replay will have nothing to compare.", file=sys.stderr)
    if initial and last:
        changed = initial != last
        tracker.set_tags(run_id, {T.INITIAL_FINGERPRINT: initial, T.WEIGHTS_CHANGED: str(changed).lower()})
        if not changed:
            print("Warning: the model's weights never changed (its fingerprint at the end equals the one at "
                  "ctx.ddp): nothing was trained. Check the loss, the learning rate and optimizer.step().",
                  file=sys.stderr)
