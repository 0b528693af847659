"""A comparison as lines of terminal text: what `harness replay` and `harness compare` print before the verdict.

The one rendering of a Comparison for the terminal; report.py renders the same comparison as Markdown
and shares its pieces (the tolerances given, the verdict's summary, where the weights parted).
"""

from __future__ import annotations

import math
from typing import Any

from harness.fmt import the
from harness.judge.compare import Comparison
from harness.judge.decisive import named
from harness.judge.delta import summarized
from harness.judge.metricdiff import (
    KIND_EXTRA_METRIC,
    KIND_EXTRA_STEP,
    KIND_MISSING_METRIC,
    KIND_MISSING_STEP,
    MetricStats,
)
from harness.judge.tolerance import WEIGHTS, weights_may_differ
from harness.judge.verdicts import Verdict


def first_divergence(m: MetricStats, labels: tuple[str, str]) -> str:
    """Where a metric first parts: "7", or "step 3 logged only by run B" where only one run logged that step."""
    if m.first_divergence is None:
        return "-"
    where = f"{m.counts or 'step'} {m.first_divergence}"
    if m.first_divergence_kind in (KIND_MISSING_STEP, KIND_MISSING_METRIC):
        return f"{where} logged only by {the(labels[0])}"
    if m.first_divergence_kind in (KIND_EXTRA_STEP, KIND_EXTRA_METRIC):
        return f"{where} logged only by {the(labels[1])}"
    return f"{m.counts} {m.first_divergence}" if m.counts else str(m.first_divergence)


def one_run(m: MetricStats) -> bool:
    """Whether the metric first parts at a step (or is a metric) that only one of the runs logged."""
    return m.first_divergence_kind in (KIND_MISSING_STEP, KIND_MISSING_METRIC, KIND_EXTRA_STEP, KIND_EXTRA_METRIC)


def given_tolerances(cmp: Comparison) -> list[tuple[str, float, float]]:
    """(metric, atol, rtol) of each --tolerance given over the recorded replay.tolerance, by metric."""
    given = cmp.tolerance.get("given") or {}
    return [(m, t["atol"], t["rtol"]) for m, t in sorted(given.items()) if m != WEIGHTS]


def weights_line(cmp: Comparison) -> str | None:
    """How the parameters were held, when the tolerance lets them differ (the default, exact, goes unsaid)."""
    if not weights_may_differ(cmp.tolerance):
        return None
    return "weights=any: the parameters may differ where every metric stays within its tolerance"


def judged_by(cmp: Comparison) -> str:
    """What judged a verdict that is not bit for bit, as "judged by ..." or "decided by ...": a value neither rounding
    nor a seed moves, a calibration's envelope (over its steps, then what judged the rest), a study's noise, or the
    tolerance."""
    d = cmp.divergence
    if d is not None and d.decisive:
        return f"decided by {named(d)} at step {d.step}, a value neither rounding nor a seed moves"
    noise = cmp.noise if cmp.noise is not None and not cmp.noise.reason else None
    seeds = None if noise is None else f"the noise of study {noise.study_id}'s {noise.seeds} seeds"
    r = cmp.rounding
    if r is None:
        return f"judged by {seeds or 'tolerance'}"
    envelope = f"the rounding envelope of calibration {r.calibration_id}"
    if r.within and r.carried:
        rest = f", and {seeds or 'the tolerance'} for the rest" if r.after else ""
        return (f"judged by {envelope} over the first {r.steps} steps, then by it carried forward at its members' "
                f"growth rate{rest}")
    if r.within and not r.covers_run:
        return f"judged by {envelope} over the first {r.steps} steps, then {seeds or 'the tolerance'}"
    return f"judged by {envelope}"


def bitwise_line(cmp: Comparison) -> str | None:
    """The environment changes that usually rule out bitwise: bitwise despite them, or what judged instead."""
    if cmp.bitwise_possible:
        return None
    if cmp.verdict == Verdict.BITWISE:
        return "Bitwise despite environment changes that usually alter the arithmetic: " + "; ".join(cmp.bitwise_blockers)
    return f"A bitwise match is impossible ({judged_by(cmp)}): " + "; ".join(cmp.bitwise_blockers)


