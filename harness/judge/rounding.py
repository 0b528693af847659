"""The rounding envelope of a run's first steps, and a replay judged against it (`WITHIN_ROUNDING`).

A replay on another machine is rarely bit-identical: another CPU's vector kernels or another GPU's reduce the same
sums in another order, and the last bits differ. A seed study measures how far *another seed* lands, which is the
worst case; a same-seed replay on other hardware differs by rounding only, and rounding differences stay three to
four orders of magnitude below any real change for the first steps (docs/verdicts.md has the measurements).

`harness calibrate` measures that reference directly, as the climate models' ensemble consistency tests do: K
members re-execute the first M steps with the same seed, config and data, each with every weight nudged by up to 256
float32 ulps (the size by which another convolution library moves an activation) and on its share of the machine's
other CPU kernels (harness/runtime/perturb.py). Per metric and step, the envelope is
how far the members landed from the original.
A replay is inside when, at every judged step, its distance from the original is within

    SAFETY x (the widest member's relative distance at this step or any earlier one) x |original value|

and never narrower than FLOOR_ULPS float32 ulps of the original value. The running maximum keeps the envelope from
closing at a step where the members happened to agree, and is the right shape: rounding differences only grow.

SAFETY is set from what honest replays measured, not chosen by hand: HEADROOM x the largest distance an honest
replay on other CPU kernels has landed from the original, in units of the widest member's distance at that step
(HONEST_WIDEST: benchmarks/margin_bench.py and verdict_bench.py --rounding in process, verdict_e2e_bench.py through
the CLI; docs/verdicts.md, "Margins"). A wider factor buys nothing against rounding that the members and those
replays do not already show, and costs power: a change that shows only in the training (momentum 0.9 -> 0.91, a
weight decay of 0.01) moves the loss at its first step by only a few times the widest member.
The weights after the M steps and the envelope carried past them keep WIDE_SAFETY: there an honest replay's weights
reach 0.61x the widest member's (linear regression, ATEN_CPU_CAPABILITY=default), and the carried width was measured
end to end at it; no planted change is judged first there.

Pure: records in, an envelope or a judgement out. The calibration's storage is harness/commands/calibrate.py (read
back: harness/record/calibration.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from harness.fmt import fmt_pair, fmt_short

if TYPE_CHECKING:
    from harness.judge.carried import Carried

FORMAT = 1
# The largest honest distance measured, in units of the widest member's at its step: the bench's CNN with oneDNN off
# (verdict_bench --rounding, seed 1019: a max-pool choice no member flipped, 3.86e-5 against members up to 1.45e-5).
# The other CPU kernels no member runs reach 0.5 (margin_bench: a 1-ulp loss against members 2 ulps apart), and
# digits_cnn through the CLI 1.04.
HONEST_WIDEST = 2.67
HEADROOM = 2.0
SAFETY = HEADROOM * HONEST_WIDEST
WIDE_SAFETY = 8.0
FLOOR_ULPS = 4
# How close to zero an original value may be before relative distances mean nothing: below it, absolute.
TINY = 1e-30
# A replay that stayed well inside this many judged steps of a metric before leaving it parted suddenly (a note).
SUDDEN_AFTER = 3
# The weights' envelope is never narrower than this relative distance: what the sketches' float64 sums round off
# (harness/runtime/sketch.py), not a difference of the weights.
WEIGHTS_FLOOR = 1e-12

Series = tuple[np.ndarray, np.ndarray]  # steps, values


@dataclass
class MetricEnvelope:
    """One metric over the first steps: the original's values and the widest member distance at each step."""

    steps: list[int]
    original: list[float]
    deviation: list[float]  # max over members of |member - original|; inf where a member logged NaN or inf alone

    def half_widths(self, safety: float | None = None, floor_ulps: float | None = None) -> np.ndarray:
        """The envelope's half-width at each of `steps` (see the module's docstring); `safety`, `floor_ulps`: other
        constants than SAFETY and FLOOR_ULPS (benchmarks/verdict_bench.py measures the choice)."""
        original = np.abs(np.asarray(self.original, dtype=np.float64))
        dev = np.asarray(self.deviation, dtype=np.float64)
        with np.errstate(invalid="ignore", divide="ignore"):
            rel = np.where(original > TINY, dev / np.maximum(original, TINY), dev)
        rel = np.maximum.accumulate(rel) if rel.size else rel
        with np.errstate(invalid="ignore"):
            width = (SAFETY if safety is None else safety) * np.where(original > TINY, rel * original, rel)
        width = np.nan_to_num(width, nan=np.inf)  # inf x 0: a member that went to NaN or inf there
        floor = (FLOOR_ULPS if floor_ulps is None else floor_ulps) * np.spacing(original.astype(np.float32)).astype(np.float64)
        return np.maximum(width, floor)

    def first_blown_up(self) -> int | None:
        """The first step where a member went to NaN or inf while the run's value did not (or the other way round):
        from there the members measure a run that rounding broke, not rounding, and a width of inf holds anything."""
        bad = ~np.isfinite(np.asarray(self.deviation, dtype=np.float64))
        return int(self.steps[int(np.argmax(bad))]) if bad.any() else None


