"""A comparison that is not bit-identical, handed on: to a calibrated run's rounding envelope (harness/judge/rounding.py)
or to a study's run-to-run noise (harness/judge/noise.py), which may turn its verdict into another."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from harness.fmt import the
from harness.judge import carried, noise, rounding
from harness.judge.compare import Comparison, FirstSteps, user_mlflow_metrics
from harness.judge.decisive import named
from harness.judge.metricdiff import (
    KIND_FINGERPRINT,
    KIND_ROUNDING,
    KIND_VALUE,
    Divergence,
    as_series,
    compare_metric,
    up_to,
)
from harness.judge.rounding import Envelope
from harness.judge.tolerance import never_judged, tolerance_for, weights_may_differ
from harness.judge.verdicts import Policy, Verdict, meets
from harness.judge.weightdistance import Distance
from harness.rundata import RunRecord


def judge_rounding(cmp: Comparison, original: RunRecord, replay: RunRecord, envelope: Envelope,
                   weights: Distance | None = None, seeds: list[RunRecord] | None = None) -> Comparison:
    """A replay of a calibrated run that is not bit-identical, held step by step to the rounding envelope over the
    envelope's first M steps. Inside at every judged value: WITHIN_ROUNDING where the envelope covered every step
    compared, else the steps from M on are held to the envelope carried forward at the members' growth rate, as far
    as it decides (_after_envelope), and the line says which steps each envelope judged. Outside: DIVERGED at the
    first step outside, naming the metric and the envelope. `seeds`: the members of the run's study, if any.
    `weights`: the replay's weights after the M steps, their distance from the run's (both sketched); held to the
    members' distances, so weights that moved where no metric showed it are outside too.

    A failed replay, or one that logged other steps or metrics, stays as it is: rounding explains none of that.
    """
    if meets(cmp.verdict, Policy.SETTLED) or _decided(cmp, f"the rounding envelope of calibration {envelope.calibration_id}"):
        return cmp
    if cmp.divergence is not None and cmp.divergence.kind not in (KIND_VALUE, KIND_FINGERPRINT):
        return cmp
    if any(m.missing_steps or m.extra_steps or not (m.in_original and m.in_replay) for m in cmp.metrics):
        return cmp
    first_steps = cmp.reached.steps if isinstance(cmp.reached, FirstSteps) else None
    # Only what the comparison compared: a metric whose tolerance is inf is judged by nothing, and replay --steps K
    # compares no metric the script logged through MLflow at steps of its own - the envelope neither.
    compared = {m.name for m in cmp.metrics}
    orig = {k: as_series(*v) for k, v in original.metrics.items() if k in compared}
    rep = {k: as_series(*v) for k, v in replay.metrics.items() if k in compared}
    if first_steps is not None:
        orig, rep = up_to(orig, first_steps - 1), up_to(rep, first_steps - 1)
    m = envelope.steps
    blown = envelope.blown_up()
    if blown is not None:  # an envelope of inf from there would hold any replay: it holds the steps before only
        metric, m = blown
        cmp.notes.append(f"a member of calibration {envelope.calibration_id} went to NaN or inf in {metric} at step {m} "
                         f"where the run did not: rounding alone breaks this run there, so its envelope holds its first "
                         f"{m} steps only, and not the weights after step {envelope.steps}")
        if m == 0:
            return cmp
    judged = rounding.judge(envelope, orig, rep, before=m)
    judged.steps, judged.blown_up = m, blown is not None
    last = max((int(s[-1]) for s, _ in orig.values() if s.size), default=-1)
    judged.covers_run = last < m and (first_steps is None or first_steps <= m)
    if judged.judged_steps == 0:
        cmp.notes.append(f"calibration {envelope.calibration_id} holds none of the metrics both runs logged in its "
                         f"first {m} steps: not judged against its envelope")
        return cmp
    if envelope.weights_differed == 0 and not cmp.fingerprints.all_equal:
        cmp.notes.append(f"the weights of calibration {envelope.calibration_id}'s members ended equal to the "
                         "original's, so weights that differ here are not rounding's: not judged against its envelope")
        return cmp
    if weights is not None and blown is None and envelope.weights is not None and not envelope.weights.finite:
        cmp.notes.append(f"a member of calibration {envelope.calibration_id} ended step {envelope.steps} with weights "
                         "at a NaN or infinite distance from the run's: the weights are not held to its envelope")
    elif weights is not None and blown is None:
        judged.weights = rounding.judge_weights(envelope, weights.relative, weights.widest)
    cmp.rounding = judged
    outside = judged.first()
    if outside is None and judged.weights is not None and not judged.weights.inside:
        cmp.verdict = Verdict.DIVERGED
        cmp.divergence = Divergence(KIND_ROUNDING, judged.weights.step, detail=(
            f"at step {judged.weights.step}: {judged.weights.describe()}, outside {judged.describe_envelope()} "
            f"(calibration {envelope.calibration_id})"))
        return cmp
    if outside is not None:
        rel = outside.distance / abs(outside.original) if outside.original else math.inf
        detail = (f"at step {outside.step}: {outside.describe()}, outside {judged.describe_envelope()} "
                  f"(calibration {envelope.calibration_id})")
        cmp.verdict = Verdict.DIVERGED
        cmp.divergence = Divergence(KIND_ROUNDING, outside.step, outside.metric, outside.original, outside.replay,
                                    outside.distance, rel, detail)
        sudden = judged.sudden(cmp.bitwise_possible and _identical_before(orig, rep, cmp, outside.step))
        if sudden is not None:
            cmp.notes.append(sudden)
        return cmp
    if judged.covers_run:
        cmp.verdict, cmp.divergence = Verdict.WITHIN_ROUNDING, None
        return cmp
    return _after_envelope(cmp, original, replay, envelope, judged, orig, rep, m, seeds)


def _after_envelope(cmp: Comparison, original: RunRecord, replay: RunRecord, envelope: Envelope,
                    judged: rounding.RoundingJudgement, orig: dict[str, Any], rep: dict[str, Any], m: int,
                    seeds: list[RunRecord] | None) -> Comparison:
    """The steps from M on of a replay inside the envelope: each metric the envelope held, by the envelope carried
    forward at its members' growth rate (harness/judge/carried.py) up to where it meets the seeds' spread (`seeds`: a
    study's other members); the rest - a metric the members never moved, the steps the seeds judge - as without a
    calibration: metrics by the tolerance, weights by their fingerprints."""
    tolerance_from: dict[str, int] = {}
    # A member that blew up: the run is on the edge of stability there, and no growth rate carries past it.
    held_names = [] if judged.blown_up else sorted(judged.judged)
    grown_by = {name: carried.growth(envelope.metrics[name], m) for name in held_names if name in rep}
    rates = [(g.rate, name) for name, g in grown_by.items() if g is not None]
    fastest = (max(rates)[1], max(rates)[0]) if rates else None
    for name in grown_by:
        grown = grown_by[name] or carried.growth(envelope.metrics[name], m, borrow=fastest)
        if grown is None:
            continue
        spread = None
        if seeds:
            spread = carried.seeds_spread(orig[name], [as_series(*r.metrics[name]) for r in seeds
                                                      if name in r.metrics and r.run_id != original.run_id])
        held = carried.judge(name, grown, orig[name], rep[name], m, spread)
        if held is None:
            continue
        judged.carried[name] = held
        if held.seeds_from is not None:
            tolerance_from[name] = held.seeds_from
    outside = [c.outside for c in judged.carried.values() if c.outside is not None]
    if outside:
        first = min(outside, key=lambda o: (o.step, o.metric))
        rel = first.distance / abs(first.original) if first.original else math.inf
        cmp.verdict = Verdict.DIVERGED
        cmp.divergence = Divergence(KIND_ROUNDING, first.step, first.metric, first.original, first.replay,
                                    first.distance, rel, f"at step {first.step}: {first.describe()}, outside the "
                                    f"envelope carried forward from step {m - 1} at its members' growth rate "
                                    f"(calibration {envelope.calibration_id})")
        return cmp
    # Steps no carried envelope judged: by the tolerance, as without a calibration.
    after = {name: _first_outside(name, orig[name], rep[name], cmp.tolerance,
                                  tolerance_from.get(name, m) if name in judged.carried else m)
             for name in sorted(orig) if name in rep and (name not in judged.carried or name in tolerance_from)}
    judged.after = {name: None if d is None else d.step for name, d in after.items() if name in judged.judged}
    rest = [d for d in after.values() if d is not None]
    fps = cmp.fingerprints
    late_fp = fps.first_mismatch_step is not None and fps.first_mismatch_step >= m or fps.final_equal is False
    # Weights that differ after M are what every member's did, where the carried envelopes held all the metrics.
    weights_held = bool(judged.carried) and envelope.weights_differed > 0
    if rest:
        cmp.verdict, cmp.divergence = Verdict.DIVERGED, min(rest, key=lambda d: (d.step, d.metric or ""))
    elif late_fp and not weights_may_differ(cmp.tolerance) and not weights_held:
        cmp.verdict = Verdict.DIVERGED
        cmp.divergence = Divergence(KIND_FINGERPRINT, None, detail=(
            f"the weights after the first {m} steps differ (final {(original.final_fingerprint or 'none')[:12]} vs "
            f"{(replay.final_fingerprint or 'none')[:12]}); --tolerance weights=any would let the metrics decide"))
    elif (undecided := judged.undecided()) is not None:
        # Beyond the ceiling, inside the carried width: rounding's growth and a change both fit.
        cmp.verdict = Verdict.INCONCLUSIVE
        cmp.divergence = Divergence(KIND_ROUNDING, undecided.step, undecided.metric, undecided.original,
                                    undecided.replay, undecided.distance,
                                    undecided.distance / abs(undecided.original) if undecided.original else math.inf,
                                    f"at step {undecided.step}: {undecided.describe()}")
    else:
        tol_names = [n for n in after if n in orig]
        exact = all(_bitwise_from(orig[n], rep[n], tolerance_from.get(n, m)) for n in tol_names)
        exact = exact and (not late_fp or weights_held)
        cmp.verdict, cmp.divergence = (Verdict.WITHIN_ROUNDING if exact else Verdict.WITHIN_TOLERANCE), None
    return cmp


def _decided(cmp: Comparison, judge: str) -> bool:
    """Whether a value neither rounding nor a seed moves already decided the verdict (compare_runs: decisive.py), so
    `judge` (an envelope, a study's noise) is not consulted; the notes say so."""
    d = cmp.divergence
    if d is None or not d.decisive:
        return False
    cmp.notes.append(f"{named(d)} differs at step {d.step}: a value neither rounding nor a seed moves decides the "
                     f"verdict; not judged against {judge}")
    return True


def _from(series: tuple[np.ndarray, np.ndarray], first: int) -> tuple[np.ndarray, np.ndarray]:
    s, v = series
    return s[s >= first], v[s >= first]


def _first_outside(name: str, a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray],
                   tol: Mapping[str, Any], first: int) -> Divergence | None:
    """The first value at a step >= `first` outside the tolerance (the steps after a rounding envelope)."""
    rtol, atol = tolerance_for(tol, name)
    _, div = compare_metric(name, *_from(a, first), *_from(b, first), rtol, atol, (False, False))
    return div


def _identical_before(orig: Mapping[str, tuple[np.ndarray, np.ndarray]], rep: Mapping[str, tuple[np.ndarray, np.ndarray]],
                      cmp: Comparison, step: int) -> bool:
    """Every value both runs logged before `step`, and every fingerprint taken before it, bit-identical."""
    fps = cmp.fingerprints
    if fps.first_mismatch_step is not None and fps.first_mismatch_step < step:
        return False
    for name in orig:
        if name not in rep:
            return False
        (sa, va), (sb, vb) = orig[name], rep[name]
        a, b = (sa[sa < step], va[sa < step]), (sb[sb < step], vb[sb < step])
        if not (np.array_equal(a[0], b[0]) and np.array_equal(a[1].view(np.int64), b[1].view(np.int64))):
            return False
    return True


def _bitwise_from(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray], first: int) -> bool:
    sa, va = _from(a, first)
    sb, vb = _from(b, first)
    return bool(np.array_equal(sa, sb) and np.array_equal(va.view(np.int64), vb.view(np.int64)))


