"""Verdicts and messages under accident and attack: a replay killed from outside is no verdict, `runs` shows only
sealed verdicts, a killed resume is closed with `harness mark`, and the messages of a full disk, a stale store
creation, too many untracked bytes and an unimportable folder name are harness's one line.

The faults are real: a rank SIGKILLs itself (the kernel kills it, as the OOM killer would), the launcher of a resume
is SIGKILLed, a full disk is a real tmpfs mounted here (root; CI runs as root)."""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import KEPT_RANK_SERVER, Project, fill_disk, git, make_project, tmpfs
from harness import tags as T
from harness.errors import EXIT_FAILED, EXIT_USAGE
from harness.store.tracking import Tracker

# linear_ddp (2 ranks, 5 steps an epoch) with faults on demand: a file in CONTROL makes rank 0 raise before its first
# step (before the checkpoint of step 0), rank 1 SIGKILL itself at step 3, rank 0 raise at step N, or every step take
# 0.5 s. Outside the repository: the code record stays clean.
FAULTY_PY = '''"""linear_ddp with faults on demand, switched by files in CONTROL."""
import os
import signal
import time
from pathlib import Path

import torch
from torch import nn

CONTROL = Path({control!r})


def train(ctx):
    cfg = ctx.cfg
    data = torch.randn(cfg.samples, 10, generator=torch.Generator().manual_seed(ctx.seed))
    loader = ctx.loader(data, batch_size=cfg.batch_size)
    model = ctx.ddp(nn.Linear(10, 5))
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    ctx.track(optimizer)
    if ctx.rank == 0 and (CONTROL / "raise-before").exists():
        raise RuntimeError("failing on purpose before the first step")
    for epoch in ctx.epochs(cfg.epochs):
        for batch in loader:
            step = ctx.step
            if ctx.rank == 1 and step == 3 and (CONTROL / "kill-rank1").exists():
                os.kill(os.getpid(), signal.SIGKILL)
            if ctx.rank == 0 and (CONTROL / f"raise-at-{{step}}").exists():
                raise RuntimeError(f"failing on purpose at step {{step}}")
            if (CONTROL / "slow").exists():
                time.sleep(0.5)
            optimizer.zero_grad()
            loss = ctx.backward(batch, lambda b: nn.functional.mse_loss(model(b), torch.zeros(len(b), 5)))
            optimizer.step()
            ctx.log({{"loss": loss}}, step)
'''
EXP = "experiments/faulty"


@dataclass
class Faulty:
    project: Project
    control: Path
    run_id: str  # FINISHED, with checkpoints
    replay_id: str  # its BITWISE replay
    env: dict[str, str]

    @contextlib.contextmanager
    def switched(self, name: str) -> Iterator[None]:
        (self.control / name).touch()
        try:
            yield
        finally:
            (self.control / name).unlink()

    def status(self, run_id: str) -> str:
        return self.project.client().get_run(run_id).info.status

    def runs_row(self, run_id: str) -> str:
        listing = self.project.cli("runs")
        assert listing.returncode == 0, listing.stderr
        [row] = [line for line in listing.stdout.splitlines() if line.startswith(run_id)]
        return row


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory) -> Faulty:
    base = tmp_path_factory.mktemp("adversarial verdicts")
    project = make_project(base)
    control = base / "control"
    control.mkdir()
    project.add_experiment("faulty", train_py=FAULTY_PY.format(control=str(control)),
                           yaml_extra="checkpoint_every: 4\n")
    # The per-launch rank server: the ranks belong to the launcher's session, and die with it.
    env = {KEPT_RANK_SERVER: "0"}
    run = project.harness("run", EXP, "train.epochs=2", env=env)
    assert run.returncode == 0, run.stderr
    replay = project.harness("replay", run.last_line, env=env)
    assert replay.returncode == 0, replay.stderr + replay.stdout
    return Faulty(project, control, run.last_line, replay.last_line, env)


