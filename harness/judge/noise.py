"""Run-to-run noise: the spread of a result over seeds, and whether a replay's result lies within it.

Across hardware a replay is rarely bit-identical: another CPU's vector width or another GPU's kernels
round differently, and those last-bit differences grow during training. A one-bit change produces
about the spread a new seed does, so the sound question is whether the replay's result is one a
new seed could have given. The statistics here answer it from a study's N seeds (harness/commands/study.py):

- one replay: the t-based prediction interval for one new draw from the seeds' distribution,
  mean +- t(N-1, 1 - a/2) * s * sqrt(1 + 1/N). It accounts for the uncertainty of both the mean and
  the spread estimated from only N values, which a +-2s band ignores (too narrow for small N). The level
  is set for the whole replay, not per metric: with C checks in all (m metrics, each by J segment means of
  its curve and its final value) each interval is at 1 - NOMINAL / C (Bonferroni), so an honest replay - one
  a new seed could have given - is called DIVERGED at most FALSE_ALARM of the time whatever m and however the
  metrics correlate. At 95% per metric, 5 metrics flagged one honest replay in five. A positive metric is
  judged on a log scale, and NOMINAL is a third of FALSE_ALARM: the margin the t interval's tail needs on the
  skewed values training gives. benchmarks/verdict_bench.py measures both rates, false alarms and power;
- several replays of members: two one-sided tests (TOST) of equivalence on the paired differences
  replay - original, with the margin one seed-to-seed standard deviation: the replays are
  equivalent when the 90% confidence interval of the mean difference lies inside +-s.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from harness.rundata import own_metric

MIN_SEEDS = 3  # below this a spread is no estimate: t(1, .975) = 12.7 makes any interval meaningless
_LEVEL = 0.95  # the study summary's descriptive intervals (ci95, pi95)
# The chance that an honest replay is called DIVERGED by the noise rule, for the whole replay: every metric and
# every check of its curves it is judged on together (benchmarks/verdict_bench.py measures it).
FALSE_ALARM = 0.01
# The level the intervals are set for: a third of the bound. The t interval's far tail is exact only for normal
# values; a final loss across seeds is skewed even on a log scale: at the nominal 1% the benchmark measured up to
# 1.7% false alarms, at half of it up to 1.1% (a linear regression's validation loss, 10 seeds).
NOMINAL = FALSE_ALARM / 3
# A curve is judged in this many segments of its logged steps, each by its mean. More segments catch a change that
# shows only mid-run (a skipped zero_grad) but widen every interval; benchmarks/verdict_bench.py weighs it.
CURVE_POINTS = 4


def family_level(checks: int, alpha: float = NOMINAL) -> float:
    """Each of `checks` intervals at 1 - alpha / checks: the chance that any honest one falls outside is then at
    most alpha (Bonferroni), whatever their correlation - metrics of one run are rarely independent."""
    return 1 - alpha / max(checks, 1)


def prediction_interval(s: Spread, level: float) -> tuple[float, float]:
    """Where one new seed lands with probability `level`: mean +- t(N-1, (1+level)/2) * sd * sqrt(1 + 1/N)."""
    if s.n < 2 or not math.isfinite(s.std):
        return (math.nan, math.nan)
    half = _t(s.n - 1, 0.5 + level / 2) * s.std * math.sqrt(1 + 1 / s.n)
    return (s.mean - half, s.mean + half)


def percent(level: float, digits: int = 4) -> str:
    """0.9975 -> '99.75%'."""
    return f"{100 * level:.{digits}g}%"


@functools.lru_cache(maxsize=4096)
def _t(df: int, q: float) -> float:
    """Student's t quantile. Cached: a replay's power search (_seeds_needed) asks for up to 200 of them per check,
    each 0.25 ms in scipy, and the same few (df, q) pairs recur (verdict_bench asked 1.2M times, 80% of its CPU)."""
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


def another_mean(values: Sequence[float], level: float = _LEVEL) -> tuple[float, float]:
    """`level` (95%) prediction interval for the mean of another N seeds: mean +- t(N-1, (1+level)/2) * s * sqrt(2/N).

    Where a paper's mean over N seeds, drawn again (another seed set, another machine), lands: the
    difference of two N-seed means has standard deviation s * sqrt(2/N).
    """
    s = spread(values)
    if s.n < 2:
        return (math.nan, math.nan)
    half = _t(s.n - 1, 0.5 + level / 2) * s.std * math.sqrt(2 / s.n)
    return (s.mean - half, s.mean + half)


CLAIMS_FALSE_ALARM = 1 - _LEVEL  # for all of a claims file's noise checks together (harness verify)


def claims_level(checks: int) -> float:
    """The level of each of `checks` noise intervals of one claims file: 5% for the whole file (Bonferroni), as a
    replay's checks share one bound - with 10 claims at 95% each, an honest paper would fail one 40% of the time."""
    return family_level(checks, CLAIMS_FALSE_ALARM)


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
    level: float = 1 - NOMINAL  # of the prediction interval it was judged against
    interval: tuple[float, float] = (math.nan, math.nan)
    log: bool = False  # judged on a log scale (a positive metric: a loss, a norm); the interval is in its units
    steps: tuple[int, int] | None = None  # a curve segment's first and last step (its mean was judged); None: final

    @property
    def label(self) -> str:
        if self.steps is None:
            return self.metric
        first, last = self.steps
        return f"{self.metric} at step {first}" if first == last else f"{self.metric} mean over steps {first}-{last}"

    def describe(self) -> str:
        s = self.spread
        if self.reason:
            return f"{self.label}: {self.reason}"
        where = "inside" if self.inside else "OUTSIDE"
        scale = " (log scale)" if self.log else ""
        return (f"{self.label}: replay {self.value:.6g} {where} the {percent(self.level)} prediction interval{scale} "
                f"[{self.interval[0]:.6g}, {self.interval[1]:.6g}] of {s.n} seeds (mean {s.mean:.6g}, sd {s.std:.3g}; "
                f"{self.below} of {s.n} seeds below it)")


