"""Portable bundles: a run's whole record, code and replays in one verified .tar.gz (harness export / import)."""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import os
import shutil
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from harness import events, npzfile, scratch, tags as T
from harness.commands.bundleformat import (
    ARTIFACTS,
    CODE_BUNDLE,
    DAMAGED_FIX,
    DATA_DIR,
    FORMAT,
    IMAGE_TAR,
    MANIFEST,
    RECORD,
    REPLAYS_DIR,
    RUN_DIR,
    BundleError,
    Manifest,
    Member,
    check_name,
    check_plain_name,
    load_document,
    verify,
)
from harness.commands.options import ExportOptions, ImportOptions
from harness.errors import DataChanged, HarnessError, RepositoryError, RunRefused, UsageError
from harness.judge.compare import follows, judged_again
from harness.record import closing, data, loading, redaction, seal
from harness.record.checkout import recorded_submodules
from harness.record.data import sha256_file
from harness.store.failures import unwritable
from harness.store.locks import exclusive
from harness.store.tracking import Tracker, import_complete
from harness.systems import docker, git as gitsource, gitbundle


@dataclass
class ExportResult:
    path: Path
    run_id: str
    replays: list[str]
    members: int
    size: int
    image: str | None
    signed: Path | None = None  # export --sign: the attestation written beside the bundle


@dataclass
class ImportResult:
    run_id: str  # the run in this store
    original_id: str
    already: bool  # an earlier import made it: nothing was written
    replays: list[str] = field(default_factory=list)
    image: str | None = None
    data: dict[str, str] = field(default_factory=dict)  # name -> where the bundled data now lies


# -- export ----------------------------------------------------------------------------------------
def _record_json(tracker: Any, run: Any) -> bytes:
    metrics = {key: [[float.hex(v), ts, step] for v, ts, step in tracker.metric_entries(run.run_id, key)]
               for key in run.metric_keys}
    return json.dumps({
        "run_id": run.run_id, "experiment": run.experiment, "run_name": run.run_name, "status": run.status,
        "start_time": run.start_time, "end_time": run.end_time, "params": run.params, "tags": run.tags,
        "metrics": metrics,
    # One line, not indented: with indent json falls back to its pure-Python encoder (9 s of a 1M-point export).
    }, sort_keys=True, separators=(",", ":")).encode()


def _stage_run(tracker: Any, run: Any, folder: Path, with_checkpoints: bool) -> None:
    folder.mkdir(parents=True)
    (folder / RECORD).write_bytes(_record_json(tracker, run))
    artifacts = folder / ARTIFACTS
    artifacts.mkdir()
    for path, _ in tracker.artifact_files(run.run_id):
        if path.split("/")[0] == T.ARTIFACT_CHECKPOINTS and not with_checkpoints:
            continue
        folder_of = artifacts / PurePosixPath(path).parent
        folder_of.mkdir(parents=True, exist_ok=True)
        tracker.download(run.run_id, path, folder_of)


def _stage_data(tracker: Any, run_id: str, dest: Path) -> None:
    """Copy the declared data as recorded into the bundle: every file must still hash as the run read it."""
    manifest = data.recorded_data(tracker, run_id)
    if not manifest or not manifest.get("entries"):
        raise RunRefused(f"run {run_id} declared no data (no data: in its experiment.yaml). Export without --with-data.")
    for name, entry in sorted(manifest["entries"].items()):
        check_name(f"{DATA_DIR}/{name}")
        root = Path(entry["path"])
        for f in entry["files"]:
            source = root if entry["kind"] == data.KIND_FILE else root / f["path"]
            target = dest / name / f["path"]
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                shutil.copyfile(source, target)
            except OSError as err:
                raise HarnessError(
                    f"data '{name}': cannot read {source} ({err.strerror}); --with-data copies the data from where "
                    "the run read it. Restore it there, or export without --with-data."
                ) from None
            if sha256_file(target) != f["sha256"]:
                raise DataChanged(
                    f"data '{name}': {source} changed since run {run_id} was recorded; a bundle carries the bytes "
                    "the run read. Restore it, or export without --with-data."
                )


