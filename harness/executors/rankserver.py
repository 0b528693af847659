"""The rank server kept warm between commands: with HARNESS_RANK_SERVER_IDLE_S=N (seconds, N > 0), the server that
forks the ranks (the standard library's forkserver with harness/executors/warm.py preloaded: torch, DDP, the data
loader - see procs.py) outlives the command that started it and serves every later command that would load the
same modules the same way, until it has been idle for N seconds. A command then pays no torch import at all: on two
cores that is about 5 s of a core per `harness run`, half of what a small run costs. The default (unset or 0) is one
server per launch, gone with the command.

Who may share a server, and why that is enough: a forked rank takes the command's environment, working folder and
sys.path at the fork (runtime/rank/child.py), so what a server decides for good is only what was fixed when it loaded
its modules and what a process inherits from its parent. Both are in the server's key, and a command whose key
differs starts a server of its own (the old one idles out):
- the interpreter and the files of the preloaded packages (harness's own sources, torch, numpy, omegaconf): an
  edited or upgraded package is loaded afresh;
- the variables read while torch and its math libraries load (IMPORT_TIME_PREFIXES: OMP_*, MKL_*, ATEN_*, ...),
  and PYTHONHASHSEED among the PYTHON* ones: the string-hash secret every fork inherits (harness/seeds.py);
- what the kernel gives a process from its parent: user, namespaces (a container, a network namespace standing
  for another host), cgroup (a Slurm job's), CPU affinity, resource limits, umask and nice value.

A server lives in a folder of its own, /tmp/harness-<uid>/rank-servers/<key>/ (0700; a Unix socket's path must stay
short), kept by a small process (the keeper) that started it and holds the one pipe whose end stops it. Each command
using it holds a shared lock on its `lease` file while it runs; the keeper stops the server only once nobody holds
the lease, the lease has not been touched for N seconds (SIGTERM: as soon as nobody holds it) and no rank is left. A command that was
killed loses its lease with its process. Ranks forked by a kept server are not the launcher's descendants: each
watches its launcher (runtime/rank/child.py) and dies with it, as a per-launch server's ranks do with their server.

Everything here is best effort: when a server cannot be kept (no /tmp, a Python whose forkserver differs), the
launch says so in one line and starts a server of its own, as by default.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import multiprocessing.util
import os
import resource
import signal
import socket
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.errors import HarnessError
from harness.scratch import alive

IDLE_ENV = "HARNESS_RANK_SERVER_IDLE_S"
# What the server imports once (a module of its own: importing it is the preload).
PRELOAD = "harness.executors.warm"
# The packages the preload loads whose files decide what a rank runs: an edited one means another server.
_PACKAGES = ("harness", "torch", "numpy", "omegaconf")
_PACKAGE_FILES = {"torch": ("__init__.py", "version.py", "lib/libtorch_cpu.so", "lib/libtorch_cuda.so"),
                  "numpy": ("__init__.py", "version.py"), "omegaconf": ("__init__.py", "version.py")}
# Variables read while torch, numpy and their math libraries load (thread pools, kernels chosen, allocators): the
# server loaded under its own values, so only a command with the same values may use it.
IMPORT_TIME_PREFIXES = (
    "OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "BLIS_", "ATEN_", "DNNL_", "ONEDNN_", "TORCH", "PYTORCH_",
    "CUDA_", "CUBLAS", "CUDNN", "NVIDIA_", "NCCL_", "HIP_", "ROCM_", "HSA_", "LD_", "PYTHON", "MALLOC_", "GLIBC_",
)
_ROOT = Path("/tmp")  # not $TMPDIR: the socket's path must fit in 107 bytes
_START_S = 10.0  # for a new keeper to say where its server listens
# A key folder nobody used for this long is removed by the next keeper that starts: every change of harness's
# files or of the environment makes a new key, and a developer's edits would otherwise leave one folder each.
STALE_S = 24 * 3600.0


def idle_s(environ: dict[str, str] | None = None) -> float:
    """How long a kept server waits for the next command; 0: none is kept (the default)."""
    raw = (os.environ if environ is None else environ).get(IDLE_ENV, "").strip()
    if not raw:
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (0 <= value < float("inf")):
        raise HarnessError(f"{IDLE_ENV}={raw!r} is not a number of seconds >= 0. Set it to how long the rank server "
                           "stays warm after a command (0 or unset: one server per launch).")
    return value


def supported() -> bool:
    """Does this Python's forkserver speak the protocol harness adopts (no authentication step, the 3.8-3.13 one)?"""
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    return (sys.platform == "linux" and sys.version_info < (3, 14) and server is not None
            and all(hasattr(server, a) for a in ("_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid")))


# --- the key ------------------------------------------------------------------------------------------------------

def _files(package: str) -> list[Path]:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return []
    root = Path(next(iter(spec.submodule_search_locations)))
    if package == "harness":
        return sorted(root.rglob("*.py"))
    return [root / name for name in _PACKAGE_FILES[package]]


def _signature(path: Path) -> list[Any]:
    try:
        st = path.stat()
    except OSError:
        return [str(path), None]
    return [str(path), st.st_size, st.st_mtime_ns, st.st_ino]