def check(metric: str, value: float, original: float | None, seeds: Sequence[float],
          level: float = 1 - NOMINAL) -> NoiseCheck:
    """Is `value` one a new seed could have given (inside the `level` prediction interval)? Not judged
    (inside=False, reason) with too few seeds.

    A metric every seed gave positive (a loss, a norm, a perplexity) is judged on a log scale: across seeds it is
    skewed to the right (a loss is a sum of squares), and its logarithm is much nearer the normal the t interval
    assumes. A replay's value of 0 or less for such a metric is outside."""
    s = spread(seeds)
    below = int(sum(1 for x in seeds if x < value))
    if s.n < MIN_SEEDS:
        return NoiseCheck(metric, value, original, s, False, below,
                          f"too few seeds to judge ({s.n} < {MIN_SEEDS}): run the study with --seeds {MIN_SEEDS} or more",
                          level)
    if not s.enough or not math.isfinite(value):
        return NoiseCheck(metric, value, original, s, False, below, "a seed's or the replay's final value is not finite",
                          level)
    if all(x > 0 for x in seeds):
        lo, hi = (math.exp(b) for b in prediction_interval(spread(math.log(x) for x in seeds), level))
        return NoiseCheck(metric, value, original, s, lo <= value <= hi, below, level=level, interval=(lo, hi),
                          log=True)
    lo, hi = prediction_interval(s, level)
    return NoiseCheck(metric, value, original, s, lo <= value <= hi, below, level=level, interval=(lo, hi))


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
    """Each metric's value at its last logged step (a RunRecord's metrics); not harness's own (a learning rate
    schedule is no seed's noise)."""
    out: dict[str, float] = {}
    for name, (steps, values) in metrics.items():
        if own_metric(name):
            continue
        s = np.asarray(steps, dtype=np.int64)
        if s.size:
            out[name] = float(np.asarray(values, dtype=np.float64)[int(np.argmax(s))])
    return out