def export(options: ExportOptions) -> ExportResult:
    """Write the run's record, code bundle, replays (and image) to `options.output` (.tar.gz), with a manifest of
    sha256s. `tree_only`: the code bundle holds the recorded commits without the history before them."""
    run_id, out, with_checkpoints, repo, tree_only = options.run_id, options.output, options.with_checkpoints, \
        options.repo, options.tree_only
    tracker = Tracker(options.tracking_uri, writable=False)
    run_id = tracker.resolve_id(run_id)
    run = tracker.harness_run(run_id)
    loading.refuse(loading.EXPORT, run)
    if out.is_dir():
        raise UsageError(f"'{out}' is a folder; pass the bundle's file name, e.g. -o {out / (run_id + '.tar.gz')}.")
    # Its replays, audits and traces, and its calibrations (the rounding envelope its replays elsewhere are judged by).
    # One still RUNNING is not complete, nor sealed: a bundle carries closed runs only (import refuses any other).
    replays = [r for r in tracker.children(run_id) if r.status != T.RUNNING
               and r.tags.get(T.KIND) in (T.KIND_REPLAY, T.KIND_AUDIT, T.KIND_TRACE, T.KIND_CALIBRATION)]
    # A replay killed while its verdict was being written has no complete report: the bundle goes without it, and
    # says so (it blocked every export of the run, and replaying the run again left it there).
    left_out = {r.run_id for r in replays if seal.interrupted(r)}
    for run_left in sorted(left_out):
        events.emit(events.Warning(f"replay {run_left} is left out of the bundle: its verdict was being written "
                                   "when the process writing it stopped, so its report is incomplete"))
    replays = [r for r in replays if r.run_id not in left_out]
    for one in [run, *replays]:  # a bundle carries only a record as it was sealed
        seal.check(tracker, one.run_id)
    commit = run.tags[T.GIT_COMMIT]
    image = None
    with scratch.folder("export") as tmp:
        stage = Path(tmp, "stage")
        _stage_run(tracker, run, stage / RUN_DIR, with_checkpoints)
        for replay in replays:
            _stage_run(tracker, replay, stage / REPLAYS_DIR / replay.run_id, with_checkpoints)
        code = stage / CODE_BUNDLE
        code.parent.mkdir(parents=True)
        carried = stage / RUN_DIR / ARTIFACTS / T.ARTIFACT_CODE_BUNDLE  # an imported run carries its code
        live = gitsource.find_repo(repo or Path.cwd())
        if live is not None and gitsource.has_commit(live, commit):
            submodules = recorded_submodules(tracker, run)
            _warn_shipped_secrets(live, commit, submodules, tree_only, tracker.uri)
            gitbundle.bundle_commit(live, commit, code, submodules, tree_only)
            carried.unlink(missing_ok=True)
        elif carried.is_file():
            carried.rename(code)
        else:
            where = f"the repository at {live}" if live else "no repository here"
            raise RepositoryError(
                f"commit {commit[:12]} of run {run_id} is not in {where}. Run the export inside a clone that has it "
                f"(git fetch {run.tags.get(T.GIT_REPO_URL) or '<remote>'} {commit})."
            )
        if options.with_image:
            image = _stage_image(run, stage / IMAGE_TAR)
        if options.with_data:
            _stage_data(tracker, run_id, stage / DATA_DIR)
        members = {}
        for path in sorted(p for p in stage.rglob("*") if p.is_file()):
            members[path.relative_to(stage).as_posix()] = Member(path.stat().st_size, sha256_file(path))
        manifest = Manifest(FORMAT, run_id, [r.run_id for r in replays], members, image)
        _write_archive(stage, manifest, out)
    return ExportResult(out, run_id, manifest.replays, len(members), out.stat().st_size,
                        image["ref"] if image else None)


