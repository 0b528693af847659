"""Run-to-run noise: the spread of a result over seeds, and whether a replay's result lies within it.

Across hardware a replay is rarely bit-identical: another CPU's vector width or another GPU's kernels
round differently, and those last-bit differences grow during training. A one-bit change produces
about the spread a new seed does, so the sound question is whether the replay's result is one a
new seed could have given. The statistics here answer it from a study's N seeds (harness/commands/study.py):

- one replay: the t-based 95% prediction interval for one new draw from the seeds' distribution,
  mean +- t(N-1, 0.975) * s * sqrt(1 + 1/N). It accounts for the uncertainty of both the mean and
  the spread estimated from only N values, which a +-2s band ignores (too narrow for small N);
- several replays of members: two one-sided tests (TOST) of equivalence on the paired differences
  replay - original, with the margin one seed-to-seed standard deviation: the replays are
  equivalent when the 90% confidence interval of the mean difference lies inside +-s.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

MIN_SEEDS = 3  # below this a spread is no estimate: t(1, .975) = 12.7 makes any interval meaningless
_LEVEL = 0.95


def _t(df: int, q: float) -> float:
    from scipy.stats import t

    return float(t.ppf(q, df))


@dataclass(frozen=True)
class Spread:
    """Summary of one metric's final values over a study's seeds (intervals are nan for n < 2)."""

    n: int
    mean: float
    std: float  # sample standard deviation (ddof=1)
    min: float
    max: float
    ci95: tuple[float, float]  # the mean's 95% confidence interval: mean +- t * s / sqrt(n)
    pi95: tuple[float, float]  # 95% prediction interval for one new seed: mean +- t * s * sqrt(1 + 1/n)
    values: tuple[float, ...] = ()

    @property
    def enough(self) -> bool:
        return self.n >= MIN_SEEDS and all(math.isfinite(v) for v in self.values)


def spread(values: Iterable[float]) -> Spread:
    v = np.asarray(list(values), dtype=np.float64)
    n = int(v.size)
    if n == 0:
        raise ValueError("spread of no values")
    mean = float(v.mean())
    if n < 2:
        nan2 = (math.nan, math.nan)
        return Spread(n, mean, math.nan, float(v.min()), float(v.max()), nan2, nan2, tuple(map(float, v)))
    std = float(v.std(ddof=1))
    t = _t(n - 1, 0.5 + _LEVEL / 2)
    half_ci = t * std / math.sqrt(n)
    half_pi = t * std * math.sqrt(1 + 1 / n)
    return Spread(
        n, mean, std, float(v.min()), float(v.max()),
        (mean - half_ci, mean + half_ci), (mean - half_pi, mean + half_pi), tuple(map(float, v)),
    )


def another_mean(values: Sequence[float]) -> tuple[float, float]:
    """95% prediction interval for the mean of another N seeds: mean +- t(N-1, 0.975) * s * sqrt(2/N).

    Where a paper's mean over N seeds, drawn again (another seed set, another machine), lands: the
    difference of two N-seed means has standard deviation s * sqrt(2/N).
    """
    s = spread(values)
    if s.n < 2:
        return (math.nan, math.nan)
    half = _t(s.n - 1, 0.5 + _LEVEL / 2) * s.std * math.sqrt(2 / s.n)
    return (s.mean - half, s.mean + half)


@dataclass(frozen=True)
class NoiseCheck:
    """One metric's replayed final value against the study's prediction interval."""

    metric: str
    value: float  # the replay's final value
    original: float | None  # the replayed member's own final value
    spread: Spread
    inside: bool
    below: int  # how many of the seeds' values lie below the replay's (its place among them)
    reason: str = ""  # why it could not be judged, when it could not

    def describe(self) -> str:
        s = self.spread
        if self.reason:
            return f"{self.metric}: {self.reason}"
        where = "inside" if self.inside else "OUTSIDE"
        return (f"{self.metric}: replay {self.value:.6g} {where} the 95% prediction interval "
                f"[{s.pi95[0]:.6g}, {s.pi95[1]:.6g}] of {s.n} seeds (mean {s.mean:.6g}, sd {s.std:.3g}; "
                f"{self.below} of {s.n} seeds below it)")


def check(metric: str, value: float, original: float | None, seeds: Sequence[float]) -> NoiseCheck:
    """Is `value` one a new seed could have given? Not judged (inside=False, reason) with too few seeds."""
    s = spread(seeds)
    below = int(sum(1 for x in seeds if x < value))
    if s.n < MIN_SEEDS:
        return NoiseCheck(metric, value, original, s, False, below,
                          f"too few seeds to judge ({s.n} < {MIN_SEEDS}): run the study with --seeds {MIN_SEEDS} or more")
    if not s.enough or not math.isfinite(value):
        return NoiseCheck(metric, value, original, s, False, below, "a seed's or the replay's final value is not finite")
    inside = s.pi95[0] <= value <= s.pi95[1]
    return NoiseCheck(metric, value, original, s, inside, below)


@dataclass(frozen=True)
class Equivalence:
    """TOST on paired differences replay - original of K members, margin one seed-to-seed sd."""

    metric: str
    k: int
    mean_diff: float
    ci90: tuple[float, float]  # the mean difference's 90% confidence interval (two one-sided 5% tests)
    margin: float  # the study's seed standard deviation
    equivalent: bool
    reason: str = ""

    def describe(self) -> str:
        if self.reason:
            return f"{self.metric}: {self.reason}"
        word = "equivalent" if self.equivalent else "NOT equivalent"
        return (f"{self.metric}: {word} - mean difference {self.mean_diff:.3g} over {self.k} members, "
                f"90% CI [{self.ci90[0]:.3g}, {self.ci90[1]:.3g}] vs margin +-{self.margin:.3g} (one seed sd)")


def equivalence(metric: str, originals: Sequence[float], replays: Sequence[float], seeds: Sequence[float]) -> Equivalence:
    """Whether K >= 2 replays of members are equivalent to their originals within the seeds' noise."""
    d = np.asarray(replays, dtype=np.float64) - np.asarray(originals, dtype=np.float64)
    k = int(d.size)
    s = spread(seeds)
    nan2 = (math.nan, math.nan)
    if s.n < MIN_SEEDS:
        return Equivalence(metric, k, math.nan, nan2, math.nan, False,
                           f"too few seeds to judge ({s.n} < {MIN_SEEDS})")
    if k < 2 or not (np.isfinite(d).all() and s.enough):
        why = "fewer than 2 members replayed" if k < 2 else "a final value is not finite"
        return Equivalence(metric, k, math.nan, nan2, s.std, False, why)
    mean = float(d.mean())
    half = _t(k - 1, 0.95) * float(d.std(ddof=1)) / math.sqrt(k)
    ci = (mean - half, mean + half)
    return Equivalence(metric, k, mean, ci, s.std, -s.std < ci[0] and ci[1] < s.std)