def envelope_first(m: MetricStats, cmp: Comparison) -> str | None:
    """Where a metric held to a calibration's envelope first parted, as the envelope saw it (and, after its steps, the
    tolerance), with the first difference beside it; None for a metric the envelope did not judge."""
    r = cmp.rounding
    if r is None or m.name not in r.judged:
        return None
    outside = next((o for o in r.outside if o.metric == m.name), None)
    if outside is not None:
        seen = f"first outside the rounding envelope at step {outside.step}"
    else:
        seen = f"inside the rounding envelope at its {r.judged[m.name]} judged steps"
        held = r.carried.get(m.name)
        if held is not None and held.judged:
            gone = held.outside or held.undecided
            seen += (f", the envelope carried forward at its {held.judged} steps after them" if gone is None else
                     f", first {'outside' if held.outside else 'beyond the ceiling of'} the envelope carried forward "
                     f"at step {gone.step}")
        if m.name in r.after:
            step = r.after[m.name]
            seen += (f", within its tolerance from step {r.steps} on" if step is None
                     else f", first outside its tolerance at step {step}")
    if m.first_divergence is None:
        return seen
    plain = "first differs at" if not (m.atol or m.rtol) else "its tolerance alone: first outside at"
    return f"{seen} ({plain} step {m.first_divergence})"


def comparison_lines(cmp: Comparison, changes: list[str]) -> list[str]:
    """What was changed and allowed, the config and environment deltas, each metric's diffs, where the weights parted."""
    out: list[str] = []
    if changes:
        out.append("Changes requested: " + ", ".join(changes))
    given = given_tolerances(cmp)
    if given:
        out.append("Tolerance given (--tolerance, over the recorded replay.tolerance): "
                   + ", ".join(f"{m} never judged (inf)" if math.isinf(atol) or math.isinf(rtol)
                               else f"{m} atol {atol:g} rtol {rtol:g}" for m, atol, rtol in given))
    weights = weights_line(cmp)
    if weights:
        out.append("Tolerance: " + weights)
    bitwise = bitwise_line(cmp)
    if bitwise:
        out.append(bitwise)
    out += [f"Note: {note}" for note in cmp.notes]
    arrow = " -> ".join(cmp.labels)
    if cmp.config_delta:
        out.append(f"Config delta ({arrow}):")
        out += [f"   {c.key}: {c.a} -> {c.b}" + ("" if c.affects_result else "  (does not affect the result)")
                for c in cmp.config_delta]
    else:
        out.append("Config delta: none")
    if cmp.delta:
        out.append(f"Environment delta ({arrow}):")
        out += [f" {'!' if d.breaks_bitwise else ' '} {d.name}: {d.a} -> {d.b}" + (f"  ({d.note})" if d.note else "")
                for d in summarized(cmp.delta, cmp.labels)]
    elif cmp.config_delta:
        # The runs do differ: "none" alone would read as "nothing changed".
        out.append(f"Environment delta ({arrow}): none besides the config delta above")
    else:
        out.append("Environment delta: none")
    for m in cmp.metrics:
        first = first_divergence(m, cmp.labels)
        if m.steps_apart is not None:
            where = ", ".join(f"{the(label)} " + ("not at all" if steps == "none" else
                                                   f"at step{'' if steps.isdigit() else 's'} {steps}")
                              for label, steps in zip(cmp.labels, m.steps_apart, strict=True))
            out.append(f"  {m.name}: no common step: logged by {where}; {first}")
            continue
        held = None if one_run(m) else envelope_first(m, cmp)
        if held is not None:
            first = held  # the envelope decided: what it saw, not the tolerance's first divergence
        elif not one_run(m):
            first = f"first divergence {first}"
        undetermined = " (not determined by the training)" if m.name in cmp.undetermined else ""
        out.append(f"  {m.name}: {m.steps_compared} {m.unit}, max abs diff {m.max_abs_diff:.3g}, "
                   f"max rel diff {m.max_rel_diff:.3g}, {first}{undetermined}"
                   + (f", tolerance atol {m.atol:g} rtol {m.rtol:g}" if m.atol or m.rtol else ""))
    if cmp.data_order is not None:
        out.append(cmp.data_order.describe(cmp.labels))  # a data-pipeline change, told from a numerical one
    out += cmp.checkpoint_lines()  # where the weights parted, just above the verdict
    speed = cmp.speed.line() if cmp.speed is not None else None
    if speed:
        out.append(speed)  # beside the verdict, never in it: wall clock differs from run to run
    return out


def verdict_line(cmp: Comparison) -> str:
    return f"verdict: {cmp.summary()}"


def study_replay_lines(result: Any) -> list[str]:
    """A study replay (replay.StudyReplayResult): each member's verdict, the equivalence tests, the verdict."""
    out = [f"seed {r.original.tags.get('harness.seed')}: {r.judged.summary()}  (replay {r.outcome.run_id})"
           for r in result.members]
    out += [f"  {t.describe()}" for t in result.equivalence]
    out.append(f"verdict: {result.summary()}")
    return out
