"""Closing a run on a store that cannot take it (a real full or read-only disk), concurrent clients of one SQLite
store, and what a failure leaves behind: a run is complete or plainly not, and the one line says which."""

from __future__ import annotations

import contextlib
import errno
import os
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import Project

from harness import tags as T
from harness.errors import EXIT_FAILED, EXIT_USAGE, HarnessError

# Logs 20 metrics a step: 80,000 points, several times what a 12 MB store holds.
FILL_PY = '''"""Logs many points fast: fills a small store."""
import time

from torch import nn


def train(ctx):
    ctx.ddp(nn.Linear(2, 1))
    for step in ctx.steps(ctx.cfg.steps):
        ctx.log({f"m{i}": float(step * i) for i in range(20)}, step)
        time.sleep(ctx.cfg.pause)
'''
FILL_YAML = "image: none\nentry: train.py:train\nworld_size: 1\nseed: 0\ntrain:\n  steps: 4000\n  pause: 0.0\n"

# A 4 MB model checkpointed every step: its checkpoints fill a small store's disk.
FAT_PY = '''"""Checkpoints a 4 MB model every step."""
import torch
from torch import nn


def train(ctx):
    model = ctx.ddp(nn.Linear(1000, 1000))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ctx.track(opt)
    for step in ctx.steps(20):
        opt.zero_grad()
        model(torch.ones(1, 1000)).sum().backward()
        opt.step()
        ctx.log({"step": float(step)}, step)
'''
FAT_YAML = "image: none\nentry: train.py:train\nworld_size: 1\nseed: 0\ncheckpoint_every: 1\n"

FAILING_PY = '''"""Fails in its first step."""
from torch import nn


def train(ctx):
    ctx.ddp(nn.Linear(2, 1))
    raise ValueError("this experiment fails on purpose")
'''


def _experiment(project: Project, name: str, train_py: str, yaml: str) -> str:
    dest = project.root / "experiments" / name
    if not dest.exists():
        dest.mkdir(parents=True)
        (dest / "train.py").write_text(train_py)
        (dest / "experiment.yaml").write_text(yaml)
        subprocess.run(["git", "add", "-A"], cwd=project.root, check=True)
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid", "commit", "-qm", name],
                       cwd=project.root, check=True)
    return f"experiments/{name}"


def _runs(db: Path) -> list[tuple[str, str, str | None]]:
    """(run id, status, status reason) of every run, read without MLflow and without writing."""
    with contextlib.closing(sqlite3.connect(f"{db.as_uri()}?mode=ro", uri=True, timeout=30)) as conn:
        return conn.execute(
            "SELECT r.run_uuid, r.status, t.value FROM runs r LEFT JOIN tags t ON t.run_uuid = r.run_uuid "
            "AND t.key = ?", (T.STATUS_REASON,)).fetchall()


