"""The only boundary to MLflow: the store, runs, params, tags, artifacts, background metric writes."""

from __future__ import annotations

import base64
import functools
import json
import logging
import os
import socket
import ssl
import tempfile
import struct
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ParamSpec, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit

if TYPE_CHECKING:
    from harness.compare import RunRecord

from harness import tags as T
from harness.errors import HarnessError
from harness.urls import strip_credentials

STORE_DIR = "mlruns"
# Not MLflow's 5000: a local Docker registry (the docker executor's) usually listens there.
UI_PORT = 5050
_DB_NAME = "mlflow.db"
_BATCH = 1000  # MLflow's per-request limit for metrics in log_batch


def default_uri(cwd: Path | None = None) -> str:
    """A SQLite store under ./mlruns (MLflow 3 no longer accepts a plain folder as a store)."""
    root = (cwd or Path.cwd()).resolve() / STORE_DIR
    return f"sqlite:///{root / _DB_NAME}"


def resolve_uri(uri: str | None) -> str:
    return uri or os.environ.get("MLFLOW_TRACKING_URI") or default_uri()


def _sqlite_path(uri: str) -> Path | None:
    """The database file of a sqlite:///PATH URI (None for an in-memory one)."""
    path = uri[len("sqlite:///"):].split("?", 1)[0]
    return Path(path) if path and path != ":memory:" else None


def _artifact_root(uri: str) -> str | None:
    # A local SQLite store keeps artifacts beside the database, not in the cwd of whoever ran it.
    if uri.startswith("sqlite:///"):
        path = _sqlite_path(uri)
        return str(path.parent / "artifacts") if path else None
    return None


# --- reaching the store ---------------------------------------------------------------------------
# Without these, an unreachable store costs minutes: MLflow retries HTTP requests 7 times with
# exponential backoff (~250 s) and SQLAlchemy engine creation 10 times (~100 s). Every outside call
# gets a deadline instead, and every failure is one line naming the store.

TIMEOUT_ENV = "HARNESS_STORE_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 10.0
# MLflow's own HTTP calls after the probe: a slow server still gets time, a dead one is given up quickly.
_MLFLOW_HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
}
# Concurrent runs sharing one SQLite file take turns for its write lock (metric batches are short);
# waiting up to 30 s beats pysqlite's 5 s "database is locked", and nothing retries beyond it.
_SQLITE_BUSY_TIMEOUT_S = 30
_SQLITE_MAGIC = b"SQLite format 3\x00"
_DATABASES = ("postgresql", "mysql", "mssql")
_PROBE_PATH = "/api/2.0/mlflow/experiments/search?max_results=1"
_FORMS = (
    "Use one of sqlite:///PATH (a local database file), http(s)://HOST:PORT (an MLflow server), "
    "postgresql://... or mysql://..., in --tracking-uri or MLFLOW_TRACKING_URI"
)
_OTHER_STORE = "or use another store with --tracking-uri or MLFLOW_TRACKING_URI"


def store_timeout() -> float:
    """Seconds allowed to reach the store: $HARNESS_STORE_TIMEOUT_S, else 10."""
    raw = os.environ.get(TIMEOUT_ENV, "")
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise HarnessError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds. Set it to a positive number, e.g. 10.")
    return value


def display_uri(uri: str) -> str:
    """The store's URI as it may be printed: no user name or password."""
    return strip_credentials(uri)


def _scheme(uri: str) -> str:
    # postgresql+psycopg2://... is SQLAlchemy's dialect+driver form; the dialect decides.
    return urlsplit(uri).scheme.split("+", 1)[0].lower() if "://" in uri else ""


def _with_query(uri: str, key: str, value: str) -> str:
    """uri with key=value added to its query, unless the user already chose a value."""
    # By string, not urlunsplit: that would drop a slash of sqlite:////abs/path.
    base, _, query = uri.partition("?")
    pairs = parse_qsl(query, keep_blank_values=True)
    if any(k == key for k, _ in pairs):
        return uri
    return f"{base}?{urlencode([*pairs, (key, value)])}"


def _reason(err: BaseException) -> str:
    """The first line of an error, short enough for a one-line message."""
    text = getattr(err, "message", None) or str(err) or type(err).__name__
    line = str(text).strip().splitlines()[0] if str(text).strip() else type(err).__name__
    return strip_credentials(line[:300].rstrip("."))