@dataclass
class WeightsEnvelope:
    """The weights after the M steps: each member's relative distance from the run's own, which the calibration's
    reference member (the run re-executed, not nudged) ended with; read from their sketches
    (harness/judge/weightdistance.py). A replay's weights after M steps are held to WIDE_SAFETY x the widest."""

    step: int
    reference: str  # the reference member's run id (its sketch is the calibration run's weights/sketch.npz)
    distances: list[float]  # per member, in member order
    widest_tensor: str  # the tensor farthest from the run's, relatively, in the member farthest away

    def half_width(self, safety: float | None = None) -> float:
        widest = max(self.distances, default=0.0)
        return max((WIDE_SAFETY if safety is None else safety) * widest, WEIGHTS_FLOOR)

    @property
    def finite(self) -> bool:
        """Every member's weights ended at a finite distance (none went to NaN or inf)."""
        return all(math.isfinite(d) for d in self.distances)


@dataclass
class Envelope:
    """What `harness calibrate` measured: K members, the first M steps (0..M-1), per metric."""

    run_id: str
    calibration_id: str
    members: int
    steps: int
    metrics: dict[str, MetricEnvelope]
    # How many members' weights after the M steps differed from the original's (a nudge that training washed out
    # would leave the members bitwise, and then no difference is rounding's).
    weights_differed: int = 0
    format: int = FORMAT
    # The weights' distances after the M steps (None: a calibration made before they were sketched, or a run with no
    # model to sketch); whether the reference member re-executed the run's first M steps bit for bit here (None: a
    # calibration without a reference). When it did not, its values are among the members' (the machine's own
    # run-to-run variation belongs in the envelope).
    weights: WeightsEnvelope | None = None
    reference_bitwise: bool | None = None
    # The members' nudge, relative to each weight (perturb.NUDGE when calibrated; None: a calibration before it was
    # recorded, whose members moved by one ulp).
    nudge: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def blown_up(self) -> tuple[str, int] | None:
        """(metric, step): the first step < M where a member's metric went to NaN or inf while the run's did not.
        The envelope holds only the steps before it: a member whose training rounding broke measures nothing after."""
        found = [(step, name) for name, m in sorted(self.metrics.items())
                 if (step := m.first_blown_up()) is not None and step < self.steps]
        if not found:
            return None
        step, name = min(found)
        return name, step

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> Envelope:
        if doc.get("format") != FORMAT:
            raise ValueError(f"envelope format {doc.get('format')!r}, this harness reads {FORMAT}")
        metrics = {name: MetricEnvelope([int(s) for s in m["steps"]], [float(v) for v in m["original"]],
                                        [float(v) for v in m["deviation"]]) for name, m in doc["metrics"].items()}
        w = doc.get("weights")
        weights = None if w is None else WeightsEnvelope(int(w["step"]), str(w["reference"]),
                                                         [float(d) for d in w["distances"]], str(w["widest_tensor"]))
        bitwise = doc.get("reference_bitwise")
        return cls(str(doc["run_id"]), str(doc["calibration_id"]), int(doc["members"]), int(doc["steps"]), metrics,
                   int(doc.get("weights_differed", 0)), weights=weights,
                   reference_bitwise=None if bitwise is None else bool(bitwise),
                   nudge=None if doc.get("nudge") is None else float(doc["nudge"]))

    def describe(self) -> str:
        return f"the rounding envelope of {self.members} members over the first {self.steps} steps"