def _processes_naming(path: Path) -> list[int]:
    """Processes whose command line or working directory is under `path` (none may outlive a command)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().decode(errors="replace")
            cwd = os.readlink(entry / "cwd")
        except OSError:
            continue
        if str(path) in cmd or cwd.startswith(str(path)):
            found.append(int(entry.name))
    return found


def _error_line(stderr: str) -> str:
    errors = [line for line in stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1, stderr
    return errors[0]


def _no_dumps(stderr: str) -> None:
    assert "Traceback" not in stderr and "[SQL:" not in stderr and "sqlalche.me" not in stderr, stderr[-3000:]
    assert len(stderr.splitlines()) < 10, stderr[-3000:]


# --- a store whose disk fills, or turns read-only, during a run ------------------------------------
def test_unwritable_errors_are_not_outages() -> None:
    from harness.store.failures import transient, unwritable

    full = OSError(errno.ENOSPC, "No space left on device")
    assert unwritable(full) == "is full" and not transient(full)
    assert unwritable(OSError(errno.EROFS, "Read-only file system")) == "is read-only"
    wrapped = HarnessError("could not write 10 metrics")
    wrapped.__cause__ = sqlite3.OperationalError("database or disk is full")
    assert unwritable(wrapped) == "is full"
    assert unwritable(sqlite3.OperationalError("attempt to write a readonly database")) == "is read-only"
    assert unwritable(ConnectionRefusedError(errno.ECONNREFUSED, "refused")) is None


def test_store_whose_disk_fills_during_a_run_is_failed_not_finished(fresh_project: Project, small_disk: Path,
                                                                    tmp_path: Path) -> None:
    exp = _experiment(fresh_project, "fill", FILL_PY, FILL_YAML)
    store = Project(fresh_project.root, small_disk)
    start = time.monotonic()
    # The default outage limit (300 s): a full disk must not be waited out as an outage.
    result = store.harness("run", exp, timeout=240, env={"HARNESS_STORE_OUTAGE_S": "", "XDG_CACHE_HOME": str(tmp_path)})
    seconds = time.monotonic() - start
    assert result.returncode == EXIT_FAILED, result.stderr[-3000:]
    assert seconds < 120, seconds
    line = _error_line(result.stderr)
    _no_dumps(result.stderr)
    (run_id, status, reason), = _runs(small_disk / "mlflow.db")
    assert status == T.FAILED  # never FINISHED with a part of its metrics
    assert f"the tracking store {store.uri} is full" in line and "database or disk is full" in line
    assert f"run {run_id} was being closed, so it is FAILED in the store, not FINISHED" in line
    assert "Free space on its disk" in line
    kept = Path(line.split(" are kept in ", 1)[1].split(". ", 1)[0])
    assert kept == tmp_path / "harness" / "unsent" / run_id
    assert (kept / "outcome.json").is_file() and (kept / "series.npz").is_file()
    assert reason is not None and "is full" in reason and "record is incomplete" in reason
    assert not _processes_naming(fresh_project.root)


def test_store_filled_to_the_last_byte_during_a_run_stays_running_as_the_message_says(
    fresh_project: Project, small_disk: Path, tmp_path: Path
) -> None:
    exp = _experiment(fresh_project, "slow_fill", FILL_PY, FILL_YAML.replace("steps: 4000", "steps: 300")
                      .replace("pause: 0.0", "pause: 0.02"))
    store = Project(fresh_project.root, small_disk)
    proc = store.popen("run", exp, env={"HARNESS_STORE_OUTAGE_S": "", "XDG_CACHE_HOME": str(tmp_path)})
    try:
        db = small_disk / "mlflow.db"
        deadline = time.monotonic() + 120
        while not (db.is_file() and _runs_or_none(db)) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)  # the ranks are logging
        # Something else takes every byte left: not even a journal fits, so the store takes no status either.
        with open(small_disk / "filler", "wb") as fh, contextlib.suppress(OSError):
            while True:
                fh.write(b"\0" * 65536)
                fh.flush()
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.communicate()
    assert proc.returncode == EXIT_FAILED, err[-3000:]
    line = _error_line(err)
    _no_dumps(err)
    (run_id, status, _), = _runs(db)
    # The store took nothing: the run is RUNNING there, exactly as the line says, and `harness mark` can close it.
    assert status == T.RUNNING
    assert f"the tracking store {store.uri} is full" in line
    assert f"run {run_id} stays RUNNING in the store until `harness mark {run_id} --status FAILED`" in line
    kept = Path(line.split(" are kept in ", 1)[1].split(". ", 1)[0])
    assert (kept / "outcome.json").is_file()
    assert not _processes_naming(fresh_project.root)


def _runs_or_none(db: Path) -> list:
    try:
        return _runs(db)
    except sqlite3.Error:
        return []


def test_checkpoint_on_a_full_disk_is_one_line_naming_the_disk(fresh_project: Project, small_disk: Path,
                                                               tmp_path: Path) -> None:
    exp = _experiment(fresh_project, "fat", FAT_PY, FAT_YAML)
    store = Project(fresh_project.root, small_disk)
    result = store.harness("run", exp, timeout=240, env={"XDG_CACHE_HOME": str(tmp_path)})
    assert result.returncode == EXIT_FAILED, result.stderr[-3000:]
    assert "inline_container" not in result.stderr and "Traceback" not in result.stderr, result.stderr[-3000:]
    (run_id, status, reason), = _runs(small_disk / "mlflow.db")
    assert status == T.FAILED
    shown = [line for line in (result.stderr + result.stdout).splitlines() if "could not be written" in line]
    assert shown and all(f"the disk of {small_disk}/" in s and "is full" in s for s in shown), result.stderr
    assert "checkpoint_every: 0" in shown[0]
    assert not _processes_naming(fresh_project.root)


# --- many clients of one SQLite store -----------------------------------------------------------
_HOLDER = '''
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
print("ready", flush=True)
for line in sys.stdin:  # "take" then "release": the test decides when the lock changes hands
    if line.strip() == "take":
        fcntl.flock(fd, fcntl.LOCK_SH if sys.argv[2] == "shared" else fcntl.LOCK_EX)
        print("held", flush=True)
    else:
        break
'''


class _Holder:
    """A process that holds the folder's flock from "take" until "release", each said on its stdin."""

    def __init__(self, folder: Path, mode: str = "exclusive") -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(folder), mode], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.pid = self.proc.pid
        assert self._say(None) == "ready\n"

    def _say(self, word: str | None) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if word is not None:
            self.proc.stdin.write(word + "\n")
            self.proc.stdin.flush()
        return self.proc.stdout.readline() if word != "release" else ""

    def take(self) -> None:
        assert self._say("take") == "held\n"

    def release(self) -> None:
        self._say("release")
        self.proc.wait(timeout=60)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def test_opening_lock_is_waited_for_while_it_changes_hands(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Busy, not hung: other processes taking turns for longer than the store timeout in all is waited out."""
    from harness.store.locks import hold_limit, opening

    monkeypatch.setenv("HARNESS_STORE_TIMEOUT_S", "0.5")  # each holder may keep it 3 s (hold_limit)
    # Shared locks, so that each next holder takes the lock before the last lets go: the lock is never free while
    # they take turns (with exclusive ones the opener could win the race between two holders and wait less).
    holders = [_Holder(tmp_path, "shared") for _ in range(4)]
    holders[0].take()

    def take_turns() -> None:
        for last, nxt in zip(holders, holders[1:]):
            time.sleep(0.6 * hold_limit())
            nxt.take()
            last.release()
        time.sleep(0.6 * hold_limit())
        holders[-1].release()

    relay = threading.Thread(target=take_turns)
    start = time.monotonic()
    relay.start()
    try:
        with opening(f"sqlite:///{tmp_path / 'mlflow.db'}"):
            waited = time.monotonic() - start
    finally:
        relay.join()
        for h in holders:
            h.kill()
    assert waited > 2 * hold_limit()  # far longer than any one holder may keep it: it changed hands meanwhile


def test_opening_lock_held_without_letting_go_names_the_holder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from harness.store.locks import opening

    monkeypatch.setenv("HARNESS_STORE_TIMEOUT_S", "0.5")
    holder = _Holder(tmp_path)
    holder.take()
    try:
        start = time.monotonic()
        with pytest.raises(HarnessError) as err, opening(f"sqlite:///{tmp_path / 'mlflow.db'}"):
            pass
        assert time.monotonic() - start < 10
    finally:
        holder.kill()
    text = str(err.value)
    assert f"process {holder.pid} (" in text and "has held the opening lock of the store" in text
    assert f"kill {holder.pid}" in text and "HARNESS_STORE_TIMEOUT_S" in text


# 8 concurrent tiny runs: about 85 s on a loaded 2-core machine (before the fix 5-6 of them failed at the lock).
CONCURRENT_RUNS = 8


def test_concurrent_runs_on_one_sqlite_store_all_succeed(fresh_project: Project) -> None:
    procs = [fresh_project.popen("run", "experiments/linear_ddp", "train.epochs=1", "world_size=1")
             for _ in range(CONCURRENT_RUNS)]
    outs = [p.communicate(timeout=400) for p in procs]
    assert [p.returncode for p in procs] == [0] * CONCURRENT_RUNS, [err[-1500:] for _, err in outs]
    runs = _runs(fresh_project.store / "mlflow.db")
    assert len(runs) == CONCURRENT_RUNS and {status for _, status, _ in runs} == {T.FINISHED}


# --- nothing made, nothing left ---------------------------------------------------------------------
@pytest.mark.parametrize("args", [("runs",), ("compare", "a" * 32, "b" * 32)], ids=["runs", "compare"])
def test_read_only_commands_on_a_mistyped_store_create_nothing(tmp_path: Path, args: tuple[str, ...]) -> None:
    missing = tmp_path / "stroe" / "deeper" / "mlflow.db"
    project = Project(tmp_path, missing.parent)
    result = project.harness(*args, env={"MLFLOW_TRACKING_URI": f"sqlite:///{missing}"})
    assert result.returncode == EXIT_USAGE
    assert result.stderr.strip().splitlines() == [
        f"Error: no store at {missing}: there is no such database. Check the path in --tracking-uri or "
        "MLFLOW_TRACKING_URI (a store is made by the first `harness run`)."]
    assert not (tmp_path / "stroe").exists() and not (tmp_path / "mlruns").exists()


def test_failed_run_leaves_no_spawn_error_files(fresh_project: Project, tmp_path: Path) -> None:
    exp = _experiment(fresh_project, "failing", FAILING_PY, "image: none\nentry: train.py:train\nworld_size: 1\n"
                                                            "seed: 0\n")
    tmp = tmp_path / "own tmp"
    tmp.mkdir()
    result = fresh_project.harness("run", exp, env={"TMPDIR": str(tmp)})
    assert result.returncode == EXIT_FAILED
    assert "this experiment fails on purpose" in result.stderr
    assert not list(tmp.glob("pytorch-errorfile-*")), list(tmp.iterdir())
