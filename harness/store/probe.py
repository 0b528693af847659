"""Reaching the tracking store before MLflow uses it: a deadline, and one line that says what failed.

Without this an unreachable store costs minutes: MLflow retries HTTP requests 7 times with exponential backoff
(~250 s) and SQLAlchemy engine creation 10 times (~100 s). Every outside call gets a deadline instead, and every
failure is one line naming the store.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import ssl
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit

from harness.errors import HarnessError, StoreUnavailable, UsageError
from harness.secrets import scrub
from harness.store.uris import DB_NAME, display_uri, scheme, sqlite_path
from harness.tags import MLFLOW_SUPPRESS_URL_ENV

TIMEOUT_ENV = "HARNESS_STORE_TIMEOUT_S"
SUPPRESS_URL = MLFLOW_SUPPRESS_URL_ENV  # the name lives in tags.py: a rank sets it too, and ranks never reach the store
DEFAULT_TIMEOUT_S = 10.0
# MLflow's own HTTP calls after the probe: a slow server still gets time, a dead one is given up quickly.
MLFLOW_HTTP_DEFAULTS = {
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
OTHER_STORE = "or use another store with --tracking-uri or MLFLOW_TRACKING_URI"


def env_seconds(name: str, default: float, *, allow_zero: bool = False) -> float:
    """A number of seconds from the environment variable `name` (default when unset); one line if it is not one."""
    raw = os.environ.get(name, "")
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (value >= 0 if allow_zero else value > 0):
        what = "a number >= 0" if allow_zero else "a positive number"
        raise UsageError(f"{name}={raw!r} is not a number of seconds. Set it to {what}, e.g. {default:g}.")
    return value


def store_timeout() -> float:
    """Seconds allowed to reach the store: $HARNESS_STORE_TIMEOUT_S, else 10."""
    return env_seconds(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)


def _with_query(uri: str, key: str, value: str) -> str:
    """uri with key=value added to its query, unless the user already chose a value."""
    # By string, not urlunsplit: that would drop a slash of sqlite:////abs/path.
    base, _, query = uri.partition("?")
    pairs = parse_qsl(query, keep_blank_values=True)
    if any(k == key for k, _ in pairs):
        return uri
    return f"{base}?{urlencode([*pairs, (key, value)])}"


def reason_of(err: BaseException) -> str:
    """The first line of an error, short enough for a one-line message."""
    text = getattr(err, "message", None) or str(err) or type(err).__name__
    line = str(text).strip().splitlines()[0] if str(text).strip() else type(err).__name__
    return scrub(line)[:300].rstrip(".")  # scrubbed before cut: a cut URL would no longer read as one


def probe_store(uri: str, writable: bool, timeout_s: float, must_exist: bool = True) -> str:
    """Reach the store before anything uses it; returns the URI MLflow should open (with deadlines).

    Raises HarnessError, one line naming the store, for a store that cannot be used.
    """
    kind = scheme(uri)
    if kind in ("http", "https"):
        _probe_http(uri, timeout_s)
        return uri
    if kind == "sqlite":
        _probe_sqlite(uri, writable, must_exist)
        return _with_query(uri, "timeout", str(_SQLITE_BUSY_TIMEOUT_S)) if sqlite_path(uri) else uri
    if kind in _DATABASES:
        if kind == "mssql":
            return uri
        uri = _with_query(uri, "connect_timeout", str(max(1, round(timeout_s))))
        _probe_database(uri, display_uri(uri.split("?", 1)[0]))
        return uri
    if kind == "":
        raise StoreUnavailable(
            f"'{uri}' is a plain path, which MLflow 3 does not accept as a tracking store. "
            f"{_FORMS}; for a local folder: sqlite:///{Path(uri).resolve() / DB_NAME}."
        )
    raise StoreUnavailable(f"unsupported tracking store URI '{display_uri(uri)}' (scheme {kind}://). {_FORMS}.")


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
    check = f"Check that an MLflow server runs there (`harness ui` starts one) and the address is right, {OTHER_STORE}."
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout_s, context=context) as r:
            body = r.read(1 << 20)
    except urllib.error.HTTPError as err:
        if err.code in (401, 403):
            raise StoreUnavailable(
                f"the tracking store {shown} refused the credentials (HTTP {err.code}). Set MLFLOW_TRACKING_USERNAME "
                "and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) for it."
            ) from None
        if err.code >= 500:
            raise StoreUnavailable(
                f"the tracking store {shown} is failing: GET {_PROBE_PATH} answered HTTP {err.code}. "
                f"Check the MLflow server's log, {OTHER_STORE}."
            ) from None
        raise StoreUnavailable(
            f"{shown} is not an MLflow tracking server: GET {_PROBE_PATH} answered HTTP {err.code}. "
            f"Check the host, port and path in --tracking-uri or MLFLOW_TRACKING_URI."
        ) from None
    except TimeoutError:
        raise StoreUnavailable(f"the tracking store {shown} did not answer within {timeout_s:g} s. {check}") from None
    except urllib.error.URLError as err:
        raise StoreUnavailable(f"cannot reach the tracking store {shown}: {_url_reason(err.reason, timeout_s)}. {check}") from None
    except OSError as err:  # a connection reset or closed mid-answer
        raise StoreUnavailable(f"cannot reach the tracking store {shown}: {_url_reason(err, timeout_s)}. {check}") from None
    try:
        answer = json.loads(body)
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        raise StoreUnavailable(
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
        return reason_of(reason)
    return str(reason)


def _probe_sqlite(uri: str, writable: bool, must_exist: bool = True) -> None:
    """The folder exists (or is made) and, for a command that records, is writable; the file is SQLite."""
    shown = display_uri(uri)
    path = sqlite_path(uri)
    if path is None:
        return
    folder = path.parent
    if not writable and not path.exists() and must_exist:
        # A command that only reads creates nothing: a mistyped path is said, not made into an empty store.
        raise StoreUnavailable(f"no store at {path}: there is no such database. Check the path in --tracking-uri or "
                           "MLFLOW_TRACKING_URI (a store is made by the first `harness run`).")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise StoreUnavailable(
            f"cannot create the folder {folder} of the tracking store {shown}: {err.strerror}. "
            f"Check the path, {OTHER_STORE}."
        ) from None
    if path.is_dir():
        raise StoreUnavailable(
            f"the tracking store {shown} names a folder, not a database file. Use sqlite:///{path / DB_NAME}."
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
            raise StoreUnavailable(
                f"the tracking store {shown} is read-only: {where} is not writable ({err.strerror}) and {what}. "
                f"Make {folder} and {path.name} writable for this user, {OTHER_STORE}."
            ) from None
    if exists:
        try:
            with open(path, "rb") as fh:
                head = fh.read(len(_SQLITE_MAGIC))
        except OSError as err:
            raise StoreUnavailable(
                f"cannot read the tracking store {shown}: {err.strerror}. Check the permissions of {path}."
            ) from None
        if head and head != _SQLITE_MAGIC:  # sqlite treats an empty file as an empty database
            raise StoreUnavailable(
                f"{path} is not an SQLite database, so it cannot be the tracking store {shown}. "
                f"Move the file away, {OTHER_STORE}."
            )


def _probe_database(uri: str, shown: str) -> None:
    """One connection attempt with the connect timeout, instead of MLflow's 10 retries."""
    import sqlalchemy
    import sqlalchemy.exc

    try:
        engine = sqlalchemy.create_engine(uri)
    except ImportError as err:
        raise StoreUnavailable(
            f"the tracking store {shown} needs the database driver {err.name or err}, which is not installed. "
            "Install it (postgresql: pip install psycopg2-binary; mysql: pip install pymysql) and name it in the URI, "
            "e.g. postgresql+psycopg2://..."
        ) from None
    except sqlalchemy.exc.ArgumentError as err:
        raise StoreUnavailable(f"the tracking store URI {shown} is malformed: {reason_of(err)}. {_FORMS}.") from None
    try:
        with engine.connect():
            pass
    except sqlalchemy.exc.SQLAlchemyError as err:
        raise StoreUnavailable(
            f"cannot reach the tracking store {shown}: {reason_of(getattr(err, 'orig', None) or err)}. "
            f"Check that the database server runs and accepts these credentials, {OTHER_STORE}."
        ) from None
    finally:
        engine.dispose()


def schema_error(shown: str, found: str, known: bool | None = None) -> HarnessError:
    """A database made by another MLflow version: name the revision and the way out.

    `known`: whether this MLflow has a migration to `found`; None to ask MLflow's own migration scripts.
    """
    from importlib.metadata import version

    if known is None:
        try:
            from alembic.script import ScriptDirectory
            from mlflow.store.db.utils import _get_alembic_config

            known = any(s.revision == found for s in ScriptDirectory.from_config(_get_alembic_config("")).walk_revisions())
        except Exception:  # MLflow's migration layout is not public: an unknown answer is the safe one
            known = False
    mlflow_version = version("mlflow")  # without importing MLflow
    if known:
        return StoreUnavailable(
            f"the tracking store {shown} has the older database schema revision {found}, and this MLflow "
            f"({mlflow_version}) needs a newer one. Back it up, then run `mlflow db upgrade {shown}`, or use the "
            "MLflow version that made it."
        )
    return StoreUnavailable(
        f"the tracking store {shown} has database schema revision {found}, which this MLflow ({mlflow_version}) "
        f"does not know: another MLflow version made it. Use the MLflow version that made it, {OTHER_STORE}."
    )
