"""A tracking store that cannot be used fails fast, in one line naming it, with nothing half-written.

Real stores only: a loopback port with nothing listening, a listener that never answers, SQLite files
that are read-only, of another MLflow version, or no database at all. No training run is needed:
every command fails before it would start one.
"""

from __future__ import annotations

import os
import shutil
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Project, Result

FAKE_ID = "0123456789abcdef0123456789abcdef"
FAST_S = 15.0  # the store deadline (10 s) plus interpreter start-up on a busy 2-core machine


def error_line(result: Result, *words: str) -> str:
    """The single `Error: ...` line, checked for the CLI's contract: exit 2, no traceback."""
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("Error: "), result.stderr
    assert sum("Error" in line for line in lines) == 1, result.stderr
    for word in words:
        assert word in lines[-1], lines[-1]
    return lines[-1]


def timed(project: Project, *args: str, env: dict[str, str]) -> tuple[Result, float]:
    start = time.monotonic()
    result = project.harness(*args, env=env, timeout=120)
    return result, time.monotonic() - start


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def count_runs(db: Path) -> int:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        return conn.execute("SELECT COUNT(*) FROM runs").fetchone()[0]


def make_store(project: Project) -> str:
    """The project's SQLite store created by MLflow, holding one run; returns its id."""
    client = project.client()
    run = client.create_run(client.create_experiment("made-by-test"))
    client.set_terminated(run.info.run_id, "FINISHED")
    return run.info.run_id


@pytest.mark.parametrize(
    "args",
    [("run", "experiments/linear_ddp"), ("runs",), ("replay", FAKE_ID), ("compare", "a", "b")],
    ids=["run", "runs", "replay", "compare"],
)
def test_server_not_listening_fails_fast(fresh_project: Project, args: tuple[str, ...]) -> None:
    uri = f"http://127.0.0.1:{free_port()}"
    result, seconds = timed(fresh_project, *args, env={"MLFLOW_TRACKING_URI": uri})
    error_line(result, f"cannot reach the tracking store {uri}", "connection refused", "MLflow server")
    assert seconds < FAST_S
    assert not (fresh_project.root / "mlruns").exists()  # no default store written instead
    assert not list(fresh_project.store.iterdir())


def test_server_that_never_answers_fails_within_the_deadline(fresh_project: Project) -> None:
    with socket.socket() as sock:  # accepts connections (backlog), never reads or answers
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        uri = f"http://127.0.0.1:{sock.getsockname()[1]}"
        result, seconds = timed(
            fresh_project, "runs", env={"MLFLOW_TRACKING_URI": uri, "HARNESS_STORE_TIMEOUT_S": "2"}
        )
    error_line(result, f"the tracking store {uri} did not answer within 2 s")
    assert seconds < 10


def test_credentials_never_appear_in_the_message(fresh_project: Project) -> None:
    port = free_port()
    result, _ = timed(fresh_project, "runs", env={"MLFLOW_TRACKING_URI": f"http://alice:s3cret-pw@127.0.0.1:{port}"})
    line = error_line(result, f"http://127.0.0.1:{port}")
    assert "s3cret" not in result.stderr + result.stdout and "alice" not in line


@pytest.mark.parametrize("uri", ["foo://x", "/srv/mlruns"], ids=["scheme", "folder"])
def test_unsupported_store_lists_the_forms(fresh_project: Project, uri: str) -> None:
    result, _ = timed(fresh_project, "runs", env={"MLFLOW_TRACKING_URI": uri})
    error_line(result, uri, "Use one of sqlite:///PATH", "http(s)://HOST:PORT", "postgresql://", "mysql://")