@dataclass(frozen=True)
class Power:
    """Could the judgement have caught a doubled learning rate? A judgement whose every interval would hold it too
    says nothing: it is INCONCLUSIVE, never WITHIN_NOISE.

    The test: early in training, k steps at twice the learning rate go about as far as 2k steps at the recorded one
    (gradient descent's path, taken in steps twice as long). So the doubled run's segment mean over steps a..b is
    about the seeds' mean over steps 2a..2b, and a check whose interval excludes that value would have caught it.
    Only segments whose doubled steps the seeds logged are asked. The proxy is rough where the curve has flattened (near
    an optimum a doubled rate oscillates about the same minimum rather than going further), so "caught" asks for a
    margin: the doubled rate's value at least MARGIN half-widths from the interval's centre, not just outside it.
    benchmarks/verdict_bench.py --power measures how often a judgement that passes this test catches a real doubled
    learning rate (docs/verdicts.md: without the margin a 5-seed study of a linear model accepted one 23% of the time,
    each of those at 1.01-1.23 half-widths)."""

    caught: bool
    check: str  # the label of the check nearest to catching it
    counterfactual: float  # the seeds' mean at twice the steps: where a doubled learning rate would land
    interval: tuple[float, float]
    seeds: int
    seeds_needed: int | None  # seeds that would narrow that check's interval enough (same spread); None: no number does

    def describe(self) -> str:
        if self.caught:
            return (f"a doubled learning rate would have been caught: {self.check} would be about "
                    f"{self.counterfactual:.6g}, well outside [{self.interval[0]:.6g}, {self.interval[1]:.6g}]")
        more = (f"about {self.seeds_needed} seeds would narrow it enough" if self.seeds_needed is not None
                else "no number of seeds would (the metric barely moves early in training)")
        where = "inside" if self.interval[0] <= self.counterfactual <= self.interval[1] else "just outside"
        return (f"its intervals could not have caught a doubled learning rate: {self.check} would be about "
                f"{self.counterfactual:.6g}, {where} [{self.interval[0]:.6g}, {self.interval[1]:.6g}] of "
                f"{self.seeds} seeds; {more}, or calibrate the run (harness calibrate RUN_ID) and judge it against "
                "its rounding envelope")


_MAX_SEEDS = 200  # beyond this "run more seeds" is no advice
# How far from an interval's centre the doubled rate's proxy must land to count as caught, in the interval's
# half-widths (see Power): 1 would be "just outside". Chosen by benchmarks/verdict_bench.py --power: every real doubled
# rate that a 5-seed study of the linear model accepted without a margin had its proxy within 1.01-1.23 half-widths.
MARGIN = 1.5


def doubled_rate_power(checks: Sequence[NoiseCheck], members: Sequence[Curves]) -> Power | None:
    """The Power of a curve judgement (see Power); None when no segment's doubled steps were logged."""
    best: tuple[float, Power, NoiseCheck, float] | None = None
    for c in checks:
        if c.steps is None or c.reason or not all(math.isfinite(b) for b in c.interval):
            continue
        first, last = c.steps
        logged = sorted(set.intersection(*({int(s) for s in np.asarray(m[c.metric][0]) if first <= s <= last}
                                           for m in members if c.metric in m)) or {first})
        doubled = [2 * s for s in logged]
        at = [v for v in (mean_over(m, c.metric, doubled) for m in members) if v is not None]
        if len(at) < len(members) or not at:
            continue
        cf = float(np.mean(at))
        lo, hi = c.interval
        # How far from the interval's centre the doubled rate lands, in half-widths (on the check's scale): 1 or more
        # is outside, MARGIN or more is caught. A metric that did not move (a constant accuracy) is at 0, however
        # narrow its interval.
        centre, half, x = _on_scale(c, cf)
        distance = abs(x - centre)
        ratio = distance / half if half > 0 else (math.inf if distance > 0 else 0.0)
        caught = ratio >= MARGIN
        if best is None or ratio > best[0]:
            best = (ratio, Power(caught, c.label, cf, (lo, hi), c.spread.n, None), c, distance)
    if best is None:
        return None
    _, power, check, distance = best
    # Only the check that decides the power is searched for the seeds it would take (the search is the costly part).
    return power if power.caught else replace(power, seeds_needed=_seeds_needed(check, distance))


