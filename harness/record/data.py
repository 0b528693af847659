"""Declared data: resolve the `data:` paths, hash them in full (cached), record a manifest, diff two manifests.

A manifest is JSON: per declared name, what was declared, where it resolved on the machine that ran,
whether it lies inside the repository, its kind (file or folder), and every file with its path
relative to the entry, its size and sha256. A name's digest is the file's sha256 for a file, and for
a folder the sha256 over its sorted "sha256 size path" lines, so equal digests mean equal bytes
under equal names. Only the digest is compared between machines; the paths are where it was found.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sqlite3
import stat
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import scratch, tags as T
from harness.errors import ConfigError, DataChanged, HarnessError

MANIFEST_FORMAT = 1
KIND_FILE = "file"
KIND_FOLDER = "folder"
ENV_CACHE_DIR = scratch.ENV_CACHE_DIR  # where the hash cache lives (default ~/.cache/harness)
CACHE_FILE = "data-hashes.sqlite"
# 1 MiB reads into one reused buffer: 64 KiB to 1 MiB measured alike here, 4 MiB slightly slower
# (benchmarks/data_bench.py). hashlib releases the GIL for each update, so a pool of threads overlaps
# files on a machine with idle cores.
CHUNK = 1 << 20
_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
_VAR_RE = re.compile(r"\$([A-Za-z_][A-Za-z0-9_]*)")
_CACHE_TIMEOUT_S = 30.0  # how long a run waits for another run's write to the cache before giving up
# File timestamps advance by the kernel's coarse clock (a few ms): a file written again within the same
# tick, at the same size, would keep its stat. A hash is cached only once the file's last change is
# older than this (git calls such entries "racy" and re-checks them the same way).
RACY_S = 0.1


@dataclass(frozen=True)
class Declared:
    """One `data:` entry resolved on this machine (nothing read yet)."""

    name: str
    declared: str  # as written in experiment.yaml
    path: Path  # absolute, after $VAR and ~ expansion
    in_repository: bool


def _expand(name: str, declared: str, environ: Mapping[str, str]) -> str:
    def var(match: re.Match[str]) -> str:
        key = match.group(1)
        if key not in environ:
            raise ConfigError(
                f"data '{name}': '{declared}' uses ${key}, which is not set. Set {key} in the environment, "
                "or write the path out in experiment.yaml."
            )
        return environ[key]

    return os.path.expanduser(_VAR_RE.sub(var, declared))


def resolve(
    declarations: Mapping[str, Any], exp_dir: Path, repo_root: Path | None = None,
    environ: Mapping[str, str] | None = None, *, must_exist: bool = True,
) -> list[Declared]:
    """`data:` entries -> absolute paths. Relative paths are relative to the experiment folder, like `entry`.

    A path that does not exist is a HarnessError naming the entry and the path (when `must_exist`).
    """
    env = os.environ if environ is None else environ
    root = Path(os.path.abspath(repo_root)) if repo_root is not None else None
    out: list[Declared] = []
    for name in sorted(declarations):
        declared = declarations[name]
        if not _NAME_RE.match(str(name)):
            raise ConfigError(
                f"data name '{name}' is not valid; use letters, digits, '_', '-' and '.' (it becomes a tag name)."
            )
        if not isinstance(declared, str) or not declared.strip():
            raise ConfigError(f"data '{name}' must be a path (a string), got {declared!r}.")
        expanded = Path(_expand(name, declared, env))
        # abspath, not resolve(): a symlinked data folder stays under the name the user gave it.
        path = Path(os.path.abspath(Path(exp_dir, expanded) if not expanded.is_absolute() else expanded))
        if must_exist and not path.exists():
            raise ConfigError(
                f"data '{name}': {path} does not exist (declared as '{declared}'). Create it, or fix data.{name} "
                "in experiment.yaml (relative paths are relative to the experiment folder)."
            )
        inside = root is not None and (path == root or root in path.parents)
        out.append(Declared(str(name), declared, path, inside))
    return out


# ---------------------------------------------------------------------------------------------
# The cache: (path, size, mtime, ctime, inode, device) -> sha256


def cache_path() -> Path:
    return scratch.cache_dir() / CACHE_FILE


class HashCache:
    """sha256 per file, valid while the file's size, mtime, ctime, inode and device are unchanged.

    ctime is part of the key because it cannot be set back: a file rewritten and then given its old
    mtime (`touch -d`, rsync -t) still misses. SQLite in WAL mode: concurrent runs read and write
    it without corrupting it; a cache that cannot be opened is only slower, never wrong.
    """

    def __init__(self, path: Path | None) -> None:
        self._db: sqlite3.Connection | None = None
        if path is None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(str(path), timeout=_CACHE_TIMEOUT_S, check_same_thread=False)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute(
                "CREATE TABLE IF NOT EXISTS hashes (path BLOB PRIMARY KEY, size INTEGER, mtime_ns INTEGER, "
                "ctime_ns INTEGER, ino INTEGER, dev INTEGER, sha256 TEXT)"
            )
            db.commit()
            self._db = db
        except (OSError, sqlite3.Error):
            self._db = None  # read-only home, a broken file: hash everything, keep going

    @staticmethod
    def _key(st: os.stat_result) -> tuple[int, int, int, int, int]:
        return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)

    def get_many(self, items: list[tuple[bytes, os.stat_result]], folder: bytes | None = None) -> dict[bytes, str]:
        """The cached sha256 of every item whose stat still matches; `folder`: all items lie under it."""
        if self._db is None or not items:
            return {}
        columns = "path, size, mtime_ns, ctime_ns, ino, dev, sha256"
        try:
            if folder is not None:
                # One range scan over the primary key instead of a query per file: 10,000 files in ~30 ms.
                lo = folder.rstrip(b"/") + b"/"
                rows = self._db.execute(
                    f"SELECT {columns} FROM hashes WHERE path >= ? AND path < ?", (lo, lo[:-1] + b"0")  # '0' follows '/'
                ).fetchall()
            else:
                rows = [r for path, _ in items for r in self._db.execute(
                    f"SELECT {columns} FROM hashes WHERE path = ?", (path,)).fetchall()]
        except sqlite3.Error:
            return {}
        cached = {bytes(r[0]): r for r in rows}
        found: dict[bytes, str] = {}
        for path, st in items:
            row = cached.get(path)
            if row is not None and tuple(row[1:6]) == self._key(st):
                found[path] = row[6]
        return found

    def put_many(self, items: Iterable[tuple[bytes, os.stat_result, str]]) -> None:
        rows = [(path, *self._key(st), digest) for path, st, digest in items]
        if self._db is None or not rows:
            return
        try:
            with self._db:
                self._db.executemany("INSERT OR REPLACE INTO hashes VALUES (?, ?, ?, ?, ?, ?, ?)", rows)
        except sqlite3.Error:
            pass  # another run holds the lock past the timeout: the next run hashes these again

    def close(self) -> None:
        if self._db is not None:
            self._db.close()


# ---------------------------------------------------------------------------------------------
# Hashing


def sha256_file(path: bytes | str | Path, chunk: int = CHUNK) -> str:
    """sha256 of a file's bytes, read in `chunk`-sized pieces into one reused buffer."""
    h = hashlib.sha256()
    buf = bytearray(chunk)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _walk(root: Path, name: str) -> list[tuple[str, bytes, os.stat_result]]:
    """(relative path, absolute path as bytes, stat) of every file under root, sorted by relative path.

    Symlinks are followed (the training reads through them; their targets' bytes are what count); a
    folder symlink that leads back into a folder already walked is refused as a loop.
    """
    out: list[tuple[str, bytes, os.stat_result]] = []
    seen: set[tuple[int, int]] = set()
    broot = os.fsencode(root)
    prefix = len(broot if broot.endswith(b"/") else broot + b"/")
    for dirpath, dirnames, filenames in os.walk(broot, followlinks=True, onerror=_raise):
        st = os.stat(dirpath)
        if (st.st_dev, st.st_ino) in seen:
            raise HarnessError(
                f"data '{name}': {os.fsdecode(dirpath)} is a symlink loop inside {root}. Remove the link."
            )
        seen.add((st.st_dev, st.st_ino))
        dirnames.sort()
        for fname in filenames:
            full = os.path.join(dirpath, fname)
            try:
                fst = os.stat(full)
            except FileNotFoundError:
                raise HarnessError(
                    f"data '{name}': {os.fsdecode(full)} is a broken symlink (or vanished while listed). "
                    "Fix or remove it."
                ) from None
            if not stat.S_ISREG(fst.st_mode):
                raise HarnessError(
                    f"data '{name}': {os.fsdecode(full)} is not a regular file (a pipe, socket or device); "
                    "declared data must be files. Move it out of the folder."
                )
            rel = full[prefix:]  # os.walk joins onto broot; relpath() would cost 60 us a file
            out.append((os.fsdecode(rel), full, fst))
    out.sort(key=lambda item: item[1])  # the same order as the relative paths' bytes: one common prefix
    return out