def _process_facts() -> dict[str, Any]:
    facts: dict[str, Any] = {"uid": os.getuid(), "gid": os.getgid(), "groups": sorted(os.getgroups()),
                             "affinity": sorted(os.sched_getaffinity(0)), "nice": os.nice(0)}
    with contextlib.suppress(OSError):
        facts["ns"] = sorted(f"{n}:{os.readlink(f'/proc/self/ns/{n}')}" for n in os.listdir("/proc/self/ns"))
    with contextlib.suppress(OSError):
        facts["cgroup"] = Path("/proc/self/cgroup").read_text()
    with contextlib.suppress(OSError):
        facts["umask"] = next((line.split()[1] for line in Path("/proc/self/status").read_text().splitlines()
                               if line.startswith("Umask:")), None)
    facts["rlimits"] = {name: resource.getrlimit(getattr(resource, name)) for name in sorted(dir(resource))
                        if name.startswith("RLIMIT_")}
    return facts


def key(environ: dict[str, str] | None = None) -> str:
    """Commands with equal keys may share a server: see the module's docstring for what goes in."""
    environ = dict(os.environ if environ is None else environ)
    facts = {
        "python": [os.path.realpath(sys.executable), sys.version, sys.flags],
        "env": sorted((k, v) for k, v in environ.items() if k.startswith(IMPORT_TIME_PREFIXES)),
        "files": [_signature(p) for package in _PACKAGES for p in _files(package)],
        "process": _process_facts(),
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def root() -> Path:
    return _ROOT / f"harness-{os.getuid()}" / "rank-servers"


def _private_dir(path: Path) -> Path:
    """Make `path` (and its parents up to /tmp) a folder of this user's that nobody else may enter; a planted link
    or someone else's folder is refused: the socket in it takes pickles to run."""
    for folder in [*reversed(path.relative_to(_ROOT).parents), path.relative_to(_ROOT)]:
        full = _ROOT / folder
        if str(folder) == ".":
            continue
        with contextlib.suppress(FileExistsError):
            os.mkdir(full, 0o700)
        st = os.lstat(full)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise HarnessError(f"{full} is not a private folder of this user's (a link, another user's, or open to "
                               "others): remove it, or unset HARNESS_RANK_SERVER_IDLE_S.")
    return path


# --- a command's side: attach to a kept server, or start one ---------------------------------------------------

@dataclass
class Lease:
    """This command's hold on a kept server: released (and the idle clock restarted) by release()."""

    key: str
    folder: Path
    address: str
    server_pid: int
    keeper_pid: int
    fd: int  # the lease file, locked shared
    alive_fd: int  # what the stdlib passes each fork as its "alive" pipe end (the rank closes it at once)

    def release(self) -> None:
        with contextlib.suppress(OSError):
            os.utime(self.folder / "lease")
        for fd in (self.fd, self.alive_fd):
            with contextlib.suppress(OSError):
                os.close(fd)


def _read_state(folder: Path) -> dict[str, Any] | None:
    try:
        state = json.loads((folder / "state.json").read_text())
    except (OSError, ValueError):
        return None
    pids_alive = all(isinstance(state.get(k), int) and alive(state[k]) for k in ("keeper", "server"))
    return state if pids_alive else None


@contextlib.contextmanager
def _locked(path: Path, how: int):
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, how)
        yield fd
    finally:
        os.close(fd)