@pytest.fixture(scope="module")
def failed_late(faulty: Faulty) -> str:
    """A run that FAILED at step 6, after its checkpoint of step 4."""
    with faulty.switched("raise-at-6"):
        run = faulty.project.harness("run", EXP, "train.epochs=2", env=faulty.env)
    assert run.returncode == EXIT_FAILED, run.stderr
    return run.last_line


def _error(stderr: str) -> str:
    errors = [line for line in stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1, stderr
    assert "Traceback" not in stderr and "[SQL:" not in stderr and "sqlalche.me" not in stderr, stderr[-3000:]
    return errors[0]


# -- verdicts --------------------------------------------------------------------------------------
def test_runs_shows_an_edited_verdict_tag_as_unverified(faulty: Faulty) -> None:
    """The verdict tag edited in the store (MlflowClient, as the UI would): `runs` checks it against the seal's
    manifest and shows UNVERIFIED, never the edited verdict; put back, it shows the verdict again."""
    assert faulty.runs_row(faulty.run_id).endswith("BITWISE 1")
    client = faulty.project.client()
    client.set_tag(faulty.replay_id, T.VERDICT, "DIVERGED")
    try:
        assert faulty.runs_row(faulty.run_id).endswith("UNVERIFIED 1")
        assert faulty.runs_row(faulty.replay_id).endswith("UNVERIFIED")
    finally:
        client.set_tag(faulty.replay_id, T.VERDICT, "BITWISE")
    assert faulty.runs_row(faulty.replay_id).endswith("BITWISE")
    assert faulty.runs_row(faulty.run_id).endswith("BITWISE 1")


def test_a_rank_sigkilled_during_a_replay_is_a_failed_replay_with_no_verdict(faulty: Faulty) -> None:
    """Before, the replay was recorded DIVERGED against the original. A rank killed from outside says nothing of the
    code: the replay is FAILED, with no verdict, the line says so, and `runs` counts no DIVERGED for the original."""
    with faulty.switched("kill-rank1"):
        result = faulty.project.harness("replay", faulty.run_id, env=faulty.env)
    assert result.returncode == EXIT_FAILED, result.stderr
    line = _error(result.stderr)
    [replay] = [r for r in faulty.project.all_runs()
                if r.data.tags.get(T.REPLAY_OF) == faulty.run_id and r.info.run_id != faulty.replay_id]
    assert line == (f"Error: replay {replay.info.run_id} FAILED: rank 1 was killed by SIGKILL (rank 0 stopped as a "
                    "consequence). A rank killed by SIGKILL from outside (the OOM killer, kill -9) is a failed replay, "
                    f"no verdict: none was recorded against run {faulty.run_id}. Free what killed it (memory), then "
                    f"replay it again: harness replay {faulty.run_id}"), line
    assert "verdict:" not in result.stdout
    assert replay.info.status == T.FAILED
    assert T.VERDICT not in replay.data.tags and replay.data.tags[T.FAILED_SIGNAL] == "SIGKILL"
    row = faulty.runs_row(faulty.run_id)
    assert "DIVERGED" not in row and row.endswith("BITWISE 1, FAILED 1"), row
    client = faulty.project.client()
    client.delete_run(replay.info.run_id)  # the next tests count the original's replays afresh


def test_replay_of_a_failed_run_says_it_has_checkpoints_only_when_it_has(faulty: Faulty, failed_late: str) -> None:
    with faulty.switched("raise-before"):  # before its first checkpoint (of step 0, every 4 steps)
        early = faulty.project.harness("run", EXP, "train.epochs=2", env=faulty.env)
    assert early.returncode == EXIT_FAILED, early.stderr
    refused = faulty.project.cli("replay", early.last_line)
    assert refused.returncode == EXIT_USAGE
    assert _error(refused.stderr) == (
        f"Error: run {early.last_line} is FAILED: it stopped before its end, so a full replay cannot be judged against "
        "it. Pass --allow-incomplete to replay it and compare only the steps it reached.")
    refused = faulty.project.cli("replay", failed_late)
    assert refused.returncode == EXIT_USAGE
    assert f"Resume it with `harness resume {failed_late}` (it has checkpoints), or pass --allow-incomplete" in (
        _error(refused.stderr))


def test_a_resume_killed_by_sigkill_is_closed_with_harness_mark_not_called_edited(faulty: Faulty,
                                                                                  failed_late: str) -> None:
    """The resume's launcher SIGKILLed while it continues the run: the run is RUNNING again, and the next resume names
    `harness mark` (its launcher is gone), not "changed after it was sealed"; marked, the run is sealed and intact."""
    with faulty.switched("slow"):
        proc = faulty.project.popen("resume", failed_late, env=faulty.env)
        try:
            deadline = time.monotonic() + 120
            while faulty.status(failed_late) != T.RUNNING:
                assert proc.poll() is None, proc.communicate()
                assert time.monotonic() < deadline, "the resume never reopened the run"
                time.sleep(0.2)
            time.sleep(1.0)  # it has written to the run: a step, a heartbeat
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=60)
    _session_gone(proc.pid)
    assert faulty.status(failed_late) == T.RUNNING
    again = faulty.project.harness("resume", failed_late, env=faulty.env)
    assert again.returncode == EXIT_USAGE
    line = _error(again.stderr)
    assert "changed after it was sealed" not in line
    assert f"`harness mark {failed_late} --status FAILED`" in line, line
    # Its launcher is gone; `harness mark --force` stands in for the wait until its heartbeat is stale.
    client = faulty.project.client()
    for tag in (T.HEARTBEAT, T.HEARTBEAT_S):
        client.delete_tag(failed_late, tag)
    marked = faulty.project.cli("mark", failed_late, "--status", "FAILED", "--force")
    assert marked.returncode == 0, marked.stderr
    Tracker(faulty.project.uri).client  # noqa: B018  (opens the store)
    from harness.record import seal

    seal.check(Tracker(faulty.project.uri, writable=False), failed_late)  # closed and sealed again, intact


