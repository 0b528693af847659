"""The rounding envelope carried past the calibrated steps: a replay's steps from M on held to what the members'
growth says rounding reaches there.

A calibration measures the members' spread over the first M steps only; a run of thousands of steps would take
thousands of member steps to measure whole. Rounding differences grow roughly geometrically while training carries
them (each step multiplies the distance by about the same factor) and then level off where the runs have lost their
correlation - at the seeds' spread. So per metric the envelope's relative half-width at step M-1 is carried on by the
fastest growth rate the window supports:

    half-width(s) = WIDE_SAFETY x r(M-1) x exp(rate x (s - (M-1))) x |original value at s|

where r is the widest member's relative distance, running maximum (rounding.MetricEnvelope.half_widths), and the rate
is the least-squares slope of log r over the second half of the window plus GROWTH_SIGMAS standard errors, never
below 0. The second half, because the first steps grow from the nudge to the kernels' own differences faster than
rounding grows later (digits_cnn: 0.17 per step over the whole window, 0.067 over its second half), and the rate of
the first steps carried over a long run would hold anything within a few dozen steps.

The carried width decides only as far as it says something: where it reaches the seeds' spread (a study's members at
that step), the seeds judge from there; without a study, where it passes CEILING of the value (or the width measured at the
window's end, when that was wider) it would hold a real change too, so a replay that lies beyond that but inside the
carried width is INCONCLUSIVE. A metric logged too rarely to fit a rate (an evaluation per epoch) is carried at the
fastest rate fitted on the run's other metrics. A replay beyond the
carried width is DIVERGED there: a change that starts late and jumps leaves it, which rounding's growth does not.

Pure: an envelope and two runs' series in, a judgement out (harness/judge/handoff.py applies it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from harness.fmt import fmt_short
from harness.judge.rounding import (
    FLOOR_ULPS,
    TINY,
    WIDE_SAFETY,
    MetricEnvelope,
    Outside,
    Series,
    abs_distance,
    series_at,
)

# Standard errors added to the fitted rate: the rate the window supports, not its point estimate.
GROWTH_SIGMAS = 2.0
# Relative half-width beyond which a carried envelope holds real changes too (docs/verdicts.md, "Across machines":
# a learning rate x1.02 moves an MLP's loss by 1.7e-4 after one step, 2.4e-2 after 50), so it decides nothing there.
CEILING = 1e-2
# Fewest window steps with a nonzero distance that a rate is fitted on.
MIN_FIT = 3


@dataclass
class Growth:
    """A metric's envelope carried past the window: its relative (or, where the run's value is ~0, absolute)
    half-width at the window's last step and the per-step growth rate it is carried on by."""

    last: int  # the window's last step of this metric
    width: float  # WIDE_SAFETY x r(last): relative half-width there (absolute where `absolute`)
    rate: float  # natural log per step, conservative
    fitted: int  # window steps the rate was fitted on (0: borrowed)
    absolute: bool = False
    borrowed: str | None = None  # the metric whose rate this one's too few steps took

    @property
    def factor(self) -> float:
        """The growth per step (e^rate)."""
        return math.exp(self.rate)

    def half_widths(self, steps: np.ndarray, original: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            rel = self.width * np.exp(self.rate * (np.asarray(steps, dtype=np.float64) - self.last))
        value = np.abs(np.asarray(original, dtype=np.float64))
        width = rel if self.absolute else rel * value
        floor = FLOOR_ULPS * np.spacing(value.astype(np.float32)).astype(np.float64)
        return np.maximum(np.nan_to_num(width, nan=np.inf), floor)

    def relative(self, steps: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            return self.width * np.exp(self.rate * (np.asarray(steps, dtype=np.float64) - self.last))


def growth(env: MetricEnvelope, m: int, safety: float | None = None, borrow: tuple[str, float] | None = None
           ) -> Growth | None:
    """The growth of `env` over its steps < `m`, or None where nothing can be carried: no step with a nonzero
    member distance (the members never moved it), a distance that is not finite, or fewer than MIN_FIT steps with a
    nonzero one and no `borrow` (metric, rate): another metric's rate, for a metric logged too rarely to fit its own
    (an evaluation every epoch) - the same weights parting drive both."""
    s = np.asarray(env.steps, dtype=np.float64)
    original = np.abs(np.asarray(env.original, dtype=np.float64))
    dev = np.asarray(env.deviation, dtype=np.float64)
    keep = s < m
    s, original, dev = s[keep], original[keep], dev[keep]
    if not s.size or not np.all(np.isfinite(dev)):
        return None
    absolute = bool(np.any(original <= TINY))
    with np.errstate(invalid="ignore", divide="ignore"):
        rel = dev if absolute else dev / original
    r = np.maximum.accumulate(rel)
    positive = r > 0
    width = (WIDE_SAFETY if safety is None else safety) * float(r[-1])
    if int(positive.sum()) < MIN_FIT:
        if borrow is None or not positive.any():
            return None
        return Growth(int(s[-1]), width, borrow[1], 0, absolute, borrowed=borrow[0])
    xs, ys = s[positive], np.log(r[positive])
    half = xs >= xs[0] + (xs[-1] - xs[0]) / 2
    if int(half.sum()) >= MIN_FIT:
        xs, ys = xs[half], ys[half]
    slope, stderr = _fit(xs, ys)
    return Growth(int(s[-1]), width, max(slope + GROWTH_SIGMAS * stderr, 0.0), int(xs.size), absolute)


def _fit(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Least-squares slope of y on x and its standard error (0 with two points or a perfect fit)."""
    xm = x - x.mean()
    sxx = float(np.sum(xm * xm))
    if sxx == 0:
        return 0.0, 0.0
    slope = float(np.sum(xm * (y - y.mean())) / sxx)
    if x.size <= 2:
        return slope, 0.0
    resid = y - y.mean() - slope * xm
    return slope, math.sqrt(float(np.sum(resid * resid)) / (x.size - 2) / sxx)


@dataclass
class Carried:
    """One metric's steps from M on held to its carried envelope."""

    metric: str
    growth: Growth
    first: int  # first step judged by the carried envelope (None-free: a Carried judges at least one step)
    last: int  # last step judged by it
    judged: int  # values judged by it
    widest: float = 0.0  # the replay's largest distance there as a fraction of the carried half-width
    outside: Outside | None = None  # the first value beyond the carried half-width: DIVERGED
    # The first value beyond the ceiling (CEILING, or the seeds' spread) yet inside the carried half-width: what
    # the carried envelope cannot decide.
    undecided: Outside | None = None
    # With a study: the first step where the carried half-width met the seeds' spread; the seeds judge from there.
    seeds_from: int | None = None
    undecided_width: float = 0.0  # the carried half-width at the undecided value's step

    def ceiling_words(self) -> str:
        if self.seeds_from is not None:
            return "the seeds' spread"
        return f"{max(CEILING, self.growth.width):.3g} of the value"

    def span(self) -> str:
        return f"{self.first}-{self.last}" if self.last > self.first else f"{self.first}"

    def describe(self) -> str:
        g = self.growth
        rate = f"x{g.factor:.5g} per step" + (f", {g.borrowed}'s rate" if g.borrowed else "")
        return (f"{self.metric} steps {self.span()} by the envelope carried forward {rate} from "
                f"±{fmt_short(g.width)}{'' if g.absolute else ' relative'} at step {g.last}")


def judge(name: str, growth_: Growth, original: Series, replay: Series, m: int,
          seeds_spread: Series | None = None, safety: float | None = None) -> Carried | None:
    """`replay`'s values at steps >= `m` held to the envelope carried by `growth_`; `seeds_spread`: a study's widest
    seed distance from the original per step (the carried envelope judges only the steps before it meets it).
    None where both runs logged no step >= `m`."""
    every = np.asarray(original[0])
    ov, rv = series_at(original, every), series_at(replay, every)
    both = ov[0] & rv[0]
    every, o, r = every[both], ov[1][both], rv[1][both]
    dist = abs_distance(o, r)
    # The replay's own widest relative distance before each step: rounding grows from where the replay is, at most
    # WIDE_SAFETY x the members' rate per step, or jumps to where the members were (a flipped choice), not past both.
    value = np.abs(o)
    with np.errstate(invalid="ignore", divide="ignore"):
        own = dist if growth_.absolute else np.where(value > TINY, dist / np.maximum(value, TINY), dist)
    prior = np.concatenate([[0.0], np.maximum.accumulate(own)[:-1]]) if own.size else own
    after = every >= m
    s, o, r, dist, prior, value = every[after], o[after], r[after], dist[after], prior[after], value[after]
    if not s.size:
        return None
    scale = 1.0 if growth_.absolute else value
    jump = np.maximum(growth_.width, (WIDE_SAFETY if safety is None else safety) * growth_.factor * prior) * scale
    floor = FLOOR_ULPS * np.spacing(value.astype(np.float32)).astype(np.float64)
    widths = np.maximum(np.minimum(growth_.half_widths(s, o), np.nan_to_num(jump, nan=np.inf)), floor)
    seeds_from = None
    if seeds_spread is not None:
        found, spread = series_at(seeds_spread, s)
        met = found & (widths >= spread)
        if met.any():
            i = int(np.argmax(met))
            seeds_from = int(s[i])
            s, o, r, widths, dist = s[:i], o[:i], r[:i], widths[:i], dist[:i]
            if not s.size:
                return Carried(name, growth_, seeds_from, seeds_from, 0, seeds_from=seeds_from)
        cap = widths
    else:
        # Never narrower than what the members measured at the window's end: the ceiling bounds the growth only.
        top = max(CEILING, growth_.width) * (1.0 if growth_.absolute else value)
        cap = np.minimum(widths, np.maximum(top, FLOOR_ULPS * np.spacing(value.astype(np.float32)).astype(np.float64)))
    out = Carried(name, growth_, int(s[0]), int(s[-1]), int(s.size), seeds_from=seeds_from)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratios = np.where(dist == 0, 0.0, dist / widths)
    out.widest = float(np.max(ratios))
    beyond = ~((dist == 0) | (dist <= widths))
    if beyond.any():
        out.outside = _outside(name, s, o, r, dist, widths, beyond, ratios)
    unsure = ~((dist == 0) | (dist <= cap)) & ~beyond
    if unsure.any():
        out.undecided = _outside(name, s, o, r, dist, cap, unsure, ratios)
        out.undecided_width = float(widths[int(np.argmax(unsure))])
    return out


def _outside(name: str, s: np.ndarray, o: np.ndarray, r: np.ndarray, dist: np.ndarray, widths: np.ndarray,
             bad: np.ndarray, ratios: np.ndarray) -> Outside:
    i = int(np.argmax(bad))
    before = ratios[:i]
    return Outside(name, int(s[i]), float(o[i]), float(r[i]), float(dist[i]), float(widths[i]), int(bad.sum()),
                   int(s.size), i, float(before.max()) if before.size else 0.0)


def seeds_spread(original: Series, members: list[Series]) -> Series:
    """Per step the original logged, the study's widest seed distance from it (steps no other seed logged: absent)."""
    s, v = np.asarray(original[0]), np.asarray(original[1], dtype=np.float64)
    widest = np.full(s.size, -np.inf)
    for member in members:
        found, other = series_at(member, s)
        widest = np.where(found, np.maximum(widest, abs_distance(v, other)), widest)
    keep = widest >= 0  # -inf: no other seed logged the step
    return s[keep], widest[keep]
