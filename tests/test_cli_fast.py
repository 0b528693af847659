"""The fast read path: `harness runs`, `compare` and `ui` read a current local SQLite store without
MLflow (fastpath.SqliteReader), and every answer equals MLflow's own for the same store.

Speed itself is measured in benchmarks/cli_bench.py, not here; these tests prove the fast path is
taken and gives MLflow's answers. Two runs (the session's reference run and one replay of it).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, Project

from harness import tags as T
from harness.errors import HarnessError
from harness.store import fastpath
from harness.store.fastpath import TESTED_SCHEMA_REVISIONS, SqliteMetricSink, SqliteReader, mlflow_schema_head
from harness.store.tracking import Tracker


@pytest.fixture(scope="module")
def replayed(project: Project, reference_run: str) -> tuple[str, str]:
    """The reference run and a replay of it: a store holding both kinds, verdict tags and a parent link."""
    result = project.harness("replay", reference_run)
    assert result.returncode == 0, result.stderr
    return reference_run, result.last_line


@pytest.fixture(scope="module")
def trackers(project: Project, replayed: tuple[str, str]) -> tuple[Tracker, Tracker]:
    fast, mlflow = Tracker(project.uri, writable=False), Tracker(project.uri)
    assert fast._reader is not None, "a read-only Tracker on a current local store must not open MLflow"
    assert mlflow._reader is None
    return fast, mlflow


def test_schema_head_is_mlflows(tmp_path: Path) -> None:
    """The revision read from MLflow's migration scripts is the one MLflow's own alembic set-up names."""
    from alembic.script import ScriptDirectory
    from mlflow.store.db.utils import _get_alembic_config

    assert mlflow_schema_head() == ScriptDirectory.from_config(_get_alembic_config("")).get_current_head()


def test_installed_mlflow_schema_was_tested() -> None:
    """The fast path's raw SQL runs only on a schema its differential tests have checked; a new MLflow whose schema
    differs must be checked before it is trusted (until then MLflow reads and writes every store itself)."""
    head = mlflow_schema_head()
    assert head in TESTED_SCHEMA_REVISIONS, (
        f"the installed MLflow's schema revision {head} is not among the ones the raw-SQL fast path was tested on "
        f"({', '.join(f'{r}: {v}' for r, v in TESTED_SCHEMA_REVISIONS.items())}), so harness reads and writes local "
        "stores through MLflow itself (correct, slower). Run the fast path's differential tests against this MLflow "
        "(pytest tests/test_cli_fast.py tests/test_metric_sink.py tests/test_store.py with the revision added), and "
        "once they pass add it with the MLflow version to TESTED_SCHEMA_REVISIONS in harness/store/fastpath.py.")


def test_an_untested_schema_goes_through_mlflow(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither the reader nor the metric sink touches a store whose schema revision no test has seen."""
    db = tmp_path / "mlflow.db"
    db.write_bytes(b"not opened")  # never read: the revision decides before the file is opened
    uri = f"sqlite:///{db}"
    assert fastpath._local_store(uri) == (db, mlflow_schema_head())
    monkeypatch.setattr(fastpath, "TESTED_SCHEMA_REVISIONS", {"0123456789ab": "an older mlflow"})
    assert fastpath._local_store(uri) is None
    assert SqliteReader.open(uri) is None
    assert SqliteMetricSink.open(uri) is None


@pytest.mark.parametrize("filter_string", [
    "", f"tags.`{T.KIND}` = 'replay'", f"tags.`{T.VERSION}` LIKE '%'", f"tags.`{T.KIND}` = 'no such kind'",
])
def test_search_answers_as_mlflow(trackers: tuple[Tracker, Tracker], filter_string: str) -> None:
    fast, mlflow = trackers
    for experiment in (None, "linear_ddp"):
        for limit in (1, 50):
            assert fast.search(experiment, limit, filter_string) == mlflow.search(experiment, limit, filter_string)