def _session_gone(pid: int) -> None:
    """No process of the killed command's session is left (its ranks die by their death signal)."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        left = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _sid(int(p.name)) == pid]
        if not left:
            return
        time.sleep(0.2)
    pytest.fail(f"processes of the killed session {pid} are left: {left}")


def _sid(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


# -- the store's files and the code record -----------------------------------------------------------
def test_a_killed_creation_of_the_store_leaves_nothing_once_its_pid_is_gone(faulty: Faulty) -> None:
    """A process killed while it created the store leaves .mlflow.db.creating-<pid>: removed by the next opening of
    the store, even though another process made the store meanwhile; one whose creator still lives is kept."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True).stdout.strip()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        stale = faulty.project.store / f".mlflow.db.creating-{dead}"
        stale_journal = faulty.project.store / f".mlflow.db.creating-{dead}-journal"
        kept = faulty.project.store / f".mlflow.db.creating-{live.pid}"
        for path in (stale, stale_journal, kept):
            path.write_bytes(b"SQLite format 3\0 half made")
        Tracker(faulty.project.uri).client  # noqa: B018  (opening the store is what removes them)
        assert not stale.exists() and not stale_journal.exists()
        assert kept.exists()
    finally:
        live.kill()
        live.wait()
        kept.unlink(missing_ok=True)


def test_untracked_files_are_bounded_in_total_not_only_each(faulty: Faulty) -> None:
    folder = faulty.project.root / EXP
    parts = [folder / f"part{i}.bin" for i in range(3)]
    for part in parts:
        part.write_bytes(b"x" * (400 << 10))  # 0.39 MiB each, under the limit of 1 MiB; 1.17 MiB together
    try:
        result = faulty.project.cli("check", EXP, "record.max_untracked_mib=1")
        assert result.returncode == EXIT_USAGE
        assert _error(result.stderr) == (
            "Error: the 3 untracked files hold 1.17 MiB (1228800 bytes) together, over the code record's limit of "
            "1 MiB (record.max_untracked_mib), which bounds their total as well as each one; the largest: "
            f"'{EXP}/part2.bin' (0.39 MiB), '{EXP}/part1.bin' (0.39 MiB), '{EXP}/part0.bin' (0.39 MiB). Commit them, "
            "add them to a .gitignore, or keep data outside the repository and declare it as data; or raise the limit "
            "(record.max_untracked_mib=50).")
        assert faulty.project.cli("check", EXP, "record.max_untracked_mib=2").returncode == 0
    finally:
        for part in parts:
            part.unlink()


