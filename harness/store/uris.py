"""Where a tracking store is and what of it lives on this machine: its URI resolved, shown without credentials, and
read for its local files (the database, its artifacts, the redaction key)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from urllib.parse import urlsplit

from harness.errors import StoreUnavailable
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


def display_uri(uri: str) -> str:
    """The store's URI as it may be printed: no user name or password."""
    return strip_credentials(uri)


def scheme(uri: str) -> str:
    """The store's kind as its URI names it (`sqlite`, `http`, `postgresql`, ...; "" for a plain path).
    postgresql+psycopg2://... is SQLAlchemy's dialect+driver form: the dialect decides."""
    return urlsplit(uri).scheme.split("+", 1)[0].lower() if "://" in uri else ""


STORE_DIR = "mlruns"


def default_uri(cwd: Path | None = None) -> str:
    """A SQLite store under ./mlruns (MLflow 3 does not accept a plain folder as a store)."""
    root = (cwd or Path.cwd()).resolve() / STORE_DIR
    return f"sqlite:///{root / DB_NAME}"


def resolve_uri(uri: str | None) -> str:
    """The store a command uses: `uri`, else $MLFLOW_TRACKING_URI, else ./mlruns's; checked to parse, made absolute."""
    chosen = uri or os.environ.get("MLFLOW_TRACKING_URI") or default_uri()
    try:
        _ = urlsplit(chosen).port  # parsed once here: a malformed one is a line, not a traceback
    except ValueError as err:
        # Not printed: it may hold a password.
        raise StoreUnavailable(f"the tracking URI (--tracking-uri or MLFLOW_TRACKING_URI) is not a valid URI ({err}). "
                           "Correct it, e.g. http://[::1]:5000 or sqlite:////abs/path/mlflow.db.") from None
    return absolute_uri(chosen)
