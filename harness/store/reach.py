"""Reaching the tracking store before MLflow uses it: a deadline, and one line that says what failed.

Without this an unreachable store costs minutes: MLflow retries HTTP requests 7 times with
exponential backoff (~250 s) and SQLAlchemy engine creation 10 times (~100 s).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import socket
import ssl
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit

from harness.errors import HarnessError, StoreUnavailable, UsageError
from harness.secrets import scrub
from harness.tags import MLFLOW_SUPPRESS_URL_ENV
from harness.urls import strip_credentials

DB_NAME = "mlflow.db"


def sqlite_path(uri: str) -> Path | None:
    """The database file of a sqlite:///PATH URI (None for an in-memory one)."""
    path = uri[len("sqlite:///"):].split("?", 1)[0]
    return Path(path) if path and path != ":memory:" else None


def absolute_uri(uri: str) -> str:
    """`uri` with a relative sqlite path made absolute against this process's cwd: the ranks, a container and MLflow's
    artifact locations all read it from another directory."""
    path = sqlite_path(uri) if uri.startswith("sqlite:///") else None
    if path is None or path.is_absolute():
        return uri
    query = uri.partition("?")[2]
    return f"sqlite:///{path.resolve()}" + (f"?{query}" if query else "")


def artifact_root(uri: str) -> str | None:
    """A local SQLite store keeps artifacts beside the database, not in the cwd of whoever ran it."""
    if uri.startswith("sqlite:///"):
        path = sqlite_path(uri)
        return str(path.parent / "artifacts") if path else None
    return None


def database_file(uri: str) -> Path | None:
    """The database file of a local SQLite store's URI; None for an in-memory or any other store."""
    return sqlite_path(uri) if uri.startswith("sqlite:///") else None


def artifact_path(uri: str) -> Path | None:
    """The local folder of a file:// or absolute-path artifact URI; None for a remote one."""
    if uri.startswith("file:"):
        # As MLflow reads its own file URIs: percent-escapes (a space is %20) are undone.
        from urllib.parse import urlparse
        from urllib.request import url2pathname

        return Path(url2pathname(urlparse(uri).path))
    if uri.startswith("/"):
        return Path(uri)
    return None


def local_paths(uri: str) -> list[Path]:
    """The files and folders of a local store (database, its journals, artifacts, redaction key): never part of
    the code record."""
    db = database_file(uri)
    if db is None:
        return []
    root = artifact_root(uri)
    return [db, *(db.with_name(db.name + suffix) for suffix in ("-journal", "-wal", "-shm")), *([Path(root)] if root else []),
            key_file(uri)]


KEY_DIR_ENV = "HARNESS_KEY_DIR"


def key_file(uri: str) -> Path:
    """Where the redaction key of the store at `uri` lives (record/redaction.py): beside a local database
    (`mlflow.db.harness-key`), else in $HARNESS_KEY_DIR (default ~/.config/harness/keys) under a name derived from
    the store's URI without credentials. Never in the store itself: whoever reads the store must not get the key."""
    db = database_file(uri)
    if db is not None:
        return db.with_name(db.name + ".harness-key")
    return key_dir() / f"{hashlib.sha256(strip_credentials(uri).encode()).hexdigest()[:16]}.key"


def key_dir() -> Path:
    """The folder of the redaction keys of stores that are not a local database."""
    return Path(os.environ.get(KEY_DIR_ENV) or Path.home() / ".config" / "harness" / "keys")


# --- deadlines ---------------------------------------------------------------------------------
# Without these, an unreachable store costs minutes: MLflow retries HTTP requests 7 times with
# exponential backoff (~250 s) and SQLAlchemy engine creation 10 times (~100 s). Every outside call
# gets a deadline instead, and every failure is one line naming the store.

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


def reason_of(err: BaseException) -> str:
    """The first line of an error, short enough for a one-line message."""
    text = getattr(err, "message", None) or str(err) or type(err).__name__
    line = str(text).strip().splitlines()[0] if str(text).strip() else type(err).__name__
    return scrub(line)[:300].rstrip(".")  # scrubbed before cut: a cut URL would no longer read as one


def probe_store(uri: str, writable: bool, timeout_s: float, must_exist: bool = True) -> str:
    """Reach the store before anything uses it; returns the URI MLflow should open (with deadlines).

    Raises HarnessError, one line naming the store, for a store that cannot be used.
    """
    scheme = _scheme(uri)
    if scheme in ("http", "https"):
        _probe_http(uri, timeout_s)
        return uri
    if scheme == "sqlite":
        _probe_sqlite(uri, writable, must_exist)
        return _with_query(uri, "timeout", str(_SQLITE_BUSY_TIMEOUT_S)) if sqlite_path(uri) else uri
    if scheme in _DATABASES:
        if scheme == "mssql":
            return uri
        uri = _with_query(uri, "connect_timeout", str(max(1, round(timeout_s))))
        _probe_database(uri, display_uri(uri.split("?", 1)[0]))
        return uri
    if scheme == "":
        raise StoreUnavailable(
            f"'{uri}' is a plain path, which MLflow 3 does not accept as a tracking store. "
            f"{_FORMS}; for a local folder: sqlite:///{Path(uri).resolve() / DB_NAME}."
        )
    raise StoreUnavailable(f"unsupported tracking store URI '{display_uri(uri)}' (scheme {scheme}://). {_FORMS}.")