def test_an_experiment_folder_named_with_a_newline_is_refused_at_run(tmp_path: Path) -> None:
    """Its name is the MLflow experiment's, which a bundle carries and import refuses: refused before anything is
    recorded, rather than a run that exports and never imports."""
    project = make_project(tmp_path)
    name = "two\nlines"
    project.add_experiment(name)
    for command in ("check", "run"):
        result = project.cli(command, f"experiments/{name}")
        assert result.returncode == EXIT_USAGE, result.stderr
        assert _error(result.stderr) == (
            "Error: the experiment folder's name 'two\\nlines' is no plain name (it holds a newline, a tab or another "
            "control character, or a backslash, or is over 256 characters); it names the MLflow experiment, and a "
            "bundle of its runs could not be imported. Rename the folder.")
    assert not (project.store / "mlflow.db").exists()
    git(project.root, "status", "--short")


# -- a full disk ---------------------------------------------------------------------------------------
def test_a_full_disk_before_a_replay_is_harness_one_line_not_sqlalchemy(tmp_path: Path) -> None:
    """The store's disk (a 12 MB tmpfs) filled after the run: the replay says the store is full in one line, exit 2,
    not SQLAlchemy's "raised as a result of Query-invoked autoflush", and leaves no run and no worktree."""
    project = make_project(tmp_path)
    with tmpfs(tmp_path / "disk", "size=12m") as disk:
        store = Project(project.root, disk)
        run = store.harness("run", "experiments/linear_ddp", "train.epochs=1", env={"XDG_CACHE_HOME": str(tmp_path)})
        assert run.returncode == 0, run.stderr
        fill_disk(disk)
        result = store.harness("replay", run.last_line, env={"XDG_CACHE_HOME": str(tmp_path)})
        assert result.returncode == EXIT_USAGE, result.stderr
        assert _error(result.stderr) == (
            f"Error: the tracking store {store.uri} is full ((sqlite3.OperationalError) database or disk is full). "
            "Free space on its disk (or use another store with --tracking-uri), then rerun.")
        assert "autoflush" not in result.stderr
        with contextlib.closing(sqlite3.connect(f"{(disk / 'mlflow.db').as_uri()}?mode=ro", uri=True)) as db:
            assert db.execute("SELECT run_uuid FROM runs").fetchall() == [(run.last_line,)]
        trees = git(project.root, "worktree", "list", "--porcelain")
        assert trees.count("worktree ") == 1, trees


def test_a_checkpoint_refused_for_want_of_an_inode_is_named(tmp_path: Path) -> None:
    """ENOSPC where the step's folder or the file is made (a disk out of inodes: bytes free, no file can be made), not
    only mid-write: one line naming the disk, never an OSError from mkdir or mkstemp."""
    import torch

    from harness.errors import ExperimentError
    from harness.runtime import checkpoint

    with tmpfs(tmp_path / "disk", "size=8m,nr_inodes=16") as disk:
        with contextlib.suppress(OSError):  # every inode taken: the root's own and what these files use
            for i in range(100):
                (disk / f"f{i}").touch()
        target = disk / "checkpoints" / "step-00000004" / "rank0.pt"
        with pytest.raises(ExperimentError) as err:
            checkpoint.save_atomic({"w": torch.ones(3)}, target)
        assert str(err.value) == (f"the disk of {target.parent} is full (no inode left): rank0.pt could not be written. "
                                  "Free space there (or set checkpoint_every: 0), then rerun.")
        (disk / "f0").unlink()  # one inode: the folder is made, the file is not
        with pytest.raises(ExperimentError, match=r"is full \(no inode left\): rank0.pt could not be written"):
            checkpoint.save_atomic({"w": torch.ones(3)}, target)
        assert not any(p.name.endswith(".tmp") for p in disk.rglob("*"))