def probe_store(uri: str, writable: bool, timeout_s: float) -> str:
    """Reach the store before anything uses it; returns the URI MLflow should open (with deadlines).

    Raises HarnessError, one line naming the store, for a store that cannot be used.
    """
    scheme = _scheme(uri)
    if scheme in ("http", "https"):
        _probe_http(uri, timeout_s)
        return uri
    if scheme == "sqlite":
        _probe_sqlite(uri, writable)
        return _with_query(uri, "timeout", str(_SQLITE_BUSY_TIMEOUT_S)) if _sqlite_path(uri) else uri
    if scheme in _DATABASES:
        if scheme == "mssql":
            return uri
        uri = _with_query(uri, "connect_timeout", str(max(1, round(timeout_s))))
        _probe_database(uri, display_uri(uri.split("?", 1)[0]))
        return uri
    if scheme == "":
        raise HarnessError(
            f"'{uri}' is a plain path, which MLflow 3 does not accept as a tracking store. "
            f"{_FORMS}; for a local folder: sqlite:///{Path(uri).resolve() / _DB_NAME}."
        )
    raise HarnessError(f"unsupported tracking store URI '{display_uri(uri)}' (scheme {scheme}://). {_FORMS}.")


def _probe_http(uri: str, timeout_s: float) -> None:
    """One plain GET of an MLflow REST endpoint with a deadline: no MLflow, no retries."""
    shown = display_uri(uri)
    parts = urlsplit(uri)
    headers = {"Accept": "application/json"}
    user, password = parts.username, parts.password
    user = user or os.environ.get("MLFLOW_TRACKING_USERNAME")
    password = password or os.environ.get("MLFLOW_TRACKING_PASSWORD")
    if os.environ.get("MLFLOW_TRACKING_TOKEN"):
        headers["Authorization"] = f"Bearer {os.environ['MLFLOW_TRACKING_TOKEN']}"
    elif user:
        token = base64.b64encode(f"{user}:{password or ''}".encode()).decode()
        headers["Authorization"] = f"Basic {token}"
    url = shown.rstrip("/") + _PROBE_PATH
    context = None
    if parts.scheme == "https":
        # The same TLS settings MLflow itself honours, so the probe and MLflow agree.
        if os.environ.get("MLFLOW_TRACKING_INSECURE_TLS", "").lower() in ("true", "1"):
            context = ssl._create_unverified_context()
        else:
            context = ssl.create_default_context(cafile=os.environ.get("MLFLOW_TRACKING_SERVER_CERT_PATH") or None)
    check = f"Check that an MLflow server runs there (`harness ui` starts one) and the address is right, {_OTHER_STORE}."
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout_s, context=context) as r:
            body = r.read(1 << 20)
    except urllib.error.HTTPError as err:
        if err.code in (401, 403):
            raise HarnessError(
                f"the tracking store {shown} refused the credentials (HTTP {err.code}). Set MLFLOW_TRACKING_USERNAME "
                "and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) for it."
            ) from None
        if err.code >= 500:
            raise HarnessError(
                f"the tracking store {shown} is failing: GET {_PROBE_PATH} answered HTTP {err.code}. "
                f"Check the MLflow server's log, {_OTHER_STORE}."
            ) from None
        raise HarnessError(
            f"{shown} is not an MLflow tracking server: GET {_PROBE_PATH} answered HTTP {err.code}. "
            f"Check the host, port and path in --tracking-uri or MLFLOW_TRACKING_URI."
        ) from None
    except (TimeoutError, socket.timeout):
        raise HarnessError(f"the tracking store {shown} did not answer within {timeout_s:g} s. {check}") from None
    except urllib.error.URLError as err:
        raise HarnessError(f"cannot reach the tracking store {shown}: {_url_reason(err.reason, timeout_s)}. {check}") from None
    except OSError as err:  # a connection reset or closed mid-answer
        raise HarnessError(f"cannot reach the tracking store {shown}: {_url_reason(err, timeout_s)}. {check}") from None
    try:
        answer = json.loads(body)
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        raise HarnessError(
            f"{shown} is not an MLflow tracking server: GET {_PROBE_PATH} did not answer with MLflow's JSON. "
            "Check the host, port and path in --tracking-uri or MLFLOW_TRACKING_URI."
        )


