"""The Slurm backend: the job is an sbatch script, one task per node, each running the local backend.

Why sbatch from a template rather than submitit: the job must run `harness _execute` on every node
(the ranks are spawned inside, per node, exactly as locally), and a plain batch script is what
Slurm users read, resubmit and debug by hand; submitit pickles a Python callable instead, which hides
the command and ties the job to the submitting interpreter's pickles. The script is kept beside its
output and its path printed.

The submitting process records the run first (so the job id, script and nodes land on it), then
follows the job: its output streams to stderr, Ctrl-C cancels it with scancel, and a job that ends
without closing its run (killed by the scheduler, out of time) is closed here with the job's state.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from harness import events, tags as T
from harness.config import check_nodes
from harness.configschema import ExperimentConfig
from harness.errors import EXIT_FAILED, EXIT_OK, BackendError, ConfigError, UsageError
from harness.executors.base import (
    FAILED,
    FINISHED,
    KILLED,
    PENDING,
    RUNNING,
    Backend,
    CliOption,
    Job,
    JobEvent,
    Output,
    Submitted,
    Topology,
)
from harness.executors.common import local_image_tags
from harness.executors.multinode import node_topology
from harness.executors.remote import Ended, RemoteExecutor, RemoteHandle, execute_command, this_python
from harness.record.checkout import checkout
from harness.store.uris import database_file


@dataclass
class SlurmConfig:
    """How `executor: slurm` asks for resources: one task per node, the node's ranks spawned inside it."""

    nodes: int = 1
    """Nodes to run on; world_size must be a multiple of it (world_size / nodes ranks per node)."""
    partition: str | None = None
    time: str | None = None
    """Time limit as sbatch takes it (e.g. 01:00:00); none: the partition's default."""
    gpus_per_node: int = 0
    cpus_per_task: int | None = None
    """CPUs for each node's task; none: threads_per_rank x ranks per node."""
    poll_s: float = 1.0
    """How often the submitting process asks the scheduler whether the job still runs."""


def check(cfg: ExperimentConfig) -> None:
    """The `slurm:` section's ranges (checked on every config, whichever executor it names)."""
    slurm = cfg.section("slurm", SlurmConfig)
    check_nodes(slurm.nodes, cfg.world_size, "slurm.nodes (--nodes)")
    if slurm.gpus_per_node < 0:
        raise ConfigError(f"slurm.gpus_per_node must be >= 0, got {slurm.gpus_per_node}.")
    if slurm.cpus_per_task is not None and slurm.cpus_per_task < 1:
        raise ConfigError(f"slurm.cpus_per_task must be >= 1, got {slurm.cpus_per_task}.")
    if not slurm.poll_s > 0:
        raise ConfigError(f"slurm.poll_s must be > 0 seconds, got {slurm.poll_s}.")


_CALL_S = 30.0  # deadline of one sbatch/scontrol/scancel call
_ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
          "DEADLINE", "SPECIAL_EXIT", "REVOKED"}
_PORT_BASE = 20000  # MASTER_PORT = base + job id mod 20000: distinct for jobs sharing a node


def _slurm(args: list[str], timeout_s: float = _CALL_S) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=timeout_s)
    except FileNotFoundError:
        raise BackendError(f"{args[0]} not found: this machine is not a Slurm client. Install Slurm's client "
                           "commands (and point SLURM_CONF at the cluster), or use --executor local.") from None
    except subprocess.TimeoutExpired:
        conf = os.environ.get("SLURM_CONF", "the default slurm.conf")
        raise BackendError(f"`{' '.join(args[:2])}` did not answer within {timeout_s:g} s: the Slurm controller "
                           f"({conf}) is unreachable or overloaded.") from None


def job_dir(run_id: str) -> Path:
    """Where the batch script and its output live: a folder every node sees (home, by default)."""
    base = Path(os.environ.get("HARNESS_SLURM_DIR") or Path.home() / ".cache" / "harness" / "slurm")
    path = base / run_id
    path.mkdir(parents=True, exist_ok=True)
    return path


