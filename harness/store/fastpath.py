"""MLflow's own SQLite tables, read and written without MLflow where that is measured to matter: the read-only
reader (SqliteReader), the bulk metric sink (SqliteMetricSink), and new stores made whole from a cached empty schema.
Only on a schema revision the differential tests checked (TESTED_SCHEMA_REVISIONS); any other store goes through
MLflow."""

from __future__ import annotations

import contextlib
import functools
import math
import os
import re
import sqlite3
from pathlib import Path
from typing import Any

from harness import scratch
from harness.rundata import RunSummary
from harness.store.probe import schema_error
from harness.store.uris import database_file, display_uri, sqlite_path

_READ_TIMEOUT_S = 30  # a reader waits out a writer's lock as long as the writers wait for each other


# --- reading a local store without MLflow ---------------------------------------------------------
# `harness runs`, `compare` and `ui` only read. Importing MLflow (~3 s here) and opening its store
# (~2 s: SQLAlchemy, the schema check) cost far more than the queries. A local SQLite store whose
# schema is the one this MLflow writes is read here with the standard library instead, read-only;
# any other store, or one this reader does not recognise, goes through MLflow as before.
_MIGRATIONS = ("store", "db_migrations", "versions")
_REVISION = re.compile(r"^(down_)?revision\s*(?::[^=]*)?=\s*(.+)$", re.MULTILINE)
# The filters harness's own queries use: one tag equal to a value, or present at all (LIKE '%').
_TAG_FILTER = re.compile(r"tags\.`([^`]+)` (=|LIKE) '([^'%]*|%)'")
# The schema revisions (MLflow's alembic heads) this raw SQL was checked against by differential tests (the same
# answers and rows as MLflow's own client), with the MLflow versions tested. "Equals the installed head" alone would
# trust a schema nothing has compared: an MLflow whose head is not listed is read and written through MLflow itself
# (slower, never wrong) until its head is checked against MLflow's client and added here.
TESTED_SCHEMA_REVISIONS = {
    "dc11669786a5": "mlflow 3.17.2",
}


@functools.lru_cache(maxsize=1)
def mlflow_schema_revisions() -> tuple[str | None, frozenset[str]]:
    """The newest database revision of the installed MLflow and every revision it can migrate from, read
    from its migration scripts without importing it; (None, ...) when they are not where MLflow 3 keeps
    them (then MLflow itself opens the store)."""
    folder = mlflow_file(*_MIGRATIONS)
    if folder is None:
        return None, frozenset()
    revisions: set[str] = set()
    parents: set[str] = set()
    try:
        for script in folder.glob("*.py"):
            for down, value in _REVISION.findall(script.read_text(encoding="utf-8")):
                named = set(re.findall(r"[\"']([0-9A-Za-z_]+)[\"']", value))
                (parents if down else revisions).update(named)
    except OSError:
        return None, frozenset()
    heads = revisions - parents
    return (heads.pop() if len(heads) == 1 else None), frozenset(revisions)


def mlflow_schema_head() -> str | None:
    return mlflow_schema_revisions()[0]


def _local_store(uri: str) -> tuple[Path, str] | None:
    """(database file, the schema revision MLflow expects) of a local SQLite store harness may read and write without
    MLflow; None for any other store, an empty file, workspaces (MLflow scopes every query by them), or an MLflow whose
    migrations cannot be read or whose schema is not among TESTED_SCHEMA_REVISIONS."""
    path = database_file(uri)
    if path is None or not path.is_file() or path.stat().st_size == 0:
        return None
    if os.environ.get("MLFLOW_ENABLE_WORKSPACES", "").lower() in ("true", "1"):
        return None
    head = mlflow_schema_head()
    return None if head not in TESTED_SCHEMA_REVISIONS else (path, head)


