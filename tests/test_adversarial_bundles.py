"""Hostile bundles, crafted as an attacker would: the bundle's manifest of sizes and sha256s recomputed after each
edit, so only what harness checks beyond it can refuse them. A verdict never enters a store on a bundle's word:
a record without its seal is refused, and a replay's verdict is derived again from the two bundled records."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
import tempfile
import tracemalloc
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import Project, make_project
from harness.commands.options import ImportOptions
from harness import npzfile, tags as T
from harness.commands import bundle, bundleformat
from harness.errors import EXIT_USAGE, HarnessError
from harness.record import seal
from harness.store import seriesfile

FIX = "Export the run again from its store, or ask whoever sent it for an intact copy."


@dataclass
class Exported:
    project: Project
    run_id: str
    replay_id: str
    path: Path


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Exported:
    """One run, its BITWISE replay, and their bundle: every forgery below starts from it."""
    project = make_project(tmp_path_factory.mktemp("adversarial bundles"))
    run = project.harness("run", "experiments/linear_ddp", "train.epochs=1")
    assert run.returncode == 0, run.stderr
    replay = project.harness("replay", run.last_line)
    assert replay.returncode == 0, replay.stderr + replay.stdout
    out = project.root.parent / "run.tar.gz"
    result = project.harness("export", run.last_line, "-o", str(out))
    assert result.returncode == 0, result.stderr
    return Exported(project, run.last_line, replay.last_line, out)


def forge(exported: Exported, dest: Path, edit: Callable[[Path, bundle.Manifest], None]) -> Path:
    """Unpack the bundle, let `edit` change the files, and pack them again under a manifest recomputed to match."""
    unpacked = dest.with_suffix(".d")
    unpacked.mkdir()
    manifest = bundle.verify(exported.path, unpacked)
    edit(unpacked, manifest)
    members = {p.relative_to(unpacked).as_posix(): bundle.Member(p.stat().st_size, bundle.sha256_file(p))
               for p in sorted(unpacked.rglob("*")) if p.is_file()}
    data = bundle.Manifest(manifest.format, manifest.run_id, manifest.replays, members, manifest.image).to_json()
    with tarfile.open(dest, "w:gz") as tar:
        info = tarfile.TarInfo(bundle.MANIFEST)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
        for name in members:
            tar.add(unpacked / name, arcname=name)
    return dest


def _replay_dir(unpacked: Path, exported: Exported) -> Path:
    return unpacked / bundle.REPLAYS_DIR / exported.replay_id


def _edit_record(folder: Path, change: Callable[[dict], None]) -> None:
    path = folder / bundle.RECORD
    record = json.loads(path.read_bytes())
    change(record)
    path.write_bytes(json.dumps(record, sort_keys=True, separators=(",", ":")).encode())


def _forge_verdict(record: dict) -> None:
    record["tags"][T.VERDICT] = "DIVERGED"


def _reseal(folder: Path) -> None:
    """What a forger who runs harness's own code does: seal the edited record afresh, as check_bundled reads it."""
    record = bundle._load_record(folder, json.loads((folder / bundle.RECORD).read_bytes())["run_id"])
    artifacts = folder / bundle.ARTIFACTS
    (artifacts / T.ARTIFACT_SEAL).unlink()
    files = {p.relative_to(artifacts).as_posix(): p.read_bytes for p in artifacts.rglob("*") if p.is_file()}
    metrics: dict[str, list[tuple[float, int, int]]] = {}
    for key, value, ts, step in record["entries"]:
        metrics.setdefault(key, []).append((value, ts, step))
    rec = seal.Record(record["status"], record["params"], record["tags"], metrics, files)
    doc = seal.manifest(rec)
    (artifacts / T.ARTIFACT_SEAL).write_bytes(json.dumps(doc, indent=1, sort_keys=True).encode())
    _edit_record(folder, lambda r: r["tags"].__setitem__(T.SEAL, seal.digest(doc)))


def _store(tmp_path: Path) -> Project:
    (tmp_path / "store").mkdir()
    return Project(tmp_path, tmp_path / "store")


