"""The tracking store's URIs (harness/store/uris.py), its probes and deadlines (probe.py) and its locks (locks.py),
importable from here too for callers that name this module."""

from __future__ import annotations

from harness.store.locks import exclusive, flock_holder, hold_limit, opening
from harness.store.probe import (
    DEFAULT_TIMEOUT_S,
    MLFLOW_HTTP_DEFAULTS,
    OTHER_STORE,
    SUPPRESS_URL,
    TIMEOUT_ENV,
    env_seconds,
    probe_store,
    reason_of,
    schema_error,
    store_timeout,
)
from harness.store.uris import (
    DB_NAME,
    KEY_DIR_ENV,
    STORE_DIR,
    absolute_uri,
    artifact_path,
    artifact_root,
    database_file,
    default_uri,
    display_uri,
    key_dir,
    key_file,
    local_paths,
    resolve_uri,
    scheme,
    sqlite_path,
)

__all__ = [
    "DB_NAME", "DEFAULT_TIMEOUT_S", "KEY_DIR_ENV", "MLFLOW_HTTP_DEFAULTS", "OTHER_STORE", "STORE_DIR", "SUPPRESS_URL",
    "TIMEOUT_ENV", "absolute_uri", "artifact_path", "artifact_root", "database_file", "default_uri", "display_uri",
    "env_seconds", "exclusive", "flock_holder", "hold_limit", "key_dir", "key_file", "local_paths", "opening",
    "probe_store", "reason_of", "resolve_uri", "schema_error", "scheme", "sqlite_path", "store_timeout",
]
