"""The exact metric series (series.npz: int64 steps, float64 values) written and read, and a run's record for the
comparison built on it (load_record)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness import npzfile, tags as T
from harness.rundata import RunRecord, wall_clock
from harness.store.failures import is_store_error, missing

if TYPE_CHECKING:
    from harness.store.tracking import Tracker


def save_series(series: dict[str, dict[int, float]], path: Path) -> None:
    """Metric series as exact int64 steps / float64 values in one .npz."""
    import numpy as np

    arrays: dict[str, Any] = {"keys": np.array(json.dumps(sorted(series)))}
    for i, key in enumerate(sorted(series)):
        steps = sorted(series[key])
        arrays[f"steps_{i}"] = np.array(steps, dtype=np.int64)
        arrays[f"values_{i}"] = np.array([series[key][s] for s in steps], dtype=np.float64)
    np.savez_compressed(path, **arrays)


def load_series(path: Path, what: str = T.ARTIFACT_SERIES) -> dict[str, tuple[Any, Any]]:
    with npzfile.opened(path, what) as data:
        keys = json.loads(str(data["keys"]))
        return {k: (data[f"steps_{i}"], data[f"values_{i}"]) for i, k in enumerate(keys)}


def load_record(tracker: Tracker, run_id: str) -> RunRecord:
    """Everything the comparison needs about one harness run: its series file, what MLflow's history holds beyond it,
    its fingerprints, data manifest and config."""
    import numpy as np
    from omegaconf import OmegaConf

    run = tracker.harness_run(run_id)
    exact = True
    with tempfile.TemporaryDirectory() as tmp:
        try:
            local = tracker.local_artifact(run_id, T.ARTIFACT_SERIES) or Path(
                tracker.client.download_artifacts(run_id, T.ARTIFACT_SERIES, tmp))
            metrics = load_series(local, f"run {run_id}'s {T.ARTIFACT_SERIES}")
            # The training code's own MLflow metrics never passed through harness, so the series lacks them:
            # MLflow's history holds them, exact (+-inf clamped as in every run that logs them so), at the steps
            # they were logged at (a step logged twice: its last value).
            direct = set(run.tags.get(T.USER_MLFLOW_METRICS, "").split(","))
            from_history = sorted((direct & set(run.metric_keys)) - metrics.keys())
        except Exception as err:  # a run cut off before its series was written: MLflow's history
            if isinstance(err, npzfile.NpzRefused) or (is_store_error(err) and not missing(err)):
                raise
            # ...which holds +-inf clamped to +-DBL_MAX: the comparison must not call such values identical.
            exact = not run.metric_keys
            metrics, from_history = {}, run.metric_keys
    for key in from_history:
        steps, values = tracker.metric_history(run_id, key)
        metrics[key] = (np.array(steps, dtype=np.int64), np.array(values, dtype=np.float64))
    if run.tags.get(T.RESUMES) and T.METRIC_LR in metrics and T.METRIC_LR in run.metric_keys:
        _add_history_past_series(tracker, run_id, run.metric_keys, metrics)
    # Step times and the like are wall clock: held apart, where no verdict reads (rundata.wall_clock).
    performance = {key: metrics.pop(key) for key in [k for k in metrics if wall_clock(k)]}
    for key in sorted(k for k in run.metric_keys if wall_clock(k) and k not in performance):
        steps, values = tracker.metric_history(run_id, key)
        performance[key] = (np.array(steps, dtype=np.int64), np.array(values, dtype=np.float64))
    fp = json.loads(tracker.read_text(run_id, T.ARTIFACT_FINGERPRINTS) or "{}")
    config_text = tracker.read_text(run_id, T.ARTIFACT_CONFIG) or "{}"
    data_text = tracker.read_text(run_id, T.ARTIFACT_DATA_MANIFEST)
    tensors_text = tracker.read_text(run_id, T.ARTIFACT_CHECKPOINT_FINGERPRINTS) if fp.get("checkpoints") else None
    order_text = tracker.read_text(run_id, T.ARTIFACT_DATA_ORDER) if run.tags.get(T.DATA_ORDER_STEPS) else None
    order = json.loads(order_text) if order_text else {}
    return RunRecord(
        run_id=run_id,
        experiment=run.experiment,
        status=run.status,
        facts={k: v for k, v in run.tags.items() if k.startswith(T.PREFIX)},
        lock=(tracker.read_text(run_id, T.ARTIFACT_LOCK) or "").splitlines(),
        metrics=metrics,
        fingerprints={int(k): v for k, v in fp.get("steps", {}).items()},
        final_fingerprint=fp.get("final"),
        checkpoints={int(k): v for k, v in fp.get("checkpoints", {}).items()},
        steps_total=fp.get("steps_total"),
        metrics_exact=exact,
        data=json.loads(data_text) if data_text is not None else None,
        checkpoint_tensors=(None if tensors_text is None else
                            {int(k): v for k, v in json.loads(tensors_text).get("steps", {}).items()}),
        data_order=dict(zip((int(s) for s in order.get("steps", [])), order.get("digests", []))),
        performance=performance,
        config=OmegaConf.to_container(OmegaConf.create(config_text), resolve=True),  # type: ignore[arg-type]
    )


def _add_history_past_series(tracker: Tracker, run_id: str, keys: list[str], metrics: dict[str, Any]) -> None:
    """A resume whose launcher was killed wrote values to MLflow's history but no series.npz: the file is the one the
    run's earlier close wrote. When the history reaches past it (harness.lr, logged at every step, says so), the
    history's later values join the series, so that a record read back holds every step its store holds."""
    import numpy as np

    lr_steps, _ = tracker.metric_history(run_id, T.METRIC_LR)
    if not lr_steps or max(lr_steps) <= int(metrics[T.METRIC_LR][0].max(initial=-1)):
        return
    for key in keys:
        if wall_clock(key):
            continue
        steps, values = tracker.metric_history(run_id, key)
        known = dict(zip(*(a.tolist() for a in metrics[key]))) if key in metrics else {}
        known.update({s: v for s, v in zip(steps, values) if s not in known})
        ordered = sorted(known)
        metrics[key] = (np.array(ordered, dtype=np.int64), np.array([known[s] for s in ordered], dtype=np.float64))
