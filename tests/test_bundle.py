"""`harness export` / `harness import`: a run carried in one bundle to a machine with no repository, and
every malformed bundle refused before anything is written."""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import os
import shlex
import shutil
import sqlite3
import subprocess
import tarfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import Project, make_project
from harness.commands.options import ImportOptions
from harness.commands import bundle
from harness import tags as T
from harness.errors import EXIT_USAGE, HarnessError


@dataclass
class Exported:
    original: Project  # its repository is gone once the bundle is written; its store stays, to compare with
    run_id: str
    replay_id: str
    path: Path
    base: Path


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Exported:
    base = tmp_path_factory.mktemp("bundles")
    project = make_project(base)
    # Uncommitted, untracked: the patch must travel with the commit.
    (project.root / "experiments" / "linear_ddp" / "notes.txt").write_text("not committed\n")
    # Declared data outside the repository: it travels only with --with-data.
    samples = base / "lab data" / "samples"
    (samples / "part").mkdir(parents=True)
    (samples / "a.bin").write_bytes(bytes(range(256)) * 8)
    (samples / "part" / "b.csv").write_text("x,y\n1,2\n")
    table = base / "lab data" / "table.csv"  # an entry that is one file, not a folder
    table.write_text("id,label\n1,cat\n")
    yaml = project.root / "experiments" / "linear_ddp" / "experiment.yaml"
    yaml.write_text(yaml.read_text() + f"data:\n  samples: '{samples}'\n  table: '{table}'\n")
    run = project.harness("run", "experiments/linear_ddp", "train.epochs=1", "checkpoint_every=2")
    assert run.returncode == 0, run.stderr
    replay = project.harness("replay", run.last_line)
    assert replay.returncode == 0, replay.stderr
    out = base / "to send" / "run.tar.gz"
    result = project.harness("export", run.last_line, "-o", str(out), "--with-data")
    assert result.returncode == 0, result.stderr
    assert result.last_line == str(out)
    with_checkpoints = project.harness("export", run.last_line, "-o", str(base / "full.tar.gz"), "--with-checkpoints")
    assert with_checkpoints.returncode == 0, with_checkpoints.stderr
    # The code now exists nowhere but in the bundle: the repository (and its remote, never reachable) are
    # gone, and so is the data where the run read it.
    shutil.rmtree(project.root)
    shutil.rmtree(samples.parent)
    return Exported(project, run.last_line, replay.last_line, out, base)


@pytest.fixture(scope="module")
def clean(exported: Exported) -> Project:
    """Another machine: a folder that is no git repository, and an empty store."""
    root = exported.base / "clean machine"
    (root / "store").mkdir(parents=True)
    return Project(root, root / "store")


@dataclass
class Imported:
    run_id: str
    replay_command: list[str]  # the `harness replay ...` command the import printed, word for word


@pytest.fixture(scope="module")
def imported_with(exported: Exported, clean: Project) -> Imported:
    result = clean.harness("import", str(exported.path))
    assert result.returncode == 0, result.stderr
    assert "Imported run" in result.stderr
    (line,) = [line for line in result.stderr.splitlines() if "harness replay" in line]
    return Imported(result.last_line, shlex.split(line.split(": harness ", 1)[1]))


@pytest.fixture(scope="module")
def imported(imported_with: Imported) -> str:
    return imported_with.run_id


def _by_tag(project: Project, tag: str, value: str) -> list:
    return [r for r in project.all_runs() if r.data.tags.get(tag) == value]


def _imported_data(exported: Exported, clean: Project) -> Path:
    return clean.root / "harness-data" / exported.run_id / "samples"  # import's default --data-dir


def test_imported_run_replays_bitwise_from_the_bundled_commit(exported: Exported, clean: Project,
                                                              imported_with: Imported) -> None:
    """The replay command the import printed, run as printed: a file entry is pointed at the file, not its folder."""
    assert not (clean.root / ".git").exists()
    home = clean.root / "harness-data" / exported.run_id
    assert imported_with.replay_command == ["replay", imported_with.run_id, "--data", f"samples={home / 'samples'}",
                                            "--data", f"table={home / 'table' / 'table.csv'}"]
    result = clean.harness(*imported_with.replay_command)
    assert result.returncode == 0, result.stderr + result.stdout
    assert result.stdout.strip().splitlines()[-2].startswith("verdict: BITWISE"), result.stdout


