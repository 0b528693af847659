"""The seal: a digest over a closed run's canonical record, so that an edit of the store after closing is caught.

When any run harness makes is closed (record/closing.py, the one door every close goes through), `seal`
writes the run's canonical manifest as the artifact seal/manifest.json and its sha256 as the
tag harness.seal = "v1:<sha256>". The manifest holds:

- the run's status and every param;
- harness's own tags (harness.*, the mlflow.source.* ones and mlflow.parentRunId), less UNSEALED_TAGS;
- per metric key, the count and sha256 of every write MLflow holds (step, value as float.hex, timestamp);
- every artifact's size and sha256: config.yaml, metrics/series.npz (the exact values), the patch, logs ...

So an edit of a param, a tag, an MLflow metric row, the series, the config or any artifact is caught, and
`check` names the first field that changed (the stored manifest says what it was).

A seal is tamper-evident, not tamper-proof: whoever can write the store can also recompute the seal. What
it catches is an edit made without harness (the UI, MlflowClient, sqlite3, a file in the artifact folder).
A run with neither the tag nor the manifest (recorded before seals existed) is accepted with one warning.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness import events, npzfile, tags as T
from harness.errors import HarnessError, RunRefused

VERSION = "v1"
# Tags that legitimately change after a run has closed, and so are not sealed: the seal itself, the
# run's note (the MLflow UI edits it; harness's reports are sealed as the artifact replay/report.md), and the
# launcher's heartbeat (a liveness clock, not part of the record), an import's commit marker (written
# last, after the imported copy was sealed: see bundle.import_bundle), and the count of a run's replays' verdicts
# (rewritten on the original as each replay is judged; each replay's own verdict is sealed on the replay).
UNSEALED_TAGS = frozenset({T.SEAL, T.MLFLOW_RUN_NOTE, T.HEARTBEAT, T.IMPORT_STATE, T.REPLAYS})
# The standard MLflow tags harness sets and seals (other mlflow.* tags - run name, user - are the UI's).
SEALED_MLFLOW_PREFIX = "mlflow.source."
SEALED_MLFLOW_TAGS = frozenset({T.MLFLOW_PARENT_RUN_ID})
_FIX = ("Use an intact copy of the run (its original store, or a bundle exported before the edit), or record it "
        "again with `harness run`.")
_SHOWN = 60  # characters of a changed value shown in the error
# A bundled run's seal manifest is read whole: ~100 bytes an artifact, so a real one is far below this.
MAX_MANIFEST_BYTES = 64 << 20
_warned: set[str] = set()  # unsealed runs already warned about in this process: one line each


class _Local:
    """A local artifact file; its sha256 is remembered by (path, size, mtime) for the process, since a run may be
    sealed again (a resume, a replay's verdict written after a remote close) and a checkpoint need not be hashed
    twice."""

    _digests: dict[tuple[str, int, int], str] = {}

    def __init__(self, path: Path) -> None:
        self.path = path

    def __call__(self) -> bytes:
        return self.path.read_bytes()

    def sha256(self) -> str:
        st = self.path.stat()
        key = (str(self.path), st.st_size, st.st_mtime_ns)
        if key not in self._digests:
            digest = hashlib.sha256()
            with open(self.path, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    digest.update(chunk)
            self._digests[key] = digest.hexdigest()
        return self._digests[key]


@dataclass
class Record:
    """A run's record as plain values, read from a store or from an unpacked bundle."""

    status: str
    params: dict[str, str]
    tags: dict[str, str]
    metrics: dict[str, list[tuple[float, int, int]]]  # key -> every write: (value, timestamp ms, step)
    artifacts: dict[str, Callable[[], bytes]]  # path -> its bytes, read when needed
    # key -> the value MLflow shows as the metric's latest (the UI's column): derived from the writes by MLflow
    latest: dict[str, float] = field(default_factory=dict)
    # Artifacts a bundle left out (checkpoints without --with-checkpoints): path -> the sha256 its seal recorded.
    known: dict[str, str] = field(default_factory=dict)

    def read(self, path: str) -> bytes | None:
        return self.artifacts[path]() if path in self.artifacts else None


def sealed_tag(key: str) -> bool:
    """Is this tag part of the seal?"""
    if key in UNSEALED_TAGS:
        return False
    return key.startswith((T.PREFIX, SEALED_MLFLOW_PREFIX)) or key in SEALED_MLFLOW_TAGS


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _metric_digest(writes: Iterable[tuple[float, int, int]]) -> str:
    rows = sorted((step, float.hex(float(value)), ts) for value, ts, step in writes)
    return _sha("".join(f"{s} {v} {t}\n" for s, v, t in rows).encode())


def manifest(record: Record) -> dict[str, Any]:
    """The canonical record the seal is the digest of."""
    return {
        "version": VERSION,
        "status": record.status,
        "params": dict(sorted(record.params.items())),
        "tags": {k: v for k, v in sorted(record.tags.items()) if sealed_tag(k)},
        "metrics": {k: {"writes": len(w), "sha256": _metric_digest(w)} for k, w in sorted(record.metrics.items())},
        "latest": {k: float.hex(float(v)) for k, v in sorted(record.latest.items())},
        "artifacts": dict(sorted({**record.known, **{p: _digest_of(read) for p, read in record.artifacts.items()
                                                     if p != T.ARTIFACT_SEAL}}.items())),
    }


def _stored(tracker: Any, run_id: str, path: str) -> Callable[[], bytes]:
    """A stored artifact's bytes, read when the seal needs them (b"" when the store has none)."""
    return lambda: tracker.read_bytes(run_id, path) or b""


def _digest_of(read: Callable[[], bytes]) -> str:
    return read.sha256() if isinstance(read, _Local) else _sha(read())


def canonical(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def digest(doc: dict[str, Any]) -> str:
    return f"{VERSION}:{_sha(canonical(doc))}"


# -- a run in a store ------------------------------------------------------------------------------
def from_store(tracker: Any, run_id: str) -> Record:
    """The run's record as the store holds it now."""
    run = tracker.get_run(run_id)
    metrics = {key: list(tracker.metric_entries(run_id, key)) for key in run.metric_keys}
    local = tracker.local_artifact_dir(run_id)
    artifacts: dict[str, Callable[[], bytes]] = {}
    if local is not None:
        if local.is_dir():
            for path in local.rglob("*"):
                if path.is_file():
                    artifacts[path.relative_to(local).as_posix()] = _Local(path)
    else:
        for path, _ in tracker.artifact_files(run_id):
            artifacts[path] = _stored(tracker, run_id, path)
    return Record(run.status, dict(run.params), dict(run.tags), metrics, artifacts, tracker.latest_metrics(run_id))


def seal(tracker: Any, run_id: str, status: str | None = None) -> str:
    """Write the run's manifest and seal tag; the seal. `status`: the run is about to be closed with it, and is
    sealed first - a process killed between the two leaves a RUNNING run whose seal says it was being closed
    (check names that), never a closed run without a seal. Without: the run is closed already, and harness
    wrote onto it (a replay's verdict)."""
    record = from_store(tracker, run_id)
    if status is not None:
        record.status = status
    doc = manifest(record)
    value = digest(doc)
    tracker.log_bytes(run_id, json.dumps(doc, indent=1, sort_keys=True).encode() + b"\n", T.ARTIFACT_SEAL)
    tracker.set_tags(run_id, {T.SEAL: value})
    return value


PENDING = "+pending"  # suffix of the seal while harness writes a verdict onto a closed, sealed replay
REOPENED = "+reopened"  # suffix of the seal while a resume continues the run (RUNNING again until it is closed)


def open_for_verdict(tracker: Any, run_id: str) -> None:
    """Say, before a verdict is written onto a sealed run, that it is being written: a process killed before the
    run is sealed again leaves a seal that says so (check refuses it in words), not an edit."""
    value = tracker.get_run(run_id).tags.get(T.SEAL)
    if value and not value.endswith(PENDING):
        tracker.set_tags(run_id, {T.SEAL: value + PENDING})


def open_for_resume(tracker: Any, run_id: str) -> None:
    """Say, before a closed run is made RUNNING again (a resume continues it), that it was reopened: a launcher killed
    before the run is closed again leaves a RUNNING run that `harness mark` closes, not one that reads as edited."""
    value = tracker.get_run(run_id).tags.get(T.SEAL)
    if value and not value.endswith(REOPENED):
        tracker.set_tags(run_id, {T.SEAL: value + REOPENED})


def check(tracker: Any, run_id: str) -> None:
    """Nothing when the run is as it was sealed; else HarnessError naming the first field that changed."""
    check_record(from_store(tracker, run_id), f"run {run_id}")


def verdict_sealed(tracker: Any, run: Any) -> bool:
    """Is the verdict tag of `run` (a RunSummary) the one its seal holds? The seal's manifest, read alone, must digest
    to the seal tag and hold this status and verdict: one artifact read, where `check` hashes the whole record - so a
    listing of many replays can afford it. An edit of the tag (or of the manifest, or a seal removed) reads False."""
    value = run.tags.get(T.SEAL)
    if not value or not value.startswith(VERSION + ":") or value.endswith((PENDING, REOPENED)):
        return False
    try:
        stored = json.loads(tracker.read_bytes(run.run_id, T.ARTIFACT_SEAL) or b"null")
    except (ValueError, RecursionError):
        return False
    return (isinstance(stored, dict) and digest(stored) == value and stored.get("status") == run.status
            and isinstance(stored.get("tags"), dict) and stored["tags"].get(T.VERDICT) == run.tags.get(T.VERDICT))


def interrupted(run: Any) -> bool:
    """Was a verdict being written onto `run` (a RunSummary) when the process writing it stopped? Its seal still
    carries PENDING: not an edit, a report left incomplete (a replay killed while judging)."""
    value = run.tags.get(T.SEAL) or ""
    return run.status != T.RUNNING and value.startswith(VERSION + ":") and value.endswith(PENDING)


# -- checking ----------------------------------------------------------------------------------------
def check_record(record: Record, who: str) -> None:
    """Refuse a record that changed since its seal; warn once about one that was never sealed."""
    value = record.tags.get(T.SEAL)
    stored_bytes = record.read(T.ARTIFACT_SEAL)
    if value is None:
        if stored_bytes is not None:
            raise changed(who, f"tag {T.SEAL} (removed)")
        if record.status != T.RUNNING and who not in _warned:
            _warned.add(who)
            events.emit(events.Warning(f"{who} has no seal (recorded before harness sealed its runs): an edit of its "
                                       "record after it closed cannot be detected."))
        return
    if value.endswith(REOPENED):
        if record.status == T.RUNNING:  # a resume continues it: its seal is renewed when it closes again
            return
        raise changed(who, f"tag {T.SEAL} (a reopened run closed without a new seal)")
    if value.endswith(PENDING):
        raise RunRefused(
            f"{who}'s verdict was being written when the process writing it stopped: its report is incomplete. "
            "Replay the original again (`harness replay ORIGINAL`) for a verdict on record.")
    if not value.startswith(VERSION + ":"):
        raise RunRefused(f"{who} has a seal of another version ({value[:20]}); this harness reads {VERSION}. "
                           "Check it with the harness that recorded it, or upgrade harness.")
    now = manifest(record)
    if digest(now) == value:
        return
    stored: dict[str, Any] | None = None
    if stored_bytes is not None:
        try:
            stored = json.loads(stored_bytes)
        except (ValueError, RecursionError):  # RecursionError: nested past Python's stack (a crafted one)
            stored = None
    if (stored is not None and record.status == T.RUNNING and stored.get("status") not in (None, T.RUNNING)
            and digest(stored) == value and dict(now, status=stored["status"]) == stored):
        run_id = who.split()[-1] if who.startswith("run ") else "RUN_ID"
        raise RunRefused(
            f"{who} was being closed as {stored['status']} when the process closing it stopped: its record may be "
            f"incomplete. Close it as failed with `harness mark {run_id} --status {T.FAILED}`, or record it again "
            "with `harness run`.")
    if stored is None or digest(stored) != value:
        what = (f"the seal's manifest {T.ARTIFACT_SEAL} (removed)" if stored_bytes is None
                else f"the seal's manifest {T.ARTIFACT_SEAL} or the tag {T.SEAL}")
        raise changed(who, what)
    raise changed(who, first_difference(stored, now, record))


def changed(who: str, what: str) -> HarnessError:
    return RunRefused(f"{who} was changed after it was sealed: {what}. {_FIX}")


def _shown(value: Any) -> str:
    text = str(value)
    return text if len(text) <= _SHOWN else text[:_SHOWN - 3] + "..."


def _dict_difference(kind: str, old: dict[str, Any], new: dict[str, Any], show: Callable[[Any], str] = _shown) -> str | None:
    for key in sorted(set(old) | set(new)):
        if key not in new:
            return f"{kind} {key} (removed; was {show(old[key])})"
        if key not in old:
            return f"{kind} {key} (added: {show(new[key])})"
        if old[key] != new[key]:
            return f"{kind} {key} ({show(old[key])} -> {show(new[key])})"
    return None


def first_difference(old: dict[str, Any], new: dict[str, Any], record: Record) -> str:
    """The first field of the sealed manifest `old` that differs in `new`, in words."""
    if old.get("status") != new["status"]:
        return f"status ({old.get('status')} -> {new['status']})"
    for kind, section in (("param", "params"), ("tag", "tags")):
        found = _dict_difference(kind, old.get(section, {}), new[section])
        if found:
            return found
    old_metrics, new_metrics = old.get("metrics", {}), new["metrics"]
    series_intact = old.get("artifacts", {}).get(T.ARTIFACT_SERIES) == new["artifacts"].get(T.ARTIFACT_SERIES)
    for key in sorted(set(old_metrics) | set(new_metrics)):
        if key not in new_metrics:
            return f"metric {key} (removed from MLflow)"
        if key not in old_metrics:
            return f"metric {key} (added to MLflow)"
        if old_metrics[key] != new_metrics[key]:
            step = _series_difference(record, key) if series_intact else None
            return f"metric {key} in MLflow" + (step or f" (its {old_metrics[key]['writes']} writes)")
    found = _dict_difference("metric", old.get("latest", {}), new["latest"], show=lambda h: repr(float.fromhex(h)))
    if found:
        return found.replace(" (", "'s latest value in MLflow (", 1)
    old_art, new_art = old.get("artifacts", {}), new["artifacts"]
    # config.yaml first: it is what replay runs.
    for path in sorted(set(old_art) | set(new_art), key=lambda p: (p != T.ARTIFACT_CONFIG, p)):
        if path not in new_art:
            return f"artifact {path} (removed)"
        if path not in old_art:
            return f"artifact {path} (added)"
        if old_art[path] != new_art[path]:
            detail = None
            if path == T.ARTIFACT_SERIES and old_metrics == new_metrics:
                detail = _first_series_step(record)
            elif path == T.ARTIFACT_CONFIG:
                detail = _config_difference(record, old.get("params", {}))
            return f"artifact {path}" + (detail or f" (sha256 {old_art[path][:12]} -> {new_art[path][:12]})")
    return "the record (no single field differs: the manifest's layout)"


def _config_difference(record: Record, params: dict[str, str]) -> str | None:
    """Which key of the (changed) config.yaml parts from the sealed params, the config flattened as they are."""
    import yaml

    try:
        doc = yaml.safe_load(record.read(T.ARTIFACT_CONFIG) or b"")
    except yaml.YAMLError:
        return None
    now: dict[str, str] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict) and (node or not prefix):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            now[prefix] = "{}" if node == {} else str(node)

    walk("", doc if isinstance(doc, dict) else {})
    for key in sorted(params):
        if key in T.RESOLVED_AT_LAUNCH and now.get(key) == "auto":
            continue  # the param is what "auto" resolved to (record/recorder.py)
        if key in now and now[key] != params[key]:
            return f": {key} ({_shown(params[key])} -> {_shown(now[key])})"
    return None


def _last_by_step(writes: list[tuple[float, int, int]]) -> dict[int, float]:
    by_step: dict[int, tuple[int, float]] = {}
    for value, ts, step in writes:
        prev = by_step.get(step)
        if prev is None or ts >= prev[0]:
            by_step[step] = (ts, value)
    return {s: v for s, (_, v) in by_step.items()}


def _series(record: Record) -> dict[str, dict[int, float]] | None:
    """metrics/series.npz (store/seriesfile.py save_series) as key -> step -> value; None if absent or unreadable."""

    data = record.read(T.ARTIFACT_SERIES)
    if data is None:
        return None
    try:
        with npzfile.opened(data, T.ARTIFACT_SERIES) as npz:
            keys = json.loads(str(npz["keys"]))
            return {k: {int(s): float(v) for s, v in zip(npz[f"steps_{i}"], npz[f"values_{i}"])}
                    for i, k in enumerate(keys)}
    except Exception:  # a damaged file (or one npzfile refuses): the sha256 alone names the change
        return None


def _same(a: float, b: float) -> bool:
    return float.hex(float(a)) == float.hex(float(b))


def _series_difference(record: Record, key: str) -> str | None:
    """Where MLflow's rows of `key` part from the (intact) series.npz: ' at step S (sealed -> now)'."""
    series = _series(record)
    if not series or key not in series:
        return None
    return _step_difference(series[key], _last_by_step(record.metrics.get(key, [])))


def _first_series_step(record: Record) -> str | None:
    """Where the (changed) series.npz parts from MLflow's (intact) rows: ': loss at step S (sealed -> now)'."""
    series = _series(record)
    if series is None:
        return None
    for key in sorted(series):
        found = _step_difference(_last_by_step(record.metrics.get(key, [])), series[key])
        if found:
            return f": {key}{found}"
    return None


def _step_difference(sealed: dict[int, float], now: dict[int, float]) -> str | None:
    for step in sorted(set(sealed) | set(now)):
        if step not in now:
            return f" at step {step} (removed; was {sealed[step]!r})"
        if step not in sealed:
            return f" at step {step} (added: {now[step]!r})"
        if not _same(sealed[step], now[step]):
            return f" at step {step} ({sealed[step]!r} -> {now[step]!r})"
    return None


# -- a run in an unpacked bundle (harness import) ------------------------------------------------------
# Artifacts an export may leave out of a bundle: checkpoints without --with-checkpoints, and an imported run's
# code bundle (it travels as the bundle's code/code.bundle).
def _optional(path: str) -> bool:
    return path.split("/")[0] == T.ARTIFACT_CHECKPOINTS or path == T.ARTIFACT_CODE_BUNDLE


def check_bundled(record: dict[str, Any], artifacts_dir: Path, who: str) -> None:
    """A bundle's run (record.json as bundle._load_record parsed it, and its artifacts) is as it was sealed.

    Artifacts an export leaves out (checkpoints, a carried code bundle) are taken as the seal recorded them.
    """
    files: dict[str, Callable[[], bytes]] = {}
    if artifacts_dir.is_dir():
        for path in artifacts_dir.rglob("*"):
            if path.is_file():  # hashed in chunks: a member is never read whole to be hashed
                files[path.relative_to(artifacts_dir).as_posix()] = _Local(path)
    sealed = artifacts_dir / T.ARTIFACT_SEAL
    if sealed.is_file() and sealed.stat().st_size > MAX_MANIFEST_BYTES:  # read whole below: bounded first
        raise RunRefused(f"{who}'s seal manifest {T.ARTIFACT_SEAL} is {sealed.stat().st_size} bytes, over the "
                         f"{MAX_MANIFEST_BYTES} a seal of any run takes; refused. {_FIX}")
    metrics: dict[str, list[tuple[float, int, int]]] = {}
    for key, value, ts, step in record["entries"]:
        metrics.setdefault(key, []).append((value, ts, step))
    rec = Record(record["status"], dict(record["params"]), dict(record["tags"]), metrics, files)
    # A bundle holds closed runs only, each sealed by the harness that exported it: a record without its seal (or one
    # still open) cannot be told from a forged one, and the import would seal it afresh as if it were genuine.
    value = rec.tags.get(T.SEAL)
    if value is None or rec.read(T.ARTIFACT_SEAL) is None or rec.status == T.RUNNING or value.endswith(REOPENED):
        state = "is still RUNNING" if rec.status == T.RUNNING else "carries no seal"
        raise RunRefused(
            f"{who} {state}: nothing shows its record is the one its harness closed, and an import would seal it as "
            "genuine; refused. Export it again with a harness that seals its runs, from the store that holds it.")
    try:
        stored = json.loads(rec.read(T.ARTIFACT_SEAL) or b"null")
    except (ValueError, RecursionError):
        stored = None
    if isinstance(stored, dict) and isinstance(stored.get("artifacts"), dict):
        rec.known = {p: str(sha) for p, sha in stored["artifacts"].items() if _optional(p) and p not in files}
        # The bundle carries every write; the store the run is imported into derives the latest values from them.
        if isinstance(stored.get("latest"), dict):
            try:
                rec.latest = {k: float.fromhex(str(v)) for k, v in stored["latest"].items()}
            except ValueError:  # a malformed manifest: its digest is not the seal, which check_record says
                pass
    check_record(rec, who)