class SqliteReader:
    """Read-only queries on a current local SQLite store: the same answers as MLflow's client for what
    harness reads (runs, tags, params, metric history, local artifacts)."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    @classmethod
    def open(cls, uri: str) -> SqliteReader | None:
        """A reader for `uri`, or None when MLflow must open it (not a local SQLite file, a schema of
        another revision - MLflow names that -, workspaces enabled, or anything unexpected)."""
        known = _local_store(uri)
        if known is None:
            return None
        path, head = known
        try:
            # mode=ro: nothing is written, not even a journal, so a read-only store reads too.
            db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=_READ_TIMEOUT_S,
                                 check_same_thread=False)
            found = db.execute("SELECT version_num FROM alembic_version").fetchall()
        except sqlite3.Error:
            return None
        if found != [(head,)]:
            db.close()
            if len(found) == 1 and isinstance(found[0][0], str):
                # What MLflow would refuse the store for, said without importing it (~3 s).
                raise schema_error(display_uri(uri), found[0][0], known=found[0][0] in mlflow_schema_revisions()[1])
            return None
        return cls(db)

    def _rows(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        return self._db.execute(sql, args).fetchall()

    def experiment(self, name: str) -> tuple[str, str] | None:
        """(id, name) of the experiment called `name`, deleted or not (as get_experiment_by_name)."""
        found = self._rows("SELECT experiment_id, name FROM experiments WHERE name = ?", (name,))
        return (str(found[0][0]), found[0][1]) if found else None

    def experiments(self) -> dict[str, str]:
        """id -> name of the active experiments (as search_experiments())."""
        return {str(i): n for i, n in self._rows("SELECT experiment_id, name FROM experiments "
                                                 "WHERE lifecycle_stage = 'active' ORDER BY experiment_id")}

    def experiment_tags(self, experiment_id: str) -> dict[str, str]:
        return dict(self._rows("SELECT key, value FROM experiment_tags WHERE experiment_id = ?", (experiment_id,)))

    def search(self, names: dict[str, str], filter_string: str, max_results: int) -> list[RunSummary] | None:
        """Active runs of the experiments `names`, newest first (MLflow's order: start time, then id);
        None for a filter this reader does not handle."""
        where = ["r.lifecycle_stage = 'active'", f"r.experiment_id IN ({','.join('?' * len(names))})"]
        args: list[Any] = [int(i) for i in names]
        if filter_string:
            match = _TAG_FILTER.fullmatch(filter_string.strip())
            if match is None:
                return None
            key, op, value = match.groups()
            if op == "LIKE" and value != "%":
                return None
            where.append("EXISTS (SELECT 1 FROM tags t WHERE t.run_uuid = r.run_uuid AND t.key = ?"
                         + (" AND t.value = ?)" if op == "=" else ")"))
            args += [key, value] if op == "=" else [key]
        ids = [row[0] for row in self._rows(
            f"SELECT r.run_uuid FROM runs r WHERE {' AND '.join(where)} "
            "ORDER BY r.start_time IS NULL, r.start_time DESC, r.run_uuid LIMIT ?", (*args, max_results))]
        return [self.run(i, names) for i in ids]  # type: ignore[misc]

    def ids_starting(self, prefix: str, limit: int) -> list[str]:
        """The active runs whose id starts with `prefix` (hex digits only: no LIKE wildcard), at most `limit`."""
        return [row[0] for row in self._rows(
            "SELECT run_uuid FROM runs WHERE run_uuid >= ? AND run_uuid < ? AND lifecycle_stage = 'active' "
            "ORDER BY run_uuid LIMIT ?", (prefix, prefix + "g", limit))]

    def run(self, run_id: str, names: dict[str, str] | None = None) -> RunSummary | None:
        found = self._rows("SELECT r.run_uuid, r.experiment_id, r.name, r.status, r.start_time, r.end_time, "
                           "r.artifact_uri, e.name FROM runs r JOIN experiments e ON e.experiment_id = r.experiment_id "
                           "WHERE r.run_uuid = ?", (run_id,))
        if not found:
            return None
        uuid, exp_id, name, status, start, end, artifact_uri, exp_name = found[0]
        return RunSummary(
            run_id=uuid, experiment=exp_name, experiment_id=str(exp_id), run_name=name, status=status,
            start_time=start, end_time=end,
            tags=dict(self._rows("SELECT key, value FROM tags WHERE run_uuid = ?", (uuid,))),
            params=dict(self._rows("SELECT key, value FROM params WHERE run_uuid = ?", (uuid,))),
            metric_keys=sorted(k for (k,) in self._rows("SELECT key FROM latest_metrics WHERE run_uuid = ?", (uuid,))),
            artifact_uri=artifact_uri,
        )

    def metric_history(self, run_id: str, key: str) -> list[tuple[float, int, int]]:
        """(value, timestamp, step) of every write, NaN restored as MLflow does, in MLflow's order (timestamp,
        step, value; ties as its primary key orders them).

        `step >= min int64` is always true: it makes SQLite (an MLflow store has no statistics) read the run's own
        rows by index_metrics_run_uuid_key_step. Without it SQLite picks the primary key's covering index, which
        starts with `key`, and walks that key's rows in every run of the store: 0.8 s at 10,000 runs of 1,000
        points, growing with the store (benchmarks/scale_store_bench.py); this way 1 ms."""
        return [(float("nan") if is_nan else value, ts, step) for value, ts, step, is_nan in self._rows(
            "SELECT value, timestamp, step, is_nan FROM metrics WHERE run_uuid = ? AND key = ? AND step >= ? "
            "ORDER BY timestamp, step, value, is_nan", (run_id, key, -(2**63)))]

    def latest_metrics(self, run_id: str) -> dict[str, float]:
        """The value MLflow shows as each metric's latest (its latest_metrics table), NaN restored."""
        return {key: float("nan") if is_nan else value for key, value, is_nan in self._rows(
            "SELECT key, value, is_nan FROM latest_metrics WHERE run_uuid = ?", (run_id,))}

    def close(self) -> None:
        self._db.close()