def test_declared_data_travels_and_a_changed_file_is_caught_before_the_replay(exported: Exported, clean: Project,
                                                                              imported: str) -> None:
    data = _imported_data(exported, clean)
    assert (data / "a.bin").read_bytes() == bytes(range(256)) * 8 and (data / "part" / "b.csv").read_text() == "x,y\n1,2\n"
    before = len(clean.all_runs())
    # Where the run read it, the data is gone on this machine: said in one line, nothing launched.
    gone = clean.cli("replay", imported)
    assert gone.returncode == 2 and "data 'samples'" in gone.stderr and "does not exist" in gone.stderr, gone.stderr
    assert "--data" not in gone.stderr or len(gone.stderr.strip().splitlines()) == 1
    # A file entry pointed at the folder holding it (what import printed before): the refusal names the file.
    table = data.parent / "table"
    folder = clean.cli("replay", imported, "--data", f"samples={data}", "--data", f"table={table}")
    assert folder.returncode == 2, folder.stderr
    assert folder.stderr.strip().splitlines()[-1] == (
        f"Error: data 'table': the whole entry was a file, is now a folder since run {imported} was recorded. "
        f"Point data 'table' at the file itself: {table / 'table.csv'}."), folder.stderr
    (data / "part" / "b.csv").write_text("x,y\n1,3\n")
    try:
        changed = clean.cli("replay", imported, "--data", f"samples={data}", "--data", f"table={table / 'table.csv'}")
        assert changed.returncode == 2, changed.stderr
        assert changed.stderr.strip().splitlines()[-1].startswith("Error: data 'samples'") and "part/b.csv" in changed.stderr
    finally:
        (data / "part" / "b.csv").write_text("x,y\n1,2\n")
    assert len(clean.all_runs()) == before  # refused before any replay run was recorded


def test_import_keeps_the_record_exactly(exported: Exported, clean: Project, imported: str) -> None:
    src, dst = exported.original.client(), clean.client()
    a, b = src.get_run(exported.run_id), dst.get_run(imported)
    assert b.data.tags[T.IMPORTED_FROM] == exported.run_id
    # The copy is sealed again in this store (it carries its code and the new tags); the rest is the same.
    assert b.data.tags[T.SEAL] != a.data.tags[T.SEAL]
    assert b.data.tags[T.IMPORT_STATE] == T.IMPORT_COMPLETE
    # harness.replays counts each copy's own replays: the copy's are replayed in this store (the tests above).
    assert ({k: v for k, v in b.data.tags.items() if k not in (T.IMPORTED_FROM, T.SEAL, T.IMPORT_STATE, T.REPLAYS)}
            == {k: v for k, v in a.data.tags.items() if k not in (T.SEAL, T.REPLAYS)})
    assert a.data.tags[T.REPLAYS] == "BITWISE 1"  # the replay exported with it
    assert b.data.params == a.data.params
    assert (b.info.status, b.info.start_time, b.info.end_time) == (a.info.status, a.info.start_time, a.info.end_time)
    assert a.data.metrics
    for key in a.data.metrics:
        history = lambda client, rid: sorted((m.step, m.timestamp, m.value) for m in client.get_metric_history(rid, key))  # noqa: E731
        assert history(dst, imported) == history(src, exported.run_id)

    def files(client, rid: str, path: str | None = None) -> dict[str, int]:
        out = {}
        for info in client.list_artifacts(rid, path):
            out.update(files(client, rid, info.path) if info.is_dir else {info.path: info.file_size})
        return out

    sent = {k: v for k, v in files(src, exported.run_id).items() if not k.startswith(f"{T.ARTIFACT_CHECKPOINTS}/")}
    got = files(dst, imported)
    # Checkpoints stay home by default; the copy's seal manifest is its own.
    assert got == {**sent, T.ARTIFACT_CODE_BUNDLE: got[T.ARTIFACT_CODE_BUNDLE], T.ARTIFACT_SEAL: got[T.ARTIFACT_SEAL]}
    assert T.ARTIFACT_CHECKPOINT_FINGERPRINTS in got  # per-tensor digests travel without --with-checkpoints
    for name in (T.ARTIFACT_SERIES, T.ARTIFACT_PATCH, T.ARTIFACT_CONFIG, T.ARTIFACT_CHECKPOINT_FINGERPRINTS):
        with open(src.download_artifacts(exported.run_id, name, str(exported.base / "a")), "rb") as fa, \
                open(dst.download_artifacts(imported, name, str(exported.base / "b")), "rb") as fb:
            assert fa.read() == fb.read(), name


