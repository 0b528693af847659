"""One metric of a replay held to its original's: the series, where they first part, and how far apart they are.

The verdict over every metric and the fingerprints is harness/judge/compare.py; the tolerance each metric is held
to, harness/judge/tolerance.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from harness.fmt import fmt_pair, fmt_short, step_list, the

# Divergence kinds.
KIND_VALUE = "value"  # a metric left its tolerance at a step both runs logged
KIND_MISSING_STEP = "missing_step"  # the original logged the step, the replay did not
KIND_EXTRA_STEP = "extra_step"  # the replay logged a step the original did not
KIND_MISSING_METRIC = "missing_metric"  # the metric exists in the original only
KIND_EXTRA_METRIC = "extra_metric"  # the metric exists in the replay only
KIND_FINGERPRINT = "fingerprint"
KIND_REPLAY_FAILED = "replay_failed"
KIND_ROUNDING = "rounding"  # a metric left a calibrated run's rounding envelope (rounding.py)
KIND_DATA_ORDER = "data_order"  # a step's samples differ (dataorder.py): decided before any envelope or study


# MLflow's SQL store writes +-inf as +-DBL_MAX; a record read back from its history cannot tell them apart.
_CLAMPED = np.finfo(np.float64).max


# Divergence.counts of a metric the script logged through MLflow itself: its steps are the script's own.
MLFLOW_STEP = "MLflow step"


@dataclass
class Divergence:
    """Where the replay first left the original."""

    kind: str
    step: int | None
    metric: str | None = None
    original: float | None = None
    replay: float | None = None
    abs_diff: float | None = None
    rel_diff: float | None = None
    detail: str = ""
    counts: str | None = None  # what `step` counts when it is no training step: an evaluation's own index, or
    # MLFLOW_STEP (the script logged the metric through MLflow itself: an epoch, MLflow's default 0)
    # A value neither rounding nor a seed moves (decisive.py): no envelope and no study's noise judges it again.
    decisive: bool = False

    def describe(self, labels: tuple[str, str] = ("original", "replay")) -> str:
        """One human line, without the verdict; `labels` name the two runs (run A / run B for a plain compare)."""
        a, b = labels
        where = "the end" if self.step is None else f"{self.counts or 'step'} {self.step}"
        if self.kind == KIND_VALUE:
            return (
                f"at {where}: {self.metric} {fmt_pair(self.original, self.replay)} "
                f"(abs {fmt_short(self.abs_diff)}, rel {fmt_short(self.rel_diff)})"
            )
        if self.kind == KIND_MISSING_STEP:
            return f"at {where}: {self.metric} logged by {the(a)} but not by {the(b)}"
        if self.kind == KIND_EXTRA_STEP:
            return f"at {where}: {self.metric} logged by {the(b)} but not by {the(a)}"
        if self.kind == KIND_MISSING_METRIC:
            return f"at {where}: metric {self.metric} missing from {the(b)}"
        if self.kind == KIND_EXTRA_METRIC:
            return f"at {where}: metric {self.metric} appears only in {the(b)}"
        if self.kind == KIND_FINGERPRINT:
            return f"at {where}: parameter fingerprints differ ({self.detail})"
        if self.kind in (KIND_REPLAY_FAILED, KIND_ROUNDING):
            return self.detail
        return f"at {where}: {self.detail}"



@dataclass
class MetricStats:
    """How one metric compares across the two runs."""

    name: str
    steps_compared: int  # steps logged by both runs
    max_abs_diff: float  # nan when no step is shared, or some step has NaN on one side only
    max_rel_diff: float
    first_divergence: int | None
    first_divergence_kind: str | None
    bitwise_equal: bool
    rtol: float
    atol: float
    missing_steps: int = 0  # in the original only
    extra_steps: int = 0  # in the replay only
    in_original: bool = True
    in_replay: bool = True
    # No step logged by both: each run's steps (fmt.step_list, "none" for a run that never logged it), so a reader is
    # told where each logged it rather than "0 steps" and NaN diffs.
    steps_apart: tuple[str, str] | None = None
    evaluation: bool = False  # logged by an evaluation (validation, test), not by training
    counts: str | None = None  # what its steps count when they are no training steps ("validation batch")

    @property
    def unit(self) -> str:
        """What one of its compared steps is, plural: "steps", or "validation batches"."""
        if self.counts is None:
            return "steps"
        return f"{self.counts}es" if self.counts.endswith(("s", "h")) else f"{self.counts}s"


def as_series(steps: Any, values: Any) -> tuple[np.ndarray, np.ndarray]:
    """Steps int64 strictly ascending with float64 values; a step logged twice keeps its last value."""
    s = np.asarray(steps, dtype=np.int64).ravel()
    v = np.ascontiguousarray(values, dtype=np.float64).ravel()
    if s.shape != v.shape:
        raise ValueError(f"steps and values differ in length ({s.size} vs {v.size})")
    if s.size > 1 and not bool(np.all(s[1:] > s[:-1])):
        order = np.argsort(s, kind="stable")
        s, v = s[order], v[order]
        last = np.append(s[1:] != s[:-1], True)
        s, v = s[last], v[last]
    return s, v


def metric_only_in_one(name: str, steps: np.ndarray, values: np.ndarray, in_original: bool,
                        rtol: float, atol: float) -> tuple[MetricStats, Divergence]:
    """A metric one run logged and the other did not: its stats and the divergence at its first step (a missing
    metric when `in_original`, an extra one when only the replay logged it)."""
    kind = KIND_MISSING_METRIC if in_original else KIND_EXTRA_METRIC
    step = int(steps[0])
    value = float(values[0])
    div = Divergence(kind, step, name, value if in_original else None, None if in_original else value)
    stats = MetricStats(
        name=name, steps_compared=0, max_abs_diff=math.nan, max_rel_diff=math.nan,
        first_divergence=step, first_divergence_kind=kind, bitwise_equal=False, rtol=rtol, atol=atol,
        missing_steps=int(steps.size) if in_original else 0, extra_steps=0 if in_original else int(steps.size),
        in_original=in_original, in_replay=not in_original,
        steps_apart=(step_list(steps.tolist()), "none") if in_original else ("none", step_list(steps.tolist())),
    )
    return stats, div


def compare_metric(name: str, sa: np.ndarray, va: np.ndarray, sb: np.ndarray, vb: np.ndarray,
                    rtol: float, atol: float, clamped: tuple[bool, bool] = (False, False)) -> tuple[MetricStats, Divergence | None]:
    """One metric of both runs (steps `sa`, values `va` of the original; `sb`, `vb` of the replay), held to `rtol` and
    `atol`: its stats and its first divergence (None: none). `clamped`: whether each side was read back from a store
    that clamps infinities to +-DBL_MAX, where those values cannot be proved bit-identical."""
    if sa.size == sb.size and np.array_equal(sa, sb):
        # The usual case: both runs logged the same steps, so no set operations are needed.
        common, a, b = sa, va, vb
        only_a = only_b = np.empty(0, dtype=np.int64)
    else:
        common, ia, ib = np.intersect1d(sa, sb, assume_unique=True, return_indices=True)
        a, b = va[ia], vb[ib]
        only_a = np.setdiff1d(sa, sb, assume_unique=True)
        only_b = np.setdiff1d(sb, sa, assume_unique=True)

    # NaN on both sides is equal whatever its payload bits: the payload says nothing about the
    # arithmetic. x86 returns a negative "default NaN" for an invalid operation, ARM a positive one,
    # and which operand's payload survives NaN + NaN depends on an operand order that compilers
    # may swap for a commutative op without changing any other result.
    bit_equal = (a.view(np.int64) == b.view(np.int64)) | (np.isnan(a) & np.isnan(b))
    for values, read_back_clamped in ((a, clamped[0]), (b, clamped[1])):
        if read_back_clamped:
            # +-DBL_MAX read from MLflow's history may have been +-inf: equal, but not provably bit-identical.
            bit_equal &= np.abs(values) != _CLAMPED
    # Equal values (including inf == inf and -0.0 == 0.0) and NaN on both sides are always
    # within tolerance; the subtraction below would turn them into NaN.
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        diff = np.abs(b - a)
        diff[same] = 0.0
        abs_a = np.abs(a)
        # isfinite: an infinite difference must never pass, even where rtol * |inf| is inf.
        ok = same | (np.isfinite(diff) & (diff <= atol + rtol * abs_a))
        rel = diff / abs_a
        rel[diff == 0.0] = 0.0

    n = int(common.size)
    max_abs = float(np.max(diff)) if n else math.nan
    max_rel = float(np.max(rel)) if n else math.nan

    candidates: list[tuple[int, Divergence]] = []
    bad = ~ok
    if n and bool(bad.any()):
        i = int(np.argmax(bad))
        candidates.append((int(common[i]), Divergence(
            KIND_VALUE, int(common[i]), name, float(a[i]), float(b[i]), float(diff[i]), float(rel[i]))))
    if only_a.size:
        step = int(only_a[0])
        value = float(va[np.searchsorted(sa, step)])
        candidates.append((step, Divergence(KIND_MISSING_STEP, step, name, value, None)))
    if only_b.size:
        step = int(only_b[0])
        value = float(vb[np.searchsorted(sb, step)])
        candidates.append((step, Divergence(KIND_EXTRA_STEP, step, name, None, value)))
    first = min(candidates, key=lambda c: c[0])[1] if candidates else None

    stats = MetricStats(
        name=name,
        steps_compared=n,
        max_abs_diff=max_abs,
        max_rel_diff=max_rel,
        first_divergence=first.step if first else None,
        first_divergence_kind=first.kind if first else None,
        bitwise_equal=bool(only_a.size == 0 and only_b.size == 0 and bit_equal.all()),
        rtol=rtol,
        atol=atol,
        missing_steps=int(only_a.size),
        extra_steps=int(only_b.size),
        steps_apart=None if n else (step_list(sa.tolist()), step_list(sb.tolist())),
    )
    return stats, first


def up_to(series: dict[Any, Any], last: int) -> dict[Any, Any]:
    """Only what was logged at steps <= `last`: metric series (steps, values), or step -> fingerprint; a metric with
    nothing left is dropped (it carries no evidence, as a key with no values does)."""
    out: dict[Any, Any] = {}
    for key, value in series.items():
        if isinstance(value, tuple):
            s, v = value
            if s.size and s[0] <= last:
                out[key] = (s[s <= last], v[s <= last])
        elif key <= last:
            out[key] = value
    return out