def final_values(metrics: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> dict[str, float]:
    """Each metric's value at its last logged step (a RunRecord's metrics)."""
    out: dict[str, float] = {}
    for name, (steps, values) in metrics.items():
        s = np.asarray(steps, dtype=np.int64)
        if s.size:
            out[name] = float(np.asarray(values, dtype=np.float64)[int(np.argmax(s))])
    return out


@dataclass
class NoiseJudgement:
    """The evidence behind WITHIN_NOISE (or a DIVERGED that the noise did not explain)."""

    study_id: str
    seeds: int
    within: bool
    checks: list[NoiseCheck] = field(default_factory=list)
    reason: str = ""  # why no judgement was possible (too few seeds, no shared metric)

    def headline(self) -> str:
        """The judgement in a clause of the verdict line."""
        if self.reason:
            return f"not judged against the seeds' noise: {self.reason}"
        if self.within:
            finals = ", ".join(f"{c.metric} {c.value:.6g} in [{c.spread.pi95[0]:.6g}, {c.spread.pi95[1]:.6g}]"
                               for c in self.checks)
            return f"every final value inside the 95% prediction interval of {self.seeds} seeds ({finals})"
        out = [c for c in self.checks if not c.inside]
        return "outside the seeds' noise: " + "; ".join(c.describe() for c in out)

    def describe(self) -> list[str]:
        head = f"judged against the noise of study {self.study_id} ({self.seeds} seeds)"
        if self.reason:
            return [f"{head}: {self.reason}"]
        return [head + ":"] + [c.describe() for c in self.checks]


def judge(study_id: str, replay_finals: Mapping[str, float], original_finals: Mapping[str, float],
          member_finals: Sequence[Mapping[str, float]]) -> NoiseJudgement:
    """Every metric the replayed member logged must land inside its prediction interval over the seeds."""
    n = len(member_finals)
    if n < MIN_SEEDS:
        return NoiseJudgement(study_id, n, False, reason=(
            f"too few seeds to judge ({n} < {MIN_SEEDS}): a spread needs at least {MIN_SEEDS} seeds "
            f"(harness run --seeds {MIN_SEEDS})"))
    checks: list[NoiseCheck] = []
    missing: list[str] = []
    for metric in sorted(original_finals):
        seeds = [m[metric] for m in member_finals if metric in m]
        if metric not in replay_finals:
            missing.append(metric)
            continue
        checks.append(check(metric, replay_finals[metric], original_finals[metric], seeds))
    if missing:
        return NoiseJudgement(study_id, n, False, checks, f"the replay logged no {', '.join(missing)}")
    if not checks:
        return NoiseJudgement(study_id, n, False, reason="the member logged no metric: nothing to judge")
    return NoiseJudgement(study_id, n, all(c.inside for c in checks), checks)