def lease(environ: dict[str, str] | None = None) -> Lease:
    """Hold the kept server for this command's key, starting it (and its keeper) if none runs; OSError or
    HarnessError when it cannot be had."""
    idle = idle_s(environ)
    name = key(environ)
    folder = _private_dir(root() / name)
    with _locked(folder / "lock", fcntl.LOCK_EX):
        state = _read_state(folder)
        if state is None:
            state = _start_keeper(folder, idle)
        fd = os.open(folder / "lease", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            # The keeper takes this lock exclusively only while it holds `lock` (which this command holds now).
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            os.utime(folder / "lease")
        except OSError:
            os.close(fd)
            raise
    alive_fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    return Lease(name, folder, state["address"], state["server"], state["keeper"], fd, alive_fd)


def _start_keeper(folder: Path, idle: float) -> dict[str, Any]:
    with contextlib.suppress(OSError):
        (folder / "state.json").unlink()
    keeper = subprocess.Popen(
        [sys.executable, "-m", "harness.executors.rankserver", str(folder), repr(idle)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True,
        start_new_session=True, cwd="/",  # no terminal's signals, no folder of the command's held open
    )
    deadline = time.monotonic() + _START_S
    while time.monotonic() < deadline:
        state = _read_state(folder)
        if state is not None and state.get("keeper") == keeper.pid:
            return state
        if keeper.poll() is not None:
            break
        time.sleep(0.02)
    with contextlib.suppress(OSError):
        keeper.kill()
    raise HarnessError(f"the rank server's keeper did not start within {_START_S:.0f} s (exit {keeper.poll()})")


def adopt(held: Lease) -> None:
    """Point the standard library's forkserver client in this process at the kept server: its Process.start() then
    forks there. (Its private state: the standard library has no call for a server it did not start.)"""
    server: Any = multiprocessing.forkserver._forkserver
    server._forkserver_address = held.address
    server._forkserver_alive_fd = held.alive_fd
    server._forkserver_pid = None
    # Its own ensure_running() would start a server of this process's (and waitpid one that is not its child).
    server.ensure_running = multiprocessing.resource_tracker.ensure_running


def forget() -> None:
    """Undo adopt(): the next start starts a server of this process's own."""
    server: Any = multiprocessing.forkserver._forkserver
    server.__dict__.pop("ensure_running", None)
    server._forkserver_address = server._forkserver_alive_fd = server._forkserver_pid = None


def stop_all(harness_root: Path | None = None) -> list[int]:
    """Ask the keepers of this user's kept servers (those of one harness checkout, if given) to stop their servers
    as soon as no command holds them; returns their pids."""
    asked = []
    for state_file in sorted(root().glob("*/state.json")) if root().is_dir() else []:
        state = _read_state(state_file.parent)
        if state is None or (harness_root is not None and state.get("harness") != str(harness_root)):
            continue
        with contextlib.suppress(OSError):
            os.kill(state["keeper"], signal.SIGTERM)
            asked.append(state["keeper"])
    return asked


# --- the keeper (this module run as a script) --------------------------------------------------------------------

def _keep(folder: Path, idle: float) -> int:
    stopping = False

    def stop(*_: Any) -> None:
        nonlocal stopping
        stopping = True

    # Caught, not ignored: an ignored signal stays ignored across exec, and the server's forks would inherit that.
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    address = str(folder / "socket")
    with contextlib.suppress(OSError):
        os.unlink(address)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(address)
    os.chmod(address, 0o600)
    listener.listen()
    alive_r, alive_w = os.pipe()
    command = f"from multiprocessing.forkserver import main; main({listener.fileno()}, {alive_r}, {[PRELOAD]!r})"
    server = subprocess.Popen([sys.executable, *multiprocessing.util._args_from_interpreter_flags(), "-c", command],  # type: ignore[attr-defined]
                              pass_fds=(listener.fileno(), alive_r), stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/")
    listener.close()
    os.close(alive_r)
    harness_root = Path(__file__).resolve().parents[1]
    tmp = folder / f".state.{os.getpid()}"
    tmp.write_text(json.dumps({"keeper": os.getpid(), "server": server.pid, "address": address,
                               "harness": str(harness_root), "idle_s": idle}))
    tmp.replace(folder / "state.json")
    sweep(keep=folder)
    poll = max(0.05, min(1.0, idle / 4))
    while server.poll() is None:
        time.sleep(poll)
        try:
            quiet = time.time() - (folder / "lease").stat().st_mtime
        except OSError:
            quiet = float("inf")
        if (stopping or quiet >= idle) and not _has_children(server.pid) and _unheld(folder):
            break
    os.close(alive_w)  # the server's own signal to end, once it sees the pipe closed
    try:
        server.wait(timeout=10)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
    return 0


def sweep(keep: Path, stale_s: float = STALE_S) -> list[Path]:
    """Remove the key folders (but `keep`) that no keeper serves and no command used for `stale_s`; returns them.
    Each is removed under its own `lock`, taken without waiting: a command attaching to it right now keeps it."""
    removed = []
    now = time.time()
    for folder in sorted(root().iterdir()) if root().is_dir() else []:
        if folder == keep or folder.is_symlink() or not folder.is_dir():
            continue
        try:
            used = max(f.lstat().st_mtime for f in (folder, *folder.iterdir()))
            if now - used < stale_s or _read_state(folder) is not None:
                continue
            with _locked(folder / "lock", fcntl.LOCK_EX | fcntl.LOCK_NB):
                for f in folder.iterdir():
                    f.unlink()
                folder.rmdir()
            removed.append(folder)
        except OSError:  # in use, not ours, or already gone: left as it is
            continue
    return removed


def _has_children(pid: int) -> bool:
    """Does the server still have a rank? (One whose launcher died and that did not follow it: it must not lose its
    parent, whose death would kill it unannounced.)"""
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            if int(stat_file.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                return True
    return False


def _unheld(folder: Path) -> bool:
    """True, with the server's state removed, when no command holds the lease: none can take it after that (taking
    it needs `lock`, held here while the state goes). False while some command holds it."""
    try:
        with _locked(folder / "lock", fcntl.LOCK_EX), _locked(folder / "lease", fcntl.LOCK_EX | fcntl.LOCK_NB):
            return _remove_state(folder)
    except BlockingIOError:
        return False


def _remove_state(folder: Path) -> bool:
    state = _read_state(folder)
    if state is not None and state.get("keeper") == os.getpid():
        for name in ("state.json", "socket"):
            with contextlib.suppress(OSError):
                (folder / name).unlink()
    return True


if __name__ == "__main__":
    sys.exit(_keep(Path(sys.argv[1]), float(sys.argv[2])))