def _on_scale(c: NoiseCheck, value: float) -> tuple[float, float, float]:
    """The check's interval as centre and half-width, and `value`, on the scale it was judged on."""
    lo, hi = c.interval
    if c.log:
        lo, hi = math.log(lo), math.log(hi)
        value = math.log(value) if value > 0 else -math.inf
    return (lo + hi) / 2, (hi - lo) / 2, value


def _seeds_needed(c: NoiseCheck, distance: float) -> int | None:
    """The fewest seeds whose interval at the check's level, with the spread it has now, would exclude a value at
    `distance` from its centre."""
    values = [math.log(v) for v in c.spread.values] if c.log else list(c.spread.values)
    sd = float(np.std(values, ddof=1)) if len(values) > 1 else math.nan
    if not (math.isfinite(sd) and sd > 0 and distance > 0):
        return None
    for n in range(c.spread.n + 1, _MAX_SEEDS + 1):
        if MARGIN * _t(n - 1, 0.5 + c.level / 2) * sd * math.sqrt(1 + 1 / n) <= distance:
            return n
    return None


@dataclass
class NoiseJudgement:
    """The evidence behind WITHIN_NOISE (or a DIVERGED that the noise did not explain)."""

    study_id: str
    seeds: int
    within: bool
    checks: list[NoiseCheck] = field(default_factory=list)
    reason: str = ""  # why no judgement was possible (too few seeds, no shared metric)
    what: str = "final value"  # what was judged: "final value", "curve point", "value at step k"
    power: Power | None = None  # could it have caught a doubled learning rate (curve judgements)

    @property
    def vacuous(self) -> bool:
        """Inside every interval, but the intervals would have held a doubled learning rate too."""
        return self.within and self.power is not None and not self.power.caught

    def family(self) -> str:
        """How the level was set: the whole replay's false-alarm bound over its checks."""
        n = len(self.checks)
        alpha = 1 - self.checks[0].level if self.checks else NOMINAL / max(n, 1)
        return (f"false-alarm bound {percent(FALSE_ALARM)} for the replay: {n} check{'s' if n != 1 else ''} "
                f"at {percent(alpha, 2)} each")

    def headline(self) -> str:
        """The judgement in a clause of the verdict line."""
        if self.reason:
            return f"not judged against the seeds' noise: {self.reason}"
        if self.within:
            last = {c.metric: c for c in self.checks}  # each metric's last point: its final value on a curve
            finals = ", ".join(f"{c.label} {c.value:.6g} in [{c.interval[0]:.6g}, {c.interval[1]:.6g}]"
                               for c in last.values())
            level = percent(self.checks[0].level)
            return (f"every {self.what} inside its {level} prediction interval of {self.seeds} seeds ({finals}; "
                    f"{self.family()})")
        out = [c for c in self.checks if not c.inside]
        return "outside the seeds' noise: " + "; ".join(c.describe() for c in out)

    def describe(self) -> list[str]:
        head = f"judged against the noise of study {self.study_id} ({self.seeds} seeds)"
        if self.reason:
            return [f"{head}: {self.reason}"]
        return [head + ":"] + [c.describe() for c in self.checks]


def judge(study_id: str, replay_finals: Mapping[str, float], original_finals: Mapping[str, float],
          member_finals: Sequence[Mapping[str, float]], alpha: float = NOMINAL,
          what: str = "final value") -> NoiseJudgement:
    """Every metric the replayed member logged must land inside its prediction interval over the seeds, each
    interval at the level that bounds the whole replay's false-alarm rate by `alpha` (family_level)."""
    n = len(member_finals)
    if n < MIN_SEEDS:
        return NoiseJudgement(study_id, n, False, reason=(
            f"too few seeds to judge ({n} < {MIN_SEEDS}): a spread needs at least {MIN_SEEDS} seeds "
            f"(harness run --seeds {MIN_SEEDS})"))
    checks: list[NoiseCheck] = []
    missing = [metric for metric in sorted(original_finals) if metric not in replay_finals]
    level = family_level(len(original_finals), alpha)
    for metric in sorted(original_finals):
        seeds = [m[metric] for m in member_finals if metric in m]
        if metric in replay_finals:
            checks.append(check(metric, replay_finals[metric], original_finals[metric], seeds, level))
    if missing:
        return NoiseJudgement(study_id, n, False, checks, f"the replay logged no {', '.join(missing)}", what)
    if not checks:
        return NoiseJudgement(study_id, n, False, reason="the member logged no metric: nothing to judge", what=what)
    return NoiseJudgement(study_id, n, all(c.inside for c in checks), checks, what=what)


