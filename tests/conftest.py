"""Shared fixtures: a real git repository in a tmp dir (with a space in its path), a real SQLite
MLflow store, and the real `harness` CLI run as a subprocess (or, for refusals, in this process).
Also sorts every test into one tier - unit, cli or infra - by what it needs (see pytest_collection_modifyitems)."""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import inspect
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import types
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import warmcli

# Real multi-host infrastructure (namespace hosts, a two-node Slurm cluster): see tests/infra.py.
from infra import lab_server, slurm, two_hosts  # noqa: F401  (fixtures, re-exported for every test module)

ROOT = Path(__file__).resolve().parent.parent
EXPERIMENTS = ROOT / "experiments"


def script(name: str) -> types.ModuleType:
    """scripts/<name>.py as a module (the scripts are no package): its functions tested as the library's are."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

# One rank server kept warm between the session's commands (harness/executors/rankserver.py) instead of one per
# launch: no torch import per command, about half the CPU of a small run. Every forked rank is still a fork of a
# server that imported harness's preload; the tests of the per-launch server itself (tests/test_startup.py) and of
# what a killed command leaves (tests/test_kills.py) set it to 0. Set here, before any worker or command starts.
KEPT_RANK_SERVER = "HARNESS_RANK_SERVER_IDLE_S"
os.environ.setdefault(KEPT_RANK_SERVER, "60")


# With a GPU present, `device: auto` (the schema's default, which the examples keep for their users) would move
# these tests onto cuda, where their golden losses - CPU losses - cannot match. Every command that composes an
# experiment folder's config gets device=cpu after its other arguments, unless the test names a device itself (a
# CUDA test passes device=cuda); replay, resume, audit and trace take the recorded config, and with it the device.
CPU = "device=cpu"
_COMPOSES_CONFIG = frozenset({"run", "check"})


def on_cpu(args: Sequence[str]) -> list[str]:
    """`harness ARGS` with device=cpu added where ARGS compose an experiment's config and name no device."""
    args = [str(a) for a in args]
    command = next((i for i, a in enumerate(args) if not a.startswith("-")), None)
    if command is None or args[command] not in _COMPOSES_CONFIG or {"-h", "--help"} & set(args):
        return args
    rest = args[command + 1 :]
    folder = any(not a.startswith("-") and "=" not in a for a in rest)  # else click refuses the missing folder
    if not folder or any(a.startswith("device=") for a in rest):
        return args
    return [*args, CPU]


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str

    @property
    def last_line(self) -> str:
        lines = self.stdout.strip().splitlines()
        return lines[-1] if lines else ""


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=repo, check=True, capture_output=True, text=True,
        env={**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.invalid",
             "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.invalid"},
    ).stdout.rstrip("\n")


# Loggers whose level the CLI sets when it opens a store (harness.tracking): restored after each in-process call.
_QUIETED_LOGGERS = ("mlflow", "alembic", "sqlalchemy")


@contextlib.contextmanager
def _chdir(path: Path) -> Iterator[None]:
    """contextlib.chdir, which Python 3.10 (still supported) lacks."""
    before = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


