"""Adversarial cases against the tracking store: many processes creating one store at once, a full disk during an
import (issue 36 items 7 and 8)."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import Project, make_project

from harness import tags as T
from harness.errors import EXIT_USAGE
from harness.store.failures import ROLLBACK_ROOM

# Eight processes that each open (and so create, or wait for) one SQLite store that does not exist yet: the opening
# path of every `harness run` (Tracker(...).client: probe, the opening lock, the schema built whole), without eight
# training runs around it. A store timeout of 0.3 s gives each holder of the opening lock 1.8 s without progress;
# with an empty schema cache the first process runs every MLflow migration, several seconds on a loaded machine:
# a holder that is building the store must be waited for, not reported as hung.
_OPEN = "import sys; from harness.store.tracking import Tracker; Tracker(sys.argv[1]).client; print('opened')"
OPENERS = 8


def test_concurrent_openers_of_a_store_that_does_not_exist_all_succeed(tmp_path: Path) -> None:
    store = tmp_path / "new store" / "mlflow.db"
    store.parent.mkdir()
    env = {**os.environ, "HARNESS_STORE_TIMEOUT_S": "0.3", "HARNESS_CACHE_DIR": str(tmp_path / "cold cache")}
    procs = [subprocess.Popen([sys.executable, "-c", _OPEN, f"sqlite:///{store}"], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(OPENERS)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0] * OPENERS, [err[-800:] for _, err in outs if err]
    assert all(out.strip() == "opened" for out, _ in outs)
    # One store, made whole; no process's temporary database left beside it.
    assert sorted(p.name for p in store.parent.iterdir() if not p.is_dir()) == ["mlflow.db"]


# --- a full disk during `harness import` ---------------------------------------------------------------------------
KIB = 1024


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """(run id, bundle) of a one-rank run whose record holds a 2 MiB untracked file: an import writes its rows (tens of
    KiB) long before that artifact, so a disk that takes the rows and not the file fails in the middle."""
    base = tmp_path_factory.mktemp("full disk")
    project = make_project(base)
    (project.root / "experiments" / "linear_ddp" / "weights.bin").write_bytes(os.urandom(2 << 20))
    run = project.harness("run", "experiments/linear_ddp", "train.epochs=1", "world_size=1")
    assert run.returncode == 0, run.stderr
    out = base / "run.tar.gz"
    exported = project.harness("export", run.last_line, "-o", str(out))
    assert exported.returncode == 0, exported.stderr
    return run.last_line, out


def _fill(disk: Path, leave: int) -> None:
    """Take all the free space of `disk` but `leave` bytes."""
    st = os.statvfs(disk)
    with open(disk / "filler", "wb") as fh:
        fh.write(bytes(st.f_bavail * st.f_frsize - leave))


def _runs(db: Path) -> list[tuple[str, str]]:
    with contextlib.closing(sqlite3.connect(f"{db.as_uri()}?mode=ro", uri=True)) as conn:
        return conn.execute("SELECT status, lifecycle_stage FROM runs").fetchall()


@pytest.mark.parametrize("free_kib", [ROLLBACK_ROOM // KIB + 512, 64], ids=["fills-midway", "full-before"])
def test_import_onto_a_full_disk_is_one_line_exit_2_and_leaves_nothing(bundle: tuple[str, Path], tmp_path: Path,
                                                                       small_disk: Path, free_kib: int) -> None:
    """The store lives on a real tmpfs (small_disk, mounted for the test) that fills up: in the middle of the import
    (room for the rows, not for the 2 MiB artifact), or before it (less than the room an undo needs): the same one
    line, and nothing of the run."""
    original, archive = bundle
    target = Project(tmp_path, small_disk / "store")
    target.store.mkdir()
    opened = subprocess.run([sys.executable, "-c", _OPEN, target.uri], capture_output=True, text=True)
    assert opened.returncode == 0, opened.stderr
    _fill(small_disk, free_kib * KIB)
    result = target.harness("import", str(archive), "--data-dir", str(tmp_path / "data"))
    (small_disk / "filler").unlink()
    made = _runs(target.store / "mlflow.db")
    runs = target.harness("runs")
    left = sorted(p.relative_to(target.store).as_posix() for p in target.store.rglob("*") if p.is_file())
    assert result.returncode == EXIT_USAGE, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith(f"Error: the tracking store {target.uri} is full") and "Free space" in result.stderr
    # Nothing left: no run in the store but a deleted one (made, then undone when the disk filled), no artifact file,
    # no room file; `runs` shows none.
    assert all(stage == "deleted" for _, stage in made), made
    assert made if free_kib > ROLLBACK_ROOM // KIB else not made
    assert left == ["mlflow.db"], left
    assert runs.returncode == 0 and original not in runs.stdout and T.RUNNING not in runs.stdout, runs.stdout