Curves = Mapping[str, tuple[np.ndarray, np.ndarray]]  # metric -> (steps, values), as in a RunRecord


def segments(steps: Iterable[int], parts: int = CURVE_POINTS) -> list[list[int]]:
    """`steps` (sorted, distinct) cut into `parts` contiguous runs of nearly equal length, the last one ending at
    the last step."""
    ordered = sorted({int(s) for s in steps})
    return [[int(x) for x in part] for part in np.array_split(np.asarray(ordered, dtype=np.int64),
                                                               min(parts, len(ordered))) if part.size]


def mean_over(curves: Curves, metric: str, steps: Sequence[int]) -> float | None:
    """The mean of `metric`'s values at `steps` (each step's last value), None if `curves` lacks any of them."""
    if metric not in curves:
        return None
    at, values = (np.asarray(a) for a in curves[metric])
    last = {int(k): float(v) for k, v in zip(at, np.asarray(values, dtype=np.float64))}
    if any(k not in last for k in steps):
        return None
    return float(np.mean([last[k] for k in steps]))


def judge_curves(study_id: str, replay: Curves, original: Curves, members: Sequence[Curves],
                 points: int = CURVE_POINTS, before: int | None = None, alpha: float = NOMINAL) -> NoiseJudgement:
    """The curve check: each metric's curve, over the steps that the original and every member logged (`before`:
    only steps below it - the check of a replay's first K steps), cut into `points` segments; each segment's mean,
    and the last value, must lie inside its prediction interval over the seeds' values, the levels set for the
    whole replay (metrics x (segments + 1) checks at 1 - alpha / checks each). Means, not single points: one step's value (a
    batch's loss) is skewed and heavy-tailed across seeds, and the t interval's far tail is only right for values
    near normal; a segment's mean is (benchmarks/verdict_bench.py measured the difference), and is less noisy."""
    n = len(members)
    what = "segment mean and final value" if before is None else f"segment mean and value before step {before}"
    if n < MIN_SEEDS:
        return NoiseJudgement(study_id, n, False, reason=(
            f"too few seeds to judge ({n} < {MIN_SEEDS}): a spread needs at least {MIN_SEEDS} seeds "
            f"(harness run --seeds {MIN_SEEDS})"), what=what)
    chosen: list[tuple[str, list[int]]] = []
    for metric in sorted(m for m in original if not own_metric(m)):  # harness's learning rate is no seed's noise
        shared = {int(s) for s in np.asarray(original[metric][0])}
        for m in members:
            shared &= {int(s) for s in np.asarray(m[metric][0])} if metric in m else set()
        parts = segments({s for s in shared if before is None or s < before}, points)
        # And the last value alone, where the paper's number comes from: a segment's mean would dilute a change
        # that shows only at the end.
        chosen += [(metric, part) for part in parts] + ([(metric, parts[-1][-1:])] if len(parts[-1]) > 1 else [])
    if not chosen:
        return NoiseJudgement(study_id, n, False, reason="the member and its seeds logged no step in common: nothing "
                              "to judge", what=what)
    level = family_level(len(chosen), alpha)
    checks: list[NoiseCheck] = []
    missing: list[str] = []
    for metric, part in chosen:
        value = mean_over(replay, metric, part)
        if value is None:
            missing.append(f"{metric} at steps {part[0]}-{part[-1]}")
            continue
        seeds = [v for v in (mean_over(m, metric, part) for m in members) if v is not None]
        checks.append(replace(check(metric, value, mean_over(original, metric, part), seeds, level),
                              steps=(part[0], part[-1])))
    if missing:
        return NoiseJudgement(study_id, n, False, checks, f"the replay logged no {', '.join(missing)}", what)
    return NoiseJudgement(study_id, n, all(c.inside for c in checks), checks, what=what,
                          power=doubled_rate_power(checks, members))