class Project:
    """A researcher's repository holding copies of the example experiments."""

    def __init__(self, root: Path, store: Path) -> None:
        self.root = root
        self.store = store
        self.uri = f"sqlite:///{store / 'mlflow.db'}"

    def harness(self, *args: str, cwd: Path | None = None, timeout: float = 600,
                env: dict[str, str] | None = None) -> Result:
        env = {**os.environ, "MLFLOW_TRACKING_URI": self.uri, "PYTHONUNBUFFERED": "1", **(env or {})}
        if warmcli.usable(env):  # the same command in its own process, without importing MLflow again
            return Result(*warmcli.run(on_cpu(args), cwd or self.root, env, timeout))
        proc = subprocess.run(
            [sys.executable, "-m", "harness", *on_cpu(args)], cwd=cwd or self.root, env=env,
            capture_output=True, text=True, timeout=timeout,
        )
        return Result(proc.returncode, proc.stdout, proc.stderr)

    def cli(self, *args: str, cwd: Path | None = None, env: dict[str, str] | None = None,
            color: bool = False) -> Result:
        """`harness ARGS` run in this process by click's CliRunner: the same Result as harness(), without the
        2-4 s a subprocess spends importing. Only for refusals and validation that end before any rank starts:
        nothing here may depend on process exit, signals, a terminal, or environment read at import time.

        An exception the CLI does not turn into an exit code propagates (a crash is never an exit code here),
        and what a command changes in this process - os.environ, sys.path, the cwd, signal handlers, MLflow's active
        run, its loggers' levels - is put back afterwards, so one call cannot leak into the next test. `color`: the
        output keeps click's colours, as a terminal gets them (without it, as a pipe does).
        """
        from click.testing import CliRunner

        main = importlib.import_module("harness.cli").main  # one string to change if the module moves
        env = {"MLFLOW_TRACKING_URI": self.uri, **(env or {})}
        saved_env, saved_path = dict(os.environ), list(sys.path)
        saved_signals = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        saved_levels = {name: logging.getLogger(name).level for name in _QUIETED_LOGGERS}
        try:
            with _chdir(cwd or self.root):
                # catch_exceptions=False: click still maps SystemExit to exit_code; anything else is raised.
                result = CliRunner().invoke(main, on_cpu(args), env=env, prog_name="python -m harness",
                                            catch_exceptions=False, color=color)
        finally:
            os.environ.clear()
            os.environ.update(saved_env)
            sys.path[:] = saved_path
            for sig, handler in saved_signals.items():
                signal.signal(sig, handler)
            for name, level in saved_levels.items():
                logging.getLogger(name).setLevel(level)
            if "mlflow" in sys.modules:
                mlflow = sys.modules["mlflow"]
                while mlflow.active_run() is not None:
                    mlflow.end_run()
        return Result(result.exit_code, result.stdout, result.stderr)

    def popen(self, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        env = {**os.environ, "MLFLOW_TRACKING_URI": self.uri, "PYTHONUNBUFFERED": "1", **(env or {})}
        return subprocess.Popen(
            [sys.executable, "-m", "harness", *on_cpu(args)], cwd=self.root, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        )

    def add_experiment(self, name: str, source: str = "linear_ddp", train_py: str | None = None,
                       yaml_extra: str = "", commit: bool = True) -> Path:
        dest = self.root / "experiments" / name
        if dest.exists():  # the session's project is shared: another module may have added it
            if train_py is not None:
                assert (dest / "train.py").read_text() == train_py, f"experiment {name} exists with other code"
            return dest
        shutil.copytree(EXPERIMENTS / source, dest)
        if train_py is not None:
            (dest / "train.py").write_text(train_py)
        if yaml_extra:
            with open(dest / "experiment.yaml", "a") as fh:
                fh.write(yaml_extra)
        if commit:
            git(self.root, "add", "-A")
            git(self.root, "commit", "-qm", f"add {name}")
        return dest

    def client(self):
        from mlflow.tracking import MlflowClient

        return MlflowClient(self.uri)

    def all_runs(self) -> list:
        client = self.client()
        ids = [e.experiment_id for e in client.search_experiments()]
        return client.search_runs(ids) if ids else []


def make_project(base: Path) -> Project:
    root = base / "my project"  # a space: paths must survive quoting nowhere
    (root / "experiments").mkdir(parents=True)
    store = base / "store"
    store.mkdir()
    for name in ("linear_ddp", "digits_cnn"):
        shutil.copytree(EXPERIMENTS / name, root / "experiments" / name)
    (root / ".gitignore").write_text("mlruns/\n__pycache__/\n")
    git(root, "init", "-q", "-b", "main")
    git(root, "remote", "add", "origin", "https://alice:s3cret@example.invalid/lab/project.git")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "experiments")
    return Project(root, store)


@pytest.fixture(scope="session")
def project(tmp_path_factory: pytest.TempPathFactory) -> Project:
    """One repository and store for the session: runs are slow, many tests read the same ones."""
    return make_project(tmp_path_factory.mktemp("session"))


@pytest.fixture(scope="session")
def reference_run(project: Project) -> str:
    """linear_ddp, one epoch, on this machine with mp.spawn: what other launch styles must equal bit for bit."""
    result = project.harness("run", "experiments/linear_ddp", "train.epochs=1")
    assert result.returncode == 0, result.stderr
    return result.last_line


