"""The only boundary to MLflow's client: the store, runs, params, tags, artifacts (Tracker)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from harness import scratch, tags as T
from harness.errors import HarnessError, RunNotFound, RunRefused
from harness.rundata import RunRecord, RunSummary
from harness.secrets import scrub
from harness.store import seriesfile
from harness.store.failures import (
    ROLLBACK_ROOM,
    allocate,
    is_store_error,
    missing,
    open_error,
    store_call,
    store_failure,
    unwritable,
)
from harness.store.fastpath import SINK_CHUNK, SqliteMetricSink, SqliteReader, create_whole
from harness.store.locks import opening
from harness.store.outages import Outages
from harness.store.probe import MLFLOW_HTTP_DEFAULTS, SUPPRESS_URL, probe_store, store_timeout
from harness.store.uris import artifact_path, artifact_root, database_file, display_uri, resolve_uri
from harness.store.writers import MLFLOW_BATCH, Heartbeat, MetricWriter

# A run id is MLflow's 32 hex digits; a shorter unique start of one names it too (as git's and docker's ids do).
# Six digits at least: one in 16.7 million, so a prefix typed from `harness runs` rarely matches two runs.
MIN_PREFIX = 6
_RUN_ID = re.compile(r"[0-9a-f]{32}")
_PREFIX = re.compile(rf"[0-9a-f]{{{MIN_PREFIX},32}}")  # 32: a whole id in capitals, looked up as its own prefix
_SHOWN_MATCHES = 5  # an ambiguous prefix lists this many of its runs


def is_prefix(ref: str) -> bool:
    """Whether `ref` may be the start of a run id rather than a whole one (Tracker.resolve_id)."""
    ref = ref.strip()
    return not _RUN_ID.fullmatch(ref) and _PREFIX.fullmatch(ref.lower()) is not None


def full_ids(tracking_uri: str | None, *refs: str | None) -> list[str | None]:
    """`refs` as full run ids (Tracker.resolve_id); the store is opened, read-only, only when one is a prefix."""
    if not any(r is not None and is_prefix(r) for r in refs):
        return list(refs)
    tracker = Tracker(tracking_uri, writable=False)
    return [None if r is None else tracker.resolve_id(r) for r in refs]


def import_complete(run: RunSummary) -> bool:
    """An imported run whose import wrote everything: its last write set IMPORT_STATE complete (an import from
    before that tag ended the run last, so an ended run without the tag is complete too)."""
    state = run.tags.get(T.IMPORT_STATE)
    return state == T.IMPORT_COMPLETE or (state is None and run.status != T.RUNNING)


def _summary(run: Any, experiment: str) -> RunSummary:
    return RunSummary(
        run_id=run.info.run_id,
        experiment=experiment,
        experiment_id=run.info.experiment_id,
        run_name=run.info.run_name,
        status=run.info.status,
        start_time=run.info.start_time,
        end_time=run.info.end_time,
        tags=dict(run.data.tags),
        params=dict(run.data.params),
        metric_keys=sorted(run.data.metrics),
        artifact_uri=run.info.artifact_uri,
    )


class Tracker:
    """An MLflow client bound to one tracking store, reached (or refused) before it is used.

    `writable`: the command records (run, replay, resume, audit); False for commands that only read.
    """

    def __init__(self, uri: str | None = None, *, writable: bool = True, must_exist: bool = True) -> None:
        self.uri = resolve_uri(uri)
        self.display_uri = display_uri(self.uri)
        # Before MLflow is imported: a dead store is reported in milliseconds, not after MLflow's retries.
        # A reader (writable=False) of a local store that does not exist is refused unless must_exist=False (the UI).
        self._client_uri = probe_store(self.uri, writable, store_timeout(), must_exist)
        self._client: Any = None
        # A command that only reads a current local store reads it directly; MLflow opens only if a
        # write, or a query the reader does not handle, needs it (see SqliteReader).
        self._reader = None if writable else SqliteReader.open(self.uri)
        self._metric_reader: SqliteReader | None = None  # see _bulk_reader
        self._metric_reader_tried = False
        if self._reader is None:
            self._open()

    @property
    def client_uri(self) -> str:
        """The URI MLflow opens this store with (the probe's deadlines added): what the ranks' own MLflow calls use."""
        return self._client_uri

    @property
    def client(self) -> Any:
        """MLflow's client on this store, opened on first use."""
        if self._client is None:
            self._open()
        return self._client

    def _open(self) -> None:
        for name, value in MLFLOW_HTTP_DEFAULTS.items():
            os.environ.setdefault(name, value)
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
        # MLflow prints `View run NAME at: URL` when a run on a server ends, the URL with the server's
        # user:password in it: forced off, not defaulted (the shell's setting must not print the password).
        os.environ[SUPPRESS_URL] = "true"
        from mlflow.tracking import MlflowClient

        # MLflow's store migrations log at INFO on first use; the CLI's stderr is for the user.
        # (After the import: importing mlflow resets its logger's level.)
        for name in ("mlflow", "alembic", "sqlalchemy"):
            logging.getLogger(name).setLevel(logging.WARNING)
        # MLflow logs every failed SQL session with its traceback and statement (a full disk: thousands of
        # lines); harness reports each store failure itself, in one line.
        logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)

        try:
            # Opens the store for real: creates a fresh SQLite schema, or refuses another version's.
            with opening(self.uri):
                create_whole(self._client_uri, MlflowClient)
                client = MlflowClient(tracking_uri=self._client_uri)
                client.search_experiments(max_results=1)
        except Exception as err:
            if not is_store_error(err):
                raise
            raise open_error(self.display_uri, err) from err
        self._client = client

    def local_artifact(self, run_id: str, artifact_file: str) -> Path | None:
        """The artifact's file on this machine when the reader serves this store and the artifacts are
        local; None when MLflow must fetch it. A missing file is a Path that does not exist."""
        if self._reader is None:
            return None
        run = self._reader.run(run_id)
        root = artifact_path(run.artifact_uri) if run and run.artifact_uri else None
        if root is None:
            return None
        local = root / artifact_file
        return None if local.is_dir() else local

    # -- writing ---------------------------------------------------------------------------------
    @store_call
    def experiment_id(self, name: str) -> str:
        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            return exp.experiment_id
        from harness.store import ui

        root = artifact_root(self.uri)
        location = Path(root, name).as_uri() if root else None
        try:
            return self.client.create_experiment(name, artifact_location=location, tags=ui.experiment_tags())
        except Exception:
            exp = self.client.get_experiment_by_name(name)  # created concurrently
            if exp is None:
                raise
            return exp.experiment_id

    @store_call
    def set_ui_view(self, experiment_id: str) -> None:
        """(Re)write the experiment's UI view (experiments made before it existed, or by another version)."""
        from harness.store import ui

        wanted = ui.experiment_tags()
        if self._reader is not None and self._reader.experiment_tags(experiment_id).items() >= wanted.items():
            return  # already this view: nothing to write, and no MLflow to open for it
        for key, value in wanted.items():
            self.client.set_experiment_tag(experiment_id, key, value)

    @store_call
    def create_run(self, experiment: str, tags: dict[str, str], run_name: str | None = None) -> str:
        from datetime import datetime, timezone

        started = datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        tags = {T.STARTED: started, **tags}
        run = self.client.create_run(self.experiment_id(experiment), tags=tags, run_name=run_name)
        return run.info.run_id

    @store_call
    def rename_run(self, run_id: str, name: str) -> None:
        """Set the run's name (MLflow's run name, the UI's)."""
        self.client.update_run(run_id, name=name)

    @store_call
    def log_params(self, run_id: str, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        self.client.log_batch(run_id, params=[Param(k, str(v)[:6000]) for k, v in params.items()])

    @store_call
    def set_tags(self, run_id: str, values: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        if values:
            # Why a run ended carries outside text (an exception's, a rank's): scrubbed before it is stored.
            self.client.log_batch(run_id, tags=[RunTag(k, (scrub(str(v)) if k == T.STATUS_REASON else str(v))[:8000])
                                                for k, v in values.items()])

    @store_call
    def log_text(self, run_id: str, text: str, artifact_file: str) -> None:
        self.client.log_text(run_id, text, artifact_file)

    @store_call
    def log_bytes(self, run_id: str, data: bytes, artifact_file: str) -> None:
        """Store `data` exactly (log_text would encode a str and is for text only)."""
        artifact = Path(artifact_file)
        with tempfile.TemporaryDirectory() as tmp:
            local = Path(tmp, artifact.name)
            local.write_bytes(data)
            parent = artifact.parent.as_posix()
            self.client.log_artifact(run_id, str(local), None if parent == "." else parent)

    @store_call
    def log_dir(self, run_id: str, local_dir: Path, artifact_path: str | None = None) -> None:
        self.client.log_artifacts(run_id, str(local_dir), artifact_path)

    @store_call
    def log_file(self, run_id: str, local_file: Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(run_id, str(local_file), artifact_path)

    @store_call
    def log_data_inputs(self, run_id: str, datasets: list[tuple[str, str, str]]) -> None:
        """(name, sha256, path) per declared data entry, as MLflow dataset inputs (the UI's Datasets column).

        Only name, digest and source are given: nothing is loaded. MLflow's digest column holds 36
        characters, so it gets the first 32 hex digits; the full sha256 is in harness's own manifest.
        """
        from mlflow.entities import Dataset, DatasetInput, InputTag
        from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

        inputs = [
            DatasetInput(
                Dataset(name=name, digest=digest[:32], source_type="local", source=json.dumps({"uri": Path(path).as_uri()})),
                tags=[InputTag(MLFLOW_DATASET_CONTEXT, "training")],
            )
            for name, digest, path in datasets
        ]
        if inputs:
            self.client.log_inputs(run_id, datasets=inputs)

    @store_call
    def dataset_inputs(self, run_id: str) -> list[tuple[str, str, str]]:
        """(name, digest, source) of the run's MLflow dataset inputs."""
        run = self.client.get_run(run_id)
        return [(d.dataset.name, d.dataset.digest, d.dataset.source) for d in run.inputs.dataset_inputs]

    @store_call
    def reopen_run(self, run_id: str) -> None:
        """Mark an ended run RUNNING again: the failure it ended with is no longer its state. The store's primitive:
        a resume reopens a run through record/closing.py, which says so in its seal first."""
        self.client.update_run(run_id, status=T.RUNNING)
        tags = self.client.get_run(run_id).data.tags
        for stale in (T.FAILED_RANK, T.STATUS_REASON, T.FAILED_SIGNAL):
            if stale in tags:
                self.client.delete_tag(run_id, stale)

    @store_call
    def terminate_run(self, run_id: str, status: str, end_time: int | None = None) -> None:
        """End the run as `status` (at `end_time`, ms since the epoch; now when None). The store's plain primitive:
        every run harness closes is closed through record/closing.py, which seals it first, and nothing else calls
        this: a close made elsewhere could skip the seal."""
        self.client.set_terminated(run_id, status, end_time)

    # -- copying a run whole (harness export / import) ------------------------------------------
    @store_call
    def create_run_at(
        self, experiment: str, tags: dict[str, str], run_name: str | None, start_time: int | None
    ) -> str:
        """A new run that keeps another run's start time (ms since the epoch)."""
        run = self.client.create_run(
            self.experiment_id(experiment), start_time=start_time, tags=tags, run_name=run_name
        )
        return run.info.run_id

    @store_call
    def log_metric_entries(self, run_id: str, entries: list[tuple[str, float, int, int]]) -> None:
        """(key, value, timestamp ms, step) exactly as given: in bulk into a local SQLite store (SqliteMetricSink,
        a million points in seconds), else in MLflow's batches (about 5k points/s)."""
        from mlflow.entities import Metric

        sink = SqliteMetricSink.open(self.uri)
        if sink is not None:
            try:
                for start in range(0, len(entries), SINK_CHUNK):
                    sink.write(run_id, entries[start:start + SINK_CHUNK])
            finally:
                sink.close()
            return
        for start in range(0, len(entries), MLFLOW_BATCH):
            batch = [Metric(k, v, ts, step) for k, v, ts, step in entries[start:start + MLFLOW_BATCH]]
            self.client.log_batch(run_id, metrics=batch, synchronous=True)

    @store_call
    def log_params_exact(self, run_id: str, params: dict[str, str]) -> None:
        """Params as another run stored them (already within MLflow's limits), 100 per request."""
        from mlflow.entities import Param

        items = list(params.items())
        for start in range(0, len(items), 100):
            self.client.log_batch(run_id, params=[Param(k, v) for k, v in items[start:start + 100]])

    @store_call
    def set_tags_exact(self, run_id: str, values: dict[str, str]) -> None:
        """Tags as another run stored them, 100 per request."""
        from mlflow.entities import RunTag

        items = list(values.items())
        for start in range(0, len(items), 100):
            self.client.log_batch(run_id, tags=[RunTag(k, v) for k, v in items[start:start + 100]])

    @store_call
    def delete_run(self, run_id: str) -> None:
        self.client.delete_run(run_id)

    def discard_run(self, run_id: str) -> None:
        """Undo a run this command made and could not finish: its local artifact files removed first (that frees
        space, and needs none), then the run deleted."""
        folder = self.local_artifact_dir(run_id)
        if folder is not None:
            # MLflow's local layout: <experiment location>/<run id>/artifacts; the run's folder goes whole.
            shutil.rmtree(folder.parent if folder.parent.name == run_id else folder, ignore_errors=True)
        self.delete_run(run_id)

    @contextlib.contextmanager
    def rollback_room(self) -> Iterator[Callable[[], None]]:
        """Room set aside on a local store's disk while a write runs that must be undone if that disk fills up (an
        import): yields the call that frees it, made before undoing, so that the undo (the runs' rows marked deleted:
        a few pages of SQLite journal) never needs space the failed write could not get. A disk without that room
        is refused before anything is written. Nothing for a store on a server: its disk is not this machine's."""
        db = database_file(self.uri)
        if db is None or not db.parent.is_dir():
            yield lambda: None
            return
        prefix = f".{db.name}.room-"
        scratch.remove_stale(db.parent, prefix)  # a killed import's
        path = db.with_name(f"{prefix}{os.getpid()}")
        try:
            allocate(path, ROLLBACK_ROOM)
        except OSError as err:
            path.unlink(missing_ok=True)
            if unwritable(err) is None:
                raise
            raise store_failure(err, self.uri) from None
        try:
            yield lambda: path.unlink(missing_ok=True)
        finally:
            path.unlink(missing_ok=True)

    @store_call
    def metric_entries(self, run_id: str, key: str) -> list[tuple[float, int, int]]:
        """Every write of one metric as MLflow holds it: (value, timestamp ms, step), repeats included."""
        reader = self._reader or self._bulk_reader()
        if reader is not None:
            return reader.metric_history(run_id, key)
        return [(m.value, m.timestamp, m.step) for m in self.client.get_metric_history(run_id, key)]

    def _bulk_reader(self) -> SqliteReader | None:
        """A read-only reader beside MLflow's client on a local SQLite store that this command writes: every point of
        a run is read back for its seal, and MLflow's history builds an ORM object per point (30 s for 1M points,
        the SQL read under 2 s). None for any other store: MLflow reads it."""
        if not self._metric_reader_tried:
            self._metric_reader_tried = True
            self._metric_reader = SqliteReader.open(self.uri)
        return self._metric_reader

    @store_call
    def latest_metrics(self, run_id: str) -> dict[str, float]:
        """Each metric's value as the MLflow UI shows it (its latest), key -> value."""
        if self._reader is not None:
            return self._reader.latest_metrics(run_id)
        return dict(self.client.get_run(run_id).data.metrics)

    @store_call
    def artifact_files(self, run_id: str, path: str | None = None) -> list[tuple[str, int | None]]:
        """(path, size) of every artifact file of the run, recursively."""
        files: list[tuple[str, int | None]] = []
        for info in self.client.list_artifacts(run_id, path):
            if info.is_dir:
                files.extend(self.artifact_files(run_id, info.path))
            else:
                files.append((info.path, info.file_size))
        return files

    @store_call
    def download(self, run_id: str, artifact_file: str, dest_dir: Path) -> Path | None:
        """The artifact file or folder copied into `dest_dir` (created) under its own name; None if there is none."""
        dest_dir.mkdir(parents=True, exist_ok=True)
        try:
            return Path(self.client.download_artifacts(run_id, artifact_file, str(dest_dir)))
        except Exception as err:
            if missing(err) or isinstance(err, FileNotFoundError):
                return None
            raise

    @store_call
    def children(self, run_id: str) -> list[RunSummary]:
        """Runs nested under `run_id` (its replays and audits), in any experiment."""
        return self.search(filter_string=f"tags.`{T.MLFLOW_PARENT_RUN_ID}` = '{run_id}'", max_results=1000)

    @store_call
    def imported(self, original_id: str) -> RunSummary | None:
        """The run an earlier, complete `harness import` made of `original_id`, if any."""
        return next((r for r in self.imports_of(original_id) if import_complete(r)), None)

    def imports_of(self, original_id: str) -> list[RunSummary]:
        """Every run an import made of `original_id`, complete or not (a killed import leaves a half one)."""
        return self.search(filter_string=f"tags.`{T.IMPORTED_FROM}` = '{original_id}'", max_results=1000)

    def local_artifact_dir(self, run_id: str) -> Path | None:
        """The run's artifact folder on this machine; None when a server holds the artifacts (record.checkpoints)."""
        return artifact_path(self.get_run(run_id).artifact_uri)

    @store_call
    def list_artifacts(self, run_id: str, path: str) -> list[tuple[str, bool]]:
        """(path, is_dir) of the artifacts directly under `path` ([] when there is none)."""
        try:
            return [(f.path, f.is_dir) for f in self.client.list_artifacts(run_id, path)]
        except Exception as err:
            if missing(err) or isinstance(err, FileNotFoundError):
                return []
            raise

    def metric_writer(self, run_id: str, flush_interval_s: float, outages: Outages | None = None) -> MetricWriter:
        return MetricWriter(self, run_id, flush_interval_s, outages)

    def heartbeat(self, run_id: str, interval_s: float, outages: Outages | None = None) -> Heartbeat:
        return Heartbeat(self, run_id, interval_s, outages)

    # -- reading ---------------------------------------------------------------------------------
    @store_call
    def resolve_id(self, ref: str) -> str:
        """The full id of the run `ref` names: its id, or a unique start of it (MIN_PREFIX hex digits or more). The
        one place a run id given by a user is read: every command that takes one resolves it here first. An ambiguous
        or too short prefix is refused in one line; a ref that names no run is returned as given, so that the
        command's own lookup says so (with the store's name)."""
        ref = ref.strip()
        if not is_prefix(ref):
            if re.fullmatch(rf"[0-9a-f]{{1,{MIN_PREFIX - 1}}}", ref.lower()):  # no run's id, too short to stand for one
                raise RunNotFound(f"run id '{ref}' is too short: a prefix needs {MIN_PREFIX} hex digits or more. "
                                   "Pass more of the id (`harness runs` lists them).")
            return ref
        prefix = ref.lower()
        limit = _SHOWN_MATCHES + 1
        if self._reader is not None:
            found = self._reader.ids_starting(prefix, limit)
        else:
            names = {e.experiment_id for e in self.client.search_experiments()}
            found = sorted(r.info.run_id for r in self.client.search_runs(
                list(names), filter_string=f"attributes.run_id LIKE '{prefix}%'", max_results=limit)) if names else []
        if len(found) == 1:
            return found[0]
        if not found:
            return ref
        shown = ", ".join(found[:_SHOWN_MATCHES]) + (", ..." if len(found) > _SHOWN_MATCHES else "")
        raise RunNotFound(f"run id prefix '{ref}' is ambiguous: it starts {'more than ' if len(found) > _SHOWN_MATCHES else ''}"
                           f"{min(len(found), _SHOWN_MATCHES)} runs ({shown}). Pass more of the id.")

    @store_call
    def get_run(self, run_id: str) -> RunSummary:
        run_id = self.resolve_id(run_id)
        if self._reader is not None:
            found = self._reader.run(run_id)
            if found is None:
                raise self._no_run(run_id)
            return found
        from mlflow.exceptions import MlflowException

        try:
            run = self.client.get_run(run_id)
        except MlflowException as err:
            # Only "not found" or a malformed id mean there is no such run; anything else is the store failing.
            if not (missing(err) or err.error_code == "INVALID_PARAMETER_VALUE"):
                raise
            raise self._no_run(run_id) from None
        return _summary(run, self.client.get_experiment(run.info.experiment_id).name)

    def _no_run(self, run_id: str) -> HarnessError:
        return RunNotFound(
            f"no run '{run_id}' in the tracking store {self.display_uri}. "
            "List runs with `harness runs`, or pass --tracking-uri for another store."
        )

    def harness_run(self, run_id: str) -> RunSummary:
        """get_run, refusing runs that harness did not make (they lack what a replay needs)."""
        run = self.get_run(run_id)
        if T.VERSION not in run.tags:
            raise RunRefused(
                f"run '{run_id}' was not made by harness (no {T.VERSION} tag); only `harness run` records "
                "what a replay needs."
            )
        return run

    def read_text(self, run_id: str, artifact_file: str) -> str | None:
        """A text artifact harness wrote itself (UTF-8); None if the run has no such artifact."""
        data = self.read_bytes(run_id, artifact_file)
        return None if data is None else data.decode("utf-8")

    @store_call
    def read_bytes(self, run_id: str, artifact_file: str) -> bytes | None:
        """The artifact's exact bytes, None if the run has no such artifact (a store failure raises)."""
        local = self.local_artifact(run_id, artifact_file)
        if local is not None:
            try:
                return local.read_bytes()
            except FileNotFoundError:
                return None
        with tempfile.TemporaryDirectory() as tmp:
            try:
                local = self.client.download_artifacts(run_id, artifact_file, tmp)
            except Exception as err:
                if missing(err) or isinstance(err, FileNotFoundError):
                    return None
                raise
            return Path(local).read_bytes()

    @store_call
    def metric_history(self, run_id: str, key: str) -> tuple[list[int], list[float]]:
        """All values of one metric, by step (last write wins for a repeated step)."""
        by_step: dict[int, tuple[int, float]] = {}
        for value, timestamp, step in self.metric_entries(run_id, key):
            prev = by_step.get(step)
            if prev is None or timestamp >= prev[0]:
                by_step[step] = (timestamp, value)
        steps = sorted(by_step)
        return steps, [by_step[s][1] for s in steps]

    @store_call
    def load_record(self, run_id: str) -> RunRecord:
        """Everything the comparison needs about one harness run (seriesfile.load_record)."""
        return seriesfile.load_record(self, run_id)

    @store_call
    def _experiment(self, name: str) -> tuple[str, str]:
        """(id, name) of an existing experiment."""
        if self._reader is not None:
            found = self._reader.experiment(name)
        else:
            exp = self.client.get_experiment_by_name(name)
            found = None if exp is None else (exp.experiment_id, exp.name)
        if found is None:
            raise RunNotFound(f"no MLflow experiment '{name}' in {self.display_uri}. Run `harness runs` to list all.")
        return found

    @store_call
    def experiment_id_of(self, name: str) -> str:
        """The id of an existing experiment (refused with one line if there is none)."""
        return self._experiment(name)[0]

    @store_call
    def search(
        self, experiment: str | None = None, max_results: int = 50, filter_string: str = ""
    ) -> list[RunSummary]:
        if experiment:
            names = dict([self._experiment(experiment)])
        elif self._reader is not None:
            names = self._reader.experiments()
        else:
            names = {e.experiment_id: e.name for e in self.client.search_experiments()}
        if not names:
            return []
        if self._reader is not None:
            found = self._reader.search(names, filter_string, max_results)
            if found is not None:
                return found
        runs = self.client.search_runs(
            list(names), filter_string=filter_string, max_results=max_results, order_by=["attributes.start_time DESC"]
        )
        return [_summary(r, names[r.info.experiment_id]) for r in runs]

    def ui_hint(self, run: str | RunSummary) -> str:
        """Where to look at `run` in the MLflow UI (harness.store.ui.hint)."""
        from harness.store import ui

        summary = run if isinstance(run, RunSummary) else self.get_run(run)
        return ui.hint(self.uri, summary.experiment_id, summary.run_id)