def create_whole(uri: str, client_class: Any) -> None:
    """A new SQLite store is made under a temporary name and renamed into place once MLflow has built its schema
    (a second or more): a process killed meanwhile leaves no half-made database that every later command refuses
    ("duplicate column name"), only a temporary file the next opening removes. Called under `opening`'s lock."""
    path = sqlite_path(uri) if uri.startswith("sqlite:///") else None
    if path is None or not path.parent.is_dir():
        return
    prefix = f".{path.name}.creating-"
    # Whatever a killed creation left (its pid gone), also once another process has made the store since.
    scratch.remove_stale(path.parent, prefix)
    if path.exists():
        return
    tmp = path.with_name(f"{prefix}{os.getpid()}")
    tmp.unlink(missing_ok=True)
    template = _schema_template()
    copied = template is not None and _copy_template(template, tmp)
    # MLflow opens the copy as it opens any current store: it makes the default experiment, whose artifact location
    # depends on where this command runs, which is why the template has none.
    client_class(tracking_uri=f"sqlite:///{tmp}").search_experiments(max_results=1)
    if template is not None and not copied:
        _save_template(tmp, template)
    os.replace(tmp, path)


# MLflow builds a new SQLite store by running each of its schema migrations: 2-3 s of a core for every new store
# (every new project, every `harness import` into a clean folder) that ends in the same tables. The first store a
# version of MLflow builds is kept, without its default experiment, in harness's cache, and later new stores start
# as a copy of it; MLflow still opens the copy itself and checks its schema, and any doubt falls back to migrating.
_TEMPLATE_SUFFIX = ".sqlite"


def _schema_template() -> Path | None:
    """Where the empty store of the installed MLflow's schema is (or would be) cached; None when it cannot be named."""
    if os.environ.get("MLFLOW_ENABLE_WORKSPACES", "").lower() in ("true", "1"):
        return None
    head = mlflow_schema_head()
    try:
        from importlib.metadata import PackageNotFoundError, version

        try:
            mlflow_version = version("mlflow")
        except PackageNotFoundError:
            mlflow_version = version("mlflow-skinny")
    except Exception:
        return None
    if head is None:
        return None
    name = f"mlflow-empty-store-{mlflow_version}-{head}-sqlite{sqlite3.sqlite_version}{_TEMPLATE_SUFFIX}"
    return scratch.cache_dir() / name


def _copy_template(template: Path, dest: Path) -> bool:
    """Copy the cached empty store to `dest` when it is one of the schema MLflow expects; False (nothing at `dest`)
    when there is none or it is not."""
    try:
        with contextlib.closing(sqlite3.connect(f"{template.resolve().as_uri()}?mode=ro", uri=True)) as db:
            (revision,) = db.execute("SELECT version_num FROM alembic_version").fetchone()
            experiments = db.execute("SELECT COUNT(*) FROM experiments").fetchone()[0]
            if revision != mlflow_schema_head() or experiments != 0:
                return False
            with contextlib.closing(sqlite3.connect(dest)) as out:
                db.backup(out)
        return True
    except (sqlite3.Error, OSError, TypeError):
        dest.unlink(missing_ok=True)
        return False


def _save_template(store: Path, template: Path) -> None:
    """Keep the store MLflow just built, less its default experiment, as the template (best effort: a cache)."""
    with contextlib.suppress(sqlite3.Error, OSError):
        template.parent.mkdir(parents=True, exist_ok=True)
        partial = template.with_name(f"{template.name}.{os.getpid()}.partial")
        with contextlib.closing(sqlite3.connect(store)) as db, contextlib.closing(sqlite3.connect(partial)) as out:
            db.backup(out)
        with contextlib.closing(sqlite3.connect(partial)) as out:
            out.execute("DELETE FROM experiment_tags")
            out.execute("DELETE FROM experiments")
            out.commit()
        os.replace(partial, template)
    with contextlib.suppress(OSError):
        template.with_name(f"{template.name}.{os.getpid()}.partial").unlink(missing_ok=True)