def _raise(err: OSError) -> None:
    raise HarnessError(f"cannot read declared data: {err.filename}: {err.strerror}. Check its permissions.")


def folder_digest(files: Sequence[Mapping[str, Any]]) -> str:
    """sha256 over "sha256 size path\\n" per file, sorted by path bytes: equal digests, equal folders."""
    lines = sorted((os.fsencode(f["path"]), f"{f['sha256']} {f['size']} ".encode()) for f in files)
    return hashlib.sha256(b"".join(head + path + b"\n" for path, head in lines)).hexdigest()


@dataclass
class HashStats:
    files: int = 0
    hashed: int = 0  # read in full (cache misses)
    bytes_hashed: int = 0
    hashed_paths: list[str] | None = None  # absolute paths read in full, for tests and benchmarks

    def summary(self) -> str:
        """One line for stderr: how much was read, how much the cache spared."""
        return (f"data: {self.files} file{'s' if self.files != 1 else ''} checked, {self.hashed} read in full "
                f"({self.bytes_hashed / 2**20:.1f} MiB), {self.files - self.hashed} unchanged since last hashed (cache)")


def _workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def build_manifest(
    entries: list[Declared], cache: HashCache | None = None, stats: HashStats | None = None
) -> dict[str, Any]:
    """Hash every declared entry in full (cache hits excepted) into a manifest."""
    own = cache is None
    cache = HashCache(cache_path()) if cache is None else cache
    stats = stats if stats is not None else HashStats()
    stats.hashed_paths = stats.hashed_paths if stats.hashed_paths is not None else []
    try:
        out: dict[str, Any] = {}
        for entry in entries:
            out[entry.name] = _hash_entry(entry, cache, stats)
        return {"format": MANIFEST_FORMAT, "entries": out}
    finally:
        if own:
            cache.close()