def test_a_seal_stripped_bundle_with_a_forged_verdict_is_refused_and_nothing_is_written(
        exported: Exported, tmp_path: Path) -> None:
    """The attack of issue 36: the verdict set to DIVERGED, the seal tag and manifest deleted, the bundle's manifest
    recomputed. Before, the import took it with one warning and sealed the copy as genuine."""
    def strip(unpacked: Path, _: bundle.Manifest) -> None:
        folder = _replay_dir(unpacked, exported)
        _edit_record(folder, lambda r: (_forge_verdict(r), r["tags"].pop(T.SEAL)))
        (folder / bundle.ARTIFACTS / T.ARTIFACT_SEAL).unlink()

    forged = forge(exported, tmp_path / "forged.tar.gz", strip)
    store = _store(tmp_path)
    result = store.cli("import", str(forged))
    assert result.returncode == EXIT_USAGE, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"Error: run {exported.replay_id} (in the bundle) carries no seal: nothing shows its record is the one its "
        "harness closed, and an import would seal it as genuine; refused. Export it again with a harness that seals "
        "its runs, from the store that holds it."]
    assert not (store.store / "mlflow.db").exists()  # refused before the store was opened
    assert "DIVERGED" not in store.cli("runs").stdout


def test_a_record_marked_running_without_its_seal_is_refused_too(exported: Exported, tmp_path: Path) -> None:
    """A RUNNING record is accepted unsealed in a store (it has not closed yet): in a bundle it is refused, or the
    import would close and seal it."""
    def running(unpacked: Path, _: bundle.Manifest) -> None:
        folder = unpacked / bundle.RUN_DIR
        _edit_record(folder, lambda r: (r.__setitem__("status", T.RUNNING), r["tags"].pop(T.SEAL)))
        (folder / bundle.ARTIFACTS / T.ARTIFACT_SEAL).unlink()

    store = _store(tmp_path)
    result = store.cli("import", str(forge(exported, tmp_path / "running.tar.gz", running)))
    assert result.returncode == EXIT_USAGE, result.stderr
    assert result.stderr.startswith(f"Error: run {exported.run_id} (in the bundle) is still RUNNING: "), result.stderr
    assert not (store.store / "mlflow.db").exists()


def test_a_forged_verdict_sealed_afresh_is_derived_again_and_refused(exported: Exported, tmp_path: Path) -> None:
    """A forger who reseals the edited record with harness's own code passes the seal: the verdict is judged again
    from the two bundled series, which are bit-identical, and the import is refused with nothing left in the store."""
    def reseal(unpacked: Path, _: bundle.Manifest) -> None:
        folder = _replay_dir(unpacked, exported)
        _edit_record(folder, _forge_verdict)
        _reseal(folder)

    store = _store(tmp_path)
    result = store.cli("import", str(forge(exported, tmp_path / "resealed.tar.gz", reseal)))
    assert result.returncode == EXIT_USAGE, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"Error: replay {exported.replay_id} (in the bundle) records the verdict DIVERGED, but its metrics and weights "
        f"against the original's judge BITWISE: the verdict does not follow from the record; refused. {FIX}"]
    assert not (store.store / "mlflow.db").exists()  # judged in a scratch store: this one was never opened


def test_an_intact_bundle_imports_with_its_verdict_derived_again_and_reexports_sealed(
        exported: Exported, tmp_path: Path) -> None:
    """The control: the same bundle, untouched, imports (its verdict follows from its series), `runs` shows the
    verdict, and a re-export of the copy imports again into a third store."""
    store = _store(tmp_path)
    result = store.harness("import", str(exported.path))
    assert result.returncode == 0, result.stderr
    listing = store.cli("runs")
    [row] = [line for line in listing.stdout.splitlines() if line.startswith(result.last_line)]
    assert row.rstrip().endswith("BITWISE 1"), listing.stdout
    again = tmp_path / "again.tar.gz"
    assert store.harness("export", result.last_line, "-o", str(again)).returncode == 0
    third = Project(tmp_path / "third", tmp_path / "third" / "store")
    third.store.mkdir(parents=True)
    assert third.harness("import", str(again)).returncode == 0


# -- decompression bombs: a member of zeros listed with its true size and sha256 -----------------------
class _Zeros(io.RawIOBase):
    """`size` zero bytes, made as they are read: a bomb is packed without ever being on disk or in memory whole."""

    def __init__(self, size: int) -> None:
        self.left = size

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), self.left)
        buffer[:n] = bytes(n)
        self.left -= n
        return n


def _zeros_sha256(size: int) -> str:
    digest, block = hashlib.sha256(), bytes(1 << 20)
    for start in range(0, size, len(block)):
        digest.update(block[:min(len(block), size - start)])
    return digest.hexdigest()