def _warn_shipped_secrets(live: Path, commit: str, submodules: Any, tree_only: bool, uri: str) -> None:
    """A warning naming the secrets the code bundle would carry: a token committed once and deleted since, or
    written in a commit message, leaves with the history (the record's own patch scan never saw committed code)."""
    changes = itertools.chain(gitbundle.shipped_changes(live, commit, tree_only),  # read as they stream
                              *(gitbundle.shipped_changes(live / s.path, s.commit, tree_only) for s in submodules))
    found = redaction.shipped_secrets(changes, redaction.known_keys(uri))
    if found:
        shown = ", ".join(found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
        cure = (" They are in the recorded code itself: move them out of the code and record the run again."
                if tree_only else " Pass --tree-only to ship the recorded commits' files without the history before "
                "them, or rewrite the history (git filter-repo).")
        events.emit(events.Warning(f"the code bundle carries secrets{'' if tree_only else ' in its git history'}: "
                                   f"{shown}; they leave with the bundle.{cure}"))


def _stage_image(run: Any, dest: Path) -> dict[str, str]:
    image_id = run.tags.get(T.IMAGE_ID)
    ref = run.tags.get(T.IMAGE, "none")
    if ref == "none" or not image_id:
        raise RunRefused(
            f"run {run.run_id} recorded no image id (image: {ref}); --with-image needs a run whose image the engine "
            "knew when it ran. Export without --with-image."
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    docker.save_image(image_id, ref, dest)
    return {"ref": ref, "id": image_id}


def _write_archive(stage: Path, manifest: Manifest, out: Path) -> None:
    """The manifest first (import reads it before any other member), then every member; atomic rename."""
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch.remove_stale(out.parent, f".{out.name}.partial-")  # an export killed before its rename
    partial = out.with_name(f".{out.name}.partial-{os.getpid()}")
    data = manifest.to_json()
    try:
        # Level 1: the big members (an image, checkpoints) take minutes at gzip's default 9 for a few % less.
        with tarfile.open(partial, "w:gz", compresslevel=1, format=tarfile.PAX_FORMAT) as tar:
            info = tarfile.TarInfo(MANIFEST)
            info.size, info.mtime, info.mode = len(data), int(time.time()), 0o644
            tar.addfile(info, io.BytesIO(data))
            for name in manifest.members:
                tar.add(stage / name, arcname=name, recursive=False)
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)


# -- import ----------------------------------------------------------------------------------------
def _strings(value: Any) -> dict[str, str]:
    if not (isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())):
        raise TypeError("expected an object of strings")
    return value


def _load_record(folder: Path, run_id: str) -> dict[str, Any]:
    """A run's record.json, every field checked and every metric write parsed before anything is written."""
    try:
        record = load_document((folder / RECORD).read_bytes())
        if record["run_id"] != run_id:
            raise ValueError(f"run_id {record['run_id']!r} where the manifest says {run_id!r}")
        check_plain_name(record["experiment"], "experiment name")
        if not (isinstance(record["experiment"], str) and record["status"] in (T.RUNNING, T.FINISHED, *T.INCOMPLETE)):
            raise ValueError("experiment or status")
        for key in ("start_time", "end_time"):
            if record.get(key) is not None and not isinstance(record[key], int):
                raise TypeError(key)
        if record.get("run_name") is not None and not isinstance(record["run_name"], str):
            raise TypeError("run_name")
        _strings(record["params"])
        _strings(record["tags"])
        record["entries"] = [(key, float.fromhex(v), int(ts), int(step))
                             for key, writes in record["metrics"].items() for v, ts, step in writes]
        return record
    except (OSError, ValueError, KeyError, TypeError, AttributeError, OverflowError) as err:
        raise BundleError(f"the bundle's {folder.name}/{RECORD} is missing or malformed ({err!s}). {DAMAGED_FIX}") from None


# Tags whose value is the id of another run.
RUN_REFERENCES = (T.MLFLOW_PARENT_RUN_ID, T.REPLAY_OF, T.AUDIT_OF, T.TRACE_OF, T.STUDY, T.STUDY_REPLAY, T.CALIBRATION_OF,
                  T.CALIBRATION)


def _remap(tags: dict[str, str], ids: dict[str, str]) -> dict[str, str]:
    """Tags naming a run of the bundle (parent, replay_of, audit_of, trace_of, study) name its copy in this store;
    those naming a run the bundle does not hold are dropped: they would attach the copy to whatever run of this
    store has that id (a forged replay counted on an unrelated run)."""
    return {k: ids[v] if k in RUN_REFERENCES else v for k, v in tags.items() if k not in RUN_REFERENCES or v in ids}


def _import_run(tracker: Any, record: dict[str, Any], folder: Path, ids: dict[str, str]) -> str:
    # Partial from the first write (a bundle of an imported run carries the state "complete" of its own import).
    marks = {T.IMPORTED_FROM: record["run_id"], T.IMPORT_STATE: T.IMPORT_PARTIAL}
    tags = _remap({**record["tags"], **marks}, ids)
    new_id = tracker.create_run_at(record["experiment"], marks, record.get("run_name"), record.get("start_time"))
    ids[record["run_id"]] = new_id
    tracker.set_tags_exact(new_id, tags)
    tracker.log_params_exact(new_id, record["params"])
    tracker.log_metric_entries(new_id, record["entries"])
    artifacts = folder / ARTIFACTS
    if artifacts.is_dir() and any(artifacts.iterdir()):
        tracker.log_dir(new_id, artifacts)
    return new_id


