"""Real multi-host test infrastructure: two network-namespace hosts and a two-node Slurm cluster.

`two_hosts` runs scripts/hosts-up.sh: namespaces hn1 (198.51.100.1) and hn2 (198.51.100.2), each
with an `eth0`, on one bridge that the root namespace reaches at 198.51.100.254. `slurm` runs
scripts/slurm-up.sh on top: slurmctld in the root namespace, slurmd node1 in hn1 and node2 in hn2.
The filesystem (/tmp, /work) is shared by all of them; only the network and, for slurmd and its job
steps, the hostname differ. `lab_server` runs scripts/labserver-up.sh: PostgreSQL and an
`mlflow server --serve-artifacts` on loopback, a lab's tracking server. conftest.py re-exports them.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"
# Fixed folders, not pytest's tmp dirs: those are 0700 and slurmctld runs as user slurm.
HOSTS_STATE = Path(os.environ.get("HARNESS_HOSTS_STATE", "/tmp/harness-hosts"))
SLURM_STATE = Path(os.environ.get("HARNESS_SLURM_STATE", "/tmp/harness-slurm"))
LABSERVER_STATE = Path(os.environ.get("HARNESS_LABSERVER_STATE", "/tmp/harness-labserver"))
# Set to 1 to leave what the fixtures started running after the session (to inspect it).
KEEP = os.environ.get("HARNESS_INFRA_KEEP") == "1"

UP_TIMEOUT_S = 300  # the first bring-up on a fresh machine installs packages with apt
DOWN_TIMEOUT_S = 120
CALL_TIMEOUT_S = 30  # any single Slurm client command

# Job states after which a job never runs again (squeue/scontrol spelling).
FINAL_STATES = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
     "BOOT_FAIL", "DEADLINE"}
)


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false")


def _unavailable(what: str, reason: str) -> None:
    # CI promises this infrastructure: there, its absence is a failure, not a reason to skip.
    if in_ci():
        pytest.fail(f"{what} is required in CI: {reason}")
    pytest.skip(f"no {what} here: {reason}")


def _tail(text: str, lines: int = 5) -> str:
    return " | ".join(text.strip().splitlines()[-lines:])


def _check_tools(what: str) -> None:
    if os.geteuid() != 0:
        _unavailable(what, "network namespaces need root")
    for tool in ("ip", "nsenter", "unshare"):
        if shutil.which(tool) is None:
            _unavailable(what, f"`{tool}` is not on PATH")


def _up(script: str, state_dir: Path) -> subprocess.CompletedProcess:
    """Run scripts/SCRIPT STATE_DIR; stdout and stderr in one stream, in the order written, so that
    the last line of a failed bring-up is its error."""
    return subprocess.run(
        ["bash", str(SCRIPTS / script), str(state_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=UP_TIMEOUT_S, check=False,
    )


def _run_script(what: str, script: str, state_dir: Path) -> None:
    """Run scripts/SCRIPT STATE_DIR for a bring-up; fail or skip (see _unavailable) if it fails."""
    try:
        proc = _up(script, state_dir)
    except (OSError, subprocess.TimeoutExpired) as err:
        _unavailable(what, f"scripts/{script} could not run: {err}")
    if proc.returncode != 0:
        _unavailable(what, f"scripts/{script} {state_dir} failed: {_tail(proc.stdout)}")


def _teardown(script: str, state_dir: Path) -> None:
    subprocess.run(["bash", str(SCRIPTS / script), str(state_dir)], check=False, timeout=DOWN_TIMEOUT_S)


# --- two hosts -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TwoHosts:
    """Two network namespaces on one bridge; processes in them share this machine's filesystem."""

    state_dir: Path
    namespaces: tuple[str, str] = ("hn1", "hn2")
    addresses: Mapping[str, str] = field(
        default_factory=lambda: {"hn1": "198.51.100.1", "hn2": "198.51.100.2"}
    )
    # The root namespace's address on the same bridge (where slurmctld listens).
    root_address: str = "198.51.100.254"
    # The interface inside each namespace. The root namespace has an eth0 too (the machine's own
    # network): GLOO_SOCKET_IFNAME=eth0 means the bridge only for processes inside hn1/hn2.
    ifname: str = "eth0"

    def ns_argv(self, ns: str, argv: Sequence[str]) -> list[str]:
        if ns not in self.namespaces:
            raise ValueError(f"unknown namespace {ns!r}; valid: {', '.join(self.namespaces)}")
        # nsenter, not `ip netns exec`: that also remounts /sys in a new mount namespace.
        return ["nsenter", f"--net=/run/netns/{ns}", *argv]

    def ns_popen(self, ns: str, argv: Sequence[str], env: Mapping[str, str], **kw) -> subprocess.Popen:
        """Start ARGV inside namespace NS with exactly ENV (pass os.environ plus what it needs)."""
        return subprocess.Popen(self.ns_argv(ns, argv), env=dict(env), **kw)