def batch_script(job: Job, exp_dir: Path, out: Path, tracking_uri: str) -> str:
    """The sbatch script: resources, the first node's address as the rendezvous, one task per node."""
    cfg, slurm = job.cfg, job.cfg.section("slurm", SlurmConfig)
    nodes = slurm.nodes
    per_node = cfg.world_size // nodes
    cpus = slurm.cpus_per_task or cfg.threads_per_rank * per_node
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name=harness-{Path(job.exp_dir).resolve().name}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --cpus-per-task={cpus}",
        f"#SBATCH --output={out / 'slurm-%j.out'}",
    ]
    if slurm.partition:
        lines.append(f"#SBATCH --partition={slurm.partition}")
    if slurm.time:
        lines.append(f"#SBATCH --time={slurm.time}")
    if slurm.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={slurm.gpus_per_node}")
    command = execute_command(job, str(Path(exp_dir).resolve()), this_python())
    lines += [
        "set -euo pipefail",
        "# Node 0 (the first node of the allocation) hosts the job's rendezvous; its address, not its name,",
        "# since node names need not resolve on the compute network.",
        'first=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        'export MASTER_ADDR=$(scontrol show node "$first" | tr " " "\\n" | sed -n "s/^NodeAddr=//p")',
        f"export MASTER_PORT=$(({_PORT_BASE} + SLURM_JOB_ID % 20000))",
        f"export MLFLOW_TRACKING_URI={shlex.quote(tracking_uri)}",
        "export PYTHONUNBUFFERED=1",
        "# One task per node; each spawns its node's ranks. A task that fails ends the others.",
        "exec srun --kill-on-bad-exit=1 --ntasks-per-node=1 " + " ".join(shlex.quote(c) for c in command),
    ]
    return "\n".join(lines) + "\n"


def place(env: Mapping[str, str]) -> Topology | None:
    """A task of a Slurm job: its node from SLURM_NODEID / SLURM_NNODES, the rendezvous from the MASTER_ADDR and
    MASTER_PORT the batch script exported; None outside a Slurm job."""
    if "SLURM_NODEID" not in env or "SLURM_NNODES" not in env or not env.get("SLURM_JOB_ID"):
        return None
    scheduler = {T.SLURM_JOB_ID: env["SLURM_JOB_ID"], T.SLURM_NODELIST: env.get("SLURM_JOB_NODELIST", "")}
    return node_topology(env, env["SLURM_NODEID"], env["SLURM_NNODES"], "slurm", scheduler)


class SlurmExecutor(RemoteExecutor):
    name = "slurm"

    def prepare(self, job: Job) -> dict[str, str]:
        if job.topology.multi_node:
            raise UsageError("--nnodes is for jobs started by hand on each node; with --executor slurm use --nodes N.")
        check_nodes(job.cfg.section("slurm", SlurmConfig).nodes, job.cfg.world_size, "slurm.nodes (--nodes)")
        if shutil.which("sbatch") is None:
            raise BackendError("sbatch not found: this machine is not a Slurm client. Install Slurm's client commands "
                               "(and point SLURM_CONF at the cluster), or use --executor local.")
        ping = _slurm(["scontrol", "ping"], timeout_s=10)
        if ping.returncode != 0 or "UP" not in ping.stdout:
            raise BackendError(f"the Slurm controller does not answer (scontrol ping: "
                               f"{(ping.stdout or ping.stderr).strip() or ping.returncode}). Check SLURM_CONF and slurmctld.")
        if database_file(job.tracker.uri) is not None:
            events.emit(events.Notice(
                "Note: the tracking store is a local SQLite file; every Slurm node must see it at the same path "
                "(a shared filesystem), or use an MLflow server (MLFLOW_TRACKING_URI=http://...)."))
        tags = local_image_tags(str(job.cfg.image))
        tags[T.EXECUTOR] = "slurm"
        tags[T.IMAGE_NOTE] = "ran on the Slurm nodes' own environment, outside the pinned image"
        return tags

    def launch(self, job: Job, on_event: Callable[[JobEvent], None], code: contextlib.ExitStack) -> RemoteHandle:
        folder = job_dir(job.run_id)
        # The nodes run the recorded code from a worktree in the job's folder (which they all see),
        # never the live working tree, which may change while the job waits in the queue.
        tree, exp_dir = code.enter_context(
            checkout(job.tracker, job.tracker.harness_run(job.run_id), job.code_root, base=folder))
        script = folder / "job.sbatch"
        script.write_text(batch_script(job, exp_dir, folder, job.tracker.uri))
        submitted = _slurm(["sbatch", "--parsable", str(script)])
        job_id = submitted.stdout.strip().split(";")[0]
        if submitted.returncode != 0 or not job_id.isdigit():
            reason = (submitted.stderr or submitted.stdout).strip().splitlines()
            raise BackendError(f"sbatch refused the job: {reason[-1] if reason else submitted.returncode}", EXIT_FAILED)
        job.tracker.set_tags(job.run_id, {T.SLURM_JOB_ID: job_id})
        on_event(Submitted(job_id, f"script {script}, output {folder / f'slurm-{job_id}.out'}"))
        return SlurmHandle(job, job_id, folder / f"slurm-{job_id}.out", on_event, code)