def _place_data(unpacked: Path, dest: Path, created: list[Path]) -> dict[str, str]:
    """Copy the bundled data (data/<name>/...) to dest/<name>; an existing dest/<name> must hold the same bytes.

    Returns name -> the path a replay's --data takes: the folder, or for an entry that was a single file
    the file inside it (the folder would be refused as "was a file, is now a folder"). The folders it
    makes are appended to `created` (removed again if the import fails)."""
    source = unpacked / DATA_DIR
    if not source.is_dir():
        return {}
    text = unpacked / RUN_DIR / ARTIFACTS / T.ARTIFACT_DATA_MANIFEST
    entries = (data.loads(text.read_text()).get("entries") or {}) if text.is_file() else {}
    placed: dict[str, str] = {}
    for entry in sorted(source.iterdir()):
        target = dest / entry.name
        if target.exists():
            ours = {p.relative_to(entry): sha256_file(p) for p in entry.rglob("*") if p.is_file()}
            theirs = {p.relative_to(target): sha256_file(p) for p in target.rglob("*") if p.is_file()}
            if ours != theirs:
                raise HarnessError(
                    f"{target} exists and holds other files than the bundle's data '{entry.name}'. "
                    "Pass another --data-dir, or remove it."
                )
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            created.append(target)
            shutil.copytree(entry, target)
        recorded = entries.get(entry.name) or {}
        files = [p for p in target.iterdir() if p.is_file()]
        single = recorded.get("kind") == data.KIND_FILE and len(files) == 1
        placed[entry.name] = str(files[0] if single else target)
    return placed


def _hold_verdicts(tracker: Any, record: dict[str, Any], replays: list[dict[str, Any]], ids: dict[str, str]) -> None:
    """Each replay's verdict derived again from the two bundled records, not taken from its tag: a seal shows an edit
    made without harness, but whoever runs harness can seal a forged verdict too. One that does not follow is refused."""
    original = None
    calibrated = any(r["tags"].get(T.KIND) == T.KIND_CALIBRATION for r in replays)
    for rec in replays:
        verdict = rec["tags"].get(T.VERDICT)
        if (rec["tags"].get(T.KIND) != T.KIND_REPLAY or verdict is None
                or rec["tags"].get(T.REPLAY_OF) != record["run_id"]):
            continue
        original = original or tracker.load_record(ids[record["run_id"]])
        again = judged_again(original, tracker.load_record(ids[rec["run_id"]]))
        judged = again.verdict
        if not follows(judged, verdict, calibrated, studied=T.STUDY in record["tags"],
                       undetermined=bool(again.undetermined)):
            raise BundleError(
                f"replay {rec['run_id']} (in the bundle) records the verdict {verdict}, but its metrics and weights "
                f"against the original's judge {judged}: the verdict does not follow from the record; refused. {DAMAGED_FIX}")


def _judge_again(unpacked: Path, record: dict[str, Any], replays: list[dict[str, Any]]) -> None:
    """_hold_verdicts on the bundle's runs copied into a scratch store of their own (the records a replay is judged
    from are read from a store: Tracker.load_record), before the destination store is opened."""
    if not any(r["tags"].get(T.VERDICT) for r in replays):
        return
    with scratch.folder("judge") as tmp:
        judge = Tracker(f"sqlite:///{Path(tmp) / 'mlflow.db'}")
        ids: dict[str, str] = {}
        for rec, folder in [(record, unpacked / RUN_DIR), *((r, unpacked / REPLAYS_DIR / r["run_id"]) for r in replays)]:
            _import_run(judge, rec, folder, ids)
            closing.close_copy(judge, ids[rec["run_id"]], rec["status"], rec.get("end_time"))
        _hold_verdicts(judge, record, replays, ids)


def import_bundle(options: ImportOptions) -> ImportResult:
    """Verify the bundle whole (within the options' limits), then copy its run (keeping its id as a tag) and replays
    into this store.

    A second import of the same run finds the first and writes nothing.
    """
    archive, tracking_uri, data_dir, limits = options.bundle, options.tracking_uri, options.data_dir, options.limits()
    with scratch.folder("import") as tmp:
        unpacked = Path(tmp, "bundle")
        unpacked.mkdir()
        manifest = verify(archive, unpacked, limits)  # first: a refused bundle leaves even a new store's file unmade
        # Every record checked before the store is opened: a refused bundle leaves even a new store's file unmade.
        record = _load_record(unpacked / RUN_DIR, manifest.run_id)
        replays = [_load_record(unpacked / REPLAYS_DIR / r, r) for r in manifest.replays]
        # Each run of the bundle is as its seal recorded it: an edit whose forger rewrote the manifest to match still shows.
        seal.check_bundled(record, unpacked / RUN_DIR / ARTIFACTS, f"run {record['run_id']} (in the bundle)")
        for rec in replays:
            seal.check_bundled(rec, unpacked / REPLAYS_DIR / rec["run_id"] / ARTIFACTS, f"run {rec['run_id']} (in the bundle)")
        # The judge reads the series and sketches: a forger who reseals can make any of them a zip bomb.
        for npz in sorted(unpacked.rglob("*.npz")):
            with open(npz, "rb") as stream:
                npzfile.check(stream, f"bundle member '{npz.relative_to(unpacked).as_posix()}'")
        _judge_again(unpacked, record, replays)  # in a scratch store: a forged verdict leaves this one untouched
        tracker = Tracker(tracking_uri)
        # One import into a store at a time: a second import of the bundle waits, then finds the first's run.
        with exclusive(tracker.uri):
            return _import_unpacked(tracker, unpacked, manifest, data_dir)