def bomb(exported: Exported, dest: Path, size: int) -> Path:
    """The real bundle with BOMB added: `size` zeros listed in the manifest with their true size and sha256, packed
    at gzip's level 9 (about 1000 times smaller) by streaming, so the test writes the compressed bytes only."""
    with tarfile.open(exported.path, "r:gz") as src:
        members = [(m, src.extractfile(m).read()) for m in src if m.name != bundle.MANIFEST]  # type: ignore[union-attr]
    listed = {m.name: bundle.Member(m.size, hashlib.sha256(data).hexdigest()) for m, data in members}
    listed[BOMB] = bundle.Member(size, _zeros_sha256(size))
    with tarfile.open(exported.path, "r:gz") as src:
        head = bundleformat.parse_manifest(src.extractfile(bundle.MANIFEST).read())  # type: ignore[union-attr]
    manifest = bundle.Manifest(head.format, head.run_id, head.replays, listed, head.image).to_json()
    with tarfile.open(dest, "w:gz", compresslevel=9, format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo(bundle.MANIFEST)
        info.size = len(manifest)
        tar.addfile(info, io.BytesIO(manifest))
        for member, data in members:
            tar.addfile(member, io.BytesIO(data))
        info = tarfile.TarInfo(BOMB)
        info.size = size
        tar.addfile(info, io.BufferedReader(_Zeros(size), 1 << 20))
    return dest


BOMB = f"{bundle.RUN_DIR}/{bundle.ARTIFACTS}/bomb.bin"


@pytest.fixture
def scratch_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The system's temporary folder, where an import unpacks: empty again after a refusal."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def test_a_bomb_over_the_size_limit_is_refused_in_one_line_before_a_byte_is_unpacked(
        exported: Exported, tmp_path: Path, scratch_tmp: Path) -> None:
    """16 MiB of zeros (16 KiB packed) against --max-unpacked-mib 4: the limit a legitimately huge bundle raises.
    Before, a bomb listed with its true size and sha256 was unpacked whole and read whole before its seal refused it."""
    path = bomb(exported, tmp_path / "bomb.tar.gz", 16 << 20)
    with tarfile.open(path, "r:gz") as tar:
        members = bundleformat.parse_manifest(tar.extractfile(bundle.MANIFEST).read()).members  # type: ignore[union-attr]
    total = sum(m.size for m in members.values())
    store = _store(tmp_path)
    result = store.cli("import", str(path), "--max-unpacked-mib", "4")
    assert result.returncode == EXIT_USAGE, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"Error: bundle member '{BOMB}' ({16 << 20} bytes) is the largest of {len(members)} that unpack to {total} bytes, "
        "over the import's limit of 4 MiB; refused before anything was unpacked. If you trust where the bundle came "
        f"from, import it with --max-unpacked-mib {-(-total // (1 << 20))}."]
    assert not (store.store / "mlflow.db").exists()
    assert list(scratch_tmp.iterdir()) == []  # no unpack folder left