def measure(run_id: str, calibration_id: str, original: Mapping[str, Series], members: list[Mapping[str, Series]],
            steps: int, weights_differed: int = 0, weights: WeightsEnvelope | None = None) -> Envelope:
    """The envelope of `members` (each a run's metrics: name -> (steps, values)) around `original`, steps < `steps`.
    A metric or step a member did not log is no evidence: the envelope there is the other members'."""
    metrics: dict[str, MetricEnvelope] = {}
    for name, (s, v) in sorted(original.items()):
        s, v = np.asarray(s), np.asarray(v, dtype=np.float64)
        keep = s < steps
        s, v = s[keep], v[keep]
        if not s.size:
            continue
        dev = np.zeros(s.size)
        for member in members:
            if name in member:
                found, other = series_at(member[name], s)
                dev = np.maximum(dev, np.where(found, abs_distance(v, other), 0.0))
        metrics[name] = MetricEnvelope([int(x) for x in s], [float(x) for x in v], [float(x) for x in dev])
    return Envelope(run_id, calibration_id, len(members), steps, metrics, weights_differed, weights=weights)


def abs_distance(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """|a - b|: 0 where both are equal (inf == inf) or both NaN, inf where one side only is NaN or infinite."""
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.abs(a - b)
    diff = np.where(same, 0.0, diff)
    return np.where(np.isfinite(diff), diff, np.inf)


@dataclass
class Outside:
    """A metric that left the envelope: where first, by how much, and how often."""

    metric: str
    step: int
    original: float
    replay: float
    distance: float
    half_width: float
    count: int  # judged steps outside
    judged: int  # judged steps of this metric
    inside_before: int = 0  # judged steps of this metric before `step`, all inside
    widest_before: float = 0.0  # their largest distance as a fraction of the half-width

    def describe(self) -> str:
        return (f"{self.metric} at step {self.step}: {fmt_pair(self.original, self.replay)} "
                f"(abs {fmt_short(self.distance)}, envelope ±{fmt_short(self.half_width)}); outside at "
                f"{self.count} of {self.judged} judged steps")


@dataclass
class RoundingJudgement:
    """A replay's first steps held to a calibration's envelope."""

    calibration_id: str
    members: int
    steps: int  # M: the envelope covers steps 0..M-1 (fewer where a member blew up: Envelope.blown_up)
    judged_steps: int  # steps judged, over all metrics (values)
    outside: list[Outside] = field(default_factory=list)
    widest: float = 0.0  # the replay's largest distance as a fraction of the envelope's half-width there
    covers_run: bool = False  # every step both runs logged lies inside the envelope's steps
    weights: WeightsJudgement | None = None  # the weights after the M steps, where both were sketched
    blown_up: bool = False  # cut short where a member went to NaN or inf: more steps would not hold the rest
    judged: dict[str, int] = field(default_factory=dict)  # per metric, its values held to the envelope
    # Per metric held to the envelope, the first step from M on outside its tolerance (None: none), where the steps
    # after the envelope were judged by the tolerance (handoff.judge_rounding).
    after: dict[str, int | None] = field(default_factory=dict)
    # Per metric, its steps from M on held to the envelope carried forward at the members' growth rate (carried.py).
    carried: dict[str, Carried] = field(default_factory=dict)

    def undecided(self) -> Outside | None:
        """The first value beyond where a carried envelope decides (its ceiling), yet inside its width."""
        found = [c.undecided for c in self.carried.values() if c.undecided is not None]
        return min(found, key=lambda o: (o.step, o.metric)) if found else None

    def after_line(self, by: str, run_id: str) -> str:
        """What judged the steps after the envelope's, for the verdict line (`by`: the tolerance, the seeds' noise)."""
        line = f"the first {self.steps} steps inside {self.describe_envelope()}"
        if not self.carried:
            return f"{line}, the steps after them judged by {by}"
        line = f"{line}, {self.carried_spans()}"
        rest = [n for n in self.after if n not in self.carried] + [c.metric for c in self.carried.values()
                                                                  if c.seeds_from is not None]
        return f"{line}; the rest ({', '.join(sorted(rest))}) judged by {by}" if rest else line

    def undecided_line(self, run_id: str) -> str:
        """INCONCLUSIVE: the value the carried envelope could not decide, and what would."""
        o = self.undecided()
        assert o is not None
        c = self.carried[o.metric]
        return (f"{o.metric} at step {o.step}: {fmt_pair(o.original, o.replay)} (abs {fmt_short(o.distance)}), beyond "
                f"{fmt_short(o.half_width)} ({c.ceiling_words()}) but inside the envelope carried forward "
                f"(±{fmt_short(c.undecided_width)}), which there would hold a real change too; a study of the run's "
                f"seeds (harness run ... --seeds N) judges those steps, "
                f"or a calibration that measures them (harness calibrate {run_id} --steps {o.step + 1})")

    def carried_spans(self) -> str:
        """Per metric, the steps the carried envelope judged and how it grew."""
        return "; ".join(c.describe() for _, c in sorted(self.carried.items()) if c.judged)

    def carried_from(self) -> str:
        """Which steps the measured envelope judged and which the carried one, in words."""
        spans = self.carried_spans()
        return f"steps 0-{self.steps - 1} by {self.describe_envelope()}, {spans}" if spans else ""

    @property
    def within(self) -> bool:
        return not self.outside and self.judged_steps > 0 and (self.weights is None or self.weights.inside)

    def first(self) -> Outside | None:
        return min(self.outside, key=lambda o: (o.step, o.metric)) if self.outside else None

    def sudden(self, identical_before: bool = False) -> str | None:
        """When the replay left the envelope abruptly - well inside for SUDDEN_AFTER judged steps or more, then
        outside - what else than a change can do that, and how to tell (a note beside the verdict, not a verdict).
        `identical_before`: a replay in the run's own environment whose every value and fingerprint was bit-identical
        before that step. Rounding there repeats itself bit for bit, so no near-tie of rounding's explains the jump."""
        first = self.first()
        if first is None or first.inside_before < SUDDEN_AFTER or first.widest_before > 0.5:
            return None
        if identical_before:
            return (f"every value was bit-identical before step {first.step}, in the run's own environment, then "
                    f"{first.metric} left the envelope at {first.distance / first.half_width:.3g}x its half-width: "
                    "rounding in the same environment repeats itself bit for bit, so this is a change that acts from "
                    "that step (the code, the config, the data), not rounding")
        return (f"{first.metric} stayed inside the envelope for its {first.inside_before} judged steps before step "
                f"{first.step} (at most {first.widest_before:.2g}x its half-width), then left it: a sudden parting, as "
                "a change acting from that step makes - or as rounding makes where it flips a discrete choice (a "
                "max-pool's or argmax's near-tie) that no member's rounding flipped; a calibration with more members "
                "(harness calibrate RUN_ID --members 32) shows whether this run's rounding does that")

    def headline(self) -> str:
        where = f"{self.describe_envelope()} (calibration {self.calibration_id})"
        weights = "" if self.weights is None else f"; {self.weights.describe()}"
        if self.within and self.carried:
            judged = sum(c.judged for c in self.carried.values())
            widest = max(c.widest for c in self.carried.values())
            return (f"inside {where} at all {self.judged_steps} judged values, at most {self.widest:.2g}x its "
                    f"half-width{weights}, and inside the envelope carried forward at its members' growth rate at "
                    f"{judged} more, at most {widest:.2g}x its half-width ({self.carried_from()})")
        if self.within:
            return (f"inside {where} at all {self.judged_steps} judged values, at most "
                    f"{self.widest:.2g}x its half-width{weights}")
        first = self.first()
        return f"outside {where}: {first.describe() if first is not None else weights[2:]}"

    def describe_envelope(self) -> str:
        return f"the rounding envelope of {self.members} members over the first {self.steps} steps"


@dataclass
class WeightsJudgement:
    """A replay's weights after the M steps against the members': its relative distance from the run's, and the
    envelope's half-width (WIDE_SAFETY x the members' widest)."""

    step: int
    distance: float
    half_width: float
    widest_member: float
    tensor: str  # the replay's tensor farthest from the run's, relatively

    @property
    def inside(self) -> bool:
        return self.distance <= self.half_width

    def describe(self) -> str:
        where = f"the weights after step {self.step}: relative distance {fmt_short(self.distance)} from the run's"
        if self.inside:
            return (f"{where}, {self.distance / self.half_width:.2g}x the envelope's half-width (members up to "
                    f"{fmt_short(self.widest_member)})")
        return (f"{where} (farthest: {self.tensor}), outside the envelope ±{fmt_short(self.half_width)} (members up to "
                f"{fmt_short(self.widest_member)})")


def judge_weights(envelope: Envelope, distance: float, tensor: str, safety: float | None = None
                  ) -> WeightsJudgement | None:
    """The replay's weights after the M steps (`distance` from the reference's, relative) held to the members'."""
    w = envelope.weights
    if w is None:
        return None
    return WeightsJudgement(w.step, distance, w.half_width(safety), max(w.distances, default=0.0), tensor)


def judge(envelope: Envelope, original: Mapping[str, Series], replay: Mapping[str, Series],
          before: int | None = None, safety: float | None = None, floor_ulps: float | None = None
          ) -> RoundingJudgement:
    """Every metric of the envelope, at every step < M (and < `before`, replay --steps) that both runs logged: the
    replay's distance from the original within the half-width there."""
    last = envelope.steps if before is None else min(envelope.steps, before)
    out = RoundingJudgement(envelope.calibration_id, envelope.members, envelope.steps, 0)
    for name, env in sorted(envelope.metrics.items()):
        if name not in original or name not in replay:
            continue  # a metric missing from one run is a divergence of its own (compare.py)
        es = np.asarray(env.steps)
        widths = env.half_widths(safety, floor_ulps)
        ov, rv = series_at(original[name], es), series_at(replay[name], es)
        judged = (es < last) & ov[0] & rv[0]
        dist = abs_distance(ov[1], rv[1])
        inside = (dist == 0) | (dist <= widths)  # equal values are inside even where the width is nan (inf values)
        bad = judged & ~inside
        n = int(judged.sum())
        out.judged_steps += n
        if n:
            out.judged[name] = n
            with np.errstate(invalid="ignore", divide="ignore"):
                ratios = np.where(dist[judged] == 0, 0.0, dist[judged] / widths[judged])
            out.widest = max(out.widest, float(np.max(ratios)))
        if bad.any():
            i = int(np.argmax(bad))
            earlier = judged.copy()
            earlier[i:] = False
            with np.errstate(invalid="ignore", divide="ignore"):
                fractions = np.where(dist[earlier] == 0, 0.0, dist[earlier] / widths[earlier])
            out.outside.append(Outside(name, int(es[i]), float(ov[1][i]), float(rv[1][i]), float(dist[i]),
                                       float(widths[i]), int(bad.sum()), n, int(earlier.sum()),
                                       float(fractions.max()) if fractions.size else 0.0))
    return out


def series_at(series: Series, steps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(logged?, value) of `series` at each of `steps` (nan where not logged)."""
    s, v = np.asarray(series[0]), np.asarray(series[1], dtype=np.float64)
    if not s.size:
        return np.zeros(steps.size, bool), np.full(steps.size, math.nan)
    idx = np.minimum(np.searchsorted(s, steps), s.size - 1)
    found = s[idx] == steps
    return found, np.where(found, v[idx], math.nan)