@pytest.fixture
def world_readable_dir() -> Iterator[Path]:
    # pytest's tmp_path is 0700; this folder must be readable by a process without root's overrides.
    path = Path(tempfile.mkdtemp(prefix="harness-ro-store-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    path.chmod(0o755)
    shutil.rmtree(path)


def test_read_only_store_refuses_writes_fast_and_still_lists(
    fresh_project: Project, world_readable_dir: Path
) -> None:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        if os.environ.get("CI") == "true":  # CI runs as root on Debian (util-linux has setpriv)
            pytest.fail("the read-only store test needs root and setpriv in CI")
        pytest.skip("needs root and setpriv to run a command that file permissions apply to")
    db = world_readable_dir / "mlflow.db"
    uri = f"sqlite:///{db}"
    ro = Project(fresh_project.root, world_readable_dir)
    run_id = make_store(ro)
    db.chmod(0o444)
    world_readable_dir.chmod(0o555)
    before = db.read_bytes()
    # Root ignores file modes; the python interpreter lives under /root (0700), so `nobody` cannot
    # start it. Root without the capabilities that override file modes is held to them like anyone.
    drop = ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner", "--"]
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "PYTHONUNBUFFERED": "1"}

    def harness(*args: str) -> tuple[Result, float]:
        start = time.monotonic()
        proc = subprocess.run([*drop, sys.executable, "-m", "harness", *args], cwd=fresh_project.root, env=env,
                              capture_output=True, text=True, timeout=120)
        return Result(proc.returncode, proc.stdout, proc.stderr), time.monotonic() - start

    result, seconds = harness("replay", run_id)
    error_line(result, f"the tracking store {uri} is read-only", str(world_readable_dir), "not writable")
    assert seconds < FAST_S
    listing, _ = harness("runs")
    assert listing.returncode == 0, listing.stderr
    assert run_id in listing.stdout
    assert db.read_bytes() == before and count_runs(db) == 1


@pytest.mark.parametrize(
    ("revision", "words"),
    [
        ("ffffffffffff", ["schema revision ffffffffffff", "another MLflow version made it",
                          "Use the MLflow version that made it"]),
        ("0584bdc529eb", ["older database schema revision 0584bdc529eb", "mlflow db upgrade sqlite:///"]),
    ],
    ids=["unknown", "older"],
)
def test_store_of_another_mlflow_version(fresh_project: Project, revision: str, words: list[str]) -> None:
    make_store(fresh_project)
    db = fresh_project.store / "mlflow.db"
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE alembic_version SET version_num = ?", (revision,))
    result, seconds = timed(fresh_project, "runs", env={})
    error_line(result, f"the tracking store {fresh_project.uri}", *words)
    assert seconds < FAST_S
    with sqlite3.connect(db) as conn:  # nothing migrated behind the user's back
        assert conn.execute("SELECT version_num FROM alembic_version").fetchone()[0] == revision
    assert count_runs(db) == 1


def test_file_that_is_not_a_database(fresh_project: Project) -> None:
    db = fresh_project.store / "mlflow.db"
    db.write_text("these are my notes, not a database\n" * 10)
    before = db.read_bytes()
    result, seconds = timed(fresh_project, "runs", env={})
    error_line(result, f"{db} is not an SQLite database", fresh_project.uri)
    assert seconds < FAST_S
    assert db.read_bytes() == before
    assert sorted(p.name for p in fresh_project.store.iterdir()) == ["mlflow.db"]


def test_store_failing_mid_command_is_not_no_run(tmp_path: Path) -> None:
    """Only MLflow's "not found" means no run; a store that breaks after opening is named as failing."""
    from harness.errors import RunNotFound, StoreUnavailable
    from harness.store.tracking import Tracker

    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = tracker.create_run("e", {})
    with pytest.raises(RunNotFound, match="^no run '0{32}' in the tracking store"):
        tracker.get_run("0" * 32)
    (tmp_path / "mlflow.db").write_bytes(b"x" * 4096)  # the database is lost under the running command
    for read in (lambda: tracker.get_run(run_id), lambda: tracker.read_text(run_id, "a.txt"), tracker.search):
        with pytest.raises(StoreUnavailable, match=r"^the tracking store sqlite:///.* failed: .*file is not a database"):
            read()


def test_artifact_path_undoes_percent_escapes_as_mlflow_does() -> None:
    # MLflow stores Path.as_uri() of an artifact folder: a store under "store B" has "store%20B" in it.
    from harness.store.uris import artifact_path

    assert artifact_path(Path("/tmp/store B/1/x/artifacts").as_uri()) == Path("/tmp/store B/1/x/artifacts")
    assert artifact_path("/plain/path") == Path("/plain/path")
    assert artifact_path("s3://bucket/key") is None


def test_a_new_sqlite_store_appears_whole_and_a_killed_creation_leaves_nothing(tmp_path: Path) -> None:
    """MLflow builds a new store's schema in a second or more: it is built under a temporary name and renamed into
    place, so a process killed meanwhile leaves no half-made mlflow.db; its temporary file is removed by the next
    opening once its process is gone."""
    from harness.store.tracking import Tracker

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    half = tmp_path / f".mlflow.db.creating-{gone.pid}"
    half.write_bytes(b"SQLite format 3\x00 half a schema")
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert tracker.client.search_experiments()  # opened: the default experiment is there
    assert (tmp_path / "mlflow.db").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlflow.db"]


def test_a_new_store_starts_from_the_cached_empty_schema_and_has_its_own_default_experiment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first new store MLflow migrates is cached without its default experiment; the next new store is a copy
    that MLflow opens and completes itself (the default experiment's artifacts under where that command ran). A cached
    template of another schema revision is not used."""
    from harness.store import fastpath
    from harness.store.tracking import Tracker

    monkeypatch.setenv("HARNESS_CACHE_DIR", str(tmp_path / "cache"))
    template = fastpath._schema_template()
    assert template is not None and template.parent == tmp_path / "cache"

    def new_store(name: str) -> sqlite3.Connection:
        (tmp_path / name).mkdir()
        monkeypatch.chdir(tmp_path / name)
        Tracker(f"sqlite:///{tmp_path / name / 'mlflow.db'}")
        return sqlite3.connect(tmp_path / name / "mlflow.db")

    first = new_store("first")
    assert template.is_file()
    with sqlite3.connect(template) as cached:
        assert cached.execute("SELECT COUNT(*) FROM experiments").fetchone() == (0,)
    second = new_store("second")
    for db, name in ((first, "first"), (second, "second")):
        assert db.execute("SELECT experiment_id, name, artifact_location FROM experiments").fetchall() == [
            (0, "Default", str(tmp_path / name / "mlruns" / "0"))]
    schema = "SELECT type, name, sql FROM sqlite_master ORDER BY name"
    assert first.execute(schema).fetchall() == second.execute(schema).fetchall()
    assert first.execute("SELECT * FROM alembic_version").fetchall() == second.execute(
        "SELECT * FROM alembic_version").fetchall()
    # A template that is not of this MLflow's schema is left alone: the store is migrated as MLflow would.
    with sqlite3.connect(template) as cached:
        cached.execute("UPDATE alembic_version SET version_num = 'ffffffffffff'")
    third = new_store("third")
    assert third.execute("SELECT version_num FROM alembic_version").fetchall() == first.execute(
        "SELECT version_num FROM alembic_version").fetchall()
    assert sorted(p.name for p in (tmp_path / "third").iterdir()) == ["mlflow.db"]
