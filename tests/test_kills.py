"""kill -9 at any moment: run, replay, study, export and import, each SIGKILLed (the launcher alone, as the OOM
killer or a lost node would) at a moment hypothesis chooses, then started again as a user would.

What must hold whatever the moment:
- nothing of the killed process is left: no rank, no helper process of its session;
- the store holds no lie: every run is either RUNNING (its launcher is gone; `harness mark` closes it), or
  closed with a seal its record matches - never closed without one, never closed FINISHED with its outcome
  missing; a cut closing or a cut verdict is refused in words;
- once the command has run again to its end: no registered worktree, no harness scratch folder and no partial
  file is left, and an import yields exactly one copy of the bundled run.

Real processes, a real SQLite store, a real git repository, a real SIGKILL. Each example costs a command or two
(seconds): few examples each, the delays spread over the command's whole life by hypothesis; the next\ncommands' clean-up is checked once, after all the kills.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import KEPT_RANK_SERVER, Project, make_project
from harness.record import seal
from harness import tags as T
from harness.errors import HarnessError
from harness.store.tracking import Tracker

# Hypothesis tries the smallest delay first: each range starts past the command's first instant (a kill before
# Python has started proves nothing), the other examples land anywhere in its life.
EXAMPLES = settings(max_examples=3, deadline=None, database=None, suppress_health_check=list(HealthCheck))
FEW = settings(max_examples=2, deadline=None, database=None, suppress_health_check=list(HealthCheck))


@dataclass
class World:
    project: Project
    tmp: Path  # the commands' TMPDIR: what they leave there is theirs
    run_id: str  # a finished run with checkpoints (replayed, exported)
    bundle: Path

    @property
    def env(self) -> dict[str, str]:
        # The per-launch rank server: its ranks are in the killed command's session, where this module looks (a kept
        # server's ranks die with their launcher too: tests/test_startup.py).
        return {"TMPDIR": str(self.tmp), KEPT_RANK_SERVER: "0"}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    base = tmp_path_factory.mktemp("kills")
    project = make_project(base)
    tmp = base / "tmp"
    tmp.mkdir()
    env = World(project, tmp, "", base).env
    run = project.harness("run", "experiments/linear_ddp", "train.epochs=2", "checkpoint_every=4", env=env)
    assert run.returncode == 0, run.stderr
    bundle = base / "run.tar.gz"
    exported = project.harness("export", run.last_line, "-o", str(bundle), "--with-checkpoints", env=env)
    assert exported.returncode == 0, exported.stderr
    return World(project, tmp, run.last_line, bundle)


def _session(pid: int) -> list[psutil.Process]:
    """The processes of the session `pid` leads (the killed command started it: start_new_session)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == pid and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (OSError, psutil.Error):
            continue
    return found


