"""The tolerance a replay's metrics are held to: the recorded config's, `--tolerance` overrides, and each metric's."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from harness import tags
from harness.errors import UsageError
from harness.rundata import RunRecord

# `--tolerance weights=any` (or replay.tolerance.weights: any): the parameters may differ where every metric stays
# within its tolerance. A fingerprint is a digest, so weights are either held exact or left to the metrics.
WEIGHTS = "weights"
WEIGHTS_EXACT, WEIGHTS_ANY = "exact", "any"


def default_tolerance(config: Mapping[str, Any] | None) -> dict[str, Any]:
    """config["replay"]["tolerance"], or zero tolerance when the config has none."""
    tol = ((config or {}).get("replay") or {}).get("tolerance")
    if not tol:
        return {"default": {"rtol": 0.0, "atol": 0.0}, "metrics": {}, WEIGHTS: WEIGHTS_EXACT}
    return {"default": dict(tol.get("default") or {}), "metrics": {k: dict(v) for k, v in (tol.get("metrics") or {}).items()},
            WEIGHTS: str(tol.get(WEIGHTS) or WEIGHTS_EXACT)}


def weights_may_differ(tolerance: Mapping[str, Any]) -> bool:
    """Whether the tolerance explicitly lets the parameters differ (else differing fingerprints are DIVERGED)."""
    return tolerance.get(WEIGHTS) == WEIGHTS_ANY


def parse_tolerances(specs: list[str] | tuple[str, ...] | None) -> dict[str, Any]:
    """--tolerance METRIC=ATOL[,RTOL] (repeatable) as {metric: {"atol": ..., "rtol": ...}}; RTOL defaults to 0.
    `METRIC=inf` leaves the metric unjudged (never_judged); `weights=any` / `weights=exact` sets how the parameters
    are held (entry WEIGHTS: "any" or "exact")."""
    out: dict[str, Any] = {}
    for spec in specs or ():
        metric, sep, value = spec.partition("=")
        metric = metric.strip()
        if metric == WEIGHTS:
            if value.strip() not in (WEIGHTS_ANY, WEIGHTS_EXACT) or WEIGHTS in out:
                raise UsageError(f"--tolerance {spec!r}: weights take 'any' (the metrics decide, the parameters may "
                                   "differ) or 'exact', once. Pass --tolerance weights=any.")
            out[WEIGHTS] = value.strip()
            continue
        parts = value.split(",") if sep else []
        try:
            numbers = [float(x) for x in parts]
        except ValueError:
            numbers = []
        if any(math.isnan(x) for x in numbers):
            # Every comparison with NaN is false: such a tolerance would hold nothing, or refuse everything.
            raise UsageError(f"--tolerance {spec!r}: nan is no tolerance. Pass {metric or 'METRIC'}=inf to leave "
                               "the metric unjudged, or finite numbers >= 0.")
        if not metric or not 1 <= len(numbers) <= 2 or not all(x >= 0 for x in numbers):
            raise UsageError(f"--tolerance {spec!r} is not METRIC=ATOL[,RTOL] with numbers >= 0 (or METRIC=inf). "
                               "Pass e.g. --tolerance loss=1e-6, --tolerance loss=1e-6,1e-4 or --tolerance mfu=inf.")
        if metric in out:
            raise UsageError(f"--tolerance gives metric '{metric}' twice. Pass it once.")
        out[metric] = {"atol": numbers[0], "rtol": numbers[1] if len(numbers) == 2 else 0.0}
    return out


def format_tolerances(given: Mapping[str, Any]) -> str:
    """The inverse of parse_tolerances, as recorded in the tag harness.replay.tolerance: `loss=0.01,0.0 mfu=inf`."""
    def one(m: str, t: Any) -> str:
        if m == WEIGHTS:
            return f"{m}={t}"
        return f"{m}=inf" if _infinite(t) else f"{m}={float(t['atol'])!r},{float(t['rtol'])!r}"

    return " ".join(one(m, t) for m, t in sorted(given.items()))


def _infinite(entry: Mapping[str, Any]) -> bool:
    return math.isinf(float(entry.get("atol", 0.0))) or math.isinf(float(entry.get("rtol", 0.0)))


def never_judged(tolerance: Mapping[str, Any], metric: str) -> bool:
    """A metric whose own tolerance is infinite (`--tolerance METRIC=inf`, or replay.tolerance.metrics.METRIC with an
    atol or rtol of .inf): any value would pass, so it is left out of the judgement altogether - a difference in it
    makes no verdict WITHIN_TOLERANCE. An infinite default tolerance judges every metric as before (within it)."""
    entry = (tolerance.get("metrics") or {}).get(metric)
    return entry is not None and _infinite(entry)


def judged_tolerance(
    original: RunRecord, replay: RunRecord, given: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The tolerance a judgement uses - the one rule for `harness replay` and `harness compare`.

    Run A's recorded replay.tolerance. When run B is a replay of A, B's own config instead (an
    `--allow-changes replay.tolerance...` override is what the replay asked to be judged by) and the
    --tolerance it was given (its tag), so comparing the two later gives the replay's verdict again.
    Then `given` (this judgement's --tolerance) per metric on top. The per-metric overrides taken from
    --tolerance are kept under "given", for the report.
    """
    of_replay = replay.facts.get(tags.REPLAY_OF) == original.run_id
    tol = default_tolerance(replay.config if of_replay and replay.config else original.config)
    recorded = replay.facts.get(tags.TOLERANCE) if of_replay else None
    layered = {**parse_tolerances(recorded.split() if recorded else []), **(given or {})}
    if WEIGHTS in layered:
        tol[WEIGHTS] = layered[WEIGHTS]
    tol["metrics"].update({m: dict(t) for m, t in layered.items() if m != WEIGHTS})
    if layered:
        tol["given"] = {m: t if m == WEIGHTS else dict(t) for m, t in layered.items()}
    return tol


def _tol_pair(entry: Mapping[str, Any] | None, where: str) -> tuple[float, float]:
    entry = entry or {}
    rtol, atol = float(entry.get("rtol", 0.0)), float(entry.get("atol", 0.0))
    if not (rtol >= 0 and atol >= 0):  # also rejects NaN
        raise ValueError(f"tolerance {where}: rtol and atol must be >= 0, got rtol={rtol}, atol={atol}")
    return rtol, atol


def tolerance_for(tolerance: Mapping[str, Any], metric: str) -> tuple[float, float]:
    """(rtol, atol) for `metric`: its own entry under `metrics`, else the `default` one (0, 0 where neither)."""
    per_metric = tolerance.get("metrics") or {}
    if metric in per_metric:
        return _tol_pair(per_metric[metric], f"'{metric}'")
    return _tol_pair(tolerance.get("default"), "default")