EXECUTOR = SlurmExecutor
BACKEND = Backend(
    name="slurm", executor=SlurmExecutor, section=SlurmConfig, check=check, runs_segments=True,
    places_nodes=True, place=place, executes="local",
    help="submitted as a batch job, one task per node",
    cli=(
        CliOption("--nodes", "slurm_nodes", "slurm: nodes to run on (one task per node).", int, min=1, key="nodes"),
        CliOption("--partition", "partition", "slurm: partition to submit to.", key="partition"),
        CliOption("--time", "slurm_time", "slurm: time limit (e.g. 01:00:00).", key="time"),
        CliOption("--gpus-per-node", "gpus_per_node", "slurm: GPUs per node.", int, min=0, key="gpus_per_node"),
    ),
)


def job_state(job_id: str) -> tuple[str, str]:
    """(state, reason) of a job, e.g. ("RUNNING", "None"); ("GONE", ...) once the controller forgot it."""
    shown = _slurm(["scontrol", "show", "job", "-o", job_id])
    if shown.returncode != 0:
        if "Invalid job id" in shown.stderr:
            return "GONE", "the controller no longer knows the job"
        return "UNKNOWN", shown.stderr.strip()
    state = re.search(r"\bJobState=(\S+)", shown.stdout)
    reason = re.search(r"\bReason=(\S+)", shown.stdout)
    return (state[1] if state else "UNKNOWN"), (reason[1] if reason else "")


class SlurmHandle(RemoteHandle):
    def __init__(
        self, job: Job, job_id: str, output: Path, on_event: Callable[[JobEvent], None], code: contextlib.ExitStack
    ) -> None:
        super().__init__(job, code)
        self.job_id, self.output, self.on_event = job_id, output, on_event
        self._offset = 0
        self._partial = ""

    def poll(self) -> str:
        """The scheduler's state of the job, asked once (scontrol answers at once, or within _CALL_S)."""
        state, _ = job_state(self.job_id)
        if state in ("PENDING", "CONFIGURING", "REQUEUED", "RESIZING", "SUSPENDED"):
            return PENDING
        if state in ("RUNNING", "COMPLETING", "UNKNOWN"):
            return RUNNING
        if state == "COMPLETED":
            return FINISHED
        return KILLED if state in ("CANCELLED", "PREEMPTED", "DEADLINE", "TIMEOUT") else FAILED

    def stop(self) -> None:
        # scancel sends SIGTERM to every task; each harness inside stops its ranks, node 0 marks the run KILLED.
        _slurm(["scancel", self.job_id])

    def _stream(self, final: bool = False) -> None:
        try:
            with open(self.output, errors="replace") as fh:
                fh.seek(self._offset)
                chunk = fh.read()
                self._offset = fh.tell()
        except FileNotFoundError:
            return
        *lines, self._partial = (self._partial + chunk).split("\n")
        if final and self._partial:
            lines, self._partial = [*lines, self._partial], ""
        for line in lines:
            self.on_event(Output(line))

    def follow(self) -> Ended:
        tracker, run_id = self.job.tracker, self.job.run_id
        poll = self.job.cfg.section("slurm", SlurmConfig).poll_s
        state, reason = "PENDING", ""
        while True:
            self._stream()
            state, reason = job_state(self.job_id)
            if state in _ENDED or state == "GONE":
                break
            time.sleep(poll)
        # The run is closed by node 0 inside the job; give its last writes a moment to land.
        deadline = time.monotonic() + 10
        status = tracker.get_run(run_id).status
        while status == T.RUNNING and time.monotonic() < deadline:
            time.sleep(0.5)
            status = tracker.get_run(run_id).status
        self._stream(final=True)
        # A job that ended without closing its run: the scheduler killed it (or it ran out of time).
        return Ended(EXIT_OK, f"Slurm job {self.job_id} ended {state}",
                     vanished=f"Slurm job {self.job_id} ended {state} ({reason}) before the run ended",
                     killed=state in ("CANCELLED", "PREEMPTED", "DEADLINE", "TIMEOUT"))