def judge_noise(cmp: Comparison, original: RunRecord, replay: RunRecord, study_id: str,
                members: list[RunRecord]) -> Comparison:
    """A DIVERGED replay of a study member, where bitwise was never possible, judged against the seeds' spread.

    Only a difference in values can be noise: a replay that failed, or logged other steps or metrics,
    stays DIVERGED. Neither can a difference where nothing changed (same environment, same config): that
    is nondeterminism or a code change, which a new seed would not explain.
    """
    if _decided(cmp, f"the noise of study {study_id}"):
        return cmp
    if cmp.verdict != Verdict.DIVERGED or cmp.divergence is None or cmp.divergence.kind not in (KIND_VALUE, KIND_FINGERPRINT):
        return cmp  # (a replay outside a calibration's rounding envelope is KIND_ROUNDING: no seed explains it)
    if any(m.missing_steps or m.extra_steps or not (m.in_original and m.in_replay) for m in cmp.metrics):
        return cmp
    if cmp.bitwise_possible and not any(c.affects_result for c in cmp.config_delta):
        cmp.notes.append(f"{the(cmp.labels[1])} ran in the same environment with the same config, so its "
                         f"difference is not judged against the noise of study {study_id}: a new seed does not "
                         "explain it (nondeterminism or a code change does)")
        return cmp
    # The curves by CURVE_POINTS segment means and their last value, not the final values alone: a change that shows
    # early (a learning rate) stands out before the seeds' spread grows (benchmarks/verdict_bench.py measures both).
    # replay --steps K: every run's curve (the members' too) before step K only, the last point step K-1's value.
    before = cmp.reached.steps if isinstance(cmp.reached, FirstSteps) else None
    skip = user_mlflow_metrics(original, replay) if before is not None else set()  # not at training steps (above)

    def curves(rec: RunRecord) -> dict[str, Any]:  # a metric whose tolerance is inf: not judged by the seeds either
        return {k: v for k, v in rec.metrics.items() if k not in skip and not never_judged(cmp.tolerance, k)}

    cmp.noise = noise.judge_curves(study_id, curves(replay), curves(original), [curves(m) for m in members],
                                   before=before)
    if cmp.noise.within:
        cmp.verdict = Verdict.INCONCLUSIVE if cmp.noise.vacuous else Verdict.WITHIN_NOISE
    return cmp