def test_replays_travel_as_children(exported: Exported, clean: Project, imported: str) -> None:
    (replay,) = _by_tag(clean, T.IMPORTED_FROM, exported.replay_id)
    assert replay.data.tags[T.MLFLOW_PARENT_RUN_ID] == imported
    assert replay.data.tags[T.REPLAY_OF] == imported
    assert replay.data.tags[T.VERDICT] == "BITWISE"


def test_checkpoints_travel_only_when_asked(exported: Exported) -> None:
    def checkpoints(path: Path) -> list[str]:
        with tarfile.open(path, "r:gz") as tar:
            return [n for n in tar.getnames() if f"/{T.ARTIFACT_CHECKPOINTS}/" in n]

    assert checkpoints(exported.path) == []
    full = checkpoints(exported.base / "full.tar.gz")
    assert any(n.startswith(f"{bundle.RUN_DIR}/{bundle.ARTIFACTS}/{T.ARTIFACT_CHECKPOINTS}/") and n.endswith(".pt")
               for n in full), full


def test_importing_twice_is_harmless(exported: Exported, clean: Project, imported: str) -> None:
    before = len(clean.all_runs())
    result = clean.harness("import", str(exported.path))
    assert result.returncode == 0, result.stderr
    assert result.last_line == imported
    assert "already in this store" in result.stderr
    assert len(clean.all_runs()) == before
    assert len(_by_tag(clean, T.IMPORTED_FROM, exported.run_id)) == 1


def _import_states(db: Path, original: str) -> list[tuple[str, str | None]]:
    """(status, import state) of every active run imported from `original`, read straight from the database."""
    import sqlite3

    if not db.is_file():
        return []
    with contextlib.closing(sqlite3.connect(f"{db.as_uri()}?mode=ro", uri=True, timeout=30)) as conn:
        try:
            return conn.execute(
                "SELECT r.status, s.value FROM runs r JOIN tags f ON f.run_uuid = r.run_uuid "
                "LEFT JOIN tags s ON s.run_uuid = r.run_uuid AND s.key = ? "
                "WHERE f.key = ? AND f.value = ? AND r.lifecycle_stage = 'active'",
                (T.IMPORT_STATE, T.IMPORTED_FROM, original)).fetchall()
        except sqlite3.OperationalError:  # the schema is still being made
            return []


def test_import_killed_halfway_is_redone_by_the_next_import(exported: Exported, tmp_path: Path) -> None:
    """kill -9 while the run is being written: the next import finds the half run, deletes it and imports again."""
    for attempt in range(5):  # the kill must land inside the import's writes (tens of ms); retried if it missed
        store = tmp_path / f"store-{attempt}"
        store.mkdir()
        target = Project(tmp_path, store)
        db = store / "mlflow.db"
        proc = target.popen("import", str(exported.path))
        try:
            while proc.poll() is None and (T.RUNNING, T.IMPORT_PARTIAL) not in _import_states(db, exported.run_id):
                time.sleep(0.002)
        finally:
            os.killpg(proc.pid, 9)
            proc.communicate()
        if (T.RUNNING, T.IMPORT_PARTIAL) in _import_states(db, exported.run_id):
            break
    else:
        pytest.fail("the kill never landed inside the import's writes")
    assert list(Path("/tmp").glob(f"harness-import-{proc.pid}-*")), "kill -9 leaves the import's staging behind"
    again = target.harness("import", str(exported.path))
    assert again.returncode == 0, again.stderr
    assert "already" not in again.stderr and "Imported run" in again.stderr
    assert _import_states(db, exported.run_id) == [("FINISHED", T.IMPORT_COMPLETE)]
    replays = _import_states(db, exported.replay_id)
    assert replays == [("FINISHED", T.IMPORT_COMPLETE)], replays
    assert not list(Path("/tmp").glob(f"harness-import-{proc.pid}-*"))  # the killed import's staging is gone
    third = target.harness("import", str(exported.path))
    assert third.returncode == 0 and "already in this store" in third.stderr, third.stderr
    assert third.last_line == again.last_line


