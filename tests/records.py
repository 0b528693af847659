"""Synthetic run records (what the comparison reads from a store), shared by the compare, noise and
determinism-watch tests."""

from __future__ import annotations

import numpy as np

from harness import tags
from harness.rundata import RunRecord

FACTS = {
    tags.VERSION: "0.1.0",
    tags.GIT_COMMIT: "a" * 40,
    tags.WORLD_SIZE: "2",
    tags.BACKEND: "gloo",
    tags.DEVICE: "cpu",
    tags.THREADS_PER_RANK: "1",
    tags.SEED: "0",
    tags.ENV_PREFIX + "torch": "2.13.0",
    tags.ENV_PREFIX + "hostname": "box-a",
    tags.DETERMINISM_PREFIX + "level": "strict",
    tags.KIND: "run",
}
LOCK = ["numpy==2.1.0", "torch==2.13.0", "tqdm==4.66.0"]


def tol(rtol: float = 0.0, atol: float = 0.0, metrics: dict | None = None) -> dict:
    return {"default": {"rtol": rtol, "atol": atol}, "metrics": metrics or {}}


def make_record(
    run_id: str = "orig0000",
    n: int = 20,
    metrics: dict[str, tuple[np.ndarray, np.ndarray]] | None = None,
    facts: dict[str, str] | None = None,
    lock: list[str] | None = None,
    fingerprints: dict[int, str] | None = None,
    final: str | None = "f" * 64,
    status: str = "FINISHED",
    tolerance: dict | None = None,
) -> RunRecord:
    steps = np.arange(n, dtype=np.int64)
    if metrics is None:
        metrics = {
            "loss": (steps.copy(), 1.0 / (steps + 1.0)),
            "acc": (steps.copy(), np.linspace(0.1, 0.9, n)),
        }
    return RunRecord(
        run_id=run_id,
        experiment="exp",
        status=status,
        facts=dict(FACTS if facts is None else facts),
        lock=list(LOCK if lock is None else lock),
        metrics=metrics,
        fingerprints=dict({0: "0" * 64, 10: "1" * 64} if fingerprints is None else fingerprints),
        final_fingerprint=final,
        config={"replay": {"tolerance": tolerance or tol()}},
    )


def clone(rec: RunRecord, run_id: str = "repl0000", **changes: object) -> RunRecord:
    """An independent copy (arrays copied, so edits don't leak into the original)."""
    new = RunRecord(
        run_id=run_id,
        experiment=rec.experiment,
        status=rec.status,
        facts=dict(rec.facts),
        lock=list(rec.lock),
        metrics={k: (s.copy(), v.copy()) for k, (s, v) in rec.metrics.items()},
        fingerprints=dict(rec.fingerprints),
        final_fingerprint=rec.final_fingerprint,
        config=rec.config,
    )
    for key, value in changes.items():
        setattr(new, key, value)
    return new