def test_a_bomb_over_the_ratio_limit_is_refused_with_the_default_limits(
        exported: Exported, tmp_path: Path, scratch_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """200 MiB of zeros packed into about 200 KiB: over the default ratio, refused before any member is copied out."""
    path = bomb(exported, tmp_path / "bomb.tar.gz", 200 << 20)
    copied: list[str] = []
    real_copy = bundleformat._copy_checked
    monkeypatch.setattr(bundleformat, "_copy_checked", lambda src, dest, name, expected: (
        copied.append(name), real_copy(src, dest, name, expected)))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with pytest.raises(bundle.BundleError) as err:
        bundle.import_bundle(ImportOptions(path, tracking_uri=uri))
    message = str(err.value)
    assert message.startswith(f"bundle member '{BOMB}' ({200 << 20} bytes) is the largest of "), message
    assert " times the bundle's " in message and "over the import's limit of 100 times" in message, message
    assert message.endswith(f"refused before anything was unpacked. If you trust where the bundle came from, import "
                            f"it with --max-ratio {message.rsplit(' ', 1)[1]}"), message
    assert err.value.exit_code == EXIT_USAGE and "\n" not in message
    assert copied == []  # not a byte of any member was unpacked
    assert not (tmp_path / "mlflow.db").exists()
    assert list(scratch_tmp.iterdir()) == []


def test_a_bundled_artifact_is_hashed_in_chunks_never_read_whole(exported: Exported, tmp_path: Path) -> None:
    """An unsealed 128 MiB artifact (a sparse file: nothing written) is refused by the run's seal with the memory
    of one chunk: before, the seal check read every artifact whole into memory to hash it."""
    unpacked = tmp_path / "unpacked"
    unpacked.mkdir()
    bundle.verify(exported.path, unpacked)
    folder = unpacked / bundle.RUN_DIR
    with open(folder / bundle.ARTIFACTS / "big.bin", "wb") as fh:
        fh.truncate(128 << 20)
    record = bundle._load_record(folder, exported.run_id)
    tracemalloc.start()
    try:
        with pytest.raises(HarnessError, match=r"was changed after it was sealed: artifact big\.bin \(added\)"):
            seal.check_bundled(record, folder / bundle.ARTIFACTS, f"run {exported.run_id} (in the bundle)")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"{peak} bytes at the peak of the seal check"


def _npz_bomb(path: Path, size: int) -> None:
    """An .npz whose one array is `size` bytes of float64 zeros, deflated (about 1000 times smaller), streamed."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive, \
            archive.open("values_0.npy", "w", force_zip64=True) as member:
        np.lib.format.write_array_header_1_0(member, {"descr": "<f8", "fortran_order": False, "shape": (size // 8,)})
        block = bytes(1 << 20)
        for _ in range(size // len(block)):
            member.write(block)


def test_a_resealed_bundle_whose_series_is_a_zip_bomb_is_refused_before_numpy_reads_it(
        exported: Exported, tmp_path: Path) -> None:
    """An .npz is a zip: a forger who reseals the run passes the seal, and the judge inflated the series into memory
    (then, finding no keys in it, judged from MLflow's rows and imported the run)."""
    def swap(unpacked: Path, _: bundle.Manifest) -> None:
        folder = unpacked / bundle.RUN_DIR
        _npz_bomb(folder / bundle.ARTIFACTS / T.ARTIFACT_SERIES, 128 << 20)
        _reseal(folder)

    store = _store(tmp_path)
    result = store.cli("import", str(forge(exported, tmp_path / "npz.tar.gz", swap)))
    assert result.returncode == EXIT_USAGE, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"Error: bundle member '{bundle.RUN_DIR}/{bundle.ARTIFACTS}/{T.ARTIFACT_SERIES}' unpacks "
                           f"to {(128 << 20) + 128} bytes, "), line
    assert line.endswith("(a decompression bomb); refused before it was read. Use an intact copy of the run (its "
                         "original store, or a bundle exported from it)."), line
    assert not (store.store / "mlflow.db").exists()


def test_a_zip_bomb_for_a_stored_series_is_refused_by_its_reader(tmp_path: Path) -> None:
    """The same .npz in a store (an import of an earlier harness): the series reader refuses it, exit 2, where a
    comparison would have inflated it."""
    path = tmp_path / "series.npz"
    _npz_bomb(path, 128 << 20)
    with pytest.raises(npzfile.NpzRefused, match=r"^run R's metrics/series\.npz unpacks to \d+ bytes") as err:
        seriesfile.load_series(path, f"run R's {T.ARTIFACT_SERIES}")
    assert err.value.exit_code == EXIT_USAGE


def test_a_seal_manifest_nested_past_the_stack_is_refused_in_one_line(exported: Exported, tmp_path: Path) -> None:
    """200 KB of '[' for a replay's seal manifest: json's recursion ran out, and the import ended in a traceback."""
    def deepen(unpacked: Path, _: bundle.Manifest) -> None:
        (_replay_dir(unpacked, exported) / bundle.ARTIFACTS / T.ARTIFACT_SEAL).write_bytes(b"[" * 200_000)

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with pytest.raises(HarnessError) as err:
        bundle.import_bundle(ImportOptions(forge(exported, tmp_path / "deep.tar.gz", deepen), tracking_uri=uri))
    assert str(err.value).startswith(f"run {exported.replay_id} (in the bundle) was changed after it was sealed: the "
                                     f"seal's manifest {T.ARTIFACT_SEAL} or the tag {T.SEAL}. "), err.value
    assert err.value.exit_code == EXIT_USAGE
    assert not (tmp_path / "mlflow.db").exists()