def test_concurrent_imports_of_one_bundle_make_one_run(exported: Exported, tmp_path: Path) -> None:
    target = Project(tmp_path, tmp_path / "store")
    target.store.mkdir()
    procs = [target.popen("import", str(exported.path)) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert sorted("already in this store" in err for _, err in outs) == [False, True], outs
    assert outs[0][0].strip().splitlines()[-1] == outs[1][0].strip().splitlines()[-1]
    assert _import_states(target.store / "mlflow.db", exported.run_id) == [("FINISHED", T.IMPORT_COMPLETE)]
    assert len(_import_states(target.store / "mlflow.db", exported.replay_id)) == 1


def test_altered_member_of_a_real_bundle_is_refused_and_nothing_written(exported: Exported, tmp_path: Path) -> None:
    altered = tmp_path / "altered.tar.gz"
    with tarfile.open(exported.path, "r:gz") as src, tarfile.open(altered, "w:gz") as dst:
        for member in src:
            data = src.extractfile(member).read() if member.isreg() else None
            if member.name == f"{bundle.RUN_DIR}/{bundle.ARTIFACTS}/{T.ARTIFACT_PATCH}":
                data = data.replace(b"not committed", b"NOT committed")  # same size, other code
            dst.addfile(member, io.BytesIO(data) if data is not None else None)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with pytest.raises(HarnessError, match=r"uncommitted\.patch' was altered") as err:
        bundle.import_bundle(ImportOptions(altered, tracking_uri=uri))
    assert "\n" not in str(err.value) and err.value.exit_code == EXIT_USAGE
    assert not (tmp_path / "mlflow.db").exists()  # refused before the store was even opened


# -- malformed bundles, built here with tarfile (no run needed) -------------------------------------
RECORD = b'{"run_id": "r"}'


def _entry(name: str, data: bytes = b"", kind: bytes = tarfile.REGTYPE, link: str = "") -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = link
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    return info, data


def _write(path: Path, entries: list[tuple[tarfile.TarInfo, bytes]], manifest: dict | None = None) -> Path:
    members = {info.name: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
               for info, data in entries if info.type == tarfile.REGTYPE}
    doc = manifest or {"format": bundle.FORMAT, "run_id": "r", "replays": [], "members": members}
    raw = json.dumps(doc).encode()
    with tarfile.open(path, "w:gz", format=tarfile.PAX_FORMAT) as tar:
        head = tarfile.TarInfo(bundle.MANIFEST)
        head.size = len(raw)
        tar.addfile(head, io.BytesIO(raw))
        for info, data in entries:
            tar.addfile(info, io.BytesIO(data) if info.type == tarfile.REGTYPE else None)
    return path


def _tampered(path: Path) -> Path:
    good = hashlib.sha256(RECORD).hexdigest()
    doc = {"format": 1, "run_id": "r", "replays": [], "members": {"run/record.json": {"size": len(RECORD), "sha256": good}}}
    return _write(path, [_entry("run/record.json", RECORD.replace(b"r", b"s"))], doc)


def _larger(path: Path) -> Path:
    doc = {"format": 1, "run_id": "r", "replays": [],
           "members": {"run/record.json": {"size": 3, "sha256": hashlib.sha256(RECORD[:3]).hexdigest()}}}
    return _write(path, [_entry("run/record.json", RECORD)], doc)


def _newer(path: Path) -> Path:
    return _write(path, [_entry("run/record.json", RECORD)],
                  {"format": bundle.FORMAT + 1, "run_id": "r", "replays": [], "members": {}})


def _unlisted(path: Path) -> Path:
    doc = {"format": 1, "run_id": "r", "replays": [],
           "members": {"run/record.json": {"size": len(RECORD), "sha256": hashlib.sha256(RECORD).hexdigest()}}}
    return _write(path, [_entry("run/record.json", RECORD), _entry("run/extra.txt", b"x")], doc)


def _missing(path: Path) -> Path:
    doc = {"format": 1, "run_id": "r", "replays": [],
           "members": {"run/record.json": {"size": len(RECORD), "sha256": hashlib.sha256(RECORD).hexdigest()},
                       "code/code.bundle": {"size": 1, "sha256": "0" * 64}}}
    return _write(path, [_entry("run/record.json", RECORD)], doc)


def _patched(path: Path, data: bytes, listed: bytes, patch: dict[int, bytes]) -> Path:
    """A bundle of manifest.json and run/record.json holding `data`, the record listed as `listed`, whose tar header
    is rewritten at offsets with bytes tarfile cannot write (a sparse map, a size that lies); its checksum made again."""
    doc = {"format": 1, "run_id": "r", "replays": [],
           "members": {"run/record.json": {"size": len(listed), "sha256": hashlib.sha256(listed).hexdigest()}}}
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for info, content in [_entry(bundle.MANIFEST, json.dumps(doc).encode()), _entry("run/record.json", data)]:
            tar.addfile(info, io.BytesIO(content))
    archive = bytearray(raw.getvalue())
    at = archive.index(b"run/record.json".ljust(100, b"\0"))  # the header's name field opens its block
    for where, value in patch.items():
        archive[at + where:at + where + len(value)] = value
    archive[at + 148:at + 156] = b" " * 8  # the checksum is the header's byte sum with its own field as spaces
    archive[at + 148:at + 156] = b"%06o\0 " % sum(archive[at:at + 512])
    path.write_bytes(gzip.compress(bytes(archive)))
    return path


def _sparse(path: Path) -> Path:
    """A GNU sparse member: 512 stored bytes that unpack to 4 MiB, the holes zeros the archive does not hold."""
    size = 4 << 20
    return _patched(path, RECORD.ljust(512), RECORD.ljust(512) + bytes(size - 512), {
        156: tarfile.GNUTYPE_SPARSE, 386: b"%011o\0%011o\0" % (0, 512), 483: b"%011o\0" % size})


def _header_lies(path: Path) -> Path:
    """A header that says 3 bytes where 2 KiB follow: tarfile reads the rest as no header and ends the archive."""
    data = RECORD.ljust(2048, b"y")
    return _patched(path, data, data[:3], {124: b"%011o\0" % 3})


def _nested(path: Path, member: str) -> Path:
    """MEMBER (manifest.json or run/record.json) as 200 KB of '[': nested past Python's stack, not malformed JSON."""
    deep = b"[" * 200_000
    if member == bundle.MANIFEST:
        with tarfile.open(path, "w:gz") as tar:
            tar.addfile(_entry(member, deep)[0], io.BytesIO(deep))
        return path
    return _write(path, [_entry(member, deep)])


MALFORMED = {
    "tampered member": (_tampered, "was altered"),
    "absolute path": (lambda p: _write(p, [_entry("/etc/harness-evil", b"x")]), "absolute name"),
    "dot-dot": (lambda p: _write(p, [_entry("run/../../evil", b"x")]), r"climbs out of the bundle \('\.\.'\)"),
    "symlink": (lambda p: _write(p, [_entry("run/link", kind=tarfile.SYMTYPE, link="/etc/passwd")]), "a symbolic link"),
    "hardlink": (lambda p: _write(p, [_entry("run/record.json", RECORD),
                                      _entry("run/hard", kind=tarfile.LNKTYPE, link="run/record.json")]), "a hard link"),
    "device": (lambda p: _write(p, [_entry("run/dev", kind=tarfile.CHRTYPE)]), "a device"),
    "fifo": (lambda p: _write(p, [_entry("run/fifo", kind=tarfile.FIFOTYPE)]), "a fifo"),
    "sparse file": (_sparse, "'run/record.json' is a sparse file"),
    "manifest nested past the stack": (lambda p: _nested(p, bundle.MANIFEST), r"not valid JSON \(nested too deeply\)"),
    "record nested past the stack": (lambda p: _nested(p, "run/record.json"),
                                     r"run/record.json is missing or malformed \(nested too deeply\)"),
    "header that understates its size": (_header_lies, "holds data after its last member"),
    "larger than the manifest": (_larger, "larger than its manifest says"),
    "newer format": (_newer, rf"format {bundle.FORMAT + 1}, newer than this harness reads"),
    "member not in the manifest": (_unlisted, "'run/extra.txt' is not in the manifest"),
    "member missing": (_missing, "lacks 'code/code.bundle'"),
    "malformed record": (lambda p: _write(p, [_entry("run/record.json", RECORD)]), "run/record.json is missing or malformed"),
    "run id that is a path": (lambda p: _write(p, [], {"format": 1, "run_id": "r", "replays": ["../x"], "members": {}}),
                              r"malformed \(at run id '\.\./x'\)"),
    "no manifest first": (lambda p: _plain_tar(p), "does not start with manifest.json"),
    "not a tar.gz": (lambda p: p.write_bytes(b"PK\x03\x04 not a tar") and p, "is not a harness bundle"),
}


def _plain_tar(path: Path) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        info, data = _entry("run/record.json", RECORD)
        tar.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture(scope="module")
def empty_store(tmp_path_factory: pytest.TempPathFactory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('empty store') / 'mlflow.db'}"


@pytest.mark.parametrize("kind", list(MALFORMED))
def test_malformed_bundle_is_refused_before_anything_is_written(kind: str, tmp_path: Path, empty_store: str) -> None:
    make, message = MALFORMED[kind]
    path = make(tmp_path / "bad.tar.gz")
    outside = tmp_path.parent / "evil"
    with pytest.raises(HarnessError, match=message) as err:
        bundle.import_bundle(ImportOptions(path, tracking_uri=empty_store))
    assert "\n" not in str(err.value)
    assert err.value.exit_code == EXIT_USAGE
    db = Path(empty_store.removeprefix("sqlite:///"))
    if db.exists():  # refused after the store was opened: it holds no run (runs and compare refuse a missing store)
        with contextlib.closing(sqlite3.connect(db)) as conn:
            assert conn.execute("SELECT COUNT(*) FROM runs").fetchone() == (0,)
    assert not outside.exists() and not Path("/etc/harness-evil").exists()


def test_refusal_on_the_command_line_is_one_line_and_exit_2(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    project = Project(tmp_path, store)
    result = project.cli("import", str(_write(tmp_path / "bad.tar.gz", [_entry("../evil", b"x")])))
    assert result.returncode == EXIT_USAGE
    assert result.stderr.startswith("Error: bundle member '../evil' climbs out of the bundle")
    assert len(result.stderr.strip().splitlines()) == 1
    assert result.stdout == ""
    assert not (tmp_path.parent / "evil").exists()


def test_member_names_are_checked_as_names() -> None:
    for ok in ("run/record.json", "replays/abc/artifacts/x y.txt"):
        bundle.check_name(ok)
    for bad in ("/abs", "a/../b", "..", "a//b", "./a", "C:/x", "a\\b"):
        with pytest.raises(bundle.BundleError):
            bundle.check_name(bad)


# -- --with-image: into a fresh engine -----------------------------------------------------------------
@contextlib.contextmanager
def fresh_engine(state: Path) -> Iterator[dict[str, str]]:
    """A second dockerd with its own data root, socket and network namespace (no bridge, no iptables: it
    leaves the shared engine's network alone); yields the environment that points the docker CLI at it;
    stopped by its pid."""
    state.mkdir(parents=True, exist_ok=True)
    sock = state / "docker.sock"
    log = open(state / "dockerd.log", "wb")
    dockerd = ["dockerd", "--data-root", str(state / "data"), "--exec-root", str(state / "exec"),
               "--pidfile", str(state / "dockerd.pid"), "-H", f"unix://{sock}", "--bridge=none", "--iptables=false"]
    # In a network namespace of its own: a dockerd with --bridge=none deletes the host's docker0 when it
    # starts, which breaks the shared engine's builds. Its socket is a file, reachable from here; its
    # --network host containers get the namespace's loopback, all a local replay needs.
    had_bridge = Path("/sys/class/net/docker0").exists()
    proc = subprocess.Popen(
        ["unshare", "--net", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *dockerd],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    env = {"DOCKER_HOST": f"unix://{sock}"}
    try:
        deadline = time.monotonic() + 60
        while subprocess.run(["docker", "version"], env={**os.environ, **env}, capture_output=True,
                             timeout=30).returncode != 0:
            assert proc.poll() is None, (state / "dockerd.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "the fresh dockerd did not answer within 60 s"
            time.sleep(0.3)
        assert Path("/sys/class/net/docker0").exists() or not had_bridge, "the fresh engine deleted docker0"
        yield env
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
        log.close()
        # dockerd leaves its network namespace file (and, when killed, overlay mounts) mounted under its state.
        with open("/proc/self/mounts") as fh:
            mounted = [line.split()[1] for line in fh if line.split()[1].startswith(f"{state}/")]
        for point in sorted(mounted, key=len, reverse=True):
            subprocess.run(["umount", "-l", point], capture_output=True, check=False, timeout=60)
        shutil.rmtree(state / "exec", ignore_errors=True)


@pytest.mark.slow
def test_with_image_loads_into_a_fresh_engine_and_the_replay_runs_it(
    engine: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    base = tmp_path_factory.mktemp("image bundle")
    project = make_project(base)
    run = project.harness("run", "experiments/linear_ddp", "--executor", "docker", "train.epochs=1")
    assert run.returncode == 0, run.stderr
    image_id = project.client().get_run(run.last_line).data.tags[T.IMAGE_ID]
    out = base / "with image.tar.gz"
    exported = project.harness("export", run.last_line, "-o", str(out), "--with-image")
    assert exported.returncode == 0, exported.stderr
    shutil.rmtree(project.root)
    machine = base / "clean machine"
    (machine / "store").mkdir(parents=True)
    clean = Project(machine, machine / "store")
    # Under pytest's own temporary folders (no space in the name: it is dockerd's socket path): the GB of
    # unpacked layers are removed with them later, not inside the timed test.
    with fresh_engine(tmp_path_factory.mktemp("engine")) as env:
        docker_env = {**os.environ, **env}
        assert subprocess.run(["docker", "image", "inspect", image_id], env=docker_env, capture_output=True,
                              timeout=60).returncode != 0  # the fresh engine has no image at all
        imported = clean.harness("import", str(out), env=env)
        assert imported.returncode == 0, imported.stderr
        assert "loaded" in imported.stderr
        replay = clean.harness("replay", imported.last_line, env=env)
        assert replay.returncode == 0, replay.stderr + replay.stdout
        assert replay.stdout.strip().splitlines()[-2].startswith("verdict: BITWISE"), replay.stdout
        tags = clean.client().get_run(replay.last_line).data.tags
        assert tags[T.IMAGE_RESOLVED_BY] == "id" and tags[T.IMAGE_ID] == image_id
        assert tags[T.IN_IMAGE] == "true"
        # Nothing was pulled: the engine still knows no registry digest for the loaded image.
        inspect = subprocess.run(["docker", "image", "inspect", "--format", "{{json .RepoDigests}}", image_id],
                                 env=docker_env, capture_output=True, text=True, timeout=60, check=True)
        assert inspect.stdout.strip() == "[]"
