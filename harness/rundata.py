"""The plain records a tracking store hands out (a run's summary, everything stored for one run).

Every layer passes them; none needs the store, or MLflow, to read one: harness.store builds them,
harness.judge judges them.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from harness.tags import OWN_METRIC_PREFIX, PERF_PREFIX

if TYPE_CHECKING:
    import numpy as np


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


@dataclass
class RunRecord:
    """Everything harness stored for one run, as the comparison needs it."""

    run_id: str
    experiment: str
    status: str
    facts: dict[str, str]
    lock: list[str]
    metrics: dict[str, tuple[np.ndarray, np.ndarray]]
    fingerprints: dict[int, str]
    final_fingerprint: str | None
    config: dict
    checkpoints: dict[int, str] = field(default_factory=dict)  # step -> sha256 of the checkpointed weights
    steps_total: int | None = None  # training steps the run completed
    # False when the metrics come from MLflow's history (no metrics/series.npz): +-inf reads back clamped there.
    metrics_exact: bool = True
    data: dict | None = None  # the declared data's manifest (harness/record/data.py), None when the run declared none
    # step -> {"tensors": name -> sha256, "ranks": [sha256 per rank]}; None when the run recorded none (no
    # checkpoints, or a run from before they were recorded).
    checkpoint_tensors: dict[int, dict] | None = None
    # step -> digest of the sample indices every rank's ctx.loader batches held at that step (empty: none recorded)
    data_order: dict[int, str] = field(default_factory=dict)
    # The wall-clock series (tags.PERF_PREFIX: step times, loader wait, throughput), {key: (steps, values)}: kept
    # apart from `metrics` so that no verdict ever sees them (wall_clock); the performance line and report read them.
    performance: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)


@dataclass(frozen=True)
class UiLinks:
    """Where to look at a run in the MLflow UI, as the command that made or judged it says it."""

    page: str | None  # the run's page while a UI serves the store (its tracking server, or a `harness ui`); else None
    hint: str  # one line: open `page`, or the command that starts a UI and the link it will answer at
    curves: tuple[str, ...] = ()  # a judged replay: where its curves and report are, and their pages while served


def same_value(recorded: float, again: float) -> bool:
    """One logged value against another, bit for bit as IEEE doubles: a NaN equals a NaN of the same bits and
    -0.0 is not 0.0 (`==` says the opposite of both). The rule for "the same value" wherever a value logged again
    is held to the record (harness/judge/reproduced.py; the store's MetricWriter on a resume)."""
    return struct.pack("<d", recorded) == struct.pack("<d", again)


def own_metric(key: str) -> bool:
    """A metric harness logs itself (tags.OWN_METRIC_PREFIX: the learning rate, the GradScaler's scale), not the
    training code: judged like the others, but never against the seeds' noise, and not missed in a record made
    before harness logged it."""
    return key.startswith(OWN_METRIC_PREFIX)


def wall_clock(key: str) -> bool:
    """A metric of how long things took (tags.PERF_PREFIX), not of what was computed: it differs from run to run by
    nature, so it is never judged. The one rule: the store loads such keys into RunRecord.performance, never into
    RunRecord.metrics, which every verdict (compare, noise, rounding, calibrate, bisect, trace, verify) reads.
    Harness's own keys only: harness writes them, so their name is proof. A key of the training code's is judged
    whatever its name (`mfu` may be anything); where the weights show the training bit-identical, one that differs
    is named as not determined by it (harness/judge/undetermined.py)."""
    return key.startswith(PERF_PREFIX)


def series(metrics: Mapping[str, tuple[Any, Any]]) -> dict[str, dict[int, float]]:
    """A record's metrics ({key: (steps, values)} arrays) as {key: {step: value}}, for looking values up."""
    return {key: dict(zip(steps.tolist(), values.tolist())) for key, (steps, values) in metrics.items()}