_MLFLOW_MAX_FLOAT = 1.7976931348623157e308  # MLflow stores +-inf as the largest float: SQL has no infinity
SINK_CHUNK = 200_000  # points per transaction: a few MB of rows, so a reader waits at most a fraction of a second


def _stored(value: float) -> tuple[int, float]:
    """(is_nan, value) as MLflow's SQL store keeps a metric value: NaN as 0 with is_nan, +-inf as +-max float."""
    if value != value:
        return 1, 0.0
    return 0, value if abs(value) <= _MLFLOW_MAX_FLOAT else math.copysign(_MLFLOW_MAX_FLOAT, value)


class SqliteMetricSink:
    """Metric points straight into a current local SQLite store, as the rows MLflow's log_batch writes.

    MLflow's SQLAlchemy path builds an ORM object per point and takes 0.2-1 ms each (4-6k points/s on this
    project's machines: 40 s at the end of a 200k-point run); the same rows inserted with executemany take a few
    microseconds. The rows are MLflow's own: `metrics` deduplicated on its primary key, NaN stored as 0 with
    is_nan, +-inf as +-max float, and `latest_metrics` updated by MLflow's rule (the greatest (step, timestamp,
    value) wins). Keys pass MLflow's own name check first, so both paths read back the same through MLflow's
    client. Any other store (a server, PostgreSQL, a schema of another revision) keeps
    MLflow's log_batch.
    """

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db
        self._valid: set[str] = set()

    @classmethod
    def open(cls, uri: str) -> SqliteMetricSink | None:
        known = _local_store(uri)
        if known is None:
            return None
        path, head = known
        try:
            db = sqlite3.connect(str(path), timeout=_READ_TIMEOUT_S, check_same_thread=False, isolation_level=None)
            found = db.execute("SELECT version_num FROM alembic_version").fetchall()
        except sqlite3.Error:
            return None
        if found != [(head,)]:  # a schema harness does not know the rows of: MLflow writes it
            db.close()
            return None
        return cls(db)

    def _check_key(self, key: str) -> None:
        if key not in self._valid:
            from mlflow.utils.validation import MAX_ENTITY_KEY_LENGTH, _validate_length_limit, _validate_metric_name

            _validate_metric_name(key)
            _validate_length_limit("Metric name", MAX_ENTITY_KEY_LENGTH, key)
            self._valid.add(key)

    def write(self, run_id: str, points: list[tuple[str, float, int, int]]) -> None:
        """(key, value, timestamp ms, step) points, in one transaction: all of them are in the store, or none."""
        for key in {p[0] for p in points}:
            self._check_key(key)
        # Rows as MLflow stores them; values all finite (a finite sum) are stored as they are, in one pass.
        rows: list[tuple[str, float, int, int, int, str]]
        if math.isfinite(sum([p[1] for p in points])):
            rows = [(key, value, ts, step, 0, run_id) for key, value, ts, step in points]
        else:
            rows = []
            for key, value, ts, step in points:
                nan, stored = _stored(value)
                rows.append((key, stored, ts, step, nan, run_id))
        # latest_metrics by MLflow's rule: per key the greatest (step, timestamp, stored value), the first on a tie.
        latest: dict[str, tuple[str, float, int, int, int, str]] = {}
        for row in rows:
            was = latest.get(row[0])
            if was is None or (row[3], row[2], row[1]) > (was[3], was[2], was[1]):
                latest[row[0]] = row
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            db.executemany("INSERT OR IGNORE INTO metrics (key, value, timestamp, step, is_nan, run_uuid) "
                           "VALUES (?, ?, ?, ?, ?, ?)", rows)
            db.executemany(
                "INSERT INTO latest_metrics (key, value, timestamp, step, is_nan, run_uuid) VALUES (?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (key, run_uuid) DO UPDATE SET value = excluded.value, timestamp = excluded.timestamp, "
                "step = excluded.step, is_nan = excluded.is_nan "
                "WHERE (excluded.step, excluded.timestamp, excluded.value) > "
                "(latest_metrics.step, latest_metrics.timestamp, latest_metrics.value)",
                list(latest.values()))
            db.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                db.execute("ROLLBACK")
            raise

    def close(self) -> None:
        with contextlib.suppress(sqlite3.Error):
            self._db.close()


def mlflow_file(*parts: str) -> Path | None:
    """A file shipped inside the installed MLflow package, found without importing it."""
    import importlib.util

    spec = importlib.util.find_spec("mlflow")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0], *parts)
    return path if path.exists() else None
