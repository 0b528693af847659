"""Two runs' speed side by side: the step-time ratio, throughput and communication share, never part of a verdict.

A verdict says whether the numbers reproduced; this says how fast they were computed. It reads only the
`harness.perf.*` and `harness.profile.*` tags a run recorded (harness/record/results.py record_performance) and
its wall-clock series (RunRecord.performance), which the verdict never sees (rundata.wall_clock).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from harness import tags as T
from harness.rundata import RunRecord


@dataclass(frozen=True)
class Speed:
    """One run's recorded speed: medians over its counted steps (None: not recorded)."""

    step_s: float | None = None  # rank 0's median seconds per step
    slowest_step_s: float | None = None  # the slowest rank's median
    samples_per_s: float | None = None
    loader_wait: float | None = None  # share of rank 0's step time spent waiting for batches
    comm_share: float | None = None  # of the first profiled step
    steps: int = 0  # steps counted

    @classmethod
    def of(cls, facts: dict[str, str]) -> Speed:
        def number(tag: str) -> float | None:
            try:
                value = float(facts[tag])
            except (KeyError, ValueError):
                return None
            return value if math.isfinite(value) else None

        return cls(number(T.PERF_STEP_MEDIAN_S), number(T.PERF_STEP_MAX_MEDIAN_S), number(T.PERF_SAMPLES_PER_S),
                   number(T.PERF_LOADER_WAIT), number(T.PROFILE_COMM_SHARE), int(number(T.PERF_STEPS) or 0))


@dataclass(frozen=True)
class SpeedDelta:
    """Run B's speed against run A's (an original and its replay, or any two runs)."""

    labels: tuple[str, str]
    a: Speed
    b: Speed

    @property
    def ratio(self) -> float | None:
        """B's median step time over A's: 1.8 is B 1.8x slower per step (None: not both recorded)."""
        a, b = self.a.slowest_step_s or self.a.step_s, self.b.slowest_step_s or self.b.step_s
        return b / a if a and b else None

    def line(self) -> str | None:
        """'performance: replay 1.8x slower per step (median 0.031 s vs 0.017 s); communication share 12% -> 31%';
        None when neither run recorded its speed."""
        a, b, (la, lb) = self.a, self.b, self.labels
        parts = []
        ratio = self.ratio
        if ratio is not None:
            sa, sb = a.slowest_step_s or a.step_s, b.slowest_step_s or b.step_s
            how = ("as fast per step" if 0.95 <= ratio <= 1.05 else
                   f"{ratio:.2f}x slower per step" if ratio > 1 else f"{1 / ratio:.2f}x faster per step")
            parts.append(f"{lb} {how} (median {sb:.3g} s vs {sa:.3g} s, slowest rank)")
        elif a.step_s is not None or b.step_s is not None:
            which = la if a.step_s is not None else lb
            parts.append(f"step times recorded by {which} only")
        if a.samples_per_s is not None and b.samples_per_s is not None:
            parts.append(f"{a.samples_per_s:.4g} -> {b.samples_per_s:.4g} samples/s")
        if a.comm_share is not None or b.comm_share is not None:
            parts.append(f"communication share {_share(a.comm_share)} -> {_share(b.comm_share)}")
        if a.loader_wait is not None and b.loader_wait is not None and max(a.loader_wait, b.loader_wait) >= 0.05:
            parts.append(f"loader wait {_share(a.loader_wait)} -> {_share(b.loader_wait)}")
        return f"performance: {'; '.join(parts)} (wall clock: not part of the verdict)" if parts else None

    def to_dict(self) -> dict[str, Any]:
        return {"labels": list(self.labels), "a": asdict(self.a), "b": asdict(self.b), "ratio": self.ratio}


def _share(value: float | None) -> str:
    return "not profiled" if value is None else f"{value:.0%}"


def speed_delta(a: RunRecord, b: RunRecord, labels: tuple[str, str]) -> SpeedDelta:
    return SpeedDelta(labels, Speed.of(a.facts), Speed.of(b.facts))


def step_series(record: RunRecord) -> tuple[list[int], list[float]]:
    """The run's per-step wall times (the slowest rank's, else rank 0's), for a plot."""
    found = record.performance.get(T.METRIC_STEP_S_MAX) or record.performance.get(T.METRIC_STEP_S)
    if found is None:
        return [], []
    steps, values = found
    return [int(s) for s in steps], [float(v) for v in values]


# A speed claim (harness verify) names a wall-clock metric; a run's number for it is the median the run recorded
# over its counted steps, not one step's value.
MEDIAN_OF = {
    T.METRIC_STEP_S: T.PERF_STEP_MEDIAN_S,
    T.METRIC_STEP_S_MAX: T.PERF_STEP_MAX_MEDIAN_S,
    T.METRIC_SAMPLES_PER_S: T.PERF_SAMPLES_PER_S,
    T.METRIC_LOADER_WAIT: T.PERF_LOADER_WAIT,
}


def run_speed(record: RunRecord, metric: str) -> float | None:
    """The run's median of a wall-clock metric (MEDIAN_OF), None when it recorded none."""
    tag = MEDIAN_OF.get(metric)
    try:
        value = float(record.facts[tag]) if tag is not None else math.nan
    except (KeyError, ValueError):
        return None
    return value if math.isfinite(value) else None


def within(x: float, claimed: float, rtol: float) -> bool:
    """|x - claimed| <= rtol * |claimed|: a speed held to the relative tolerance its claim states."""
    return abs(x - claimed) <= rtol * abs(claimed)