def _hosts_present(hosts: TwoHosts) -> bool:
    return all(Path(f"/run/netns/{ns}").exists() for ns in (*hosts.namespaces, "hnsw"))


@pytest.fixture(scope="session")
def two_hosts() -> Iterator[TwoHosts]:
    """Namespaces hn1/hn2 up and pinging each other; removed at the end if this session made them."""
    what = "two network-namespace hosts"
    _check_tools(what)
    hosts = TwoHosts(state_dir=HOSTS_STATE)
    made = not _hosts_present(hosts)
    _run_script(what, "hosts-up.sh", HOSTS_STATE)  # idempotent: also checks connectivity
    yield hosts
    if made and not KEEP:
        _teardown("hosts-down.sh", HOSTS_STATE)


# --- Slurm ---------------------------------------------------------------------------------------


def parse_scontrol(line: str) -> dict[str, str]:
    """`scontrol show ... -o` output (one line of Key=Value) as a dict.

    Values may hold '=' (TRES=cpu=2,node=1) and, rarely, spaces (Command=, WorkDir=): a new field
    starts only at a space followed by a key and '='.
    """
    fields: dict[str, str] = {}
    for token in re.split(r" (?=[A-Za-z][\w/:]*=)", line.strip()):
        key, sep, value = token.partition("=")
        if sep:
            fields[key] = value
    return fields