def test_runs_and_records_read_as_mlflow(trackers: tuple[Tracker, Tracker], replayed: tuple[str, str]) -> None:
    fast, mlflow = trackers
    for run_id in replayed:
        assert fast.get_run(run_id) == mlflow.get_run(run_id)
        for artifact in (T.ARTIFACT_CONFIG, T.ARTIFACT_FINGERPRINTS, T.ARTIFACT_SERIES, "no/such/file"):
            assert fast.read_bytes(run_id, artifact) == mlflow.read_bytes(run_id, artifact)
        assert fast.metric_entries(run_id, "loss") == mlflow.metric_entries(run_id, "loss") != []
        a, b = fast.load_record(run_id), mlflow.load_record(run_id)
        assert a.metrics.keys() == b.metrics.keys() != set()
        assert a.performance.keys() == b.performance.keys() != set()  # the step times, held apart
        for mine, theirs in ((a.metrics, b.metrics), (a.performance, b.performance)):
            for key in mine:
                assert all(np.array_equal(x, y) and x.dtype == y.dtype for x, y in zip(mine[key], theirs[key]))
        a.metrics = b.metrics = a.performance = b.performance = {}
        assert a == b
    assert fast.children(replayed[0]) == mlflow.children(replayed[0]) != []
    assert fast.experiment_id_of("linear_ddp") == mlflow.experiment_id_of("linear_ddp")


def test_missing_run_and_experiment_read_as_mlflow(trackers: tuple[Tracker, Tracker]) -> None:
    fast, mlflow = trackers
    for call in (lambda t: t.get_run("0" * 32), lambda t: t.get_run("not-an-id"), lambda t: t.search("nope"),
                 lambda t: t.experiment_id_of("nope")):
        with pytest.raises(HarnessError) as by_fast:
            call(fast)
        with pytest.raises(HarnessError) as by_mlflow:
            call(mlflow)
        assert str(by_fast.value) == str(by_mlflow.value)


@pytest.mark.parametrize("revision", ["0584bdc529eb", "ffffffffffff"], ids=["older", "unknown"])
def test_another_revision_is_refused_as_mlflow_would(tmp_path: Path, revision: str) -> None:
    """A store of another MLflow version gets MLflow's refusal (tests/test_store.py checks its words via the
    CLI), named from the migration scripts without importing MLflow; a store not made yet is left to MLflow."""
    import sqlite3

    from harness.store.probe import schema_error

    db = tmp_path / "mlflow.db"
    uri = f"sqlite:///{db}"
    assert SqliteReader.open(uri) is None  # no file yet: MLflow creates it
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL)")
        conn.execute("INSERT INTO alembic_version VALUES (?)", (revision,))
    with pytest.raises(HarnessError) as refused:
        SqliteReader.open(uri)
    assert str(refused.value) == str(schema_error(uri, revision))  # known=None: MLflow's alembic decides


def test_runs_and_compare_never_import_mlflow_or_torch(project: Project, replayed: tuple[str, str]) -> None:
    """The real CLI, each module it imports listed by python -X importtime."""
    env = {**os.environ, "MLFLOW_TRACKING_URI": project.uri}
    for args in (["runs"], ["runs", "--all"], ["compare", *replayed], ["compare", replayed[0]]):
        proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "harness", *args], cwd=project.root,
                              env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines()
                    if line.startswith("import time:")}
        assert replayed[0] in proc.stdout or "BITWISE" in proc.stdout
        assert {"mlflow", "torch", "sqlalchemy"}.isdisjoint(imported), args


def _gpu_listed() -> bool:
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return any(line.startswith("GPU ") for line in listed.splitlines())


@pytest.mark.skipif(_gpu_listed(), reason="a GPU is visible: scripts/gpu-check.sh runs its checks there instead")
def test_gpu_check_without_a_gpu_says_so_in_one_line() -> None:
    """scripts/gpu-check.sh on this CPU-only machine: one line, exit 2, nothing run."""
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check.sh")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("gpu-check: no GPU visible"), proc.stderr