@contextlib.contextmanager
def opening(uri: str) -> Iterator[None]:
    """Held while a process opens the store: the processes of one job (torchrun's ranks) open it at once,
    and two that create a fresh SQLite schema together collide. Other stores migrate on their own."""
    path = sqlite_path(uri) if _scheme(uri) == "sqlite" else None
    if path is None:
        yield
        return
    import fcntl

    try:  # the folder, not a file beside the database: nothing is left behind in the store
        fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        yield
        return
    try:
        # The processes of one job, or many jobs on one store, take turns: each opening takes a second or two, more
        # on a loaded machine. Waiting is bounded per holder, not in all, and a holder that makes progress is not
        # waited out: the one that builds a new store's schema (MLflow's migrations, minutes of a loaded core) burns
        # CPU and writes the database as it goes. Only a holder that keeps the lock for longer than HOLD_LIMIT with
        # neither is a problem, and it is named.
        limit = hold_limit()
        holder, since, seen = None, time.monotonic(), None
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                now = time.monotonic()
                who = flock_holder(fd)
                progress = _progress(who, path)
                if who != holder or progress != seen:
                    holder, since, seen = who, now, progress
                elif now - since > limit:
                    raise StoreUnavailable(_held_message(holder, path.parent, limit)) from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def exclusive(uri: str) -> Iterator[None]:
    """Held by one process at a time per local SQLite store, for writes that must not interleave (an import): a
    flock on the database file itself, which SQLite's own (fcntl) locks do not see, and which a killed holder
    releases. Nothing for other stores."""
    path = sqlite_path(uri) if _scheme(uri) == "sqlite" else None
    if path is None or not path.is_file():
        yield
        return
    import fcntl

    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def hold_limit() -> float:
    """Seconds one process may hold a store's opening lock without progress (no CPU time, no write to the store)
    before the next one gives up: six store timeouts (60 s)."""
    return 6 * store_timeout()


def _progress(pid: int | None, db: Path) -> tuple[object, ...]:
    """What changes while the opening lock's holder works: its CPU time (utime and stime of /proc/PID/stat), and
    the size and modification time of the store's files (the database, its journal, the one being created)."""
    cpu: object = None
    if pid is not None:
        with contextlib.suppress(OSError, IndexError):
            # The command name (field 2) may hold spaces and parentheses: count from the last ')'.
            fields = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()
            cpu = (fields[11], fields[12])  # utime, stime (fields 14 and 15)
    files = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(db.parent):
            if entry.name.startswith((db.name, f".{db.name}.creating-")):
                with contextlib.suppress(OSError):
                    st = entry.stat(follow_symlinks=False)
                    files.append((entry.name, st.st_size, st.st_mtime_ns))
    return cpu, tuple(sorted(files))


def flock_holder(fd: int) -> int | None:
    """The pid holding a flock on the file open as `fd`, from /proc/locks; None when it cannot be told."""
    st = os.fstat(fd)
    ident = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as fh:
            for line in fh:
                fields = line.split()
                if "->" in fields or len(fields) < 6 or fields[1] != "FLOCK":
                    continue
                if fields[5] == ident and fields[4].isdigit():
                    return int(fields[4])
    except OSError:
        pass
    return None


def _held_message(pid: int | None, folder: Path, limit: float) -> str:
    if pid is None:
        return (f"a process has held the opening lock of the store in {folder} for more than {limit:g} s without "
                f"letting go; check for a hung harness process (raise {TIMEOUT_ENV} to wait longer).")
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        command = "command unknown"
    return (f"process {pid} ({command[:200]}) has held the opening lock of the store in {folder} for more than "
            f"{limit:g} s without letting go. If it is hung, stop it (kill {pid}); else raise {TIMEOUT_ENV} to "
            "wait longer.")


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


STORE_DIR = "mlruns"


def default_uri(cwd: Path | None = None) -> str:
    """A SQLite store under ./mlruns (MLflow 3 no longer accepts a plain folder as a store)."""
    root = (cwd or Path.cwd()).resolve() / STORE_DIR
    return f"sqlite:///{root / DB_NAME}"


def resolve_uri(uri: str | None) -> str:
    chosen = uri or os.environ.get("MLFLOW_TRACKING_URI") or default_uri()
    try:
        _ = urlsplit(chosen).port  # parsed once here: a malformed one is a line, not a traceback
    except ValueError as err:
        # Not printed: it may hold a password.
        raise StoreUnavailable(f"the tracking URI (--tracking-uri or MLFLOW_TRACKING_URI) is not a valid URI ({err}). "
                           "Correct it, e.g. http://[::1]:5000 or sqlite:////abs/path/mlflow.db.") from None
    return absolute_uri(chosen)