def kill_at(project: Project, delay: float, *args: str, env: dict[str, str]) -> None:
    """Start `harness ARGS`, SIGKILL its process (only it) after `delay` s, and see its whole session gone."""
    proc = project.popen(*args, env=env)
    try:
        proc.wait(timeout=delay)  # it may end before the kill: then the kill is a no-op
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    deadline = time.monotonic() + 20  # ranks die by their death signal; multiprocessing's helpers just after
    while (left := _session(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    if left:
        for p in left:
            p.kill()
        pytest.fail(f"{args[0]} killed at {delay:.2f} s left processes behind: {[p.cmdline()[:4] for p in left]}")


def assert_no_lie(uri: str) -> None:
    """Every run is RUNNING or closed and sealed intact; a cut closing / verdict is refused in words."""
    tracker = Tracker(uri, writable=False)
    client = tracker.client
    ids = [e.experiment_id for e in client.search_experiments()]
    for run in client.search_runs(ids) if ids else []:
        run_id, status, tags = run.info.run_id, run.info.status, run.data.tags
        try:
            seal.check(tracker, run_id)
        except HarnessError as err:
            words = str(err)
            assert ("was being closed as" in words and status == T.RUNNING) or "verdict was being written" in words, words
            continue
        if status != T.RUNNING:
            assert T.SEAL in tags, f"run {run_id} is {status} without a seal"
        if status == T.FINISHED and tags.get(T.KIND) == T.KIND_RUN:
            assert T.FINGERPRINT in tags, f"run {run_id} is FINISHED without its final fingerprint"


def assert_nothing_left(world: World, *also: Path) -> None:
    """After a complete command: no scratch, no partial file, no registered worktree but the repository's own."""
    left = [p.name for p in world.tmp.iterdir() if p.name.startswith("harness-")]
    left += [p.name for folder in also for p in folder.iterdir() if ".partial-" in p.name]
    assert not left, left
    trees = subprocess.run(["git", "worktree", "list", "--porcelain"], cwd=world.project.root, capture_output=True,
                           text=True, check=True).stdout
    assert trees.count("worktree ") == 1, trees


@EXAMPLES
@given(delay=st.floats(0.5, 10.0))
def test_a_run_killed_at_any_moment(world: World, delay: float) -> None:
    kill_at(world.project, delay, "run", "experiments/linear_ddp", "train.epochs=2", "checkpoint_every=4", env=world.env)
    assert_no_lie(world.project.uri)


@FEW
@given(delay=st.floats(1.0, 10.0))
def test_a_replay_killed_at_any_moment(world: World, delay: float) -> None:
    kill_at(world.project, delay, "replay", world.run_id, env=world.env)
    assert_no_lie(world.project.uri)


@FEW
@given(delay=st.floats(1.0, 15.0))
def test_a_study_killed_at_any_moment(world: World, delay: float) -> None:
    kill_at(world.project, delay, "run", "experiments/linear_ddp", "--seeds", "2", "train.epochs=1", env=world.env)
    assert_no_lie(world.project.uri)


@FEW
@given(delay=st.floats(0.3, 4.0))
def test_an_export_killed_at_any_moment(world: World, delay: float, tmp_path_factory: pytest.TempPathFactory) -> None:
    out = world.tmp.parent / "exports" / "bundle.tar.gz"
    kill_at(world.project, delay, "export", world.run_id, "-o", str(out), "--with-checkpoints", env=world.env)
    if out.exists():  # the rename is the export's last step: a bundle there is whole, and imports
        store = tmp_path_factory.mktemp("whole")
        whole = world.project.harness("import", str(out),
                                      env={**world.env, "MLFLOW_TRACKING_URI": f"sqlite:///{store / 'm.db'}"})
        assert whole.returncode == 0, whole.stderr


@FEW
@given(delay=st.floats(0.3, 4.0))
def test_an_import_killed_at_any_moment(world: World, delay: float, tmp_path_factory: pytest.TempPathFactory) -> None:
    store = tmp_path_factory.mktemp("dest")
    uri = f"sqlite:///{store / 'mlflow.db'}"
    env = {**world.env, "MLFLOW_TRACKING_URI": uri}
    kill_at(world.project, delay, "import", str(world.bundle), env=env)
    if (store / "mlflow.db").exists():
        assert_no_lie(uri)
    again = world.project.harness("import", str(world.bundle), env=env)
    assert again.returncode == 0, again.stderr
    assert not list(world.tmp.glob("harness-import-*")), "the next import removes a killed one's staging"
    assert_no_lie(uri)
    client = Tracker(uri, writable=False).client
    copies = client.search_runs([e.experiment_id for e in client.search_experiments()],
                                f"tags.`{T.IMPORTED_FROM}` = '{world.run_id}'")
    assert len(copies) == 1 and copies[0].info.status == T.FINISHED, [(r.info.run_id, r.info.status) for r in copies]
    assert copies[0].data.tags[T.IMPORT_STATE] == T.IMPORT_COMPLETE


def test_after_the_kills_the_next_commands_leave_nothing_behind(world: World) -> None:
    """The kills above left processes' scratch, worktrees and partial bundles: the next run, replay and export
    (each started as a user would) remove what is stale, and leave nothing of their own."""
    p = world.project
    again = p.harness("run", "experiments/linear_ddp", "train.epochs=1", env=world.env)
    assert again.returncode == 0, again.stderr
    replayed = p.harness("replay", world.run_id, env=world.env)
    assert replayed.returncode == 0 and "verdict: BITWISE" in replayed.stdout, replayed.stdout + replayed.stderr
    out = world.tmp.parent / "exports" / "bundle.tar.gz"
    exported = p.harness("export", world.run_id, "-o", str(out), "--with-checkpoints", env=world.env)
    assert exported.returncode == 0, exported.stderr
    assert_nothing_left(world, out.parent)
    assert_no_lie(p.uri)