_HASH_BATCH = 256  # files a hashing task takes at most (a big file is one task's whole time either way)


def _hash_entry(entry: Declared, cache: HashCache, stats: HashStats) -> dict[str, Any]:
    path = entry.path
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise HarnessError(f"data '{entry.name}': {path} does not exist (declared as '{entry.declared}').") from None
    if stat.S_ISDIR(st.st_mode):
        kind = KIND_FOLDER
        listing = _walk(path, entry.name)
    elif stat.S_ISREG(st.st_mode):
        kind = KIND_FILE
        listing = [(path.name, os.fsencode(path), st)]
    else:
        raise HarnessError(f"data '{entry.name}': {path} is neither a file nor a folder.")
    known = cache.get_many([(p, s) for _, p, s in listing], os.fsencode(path) if kind == KIND_FOLDER else None)
    todo = [(p, s) for _, p, s in listing if p not in known]
    lock = threading.Lock()
    fresh: list[tuple[bytes, os.stat_result, str]] = []
    racy: set[bytes] = set()

    def work(item: tuple[bytes, os.stat_result]) -> None:
        p, before = item
        try:
            digest = sha256_file(p)
            after = os.stat(p)
        except OSError as err:
            raise HarnessError(f"data '{entry.name}': cannot read {os.fsdecode(p)}: {err.strerror}.") from None
        if HashCache._key(after) != HashCache._key(before):
            raise HarnessError(
                f"data '{entry.name}': {os.fsdecode(p)} changed while it was hashed. Stop what writes it, then rerun."
            )
        settled = max(after.st_mtime_ns, after.st_ctime_ns) < time.time_ns() - int(RACY_S * 1e9)
        with lock:
            fresh.append((p, before, digest))
            if not settled:
                racy.add(p)

    if len(todo) > 1:
        # Batches, not a Future per file: 100,000 live Futures cost a sixth of the time in garbage-collector passes.
        def batch(items: list[tuple[bytes, os.stat_result]]) -> None:
            for item in items:
                work(item)

        size = max(1, min(_HASH_BATCH, len(todo) // (4 * _workers())))
        with ThreadPoolExecutor(max_workers=_workers()) as pool:
            list(pool.map(batch, [todo[i:i + size] for i in range(0, len(todo), size)]))  # re-raises the first error
    else:
        for item in todo:
            work(item)
    cache.put_many(item for item in fresh if item[0] not in racy)
    digests = dict(known)
    digests.update({p: d for p, _, d in fresh})
    stats.files += len(listing)
    stats.hashed += len(fresh)
    stats.bytes_hashed += sum(s.st_size for _, s, _ in fresh)
    stats.hashed_paths.extend(os.fsdecode(p) for p, _, _ in fresh)  # type: ignore[union-attr]
    files = [{"path": rel, "size": s.st_size, "sha256": digests[p]} for rel, p, s in listing]
    digest = files[0]["sha256"] if kind == KIND_FILE else folder_digest(files)
    return {
        "declared": entry.declared,
        "path": os.fsdecode(os.fsencode(path)),
        "in_repository": entry.in_repository,
        "kind": kind,
        "sha256": digest,
        "size": sum(f["size"] for f in files),
        "files": files,
    }


def dumps(manifest: Mapping[str, Any]) -> str:
    """The manifest as stored: sorted keys, so equal manifests are equal bytes."""
    return json.dumps(manifest, indent=1, sort_keys=True) + "\n"


def loads(text: str) -> dict[str, Any]:
    return json.loads(text)


def digests(manifest: Mapping[str, Any] | None) -> dict[str, str]:
    """name -> digest."""
    return {name: e["sha256"] for name, e in ((manifest or {}).get("entries") or {}).items()}


def paths(manifest: Mapping[str, Any] | None) -> dict[str, str]:
    """name -> the absolute path the entry resolved to where the manifest was made (what ctx.data gives)."""
    return {name: e["path"] for name, e in ((manifest or {}).get("entries") or {}).items()}


# ---------------------------------------------------------------------------------------------
# Differences


@dataclass(frozen=True)
class DataChange:
    """One difference between two manifests, as one plain line."""

    name: str  # the declared name
    kind: str  # changed | missing | added | renamed | undeclared | declared | kind
    path: str  # the file (relative to the entry), or "" for the whole entry
    detail: str
    fix: str = ""  # a way out more precise than "restore the data as recorded", when one is known

    def line(self) -> str:
        where = f"'{self.path}'" if self.path else "the whole entry"
        return f"data '{self.name}': {where} {self.detail}"


def diff(recorded: Mapping[str, Any] | None, current: Mapping[str, Any] | None) -> list[DataChange]:
    """What differs from `recorded` in `current`: changed, missing, added, renamed (same sha256 elsewhere)."""
    a = (recorded or {}).get("entries") or {}
    b = (current or {}).get("entries") or {}
    out: list[DataChange] = []
    for name in sorted(a.keys() | b.keys()):
        ea, eb = a.get(name), b.get(name)
        if eb is None:
            out.append(DataChange(name, "undeclared", "", "was declared in the record, not now"))
            continue
        if ea is None:
            out.append(DataChange(name, "declared", "", "is declared now but not in the record"))
            continue
        if ea["sha256"] == eb["sha256"] and ea["kind"] == eb["kind"]:
            continue
        if ea["kind"] != eb["kind"]:
            # A folder holding the recorded file (the folder an import put it in): the way out is that file.
            inside = [f["path"] for f in eb["files"] if f["sha256"] == ea["sha256"]] if ea["kind"] == KIND_FILE else []
            fix = f"Point data '{name}' at the file itself: {os.path.join(eb['path'], inside[0])}" if inside else ""
            out.append(DataChange(name, "kind", "", f"was a {ea['kind']}, is now a {eb['kind']}", fix))
            continue
        fa = {f["path"]: f for f in ea["files"]}
        fb = {f["path"]: f for f in eb["files"]}
        if ea["kind"] == KIND_FILE:  # one file, whatever its name: only its bytes count
            (pa, xa), xb = next(iter(fa.items())), next(iter(fb.values()))
            out.append(DataChange(name, "changed", pa, _changed(xa, xb)))
            continue
        gone = sorted(set(fa) - set(fb), key=os.fsencode)
        new = sorted(set(fb) - set(fa), key=os.fsencode)
        by_sha: dict[str, list[str]] = {}
        for p in new:
            by_sha.setdefault(fb[p]["sha256"], []).append(p)
        renamed_to: dict[str, str] = {}
        for p in gone:
            candidates = by_sha.get(fa[p]["sha256"])
            if candidates:
                renamed_to[p] = candidates.pop(0)
        taken = set(renamed_to.values())
        for p in sorted(set(fa) | set(fb), key=os.fsencode):
            if p in fa and p in fb:
                if fa[p]["sha256"] != fb[p]["sha256"]:
                    out.append(DataChange(name, "changed", p, _changed(fa[p], fb[p])))
            elif p in renamed_to:
                out.append(DataChange(name, "renamed", p, f"was renamed to '{renamed_to[p]}' (same sha256)"))
            elif p in fa:
                out.append(DataChange(name, "missing", p, "is missing"))
            elif p not in taken:
                out.append(DataChange(name, "added", p, f"was added ({fb[p]['size']} bytes)"))
    return out


def _changed(a: Mapping[str, Any], b: Mapping[str, Any]) -> str:
    return f"changed (sha256 {a['sha256'][:12]}, {a['size']} bytes recorded; now {b['sha256'][:12]}, {b['size']} bytes)"


# ---------------------------------------------------------------------------------------------
# Run start, replay, resume and audit


@dataclass
class DataCheck:
    """The declared data held to a run's record on this machine."""

    manifest: dict[str, Any] | None  # as hashed here (entries that exist)
    changes: list[DataChange]  # empty: the same bytes as recorded
    paths: dict[str, str]  # name -> absolute path here: what ctx.data gives the ranks
    stats: HashStats | None = None


def resolve_and_hash(
    declarations: Mapping[str, Any], exp_dir: Path, repo_root: Path | None, stats: HashStats | None = None
) -> dict[str, Any] | None:
    """The manifest of an experiment's declared data on this machine; None when it declares none."""
    if not declarations:
        return None
    return build_manifest(resolve(declarations, exp_dir, repo_root), stats=stats)


def verify(
    declarations: Mapping[str, Any], recorded: Mapping[str, Any] | None, exp_dir: Path, repo_root: Path | None,
    *, run_id: str, allow_changes: bool, flag: str | None = "--allow-data-changes", stats: HashStats | None = None,
) -> DataCheck:
    """Resolve and hash the data again on this machine and hold it to the run's recorded manifest.

    Replay, resume and audit all call this before anything runs. A difference is refused (HarnessError,
    naming the first one) unless `allow_changes`. `flag`: the option that allows changes (None: none does).
    """
    stats = stats if stats is not None else HashStats()
    if not declarations and not recorded:
        return DataCheck(None, [], {})
    entries = resolve(declarations or {}, exp_dir, repo_root, must_exist=False)
    present = [e for e in entries if e.path.exists()]
    manifest = build_manifest(present, stats=stats) if present else None
    gone = {e.name for e in entries} - {e.name for e in present}
    changes = [
        DataChange(e.name, "missing", "", f"({e.path}, declared as '{e.declared}') does not exist")
        for e in entries if e.name in gone
    ]
    changes += [c for c in diff(recorded, manifest) if c.name not in gone]
    if changes and not allow_changes:
        more = f" (and {len(changes) - 1} more difference{'s' if len(changes) > 2 else ''})" if len(changes) > 1 else ""
        way = (f", or pass {flag} to go on with the data as it is now (the verdict cannot be BITWISE)" if flag
               else "; the run must go on reading the bytes it read")
        fix = changes[0].fix or f"Restore the data as recorded{way}"
        raise DataChanged(f"{changes[0].line()} since run {run_id} was recorded{more}. {fix}.")
    return DataCheck(manifest, changes, {e.name: str(e.path) for e in entries}, stats)


def changed_since(recorded: Mapping[str, Any] | None) -> list[DataChange]:
    """The data of a manifest hashed again where it was found (the cache keeps an unchanged file at a stat), and
    what differs now from `recorded`: [] when every file holds the recorded bytes."""
    held = dict((recorded or {}).get("entries") or {})
    entries = [Declared(name, str(e["declared"]), Path(e["path"]), bool(e["in_repository"]))
               for name, e in sorted(held.items())]
    present = [e for e in entries if e.path.exists()]
    changes = [DataChange(e.name, "missing", "", f"({e.path}) is gone") for e in entries if e not in present]
    if present:
        changes += diff({"entries": {e.name: held[e.name] for e in present}}, build_manifest(present))
    return changes


def written_since(recorded: Mapping[str, Any] | None, since_ns: int) -> list[str]:
    """The files of a manifest written (or moved into place) since `since_ns` (time.time_ns()), as absolute paths."""
    out = []
    for entry in ((recorded or {}).get("entries") or {}).values():
        files = [entry["path"]] if entry["kind"] == KIND_FILE else [os.path.join(entry["path"], f["path"]) for f in entry["files"]]
        for path in files:
            try:
                st = os.stat(path)
            except OSError:
                continue  # gone: changed_since names it
            if max(st.st_mtime_ns, st.st_ctime_ns) >= since_ns:
                out.append(path)
    return out


def recorded_data(tracker: Any, run_id: str) -> dict[str, Any] | None:
    """A run's data manifest (declarations, resolved paths, per-file sha256), or None if it declared none.

    For bundles: `paths(recorded_data(...))` are the files a `--with-data` export would copy.
    """
    text = tracker.read_text(run_id, T.ARTIFACT_DATA_MANIFEST)
    return None if text is None else loads(text)
