"""The only boundary to MLflow: the store, runs, params, tags, artifacts, background metric writes."""

from __future__ import annotations

import json
import logging
import os
import tempfile
import struct
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from harness.compare import RunRecord

from harness import tags as T
from harness.errors import HarnessError

STORE_DIR = "mlruns"
# Not MLflow's 5000: a local Docker registry (the docker executor's) usually listens there.
UI_PORT = 5050
_DB_NAME = "mlflow.db"
_BATCH = 1000  # MLflow's per-request limit for metrics in log_batch


def default_uri(cwd: Path | None = None) -> str:
    """A SQLite store under ./mlruns (MLflow 3 no longer accepts a plain folder as a store)."""
    root = (cwd or Path.cwd()).resolve() / STORE_DIR
    return f"sqlite:///{root / _DB_NAME}"


def resolve_uri(uri: str | None) -> str:
    return uri or os.environ.get("MLFLOW_TRACKING_URI") or default_uri()


def _artifact_root(uri: str) -> str | None:
    # A local SQLite store keeps artifacts beside the database, not in the cwd of whoever ran it.
    if uri.startswith("sqlite:///"):
        return str(Path(uri[len("sqlite:///"):]).parent / "artifacts")
    return None


@dataclass(frozen=True)
class RunSummary:
    run_id: str
    experiment: str
    experiment_id: str
    run_name: str
    status: str
    start_time: int | None
    end_time: int | None
    tags: dict[str, str]
    params: dict[str, str]
    metric_keys: list[str]
    artifact_uri: str


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
    """An MLflow client bound to one tracking store."""

    def __init__(self, uri: str | None = None) -> None:
        self.uri = resolve_uri(uri)
        if self.uri.startswith("sqlite:///"):
            Path(self.uri[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
        from mlflow.tracking import MlflowClient

        # MLflow's store migrations log at INFO on first use; the CLI's stderr is for the user.
        # (After the import: importing mlflow resets its logger's level.)
        for name in ("mlflow", "alembic", "sqlalchemy"):
            logging.getLogger(name).setLevel(logging.WARNING)

        self.client = MlflowClient(tracking_uri=self.uri)

    # -- writing ---------------------------------------------------------------------------------
    def experiment_id(self, name: str) -> str:
        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            return exp.experiment_id
        root = _artifact_root(self.uri)
        location = Path(root, name).as_uri() if root else None
        try:
            return self.client.create_experiment(name, artifact_location=location)
        except Exception:
            exp = self.client.get_experiment_by_name(name)  # created concurrently
            if exp is None:
                raise
            return exp.experiment_id

    def create_run(self, experiment: str, tags: dict[str, str], run_name: str | None = None) -> str:
        run = self.client.create_run(self.experiment_id(experiment), tags=tags, run_name=run_name)
        return run.info.run_id

    def log_params(self, run_id: str, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        self.client.log_batch(run_id, params=[Param(k, str(v)[:6000]) for k, v in params.items()])

    def set_tags(self, run_id: str, values: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        if values:
            self.client.log_batch(run_id, tags=[RunTag(k, str(v)[:8000]) for k, v in values.items()])

    def log_text(self, run_id: str, text: str, artifact_file: str) -> None:
        self.client.log_text(run_id, text, artifact_file)

    def log_bytes(self, run_id: str, data: bytes, artifact_file: str) -> None:
        """Store `data` exactly (log_text would encode a str and is for text only)."""
        artifact = Path(artifact_file)
        with tempfile.TemporaryDirectory() as tmp:
            local = Path(tmp, artifact.name)
            local.write_bytes(data)
            parent = artifact.parent.as_posix()
            self.client.log_artifact(run_id, str(local), None if parent == "." else parent)

    def log_dir(self, run_id: str, local_dir: Path, artifact_path: str | None = None) -> None:
        self.client.log_artifacts(run_id, str(local_dir), artifact_path)

    def log_file(self, run_id: str, local_file: Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(run_id, str(local_file), artifact_path)

    def reopen(self, run_id: str) -> None:
        """Mark an ended run RUNNING again (a resume continues it)."""
        self.client.update_run(run_id, status="RUNNING")

    def end_run(self, run_id: str, status: str) -> None:
        self.client.set_terminated(run_id, status)

    def local_artifact_dir(self, run_id: str) -> Path:
        """The run's artifact folder on this machine (checkpoints are written straight into it)."""
        uri = self.get_run(run_id).artifact_uri
        if uri.startswith("file://"):
            return Path(uri[len("file://"):])
        if uri.startswith("/"):
            return Path(uri)
        raise HarnessError(
            f"checkpoints need a local artifact store, but run {run_id} stores artifacts at {uri}. "
            "Use a file:// artifact root (the default SQLite store has one), or set checkpoint_every: 0."
        )

    def metric_writer(self, run_id: str, flush_interval_s: float) -> "MetricWriter":
        return MetricWriter(self, run_id, flush_interval_s)

    # -- reading ---------------------------------------------------------------------------------
    def get_run(self, run_id: str) -> RunSummary:
        from mlflow.exceptions import MlflowException

        try:
            run = self.client.get_run(run_id)
        except MlflowException:
            raise HarnessError(
                f"no run '{run_id}' in the tracking store {self.uri}. "
                "List runs with `harness runs`, or pass --tracking-uri for another store."
            ) from None
        return _summary(run, self.client.get_experiment(run.info.experiment_id).name)

    def harness_run(self, run_id: str) -> RunSummary:
        """get_run, refusing runs that harness did not make (they lack what a replay needs)."""
        run = self.get_run(run_id)
        if T.VERSION not in run.tags:
            raise HarnessError(
                f"run '{run_id}' was not made by harness (no {T.VERSION} tag); only `harness run` records "
                "what a replay needs."
            )
        return run

    def read_text(self, run_id: str, artifact_file: str) -> str | None:
        with tempfile.TemporaryDirectory() as tmp:
            try:
                local = self.client.download_artifacts(run_id, artifact_file, tmp)
            except Exception:
                return None
            return Path(local).read_text()

    def read_bytes(self, run_id: str, artifact_file: str) -> bytes | None:
        """The artifact's exact bytes; None when the run has no such artifact."""
        with tempfile.TemporaryDirectory() as tmp:
            try:
                local = self.client.download_artifacts(run_id, artifact_file, tmp)
            except Exception:
                return None
            return Path(local).read_bytes()

    def metric_history(self, run_id: str, key: str) -> tuple[list[int], list[float]]:
        """All values of one metric, by step (last write wins for a repeated step)."""
        by_step: dict[int, tuple[int, float]] = {}
        for m in self.client.get_metric_history(run_id, key):
            prev = by_step.get(m.step)
            if prev is None or m.timestamp >= prev[0]:
                by_step[m.step] = (m.timestamp, m.value)
        steps = sorted(by_step)
        return steps, [by_step[s][1] for s in steps]

    def load_record(self, run_id: str) -> "RunRecord":
        """Everything the comparison needs about one harness run."""
        import numpy as np
        from omegaconf import OmegaConf

        from harness.compare import RunRecord

        run = self.harness_run(run_id)
        with tempfile.TemporaryDirectory() as tmp:
            try:
                local = self.client.download_artifacts(run_id, T.ARTIFACT_SERIES, tmp)
                metrics = load_series(Path(local))
            except Exception:  # a run cut off before its series was written: MLflow's history
                metrics = {}
                for key in run.metric_keys:
                    steps, values = self.metric_history(run_id, key)
                    metrics[key] = (np.array(steps, dtype=np.int64), np.array(values, dtype=np.float64))
        fp = json.loads(self.read_text(run_id, T.ARTIFACT_FINGERPRINTS) or "{}")
        config_text = self.read_text(run_id, T.ARTIFACT_CONFIG) or "{}"
        return RunRecord(
            run_id=run_id,
            experiment=run.experiment,
            status=run.status,
            facts={k: v for k, v in run.tags.items() if k.startswith(T.PREFIX)},
            lock=(self.read_text(run_id, T.ARTIFACT_LOCK) or "").splitlines(),
            metrics=metrics,
            fingerprints={int(k): v for k, v in fp.get("steps", {}).items()},
            final_fingerprint=fp.get("final"),
            checkpoints={int(k): v for k, v in fp.get("checkpoints", {}).items()},
            steps_total=fp.get("steps_total"),
            config=OmegaConf.to_container(OmegaConf.create(config_text), resolve=True),  # type: ignore[arg-type]
        )

    def search(
        self, experiment: str | None = None, max_results: int = 50, filter_string: str = ""
    ) -> list[RunSummary]:
        if experiment:
            exp = self.client.get_experiment_by_name(experiment)
            if exp is None:
                raise HarnessError(f"no MLflow experiment '{experiment}' in {self.uri}. Run `harness runs` to list all.")
            exps = [exp]
        else:
            exps = self.client.search_experiments()
        names = {e.experiment_id: e.name for e in exps}
        if not names:
            return []
        runs = self.client.search_runs(
            list(names), filter_string=filter_string, max_results=max_results, order_by=["attributes.start_time DESC"]
        )
        return [_summary(r, names[r.info.experiment_id]) for r in runs]

    def ui_hint(self, run: str | RunSummary) -> str:
        summary = run if isinstance(run, RunSummary) else self.get_run(run)
        store = "" if self.uri == default_uri() else f" --tracking-uri {self.uri}"
        return (
            f"Open it in the MLflow UI: harness ui{store}, then "
            f"http://127.0.0.1:{UI_PORT}/#/experiments/{summary.experiment_id}/runs/{summary.run_id}"
        )


def save_series(series: dict[str, dict[int, float]], path: Path) -> None:
    """Metric series as exact int64 steps / float64 values in one .npz."""
    import numpy as np

    arrays: dict[str, Any] = {"keys": np.array(json.dumps(sorted(series)))}
    for i, key in enumerate(sorted(series)):
        steps = sorted(series[key])
        arrays[f"steps_{i}"] = np.array(steps, dtype=np.int64)
        arrays[f"values_{i}"] = np.array([series[key][s] for s in steps], dtype=np.float64)
    np.savez_compressed(path, **arrays)


def load_series(path: Path) -> dict[str, tuple[Any, Any]]:
    import numpy as np

    with np.load(path) as data:
        keys = json.loads(str(data["keys"]))
        return {k: (data[f"steps_{i}"], data[f"values_{i}"]) for i, k in enumerate(keys)}


class MetricWriter:
    """Buffers metrics and writes them with log_batch from a background thread.

    A per-call log_metric costs a store round trip (~11 ms on SQLite); the training loop
    must never pay that, so add() only appends to a deque.
    """

    def __init__(self, tracker: Tracker, run_id: str, flush_interval_s: float) -> None:
        self._tracker = tracker
        self._run_id = run_id
        self._interval = flush_interval_s
        self._pending: deque[tuple[str, float, int, int]] = deque()
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one flush at a time
        self.written = 0
        self.error: Exception | None = None
        # Every value as logged, for series.npz: reading 100k steps back through MLflow's
        # metric history takes seconds per metric, the comparison needs them in milliseconds.
        self.series: dict[str, dict[int, float]] = {}
        self._known: dict[str, dict[int, float]] = {}
        self._thread = threading.Thread(target=self._loop, name="harness-metrics", daemon=True)
        self._thread.start()

    def prime(self, metrics: dict[str, tuple[Any, Any]]) -> None:
        """Values already in the run (a resume): logged again bit-identically, they are not rewritten."""
        self._known = {key: dict(zip(steps.tolist(), values.tolist())) for key, (steps, values) in metrics.items()}
        self.series = {key: dict(known) for key, known in self._known.items()}

    def add(self, step: int, values: dict[str, float], timestamp_ms: int) -> None:
        for key, value in values.items():
            known = self._known.get(key, {}).get(step)
            self.series.setdefault(key, {})[step] = value  # last write wins, as in MLflow
            if known is not None and struct.pack("<d", known) == struct.pack("<d", value):
                continue
            self._pending.append((key, value, timestamp_ms, step))

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            self.flush()

    def flush(self) -> None:
        from mlflow.entities import Metric

        with self._lock:
            while self._pending:
                batch = []
                while self._pending and len(batch) < _BATCH:
                    key, value, ts, step = self._pending.popleft()
                    batch.append(Metric(key, value, ts, step))
                try:
                    self._tracker.client.log_batch(self._run_id, metrics=batch, synchronous=True)
                    self.written += len(batch)
                except Exception as err:  # keep the data; retried at the next flush
                    self.error = err
                    self._pending.extendleft(
                        reversed([(m.key, m.value, m.timestamp, m.step) for m in batch])
                    )
                    return

    def close(self) -> None:
        """Stop the thread and write everything still buffered (also after a failure)."""
        self._stop.set()
        self._thread.join(timeout=30)
        self.flush()
        if self._pending and self.error is not None:
            raise HarnessError(f"could not write {len(self._pending)} metrics to MLflow: {self.error}")


def ui_command(uri: str, host: str, port: int) -> list[str]:
    """`mlflow server` on this store, as an argument list."""
    import sys

    cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", uri, "--host", host, "--port", str(port)]
    root = _artifact_root(uri)
    if root:
        cmd += ["--default-artifact-root", Path(root).as_uri()]
    return cmd