def _url_reason(reason: object, timeout_s: float) -> str:
    if isinstance(reason, ConnectionRefusedError):
        return "connection refused"
    if isinstance(reason, (TimeoutError, socket.timeout)):
        return f"no answer within {timeout_s:g} s"
    if isinstance(reason, socket.gaierror):
        return "host name not found"
    if isinstance(reason, ssl.SSLError):
        return f"TLS failed ({reason.reason or reason}); set MLFLOW_TRACKING_SERVER_CERT_PATH to its CA"
    if isinstance(reason, BaseException):
        return _reason(reason)
    return str(reason)


def _probe_sqlite(uri: str, writable: bool) -> None:
    """The folder exists (or is made) and, for a command that records, is writable; the file is SQLite."""
    shown = display_uri(uri)
    path = _sqlite_path(uri)
    if path is None:
        return
    folder = path.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise HarnessError(
            f"cannot create the folder {folder} of the tracking store {shown}: {err.strerror}. "
            f"Check the path, {_OTHER_STORE}."
        ) from None
    if path.is_dir():
        raise HarnessError(
            f"the tracking store {shown} names a folder, not a database file. Use sqlite:///{path / _DB_NAME}."
        )
    exists = path.exists()
    if writable or not exists:  # a missing database is created, which writes too
        try:
            # sqlite writes a journal beside the database: the folder itself must take new files.
            with tempfile.TemporaryFile(dir=folder, prefix=".harness-probe-"):
                pass
            if exists:
                with open(path, "r+b"):
                    pass
        except OSError as err:
            what = "this command records runs" if writable else "the database does not exist yet"
            where = path if exists and err.filename == str(path) else folder
            raise HarnessError(
                f"the tracking store {shown} is read-only: {where} is not writable ({err.strerror}) and {what}. "
                f"Make {folder} and {path.name} writable for this user, {_OTHER_STORE}."
            ) from None
    if exists:
        try:
            with open(path, "rb") as fh:
                head = fh.read(len(_SQLITE_MAGIC))
        except OSError as err:
            raise HarnessError(
                f"cannot read the tracking store {shown}: {err.strerror}. Check the permissions of {path}."
            ) from None
        if head and head != _SQLITE_MAGIC:  # sqlite treats an empty file as an empty database
            raise HarnessError(
                f"{path} is not an SQLite database, so it cannot be the tracking store {shown}. "
                f"Move the file away, {_OTHER_STORE}."
            )


def _probe_database(uri: str, shown: str) -> None:
    """One connection attempt with the connect timeout, instead of MLflow's 10 retries."""
    import sqlalchemy
    import sqlalchemy.exc

    try:
        engine = sqlalchemy.create_engine(uri)
    except ImportError as err:
        raise HarnessError(
            f"the tracking store {shown} needs the database driver {err.name or err}, which is not installed. "
            "Install it (postgresql: pip install psycopg2-binary; mysql: pip install pymysql) and name it in the URI, "
            "e.g. postgresql+psycopg2://..."
        ) from None
    except sqlalchemy.exc.ArgumentError as err:
        raise HarnessError(f"the tracking store URI {shown} is malformed: {_reason(err)}. {_FORMS}.") from None
    try:
        with engine.connect():
            pass
    except sqlalchemy.exc.SQLAlchemyError as err:
        raise HarnessError(
            f"cannot reach the tracking store {shown}: {_reason(getattr(err, 'orig', None) or err)}. "
            f"Check that the database server runs and accepts these credentials, {_OTHER_STORE}."
        ) from None
    finally:
        engine.dispose()


def _schema_error(shown: str, found: str) -> HarnessError:
    """A database made by another MLflow version: name the revision and the way out."""
    import mlflow

    known = False
    try:
        from mlflow.store.db.utils import _get_alembic_config
        from alembic.script import ScriptDirectory

        known = any(s.revision == found for s in ScriptDirectory.from_config(_get_alembic_config("")).walk_revisions())
    except Exception:  # MLflow's migration layout is not public: an unknown answer is the safe one
        known = False
    if known:
        return HarnessError(
            f"the tracking store {shown} has the older database schema revision {found}, and this MLflow "
            f"({mlflow.__version__}) needs a newer one. Back it up, then run `mlflow db upgrade {shown}`, or use the "
            "MLflow version that made it."
        )
    return HarnessError(
        f"the tracking store {shown} has database schema revision {found}, which this MLflow ({mlflow.__version__}) "
        f"does not know: another MLflow version made it. Use the MLflow version that made it, {_OTHER_STORE}."
    )