# A study whose replays on "other hardware" differ in their last bits. One machine cannot change its
# CPU, so another thread count stands in for it, honestly: with two intra-op threads the loss's norm
# over 65,536 values is summed in two halves, so its last bits differ exactly as they would on a CPU
# with other vector units, and training carries the difference on. Code, data and seeds are as recorded.
WIDE_TRAIN = '''"""Linear(64, 1024) learning a fixed linear map; the loss normalises by norms over 65,536 values."""

import torch
from torch import nn


def train(ctx):
    cfg = ctx.cfg
    generator = torch.Generator().manual_seed(ctx.seed)
    data = torch.randn(cfg.samples, 64, generator=generator)
    teacher = torch.randn(64, 1024, generator=generator)
    loader = ctx.loader(data, batch_size=cfg.batch_size)
    model = ctx.ddp(nn.Linear(64, 1024))
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)

    def batch_loss(batch):
        output, target = model(batch), batch @ teacher
        return ((output / output.norm() - target / target.norm()) ** 2).sum() * 1000

    for epoch in ctx.epochs(cfg.epochs):
        for batch in loader:
            optimizer.zero_grad()
            loss = ctx.backward(batch.to(ctx.device), batch_loss)
            optimizer.step()
            ctx.log({"loss": loss}, ctx.step)
        ctx.print(f"epoch {epoch + 1}/{cfg.epochs} loss {loss.item():.4f}")
'''
WIDE_CONFIG = ["train.lr=0.5", "train.epochs=3", "train.batch_size=64", "train.samples=512"]
OTHER_HARDWARE = ["--allow-changes", "threads_per_rank=2"]


@pytest.fixture(scope="session")
def wide_study_run(project: Project) -> Result:
    """`harness run experiments/wide --seeds 3` (sequential), as the CLI answered it."""
    project.add_experiment("wide", train_py=WIDE_TRAIN)
    result = project.harness("run", "experiments/wide", "--seeds", "3", *WIDE_CONFIG)
    assert result.returncode == 0, result.stderr
    return result


@pytest.fixture(scope="session")
def wide_study(project: Project, wide_study_run: Result) -> tuple[str, dict[int, str]]:
    """(study id, seed -> member id) of a 3-seed study of the wide experiment, shared by the study, noise and
    claims tests."""
    study_id = wide_study_run.last_line
    members = {int(r.data.tags["harness.seed"]): r.info.run_id for r in project.all_runs()
               if r.data.tags.get("harness.study") == study_id}
    assert sorted(members) == [0, 1, 2]
    return study_id, members


@pytest.fixture
def fresh_project(tmp_path: Path) -> Project:
    return make_project(tmp_path)