@dataclass(frozen=True)
class Slurm:
    """A running two-node cluster; every client call goes through `env` (SLURM_CONF set)."""

    conf: Path
    env: Mapping[str, str]
    state_dir: Path
    hosts: TwoHosts
    partition: str = "debug"
    nodes: tuple[str, str] = ("node1", "node2")
    # node -> address; the first node's is what MASTER_ADDR must be for a job spanning both.
    node_addresses: Mapping[str, str] = field(
        default_factory=lambda: {"node1": "198.51.100.1", "node2": "198.51.100.2"}
    )

    def run(self, argv: Sequence[str], timeout: float = CALL_TIMEOUT_S, cwd: Path | str | None = None,
            env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
        """A Slurm client command (sinfo, squeue, scontrol...) with `self.env` plus ENV; raises if
        it fails."""
        proc = subprocess.run(
            list(argv), env={**self.env, **(env or {})}, cwd=cwd, capture_output=True, text=True,
            timeout=timeout, check=False,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip()}")
        return proc

    def sbatch(self, *args: str, cwd: Path | str | None = None, env: Mapping[str, str] | None = None,
               timeout: float = CALL_TIMEOUT_S) -> str:
        """Submit a job (`sbatch --parsable ARGS...`); returns its id. sbatch passes its whole
        environment (`self.env` plus ENV) on to the job: --export=ALL is the default."""
        proc = self.run(["sbatch", "--parsable", *args], timeout=timeout, cwd=cwd, env=env)
        return proc.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job -o ID` as a dict (kept MinJobAge=600 s after the job ends)."""
        return parse_scontrol(self.run(["scontrol", "show", "job", "-o", job_id]).stdout)

    def job_state(self, job_id: str) -> str:
        """PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, ... (see FINAL_STATES)."""
        return self.job(job_id)["JobState"]

    def wait(self, job_id: str, timeout: float = 60) -> str:
        """Poll until the job reaches a final state; returns it. (`sbatch --wait` polls far slower.)"""
        deadline = time.monotonic() + timeout
        while (state := self.job_state(job_id)) not in FINAL_STATES:
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {state} after {timeout}s")
            time.sleep(0.2)
        return state

    def scancel(self, job_id: str) -> None:
        self.run(["scancel", job_id])


def _slurm_running(state_dir: Path) -> bool:
    pidfile = state_dir / "slurmctld.pid"
    try:
        os.kill(int(pidfile.read_text()), 0)
    except (OSError, ValueError):
        return False
    return True


@pytest.fixture(scope="session")
def slurm(two_hosts: TwoHosts) -> Iterator[Slurm]:
    """Two idle Slurm nodes (node1 in hn1, node2 in hn2), partition debug; stopped at the end if
    this session started them. State, config and logs: $HARNESS_SLURM_STATE (/tmp/harness-slurm)."""
    what = "two-node Slurm cluster"
    _check_tools(what)
    started = not _slurm_running(SLURM_STATE)
    _run_script(what, "slurm-up.sh", SLURM_STATE)  # idempotent: also waits for both nodes idle
    conf = SLURM_STATE / "slurm.conf"
    yield Slurm(conf=conf, env={**os.environ, "SLURM_CONF": str(conf)}, state_dir=SLURM_STATE,
                hosts=two_hosts)
    if started and not KEEP:
        _teardown("slurm-down.sh", SLURM_STATE)


# --- a lab tracking server ------------------------------------------------------------------------


@dataclass(frozen=True)
class LabServer:
    """PostgreSQL + `mlflow server --serve-artifacts` on loopback; clients use `uri` (http://, no secret)."""

    uri: str
    state_dir: Path

    @property
    def password(self) -> str:
        """The database password: what must never reach a harness record."""
        return (self.state_dir / "pg" / "password").read_text().strip()

    def stop_server(self) -> None:
        """Stop the mlflow server only (its process group); PostgreSQL keeps running."""
        pid = int((self.state_dir / "mlflow.pid").read_text())
        try:
            os.killpg(pid, 15)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + DOWN_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                os.killpg(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)
        os.killpg(pid, 9)

    def start_server(self) -> None:
        """Start the mlflow server again (labserver-up.sh keeps the running database); waits for /health."""
        proc = _up("labserver-up.sh", self.state_dir)
        if proc.returncode != 0:
            raise RuntimeError(f"labserver-up.sh failed: {_tail(proc.stdout)}")


def _labserver_running(state_dir: Path) -> bool:
    try:
        os.kill(int((state_dir / "mlflow.pid").read_text()), 0)
    except (OSError, ValueError):
        return False
    return True


@pytest.fixture(scope="session")
def lab_server() -> Iterator[LabServer]:
    """A lab tracking server for the session; a fresh database unless one already runs (then reused).
    State, logs and artifacts: $HARNESS_LABSERVER_STATE (/tmp/harness-labserver)."""
    what = "lab tracking server (PostgreSQL + mlflow server)"
    if os.geteuid() != 0:
        _unavailable(what, "initdb and postgres run as user postgres, which needs root to switch to")
    started = not _labserver_running(LABSERVER_STATE)
    if started:
        _teardown("labserver-down.sh", LABSERVER_STATE)  # a database left by an earlier session
        shutil.rmtree(LABSERVER_STATE, ignore_errors=True)
    _run_script(what, "labserver-up.sh", LABSERVER_STATE)  # idempotent; installs what is missing
    yield LabServer(uri=(LABSERVER_STATE / "uri").read_text().strip(), state_dir=LABSERVER_STATE)
    if started and not KEEP:
        _teardown("labserver-down.sh", LABSERVER_STATE)