def _open_error(shown: str, err: BaseException) -> HarnessError:
    import re

    text = str(getattr(err, "message", None) or err)
    found = re.search(r"out-of-date database schema \(found version ([^,\s)]+)", text)
    if found:
        return _schema_error(shown, found.group(1))
    if "readonly database" in text or "read-only" in text:
        return HarnessError(
            f"the tracking store {shown} is read-only: {_reason(err)}. Make it writable for this user, {_OTHER_STORE}."
        )
    return HarnessError(f"cannot open the tracking store {shown}: {_reason(err)}. Check it, {_OTHER_STORE}.")


def is_store_error(err: BaseException) -> bool:
    """An error raised by MLflow, SQLAlchemy or the HTTP client: a store that failed, not a harness bug."""
    import sys

    kinds: list[type] = []
    if "mlflow" in sys.modules:
        from mlflow.exceptions import MlflowException

        kinds.append(MlflowException)
    if "sqlalchemy" in sys.modules:
        import sqlalchemy.exc

        kinds.append(sqlalchemy.exc.SQLAlchemyError)
    if "requests" in sys.modules:
        import requests

        kinds.append(requests.RequestException)
    return bool(kinds) and isinstance(err, tuple(kinds))


def store_failure(err: BaseException, uri: str) -> HarnessError:
    return HarnessError(
        f"the tracking store {display_uri(uri)} failed: {_reason(err)}. Check that it is reachable (and writable for "
        "commands that record), then rerun."
    )


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _store_call(method: Callable[_P, _R]) -> Callable[_P, _R]:
    """A Tracker method whose store failures become one line naming the store."""

    @functools.wraps(method)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return method(*args, **kwargs)
        except HarnessError:
            raise
        except Exception as err:
            if not is_store_error(err):
                raise
            raise store_failure(err, args[0].uri) from err  # type: ignore[attr-defined]

    return wrapper


def _missing(err: BaseException) -> bool:
    """MLflow's "not found" (a run or artifact that does not exist), as opposed to a store failure."""
    return getattr(err, "error_code", None) == "RESOURCE_DOES_NOT_EXIST"


@dataclass(frozen=True)
class RunSummary:
    run_id: str
    experiment: str
    experiment_id: str
    run_name: str
    status: str
    start_time: int | None
    end_time: int | None
    tags: dict[str, str]
    params: dict[str, str]
    metric_keys: list[str]
    artifact_uri: str


def _summary(run: Any, experiment: str) -> RunSummary:
    return RunSummary(
        run_id=run.info.run_id,
        experiment=experiment,
        experiment_id=run.info.experiment_id,
        run_name=run.info.run_name,
        status=run.info.status,
        start_time=run.info.start_time,
        end_time=run.info.end_time,
        tags=dict(run.data.tags),
        params=dict(run.data.params),
        metric_keys=sorted(run.data.metrics),
        artifact_uri=run.info.artifact_uri,
    )


