"""What a tracking store's failures mean: one line naming the store, a disk that is full or read-only (and the
room kept on it for undoing), a failure that may pass (transient) as opposed to a wrong request."""

from __future__ import annotations

import errno
import functools
import os
import re
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import ParamSpec, TypeVar

from harness.errors import HarnessError, StoreUnavailable
from harness.store.probe import OTHER_STORE, reason_of, schema_error
from harness.store.uris import display_uri


def open_error(shown: str, err: BaseException) -> HarnessError:
    text = str(getattr(err, "message", None) or err)
    found = re.search(r"out-of-date database schema \(found version ([^,\s)]+)", text)
    if found:
        return schema_error(shown, found.group(1))
    if "readonly database" in text or "read-only" in text:
        return StoreUnavailable(
            f"the tracking store {shown} is read-only: {reason_of(err)}. Make it writable for this user, {OTHER_STORE}."
        )
    return StoreUnavailable(f"cannot open the tracking store {shown}: {reason_of(err)}. Check it, {OTHER_STORE}.")


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
    full = unwritable(err)
    if full:  # the words that say so, not a wrapper's (SQLAlchemy's "raised as a result of Query-invoked autoflush")
        fix = "Free space on its disk" if full == "is full" else "Make it writable for this user"
        return StoreUnavailable(f"the tracking store {display_uri(uri)} {full} ({_unwritable_words(err)}). {fix} (or use "
                            "another store with --tracking-uri), then rerun.")
    return StoreUnavailable(
        f"the tracking store {display_uri(uri)} failed: {reason_of(err)}. Check that it is reachable (and writable for "
        "commands that record), then rerun."
    )


_P = ParamSpec("_P")
_R = TypeVar("_R")


def store_call(method: Callable[_P, _R]) -> Callable[_P, _R]:
    """A Tracker method whose store failures become one line naming the store."""

    @functools.wraps(method)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return method(*args, **kwargs)
        except HarnessError:
            raise
        except OSError as err:  # an artifact written to a local store's disk
            if unwritable(err) is None:
                raise
            raise store_failure(err, args[0].uri) from err  # type: ignore[attr-defined]
        except Exception as err:
            if not is_store_error(err):
                raise
            raise store_failure(err, args[0].uri) from err  # type: ignore[attr-defined]

    return wrapper


def missing(err: BaseException) -> bool:
    """MLflow's "not found" (a run or artifact that does not exist), as opposed to a store failure."""
    return getattr(err, "error_code", None) == "RESOURCE_DOES_NOT_EXIST"


# Error codes that a retry cannot change: the request itself is wrong, whatever the server's state.
_PERMANENT = frozenset({"RESOURCE_DOES_NOT_EXIST", "RESOURCE_ALREADY_EXISTS", "INVALID_PARAMETER_VALUE",
                        "BAD_REQUEST", "PERMISSION_DENIED", "UNAUTHENTICATED", "INVALID_STATE"})


# A store that cannot take writes is not away: waiting cannot free its disk or make it writable.
_UNWRITABLE_TEXT = (("database or disk is full", "is full"), ("no space left on device", "is full"),
                    ("disk quota exceeded", "is full"), ("readonly database", "is read-only"),
                    ("read-only file system", "is read-only"))
_UNWRITABLE_ERRNO = {errno.ENOSPC: "is full", errno.EDQUOT: "is full", errno.EROFS: "is read-only"}


def unwritable(err: BaseException | None) -> str | None:
    """"is full" or "is read-only" when `err` (or what caused it) says the store's disk cannot take writes: sqlite's
    "database or disk is full" / "attempt to write a readonly database", or ENOSPC / EROFS from an artifact write.
    None for any other failure."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in _UNWRITABLE_ERRNO:
            return _UNWRITABLE_ERRNO[err.errno]
        text = str(getattr(err, "message", None) or err).lower()
        for needle, what in _UNWRITABLE_TEXT:
            if needle in text:
                return what
        err = err.__cause__ or err.__context__
    return None


def _unwritable_words(err: BaseException | None) -> str:
    """The line of `err` (or what caused it) that says its disk is full or read-only, for a one-line message."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in _UNWRITABLE_ERRNO:
            return err.strerror or os.strerror(err.errno or 0)
        for line in str(getattr(err, "message", None) or err).splitlines():
            if any(needle in line.lower() for needle, _ in _UNWRITABLE_TEXT):
                return reason_of(Exception(line.strip()))
        err = err.__cause__ or err.__context__
    return "no space"


def transient(err: BaseException | None) -> bool:
    """A store failure that may pass (server restarting, connection refused, 5xx), not a wrong request, nor a disk
    that is full or read-only (unwritable)."""
    if unwritable(err):
        return False
    if isinstance(err, sqlite3.OperationalError) and "locked" in str(err):  # another writer held the store too long
        return True
    while err is not None:
        if is_store_error(err):
            return getattr(err, "error_code", None) not in _PERMANENT
        err = err.__cause__
    return False


# What undoing an import needs on a full disk, with a wide margin: its runs marked deleted (SQLite journals a few
# 4 KiB pages); the artifact files it wrote are removed, which frees space.
ROLLBACK_ROOM = 1 << 20


def allocate(path: Path, size: int) -> None:
    """A file of `size` bytes whose blocks are taken on its disk (not a sparse one): ENOSPC when they are not there."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as err:
            if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            os.write(fd, bytes(size))  # a filesystem without fallocate
            os.fsync(fd)
    finally:
        os.close(fd)