@contextlib.contextmanager
def tmpfs(where: Path, options: str) -> Iterator[Path]:
    """A real tmpfs of `options` (size=..., nr_inodes=...) mounted at `where`: writes past it fail with ENOSPC
    mid-write; unmounted afterwards. Needs root: in CI (which runs as root) its absence is a failure."""
    if os.geteuid() != 0:
        if os.environ.get("CI") == "true":
            pytest.fail("the full-disk tests need root to mount a tmpfs in CI")
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    where.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill_disk(disk: Path) -> None:
    """Take every byte left on `disk` (a tmpfs), as another program would."""
    with open(disk / "filler", "wb") as fh, contextlib.suppress(OSError):
        while True:
            fh.write(b"\0" * 65536)
            fh.flush()


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 12 MB filesystem at tmp_path/"small disk"."""
    with tmpfs(tmp_path / "small disk", "size=12m") as disk:
        yield disk


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for every purpose but the process table.
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


# --- Docker engine + registry (real) -------------------------------------------------------------

STATE_DIR = Path(os.environ.get("HARNESS_DOCKER_STATE", "/tmp/harness-docker"))
REGISTRY = "127.0.0.1:5000"
IMAGE = "localhost:5000/harness-cpu:0.1"
REPOSITORY, TAG = "harness-cpu", "0.1"
MANIFEST_TYPES = ", ".join(
    [
        "application/vnd.docker.distribution.manifest.v2+json",
        "application/vnd.docker.distribution.manifest.list.v2+json",
        "application/vnd.oci.image.manifest.v1+json",
        "application/vnd.oci.image.index.v1+json",
    ]
)


def _registry_answers() -> bool:
    try:
        with urllib.request.urlopen(f"http://{REGISTRY}/v2/", timeout=2):
            return True
    except OSError:
        return False


def _unavailable(reason: str) -> None:
    # CI promises a Docker engine: there, its absence is a failure, not a reason to skip.
    if os.environ.get("CI") == "true":
        pytest.fail(f"Docker is required in CI: {reason}")
    pytest.skip(f"no Docker engine/registry here: {reason}")


def _tail(text: str, lines: int = 5) -> str:
    return " | ".join(text.strip().splitlines()[-lines:])


@pytest.fixture(scope="session")
def engine() -> Iterator[str]:
    """A running engine + registry with the CPU image pushed; yields the image tag.

    Reuses an engine and registry that already answer; otherwise runs scripts/docker-up.sh with its
    state (and so the image cache) in $HARNESS_DOCKER_STATE (default /tmp/harness-docker), and stops
    what it started at the end. The first build of the image takes minutes; later runs reuse it.
    """
    from harness.systems import docker

    started_engine = False
    if not (docker.engine_available()[0] and _registry_answers()):
        started_engine = not docker.engine_available()[0]
        try:
            proc = subprocess.run(
                ["bash", str(ROOT / "scripts" / "docker-up.sh"), str(STATE_DIR)],
                capture_output=True,
                text=True,
                timeout=900,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as err:
            _unavailable(f"scripts/docker-up.sh could not run: {err}")
        if proc.returncode != 0:
            _unavailable(f"scripts/docker-up.sh {STATE_DIR} failed: {_tail(proc.stderr + proc.stdout)}")
    # Always (re)build: the image must hold the harness as it is now, and a rebuild with nothing
    # changed takes seconds (every layer cached).
    proc = subprocess.run(
        ["bash", str(ROOT / "docker" / "build-cpu-image.sh"), "--push", IMAGE],
        capture_output=True,
        text=True,
        timeout=3600,
        check=False,
    )
    if proc.returncode != 0:
        pytest.fail(f"docker/build-cpu-image.sh --push failed: {_tail(proc.stderr + proc.stdout, 15)}")
    yield IMAGE
    if started_engine and os.environ.get("HARNESS_DOCKER_KEEP") != "1":
        subprocess.run(["bash", str(ROOT / "scripts" / "docker-down.sh"), str(STATE_DIR)], check=False, timeout=120)


def _registry_digest(repository: str, tag: str) -> str | None:
    """The manifest digest the registry itself serves for repository:tag (None if it has none)."""
    request = urllib.request.Request(
        f"http://{REGISTRY}/v2/{repository}/manifests/{tag}", headers={"Accept": MANIFEST_TYPES}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            body = response.read()
            header: str = response.headers["Docker-Content-Digest"]
    except OSError:
        return None
    # The header must be the digest of the exact bytes served: guards against a misread header.
    assert header == "sha256:" + hashlib.sha256(body).hexdigest()
    return header


# --- tiers: unit, cli, infra ---------------------------------------------------------------------
# Every test gets exactly one tier, from what it needs, so that `-m unit` (seconds to minutes) and
# `-m "not infra"` (no Docker, Slurm, namespaces, server or browser) are meaningful selections:
#   infra - a Docker engine, Slurm, network-namespace hosts, a real `mlflow server`/PostgreSQL, a browser
#           (by the fixtures it uses, the `slow` marker, or what its code starts);
#   cli   - runs harness commands (subprocess or in-process), ranks (start_ranks, launch), git or any
#           other process;
#   unit  - everything else: library code called directly, in seconds (a module that computes for minutes in-process,
#           the verdict calibration, declares itself cli: `-m unit` stays under a minute).
# What counts is the test function, every fixture it uses (transitively) and every helper they call
# that is defined in tests/. A test module's own `pytestmark` (or a test's marker) of a tier wins.
TIERS = ("unit", "cli", "infra")
INFRA_FIXTURES = frozenset({"engine", "two_hosts", "slurm", "lab_server"})
INFRA_CODE = re.compile(r"open_page\(|chromium\(|\"mlflow\", \"server\"")
CLI_CODE = re.compile(r"\.harness\(|\.popen\(|\.cli\(|make_project\(|\bgit\(|subprocess|Popen|mp\.spawn|"
                      r"sys\.executable|CliRunner|multiprocessing|start_ranks\(|\blaunch\(|procs\.start\(")
TESTS_DIR = Path(__file__).resolve().parent


def _own_functions(fn, seen: set) -> Iterator[str]:
    """The source of `fn` and of every function defined in tests/ that it names, transitively."""
    fn = inspect.unwrap(getattr(fn, "__func__", fn))  # a test in a class is collected as a bound method
    if fn in seen or not inspect.isfunction(fn):
        return
    seen.add(fn)
    source, named = _read_function(fn)
    if source is None:
        return
    yield source
    for target in named:
        yield from _own_functions(target, seen)


# Every worker sorts every test at collection, and most tests share their helpers and fixtures: each function's source
# is read once (inspect.getsource tokenises the file again at each call), not once per test that reaches it.
_READ: dict[object, tuple[str | None, tuple]] = {}


def _read_function(fn) -> tuple[str | None, tuple]:
    """(`fn`'s source, the functions it names), or (None, ()) for a function outside tests/ or without source."""
    if fn in _READ:
        return _READ[fn]
    _READ[fn] = None, ()
    try:
        if not Path(inspect.getfile(fn)).resolve().is_relative_to(TESTS_DIR):
            return _READ[fn]
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        return _READ[fn]
    codes, names = [fn.__code__], set()
    while codes:
        code = codes.pop()
        names.update(code.co_names)
        codes.extend(c for c in code.co_consts if inspect.iscode(c))
    named: list = []
    for name in sorted(names):
        target = fn.__globals__.get(name)
        if inspect.isfunction(target):
            named.append(target)
        elif inspect.isclass(target):
            named.extend(member for member in vars(target).values() if inspect.isfunction(member))
    _READ[fn] = source, tuple(named)
    return _READ[fn]


def _tier(item: pytest.Item) -> str:
    if item.get_closest_marker("slow") or INFRA_FIXTURES.intersection(item.fixturenames):
        return "infra"
    seen: set = set()
    functions = [getattr(item, "function", None)]
    info = getattr(item, "_fixtureinfo", None)
    for name in item.fixturenames:
        for fixturedef in (info.name2fixturedefs.get(name, ()) if info else ()):
            functions.append(fixturedef.func)
    code = "\n".join(src for fn in functions if fn is not None for src in _own_functions(fn, seen))
    if INFRA_CODE.search(code):
        return "infra"
    return "cli" if CLI_CODE.search(code) else "unit"


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's, which would make a bare `-n N` distribute test by test
def pytest_cmdline_main(config: pytest.Config) -> None:
    """`-n N` alone runs as `-n N --dist loadgroup`: the groups below are what keeps a module's shared fixtures (and a
    daemon's tests) on one worker, and every documented command relies on them."""
    if getattr(config.option, "numprocesses", None) and getattr(config.option, "dist", "no") == "no":
        config.option.dist = "loadgroup"


def pytest_configure_node(node) -> None:  # type: ignore[no-untyped-def]  (pytest-xdist's hook, in the controller)
    node.workerinput["harness_dist"] = node.config.getvalue("dist")


def pytest_unconfigure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the controller, once every worker is done: this checkout's servers go
        from harness.executors import rankserver

        rankserver.stop_all(ROOT / "harness")


def pytest_configure(config: pytest.Config) -> None:
    # A worker parses the command line again, without the dist chosen above: it is told.
    if getattr(config, "workerinput", {}).get("harness_dist") == "loadgroup":
        config.option.loadgroup = True


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook, which reads the xdist_group marks set here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if not any(item.get_closest_marker(tier) for tier in TIERS):
            item.add_marker(_tier(item))
        # The adversarial suite (`-m adversarial`) is a module family, across tiers: one place the next round adds to.
        if Path(str(item.fspath)).name.startswith("test_adversarial_"):
            item.add_marker(pytest.mark.adversarial)
    groups = _resource_groups(items, _started_outside())
    for item in items:
        item.add_marker(pytest.mark.xdist_group(groups.get(item.nodeid) or item.nodeid.split("::", 1)[0]))
    items[:] = _in_schedule_order(items)


def _started_outside() -> frozenset[str]:
    """The daemons that already run as the session starts (`.ci/run` starts the Docker engine and the lab server
    before the tests): their fixtures reuse them and never stop them, so their tests need not share a worker. Read
    once per process at collection, before any fixture starts anything: every worker sees the same."""
    from infra import LABSERVER_STATE, _labserver_running

    from harness.systems import docker

    outside = set()
    if docker.engine_available()[0] and _registry_answers():
        outside.add("engine")
    if _labserver_running(LABSERVER_STATE):
        outside.add("lab_server")
    return frozenset(outside)


def _in_schedule_order(items: list[pytest.Item]) -> list[pytest.Item]:
    """Items in the order their groups are handed to workers (`--no-loadscope-reorder`: in collection order): the
    infrastructure modules first, then the first half of the command modules, then those using the Docker engine (its
    image may still be building when the session starts: `.ci/run` builds it beside the first tests), the other half,
    and the unit modules last, many small ones that even out the workers' ends. Within a module, the file's order."""
    def module(item: pytest.Item) -> str:
        return item.nodeid.split("::", 1)[0]

    tiers: dict[str, set[str]] = {}
    engine: set[str] = set()
    for item in items:
        tiers.setdefault(module(item), set()).update(t for t in TIERS if item.get_closest_marker(t))
        if "engine" in item.fixturenames:
            engine.add(module(item))
    modules = list(dict.fromkeys(module(item) for item in items))
    infra = [m for m in modules if "infra" in tiers[m] and m not in engine]
    cli = [m for m in modules if tiers[m] == {"cli"} or ("cli" in tiers[m] and "infra" not in tiers[m])]
    cli = [m for m in cli if m not in engine]
    unit = [m for m in modules if m not in infra and m not in cli and m not in engine]
    half = len(cli) // 2
    order = {m: i for i, m in enumerate([*infra, *cli[:half], *sorted(engine), *cli[half:], *unit])}
    return sorted(items, key=lambda item: order[module(item)])  # stable: a module's own order is kept


# The session fixtures that own a daemon, namespaces or fixed addresses (`slurm` runs on `two_hosts`).
RESOURCES = ("engine", "lab_server", "two_hosts")


def _resource_groups(items: list[pytest.Item], outside: frozenset[str] = frozenset()) -> dict[str, str]:
    """Under pytest-xdist (`-n N --dist loadgroup`) each xdist group runs on one worker, in order.

    The tests of one daemon share one group: one worker's teardown would otherwise stop what the other uses.
    Daemons are independent of each other, so each has its own group and two workers run, say, a Docker test
    and a Slurm test at once - unless some test uses both, which joins their groups. Every other module (a
    browser or a server of its own on a free port included) stays whole on one worker, its module-scoped
    fixtures built once. A daemon in `outside` was started before the session and outlives it: its tests need no group
    of their own."""
    used = {item.nodeid: {r for r in RESOURCES if r in item.fixturenames and r not in outside} for item in items}
    joined: list[set[str]] = []
    for resources in used.values():
        if resources:
            overlapping = [g for g in joined if g & resources]
            merged = set(resources).union(*overlapping)
            joined = [g for g in joined if not g & resources] + [merged]
    name = {r: "infra-" + "+".join(sorted(g)) for g in joined for r in g}
    return {nodeid: name[next(iter(resources))] for nodeid, resources in used.items() if resources}


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Under xdist, a group's tests run on one worker (its module- and session-scoped fixtures - a daemon, a server,
    a shared run - are built and torn down there once): a group that reaches a second worker while the first one
    lives fails here, naming both, instead of as a connection refused from a server the first worker already stopped.

    A worker that died (a crash, a kill from outside) is another matter: xdist reports the test it died in and hands
    the rest of its group to another worker, where the group's fixtures are built again. That worker takes the group
    over; failing each of the group's remaining tests would bury the one report that says what happened."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    mark = item.get_closest_marker("xdist_group")
    if worker is None or mark is None or not mark.args:
        return
    # Every worker's base temp is a folder of the session's own (pytest-N/popen-gwK): their parent is shared, and
    # removed with pytest's old temporary folders.
    claims = item.config._tmp_path_factory.getbasetemp().parent / "xdist-groups"  # type: ignore[attr-defined]
    claims.mkdir(exist_ok=True)
    claim = claims / hashlib.sha256(str(mark.args[0]).encode()).hexdigest()[:32]
    mine = f"{worker} {os.getpid()}"
    try:
        fd = os.open(claim, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        owner, _, pid = claim.read_text().strip().partition(" ")
        if not owner or owner == worker:
            return
        if pid.isdigit() and pid_alive(int(pid)):
            pytest.fail(f"xdist group {mark.args[0]!r} ran on {owner} and now on {worker}: its tests share fixtures that "
                        "must live on one worker (run with --dist loadgroup)", pytrace=False)
        fd = os.open(claim, os.O_WRONLY | os.O_TRUNC)  # its worker is gone: the group is this worker's now
    with os.fdopen(fd, "w") as fh:
        fh.write(mine)


@contextlib.contextmanager
def mlflow_server(folder: Path) -> Iterator[tuple[subprocess.Popen, int]]:
    """A real `mlflow server` on a free loopback port (SQLite in `folder`, artifacts served), stopped on the way out
    (a test may stop it earlier: an outage)."""
    import socket
    import time

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    folder.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}",
         "--serve-artifacts", "--artifacts-destination", str(folder / "artifacts"), "--host", "127.0.0.1",
         "--port", str(port), "--workers", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "mlflow server did not start"
                time.sleep(1)
        yield proc, port
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