class Tracker:
    """An MLflow client bound to one tracking store, reached (or refused) before it is used.

    `writable`: the command records (run, replay, resume, audit); False for commands that only read.
    """

    def __init__(self, uri: str | None = None, *, writable: bool = True) -> None:
        self.uri = resolve_uri(uri)
        self.display_uri = display_uri(self.uri)
        # Before MLflow is imported: a dead store is reported in milliseconds, not after MLflow's retries.
        client_uri = probe_store(self.uri, writable, store_timeout())
        for name, value in _MLFLOW_HTTP_DEFAULTS.items():
            os.environ.setdefault(name, value)
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
        from mlflow.tracking import MlflowClient

        # MLflow's store migrations log at INFO on first use; the CLI's stderr is for the user.
        # (After the import: importing mlflow resets its logger's level.)
        for name in ("mlflow", "alembic", "sqlalchemy"):
            logging.getLogger(name).setLevel(logging.WARNING)

        try:
            # Opens the store for real: creates a fresh SQLite schema, or refuses another version's.
            self.client = MlflowClient(tracking_uri=client_uri)
            self.client.search_experiments(max_results=1)
        except Exception as err:
            if not is_store_error(err):
                raise
            raise _open_error(self.display_uri, err) from err

    # -- writing ---------------------------------------------------------------------------------
    @_store_call
    def experiment_id(self, name: str) -> str:
        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            return exp.experiment_id
        root = _artifact_root(self.uri)
        location = Path(root, name).as_uri() if root else None
        try:
            return self.client.create_experiment(name, artifact_location=location)
        except Exception:
            exp = self.client.get_experiment_by_name(name)  # created concurrently
            if exp is None:
                raise
            return exp.experiment_id

    @_store_call
    def create_run(self, experiment: str, tags: dict[str, str], run_name: str | None = None) -> str:
        run = self.client.create_run(self.experiment_id(experiment), tags=tags, run_name=run_name)
        return run.info.run_id

    @_store_call
    def log_params(self, run_id: str, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        self.client.log_batch(run_id, params=[Param(k, str(v)[:6000]) for k, v in params.items()])

    @_store_call
    def set_tags(self, run_id: str, values: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        if values:
            self.client.log_batch(run_id, tags=[RunTag(k, str(v)[:8000]) for k, v in values.items()])

    @_store_call
    def log_text(self, run_id: str, text: str, artifact_file: str) -> None:
        self.client.log_text(run_id, text, artifact_file)

    @_store_call
    def log_dir(self, run_id: str, local_dir: Path, artifact_path: str | None = None) -> None:
        self.client.log_artifacts(run_id, str(local_dir), artifact_path)

    @_store_call
    def log_file(self, run_id: str, local_file: Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(run_id, str(local_file), artifact_path)

    @_store_call
    def reopen(self, run_id: str) -> None:
        """Mark an ended run RUNNING again (a resume continues it)."""
        self.client.update_run(run_id, status="RUNNING")

    @_store_call
    def end_run(self, run_id: str, status: str) -> None:
        self.client.set_terminated(run_id, status)

    def local_artifact_dir(self, run_id: str) -> Path:
        """The run's artifact folder on this machine (checkpoints are written straight into it)."""
        uri = self.get_run(run_id).artifact_uri
        if uri.startswith("file://"):
            return Path(uri[len("file://"):])
        if uri.startswith("/"):
            return Path(uri)
        raise HarnessError(
            f"checkpoints need a local artifact store, but run {run_id} stores artifacts at {uri}. "
            "Use a file:// artifact root (the default SQLite store has one), or set checkpoint_every: 0."
        )

    def metric_writer(self, run_id: str, flush_interval_s: float) -> "MetricWriter":
        return MetricWriter(self, run_id, flush_interval_s)

    def heartbeat(self, run_id: str, interval_s: float) -> "Heartbeat":
        return Heartbeat(self, run_id, interval_s)

    # -- reading ---------------------------------------------------------------------------------
    @_store_call
    def get_run(self, run_id: str) -> RunSummary:
        from mlflow.exceptions import MlflowException

        try:
            run = self.client.get_run(run_id)
        except MlflowException as err:
            # Only "not found" or a malformed id mean there is no such run; anything else is the store failing.
            if not (_missing(err) or err.error_code == "INVALID_PARAMETER_VALUE"):
                raise
            raise HarnessError(
                f"no run '{run_id}' in the tracking store {self.display_uri}. "
                "List runs with `harness runs`, or pass --tracking-uri for another store."
            ) from None
        return _summary(run, self.client.get_experiment(run.info.experiment_id).name)

    def harness_run(self, run_id: str) -> RunSummary:
        """get_run, refusing runs that harness did not make (they lack what a replay needs)."""
        run = self.get_run(run_id)
        if T.VERSION not in run.tags:
            raise HarnessError(
                f"run '{run_id}' was not made by harness (no {T.VERSION} tag); only `harness run` records "
                "what a replay needs."
            )
        return run

    @_store_call
    def read_text(self, run_id: str, artifact_file: str) -> str | None:
        """The artifact's text, None if the run has no such artifact (a store failure raises)."""
        with tempfile.TemporaryDirectory() as tmp:
            try:
                local = self.client.download_artifacts(run_id, artifact_file, tmp)
            except Exception as err:
                if _missing(err) or isinstance(err, FileNotFoundError):
                    return None
                raise
            return Path(local).read_text()

    @_store_call
    def metric_history(self, run_id: str, key: str) -> tuple[list[int], list[float]]:
        """All values of one metric, by step (last write wins for a repeated step)."""
        by_step: dict[int, tuple[int, float]] = {}
        for m in self.client.get_metric_history(run_id, key):
            prev = by_step.get(m.step)
            if prev is None or m.timestamp >= prev[0]:
                by_step[m.step] = (m.timestamp, m.value)
        steps = sorted(by_step)
        return steps, [by_step[s][1] for s in steps]

    @_store_call
    def load_record(self, run_id: str) -> "RunRecord":
        """Everything the comparison needs about one harness run."""
        import numpy as np
        from omegaconf import OmegaConf

        from harness.compare import RunRecord

        run = self.harness_run(run_id)
        with tempfile.TemporaryDirectory() as tmp:
            try:
                local = self.client.download_artifacts(run_id, T.ARTIFACT_SERIES, tmp)
                metrics = load_series(Path(local))
            except Exception as err:  # a run cut off before its series was written: MLflow's history
                if is_store_error(err) and not _missing(err):
                    raise
                metrics = {}
                for key in run.metric_keys:
                    steps, values = self.metric_history(run_id, key)
                    metrics[key] = (np.array(steps, dtype=np.int64), np.array(values, dtype=np.float64))
        fp = json.loads(self.read_text(run_id, T.ARTIFACT_FINGERPRINTS) or "{}")
        config_text = self.read_text(run_id, T.ARTIFACT_CONFIG) or "{}"
        return RunRecord(
            run_id=run_id,
            experiment=run.experiment,
            status=run.status,
            facts={k: v for k, v in run.tags.items() if k.startswith(T.PREFIX)},
            lock=(self.read_text(run_id, T.ARTIFACT_LOCK) or "").splitlines(),
            metrics=metrics,
            fingerprints={int(k): v for k, v in fp.get("steps", {}).items()},
            final_fingerprint=fp.get("final"),
            checkpoints={int(k): v for k, v in fp.get("checkpoints", {}).items()},
            steps_total=fp.get("steps_total"),
            config=OmegaConf.to_container(OmegaConf.create(config_text), resolve=True),  # type: ignore[arg-type]
        )

    @_store_call
    def search(
        self, experiment: str | None = None, max_results: int = 50, filter_string: str = ""
    ) -> list[RunSummary]:
        if experiment:
            exp = self.client.get_experiment_by_name(experiment)
            if exp is None:
                raise HarnessError(
                    f"no MLflow experiment '{experiment}' in {self.display_uri}. Run `harness runs` to list all."
                )
            exps = [exp]
        else:
            exps = self.client.search_experiments()
        names = {e.experiment_id: e.name for e in exps}
        if not names:
            return []
        runs = self.client.search_runs(
            list(names), filter_string=filter_string, max_results=max_results, order_by=["attributes.start_time DESC"]
        )
        return [_summary(r, names[r.info.experiment_id]) for r in runs]

    def ui_hint(self, run: str | RunSummary) -> str:
        summary = run if isinstance(run, RunSummary) else self.get_run(run)
        store = "" if self.uri == default_uri() else f" --tracking-uri {self.uri}"
        return (
            f"Open it in the MLflow UI: harness ui{store}, then "
            f"http://127.0.0.1:{UI_PORT}/#/experiments/{summary.experiment_id}/runs/{summary.run_id}"
        )


def save_series(series: dict[str, dict[int, float]], path: Path) -> None:
    """Metric series as exact int64 steps / float64 values in one .npz."""
    import numpy as np

    arrays: dict[str, Any] = {"keys": np.array(json.dumps(sorted(series)))}
    for i, key in enumerate(sorted(series)):
        steps = sorted(series[key])
        arrays[f"steps_{i}"] = np.array(steps, dtype=np.int64)
        arrays[f"values_{i}"] = np.array([series[key][s] for s in steps], dtype=np.float64)
    np.savez_compressed(path, **arrays)


def load_series(path: Path) -> dict[str, tuple[Any, Any]]:
    import numpy as np

    with np.load(path) as data:
        keys = json.loads(str(data["keys"]))
        return {k: (data[f"steps_{i}"], data[f"values_{i}"]) for i, k in enumerate(keys)}


class MetricWriter:
    """Buffers metrics and writes them with log_batch from a background thread.

    A per-call log_metric costs a store round trip (~11 ms on SQLite); the training loop
    must never pay that, so add() only appends to a deque.
    """

    def __init__(self, tracker: Tracker, run_id: str, flush_interval_s: float) -> None:
        self._tracker = tracker
        self._run_id = run_id
        self._interval = flush_interval_s
        self._pending: deque[tuple[str, float, int, int]] = deque()
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one flush at a time
        self.written = 0
        self.error: Exception | None = None
        # Every value as logged, for series.npz: reading 100k steps back through MLflow's
        # metric history takes seconds per metric, the comparison needs them in milliseconds.
        self.series: dict[str, dict[int, float]] = {}
        self._known: dict[str, dict[int, float]] = {}
        self._thread = threading.Thread(target=self._loop, name="harness-metrics", daemon=True)
        self._thread.start()

    def prime(self, metrics: dict[str, tuple[Any, Any]]) -> None:
        """Values already in the run (a resume): logged again bit-identically, they are not rewritten."""
        self._known = {key: dict(zip(steps.tolist(), values.tolist())) for key, (steps, values) in metrics.items()}
        self.series = {key: dict(known) for key, known in self._known.items()}

    def add(self, step: int, values: dict[str, float], timestamp_ms: int) -> None:
        for key, value in values.items():
            known = self._known.get(key, {}).get(step)
            self.series.setdefault(key, {})[step] = value  # last write wins, as in MLflow
            if known is not None and struct.pack("<d", known) == struct.pack("<d", value):
                continue
            self._pending.append((key, value, timestamp_ms, step))

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            self.flush()

    def flush(self) -> None:
        from mlflow.entities import Metric

        with self._lock:
            while self._pending:
                batch = []
                while self._pending and len(batch) < _BATCH:
                    key, value, ts, step = self._pending.popleft()
                    batch.append(Metric(key, value, ts, step))
                try:
                    self._tracker.client.log_batch(self._run_id, metrics=batch, synchronous=True)
                    self.written += len(batch)
                except Exception as err:  # keep the data; retried at the next flush
                    self.error = err
                    self._pending.extendleft(
                        reversed([(m.key, m.value, m.timestamp, m.step) for m in batch])
                    )
                    return

    def close(self) -> None:
        """Stop the thread and write everything still buffered (also after a failure)."""
        self._stop.set()
        self._thread.join(timeout=30)
        self.flush()
        if self._pending and self.error is not None:
            raise HarnessError(
                f"could not write {len(self._pending)} metrics to the tracking store "
                f"{display_uri(self._tracker.uri)}: {_reason(self.error)}. Check that it is reachable and writable."
            )


def ui_command(uri: str, host: str, port: int) -> list[str]:
    """`mlflow server` on this store, as an argument list."""
    import sys

    cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", uri, "--host", host, "--port", str(port)]
    root = _artifact_root(uri)
    if root:
        cmd += ["--default-artifact-root", Path(root).as_uri()]
    return cmd


class Heartbeat:
    """Marks a run alive (tag HEARTBEAT = unix seconds) every `interval_s` from a background thread.

    A RUNNING run whose launcher was SIGKILLed cannot mark itself ended; its heartbeat going stale is
    how `harness runs` and `harness mark` tell it from a live one.
    """

    def __init__(self, tracker: Tracker, run_id: str, interval_s: float) -> None:
        self._tracker = tracker
        self._run_id = run_id
        self._interval = interval_s
        self._stop = threading.Event()
        tracker.set_tags(run_id, {T.HEARTBEAT_S: f"{interval_s:g}", T.HEARTBEAT: f"{time.time():.3f}"})
        self._thread = threading.Thread(target=self._loop, name="harness-heartbeat", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._tracker.set_tags(self._run_id, {T.HEARTBEAT: f"{time.time():.3f}"})
            except Exception:  # a store hiccup: the next beat tries again; the run goes on
                pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