def _import_unpacked(tracker: Any, unpacked: Path, manifest: Manifest, data_dir: Path | None) -> ImportResult:
    record = _load_record(unpacked / RUN_DIR, manifest.run_id)
    original = record["run_id"]
    # A half import (its importer killed) is no import: it and the replays it made are deleted here, redone below.
    halves = {r.run_id for r in tracker.imports_of(original) if not import_complete(r)}
    for replay in (r for o in manifest.replays for r in tracker.imports_of(o)):
        links = {replay.tags.get(k) for k in (T.MLFLOW_PARENT_RUN_ID, T.REPLAY_OF, T.AUDIT_OF, T.TRACE_OF)}
        if replay.tags.get(T.IMPORT_STATE) == T.IMPORT_PARTIAL or links & halves:
            tracker.delete_run(replay.run_id)
    for half in halves:
        tracker.delete_run(half)
    found = tracker.imported(original)
    if found is None:
        try:
            found = tracker.get_run(original)  # the bundle came back to the store it was exported from
        except HarnessError:
            found = None
    if found is not None:
        return ImportResult(found.run_id, original, already=True)
    replays = [_load_record(unpacked / REPLAYS_DIR / r, r) for r in manifest.replays]
    if not (unpacked / CODE_BUNDLE).is_file():
        raise BundleError(f"the bundle holds no {CODE_BUNDLE}; the run could not be replayed from it. {DAMAGED_FIX}")
    image = None
    if manifest.image is not None and (unpacked / IMAGE_TAR).is_file():
        # Before the store is written: an image that is not the recorded one leaves the store untouched.
        docker.load_image(unpacked / IMAGE_TAR, manifest.image["id"])
        image = manifest.image["ref"]
    code_dir = unpacked / RUN_DIR / ARTIFACTS / Path(T.ARTIFACT_CODE_BUNDLE).parent
    code_dir.mkdir(parents=True, exist_ok=True)
    shutil.move(unpacked / CODE_BUNDLE, code_dir / Path(T.ARTIFACT_CODE_BUNDLE).name)
    # Declared data (--with-data) goes beside, not into, the store: a replay points at it with --data.
    data_home = (data_dir or Path.cwd() / "harness-data" / original).resolve()
    created: list[Path] = []
    ids: dict[str, str] = {}
    # A full disk may stop any write below; undoing them must not need that disk to take more (rollback_room).
    with tracker.rollback_room() as free_room:
        try:
            placed = _place_data(unpacked, data_home, created)
            new_id = _import_run(tracker, record, unpacked / RUN_DIR, ids)
            for rec in replays:
                _import_run(tracker, rec, unpacked / REPLAYS_DIR / rec["run_id"], ids)
            for rec in [record, *replays]:  # ended last: a run listed before it is complete would look live
                closing.close_copy(tracker, ids[rec["run_id"]], rec["status"], rec.get("end_time"))
            # The commit: until the run says complete, the next import takes it for a half one and redoes it.
            for rec in [*replays, record]:
                tracker.set_tags_exact(ids[rec["run_id"]], {T.IMPORT_STATE: T.IMPORT_COMPLETE})
        except BaseException as err:
            free_room()
            for folder in created:
                shutil.rmtree(folder, ignore_errors=True)
            for made in ids.values():  # nothing half-imported stays
                with contextlib.suppress(Exception):
                    tracker.discard_run(made)
            if isinstance(err, OSError) and unwritable(err):  # the data folder's disk, not the store's
                raise HarnessError(f"the disk of {data_home} {unwritable(err)}: the bundle's data could not be placed "
                                   "there. Free space on it, or pass another --data-dir.") from None
            raise
    return ImportResult(new_id, original, already=False, replays=[ids[r["run_id"]] for r in replays],
                        image=image, data=placed)
