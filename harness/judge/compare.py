"""Judge a replay against its original run: per-metric comparison, fingerprints, the verdict.

What differs between the runs (and whether it rules out bitwise) is harness/judge/delta.py; the run-to-run
noise a cross-hardware replay is judged against is harness/judge/noise.py.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from harness import tags
from harness.errors import UsageError
from harness.fmt import fmt_pair, fmt_short, json_safe, step_list, the
from harness.judge import noise, rounding
from harness.judge.dataorder import DataOrderDiff, diff_data_order
from harness.judge.delta import ConfigChange, FactDelta, config_delta, environment_delta
from harness.judge.noise import NoiseJudgement
from harness.judge.perf import SpeedDelta, speed_delta
from harness.judge.rounding import Envelope, RoundingJudgement
from harness.judge.tensordiff import CheckpointDiff, diff_checkpoints
from harness.judge.verdicts import Policy, Verdict, exit_code, meets, verdicts
from harness.records import RunRecord, own_metric

# The verdicts, by their names here too (harness/judge/verdicts.py holds them, their exit codes and policies).
BITWISE = Verdict.BITWISE
WITHIN_ROUNDING = Verdict.WITHIN_ROUNDING
WITHIN_TOLERANCE = Verdict.WITHIN_TOLERANCE
WITHIN_NOISE = Verdict.WITHIN_NOISE
DIVERGED = Verdict.DIVERGED
INCONCLUSIVE = Verdict.INCONCLUSIVE
NOTHING_TO_COMPARE = Verdict.NOTHING_TO_COMPARE
VERDICTS = tuple(Verdict)
REPRODUCED = verdicts(Policy.REPRODUCED)  # exit 0

# Divergence kinds.
KIND_VALUE = "value"  # a metric left its tolerance at a step both runs logged
KIND_MISSING_STEP = "missing_step"  # the original logged the step, the replay did not
KIND_EXTRA_STEP = "extra_step"  # the replay logged a step the original did not
KIND_MISSING_METRIC = "missing_metric"  # the metric exists in the original only
KIND_EXTRA_METRIC = "extra_metric"  # the metric exists in the replay only
KIND_FINGERPRINT = "fingerprint"
KIND_REPLAY_FAILED = "replay_failed"
KIND_ROUNDING = "rounding"  # a metric left a calibrated run's rounding envelope (rounding.py)


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



@dataclass
class FingerprintStats:
    """Parameter fingerprints over the union of fingerprinted steps, plus the final one."""

    compared: int = 0
    equal: int = 0
    first_mismatch_step: int | None = None
    final_equal: bool | None = None  # None when neither run has a final fingerprint

    @property
    def all_equal(self) -> bool:
        return self.compared == self.equal



@dataclass
class Reached:
    """How far an incomplete (FAILED or KILLED) original got: only these steps were judged."""

    status: str
    steps: int


@dataclass
class FirstSteps(Reached):
    """replay --steps K: the replay stopped on purpose after the first `steps` of the original's `of` steps; only
    those were judged (the same cut as an incomplete original's, for another reason)."""

    of: int = 0

    def clause(self) -> str:
        return f"over the first {self.steps} of {self.of} steps"


# What run B is to run A in a comparison (its JSON's "relation").
RELATION_REPLAY = "replay"
RELATION_INDEPENDENT = "independent"


@dataclass
class Comparison:
    """The verdict on a replay and the evidence behind it."""

    verdict: str
    run_a: str  # the reference (the original, when run B is a replay of it)
    run_b: str  # judged against run A
    delta: list[FactDelta]
    bitwise_possible: bool
    bitwise_blockers: list[str]
    metrics: list[MetricStats]
    fingerprints: FingerprintStats
    divergence: Divergence | None
    tolerance: dict[str, Any] = field(default_factory=dict)
    config_delta: list[ConfigChange] = field(default_factory=list)
    of_replay: bool = True  # run B is a replay of run A (else two independent runs)
    weights_unchanged_in: list[str] = field(default_factory=list)  # labels of runs that trained nothing
    reached: Reached | None = None  # an incomplete original, judged up to where it stopped (FirstSteps: replay --steps)
    failed_alike: bool = False  # the replay of an incomplete original failed with the original's own reason
    notes: list[str] = field(default_factory=list)
    noise: NoiseJudgement | None = None  # set when a difference was judged against a study's spread
    checkpoints: CheckpointDiff | None = None  # checkpoint tensors compared; None when neither run checkpointed
    data_order: DataOrderDiff | None = None  # the samples each step drew, compared; None when neither recorded them
    rounding: RoundingJudgement | None = None  # the first steps held to a calibration's envelope (judge_rounding)
    # The two runs' speed, shown beside the verdict and never read by it (harness/judge/perf.py).
    speed: SpeedDelta | None = None

    @property
    def exit_code(self) -> int:
        return exit_code(self.verdict)

    @property
    def labels(self) -> tuple[str, str]:
        return ("original", "replay") if self.of_replay else ("run A", "run B")

    def summary(self) -> str:
        """The verdict in one line, with what limits it (an incomplete original, weights that never changed)."""
        line = self._verdict_line()
        if self.rounding is not None and self.rounding.within and self.verdict != WITHIN_ROUNDING:
            # The envelope held over its steps; what came after decided (the tolerance, or the seeds' noise).
            by = "the seeds' noise" if self.noise is not None else "the tolerance"
            line += (f"; the first {self.rounding.steps} steps inside {self.rounding.describe_envelope()}, "
                     f"the steps after them judged by {by}")
        if isinstance(self.reached, FirstSteps):
            line = self._early_line(line, self.reached)
        elif self.reached is not None:
            alike = "; the replay failed the same way" if self.failed_alike else ""
            line += f" (compared the {self.reached.steps} steps the {self.reached.status} original reached{alike})"
        code = [m for m in self.metrics if not own_metric(m.name)]
        if meets(self.verdict, Policy.REPRODUCED) and code and all(m.evaluation for m in code):
            line += f"; {_evaluation_only(code, [m.name for m in self.metrics if own_metric(m.name)])}"
        if len(self.weights_unchanged_in) == 2:
            line += " - but the model's weights never changed: nothing was trained"
        elif self.weights_unchanged_in:
            line += f" - but {the(self.weights_unchanged_in[0])}'s model weights never changed: nothing was trained in it"
        return line

    def _early_line(self, line: str, reached: FirstSteps) -> str:
        """replay --steps K: the verdict names the steps it covers, and whether the weights were held to anything."""
        head = f"{self.verdict}:"
        line = (f"{self.verdict} {reached.clause()}:{line[len(head):]}" if line.startswith(head)
                else f"{line} ({reached.clause()})")
        if self.verdict == DIVERGED:
            return line
        if self.fingerprints.final_equal is None:
            return (f"{line}; weights after step {reached.steps} not compared: the original has no checkpoint "
                    f"fingerprint of step {reached.steps}")
        return f"{line}, including the weights after step {reached.steps} (the original's checkpoint of that step)"

    def checkpoint_lines(self) -> list[str]:
        """Where the weights parted, for the verdict output: said on a divergence, or whenever tensors differ."""
        ck = self.checkpoints
        if ck is None or (self.verdict != DIVERGED and ck.first_diff_step is None and not ck.desynced_ranks):
            return []
        lines = [ck.describe(self.labels)]
        for label, steps in ck.desynced_ranks.items():
            step, ranks = next(iter(steps.items()))
            lines.append(f"checkpoint tensors: in {the(label)}, rank{'s' if len(ranks) > 1 else ''} "
                         f"{', '.join(map(str, ranks))} held other tensors than rank 0 at step {step}")
        return lines

    def _verdict_line(self) -> str:
        if self.verdict == NOTHING_TO_COMPARE:
            return (f"{NOTHING_TO_COMPARE}: there was nothing to compare (no metrics, no fingerprints): "
                    "log metrics with ctx.log and register the model with ctx.ddp")
        if self.verdict == WITHIN_ROUNDING and self.rounding is not None:
            # The training code's metrics: harness's learning rate is the recorded one, bit for bit, or this is no
            # rounding.
            mine = [m for m in self.metrics if not own_metric(m.name)] or self.metrics
            shape, apart = _shape(mine), [m.name for m in mine if not m.bitwise_equal]
            # Say which values differed: the weights can part while every logged value is still bit-identical.
            if len(apart) == len(mine):
                what = f"{shape} not bit-identical"
            elif apart:
                listed = ", ".join(apart[:3]) + (f" and {len(apart) - 3} more" if len(apart) > 3 else "")
                what = f"{listed} not bit-identical ({len(apart)} of {shape})"
            else:
                what = f"{shape} bit-identical, the weights not"
            n = len(self.bitwise_blockers)
            why = f"bitwise impossible ({_changes(n)})" if n else "in the same environment (the machine's own run-to-run variation)"
            return (f"{WITHIN_ROUNDING}: {what}, {self.rounding.headline()}; {why}; "
                    f"the weights differ as the calibration's members' did")
        if self.verdict == INCONCLUSIVE and self.noise is not None and self.noise.power is not None:
            return (f"{INCONCLUSIVE}: inside the noise of {self.noise.seeds} seeds, but {self.noise.power.describe()}; "
                    f"first outside the tolerance {self.divergence.describe(self.labels) if self.divergence else 'nowhere'}")
        if self.verdict == WITHIN_NOISE and self.noise is not None:
            n = len(self.bitwise_blockers)
            why = f"bitwise impossible ({_changes(n)})" if n else "the config changed"
            return (f"{WITHIN_NOISE}: {self.noise.headline()}; {why}, first outside the tolerance "
                    f"{self.divergence.describe(self.labels) if self.divergence else 'nowhere'}")
        if self.verdict == DIVERGED and self.divergence is not None:
            if self.divergence.kind == KIND_REPLAY_FAILED:
                return f"{DIVERGED}: {self.divergence.describe(self.labels)}"
            line = f"{DIVERGED} {self.divergence.describe(self.labels)}"
            return line if self.noise is None else f"{line}; {self.noise.headline()}"
        shape = _shape(self.metrics)
        fps = self.fingerprints
        if self.verdict == BITWISE:
            line = f"{BITWISE}: {shape} bit-identical, {fps.compared} fingerprint{'' if fps.compared == 1 else 's'} equal"
            if self.bitwise_blockers:
                names = [d.name for d in self.delta if d.breaks_bitwise]
                line += f"; bitwise despite {_changes(len(names))}: {', '.join(names)}"
            return line
        if all(m.bitwise_equal for m in self.metrics):
            body = f"{shape} bit-identical"
        else:
            worst = max(self.metrics, key=lambda m: _sort_key(m.max_abs_diff))
            body = f"{shape} within tolerance, max abs diff {fmt_short(worst.max_abs_diff)} ({worst.name})"
        line = f"{self.verdict}: {body}, {fps.equal}/{fps.compared} fingerprints equal"
        if not fps.all_equal:
            line += " (weights may differ: weights=any)"
        if not self.bitwise_possible:
            line += f"; bitwise impossible ({_changes(len(self.bitwise_blockers))})"
        return line

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable; inf and nan become the strings "inf", "-inf" and "nan". `run_a` is the reference and
        `relation` says what `run_b` is to it: "replay" (a replay of it) or "independent" (two runs compared)."""
        return json_safe({"verdict": self.verdict, "summary": self.summary(), "exit_code": self.exit_code,
                          "relation": RELATION_REPLAY if self.of_replay else RELATION_INDEPENDENT, **asdict(self)})


# ---------------------------------------------------------------------------------------------
# Metrics


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
    `weights=any` / `weights=exact` sets how the parameters are held (entry WEIGHTS: "any" or "exact")."""
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
        if not metric or not 1 <= len(numbers) <= 2 or not all(math.isfinite(x) and x >= 0 for x in numbers):
            raise UsageError(f"--tolerance {spec!r} is not METRIC=ATOL[,RTOL] with finite numbers >= 0. "
                               "Pass e.g. --tolerance loss=1e-6 or --tolerance loss=1e-6,1e-4.")
        if metric in out:
            raise UsageError(f"--tolerance gives metric '{metric}' twice. Pass it once.")
        out[metric] = {"atol": numbers[0], "rtol": numbers[1] if len(numbers) == 2 else 0.0}
    return out


def format_tolerances(given: Mapping[str, Any]) -> str:
    """The inverse of parse_tolerances, as recorded in the tag harness.replay.tolerance: `loss=0.01,0.0 acc=...`."""
    return " ".join(f"{m}={t}" if m == WEIGHTS else f"{m}={float(t['atol'])!r},{float(t['rtol'])!r}"
                    for m, t in sorted(given.items()))


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


def _tolerance_for(tolerance: Mapping[str, Any], metric: str) -> tuple[float, float]:
    per_metric = tolerance.get("metrics") or {}
    if metric in per_metric:
        return _tol_pair(per_metric[metric], f"'{metric}'")
    return _tol_pair(tolerance.get("default"), "default")


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


def _metric_only_in_one(name: str, steps: np.ndarray, values: np.ndarray, in_original: bool,
                        rtol: float, atol: float) -> tuple[MetricStats, Divergence]:
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


def _compare_metric(name: str, sa: np.ndarray, va: np.ndarray, sb: np.ndarray, vb: np.ndarray,
                    rtol: float, atol: float, clamped: tuple[bool, bool] = (False, False)) -> tuple[MetricStats, Divergence | None]:
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


def _compare_fingerprints(original: RunRecord, replay: RunRecord, incomplete: bool = False,
                          first: int | None = None) -> FingerprintStats:
    """`first` (replay --steps K): only the fingerprints of steps < K, and the replay's last weights (after K steps)
    held to the original's checkpoint of step K where one is recorded - the original's final weights are not K's."""
    fa, fb = original.fingerprints, replay.fingerprints
    if incomplete:
        # Only the steps the original reached; it has no final fingerprint to hold the replay to.
        last = max(fa, default=-1)
        fb = {k: v for k, v in fb.items() if k <= last}
    elif first is not None:
        fa, fb = _upto(fa, first - 1), _upto(fb, first - 1)
    stats = FingerprintStats()
    for step in sorted(fa.keys() | fb.keys()):
        stats.compared += 1
        # A step fingerprinted by one run only is a mismatch: it cannot be shown equal.
        if fa.get(step) is not None and fa.get(step) == fb.get(step):
            stats.equal += 1
        elif stats.first_mismatch_step is None:
            stats.first_mismatch_step = int(step)
    if first is not None:
        held = original.checkpoints.get(first)
        if held is not None:
            stats.compared += 1
            stats.final_equal = held == replay.final_fingerprint
            stats.equal += int(stats.final_equal)
    elif not incomplete and (original.final_fingerprint is not None or replay.final_fingerprint is not None):
        stats.compared += 1
        stats.final_equal = original.final_fingerprint == replay.final_fingerprint
        stats.equal += int(stats.final_equal)
    return stats


def _upto(series: dict[Any, Any], last: int) -> dict[Any, Any]:
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


def evaluation_keys(*records: RunRecord) -> dict[str, str]:
    """The metric keys the runs' evaluations logged (tags.EVALUATION_METRICS): key -> what its steps count."""
    out: dict[str, str] = {}
    for record in records:
        try:
            keys = json.loads(record.facts.get(tags.EVALUATION_METRICS) or "{}")
        except ValueError:  # cut at MLflow's tag length: the keys are not known
            continue
        out.update({str(k): str(v) for k, v in keys.items() if str(k) not in out})
    return out


def _without(series: dict[str, Any], keys: Mapping[str, str]) -> dict[str, Any]:
    return {k: v for k, v in series.items() if k not in keys}


def _only(series: dict[str, Any], keys: Mapping[str, str]) -> dict[str, Any]:
    return {k: v for k, v in series.items() if k in keys}


def _as_far(series: dict[str, Any], other: dict[str, Any], keys: Mapping[str, str]) -> dict[str, Any]:
    """Each of `keys` (indexes of their own) in `series` as far as `other` logged it: `other` is the run that stopped
    early, so what it lacks is what came after, not a difference."""
    out = {}
    for key in keys:
        if key in series and key in other:
            s, v = series[key]
            last = other[key][0][-1]
            if s.size and s[0] <= last:
                out[key] = (s[s <= last], v[s <= last])
    return out


def user_mlflow_metrics(*records: RunRecord) -> set[str]:
    """The keys the training code logged through MLflow itself, in any of `records`."""
    return {k for rec in records for k in rec.facts.get(tags.USER_MLFLOW_METRICS, "").split(",") if k}


def original_steps(original: RunRecord) -> int:
    """How many training steps the original took: its recorded count, else one past the last step it logged at."""
    if original.steps_total is not None:
        return int(original.steps_total)
    return max((int(np.max(s)) + 1 for s, _ in original.metrics.values() if np.size(s)), default=0)


def judged_again(a: RunRecord, b: RunRecord) -> Comparison:
    """Replay `b` of run `a`, judged again from the two records alone, as replay judged it: its tolerance, its --steps,
    the original's completeness (not the calibration or the study it was held to: see follows)."""
    steps = b.facts.get(tags.REPLAY_STEPS)
    return compare_runs(a, b, tolerance=judged_tolerance(a, b), incomplete_original=a.status != tags.FINISHED,
                        first_steps=int(steps) if steps and steps.isdigit() else None)


def follows(judged: str, recorded: str, calibrated: bool, studied: bool) -> bool:
    """Can a replay recorded with verdict `recorded` be the one whose two records compare_runs judges `judged` now?

    Exactly equal where nothing else entered the judgement. A calibration's envelope (judge_rounding) may have
    turned any verdict but BITWISE and NOTHING_TO_COMPARE into another such, and a study's seeds (judge_noise) a
    DIVERGED into WITHIN_NOISE or INCONCLUSIVE: those are read from runs a bundle need not carry."""
    if judged == recorded:
        return True
    if meets(judged, Policy.SETTLED) or meets(recorded, Policy.SETTLED):
        return False
    if calibrated:
        return True
    return studied and judged == DIVERGED and recorded in (WITHIN_NOISE, INCONCLUSIVE)


def compare_runs(
    original: RunRecord,
    replay: RunRecord,
    tolerance: dict | None = None,
    replay_failed: str | None = None,
    incomplete_original: bool = False,
    first_steps: int | None = None,
) -> Comparison:
    """Compare a replay with its original and give the verdict (one of VERDICTS).

    With `incomplete_original` (a FAILED or KILLED original), only the steps the original reached
    are judged, and its missing final fingerprint is no divergence. With `first_steps` K (replay --steps K),
    only both runs' steps < K are judged, and the replay's weights after K steps are held to the original's
    checkpoint of step K when it has one (else they are not compared).
    """
    tol = judged_tolerance(original, replay) if tolerance is None else tolerance
    of_replay = replay.facts.get(tags.REPLAY_OF) == original.run_id
    labels = ("original", "replay") if of_replay else ("run A", "run B")
    delta = environment_delta(original, replay, labels)
    blockers = [f"{d.name}: {d.note}" for d in delta if d.breaks_bitwise]
    notes = [
        f"metrics of {the(label)} {rec.run_id} were read from MLflow's metric history ({tags.ARTIFACT_SERIES} is missing), "
        "which stores +-inf as +-1.8e308: such values are not counted as bit-identical"
        for label, rec in zip(labels, (original, replay)) if not rec.metrics_exact
    ]
    if bool(original.config) != bool(replay.config):
        notes.append(f"config recorded in {the(labels[0] if original.config else labels[1])} only: no config delta")

    orig_metrics = {k: as_series(*v) for k, v in original.metrics.items()}
    rep_metrics = {k: as_series(*v) for k, v in replay.metrics.items()}
    # A key with no logged values carries no evidence; treat it as absent.
    orig_metrics = {k: v for k, v in orig_metrics.items() if v[0].size}
    rep_metrics = {k: v for k, v in rep_metrics.items() if v[0].size}
    evaluation = evaluation_keys(original, replay)
    own = {k: counts for k, counts in evaluation.items() if counts != tags.EVAL_AT_STEP}
    reached = None
    if incomplete_original or first_steps is not None:
        # The script's own MLflow metrics are at its own steps (an epoch, MLflow's default 0), not training steps: a
        # cut by training step cannot tell which of them the original had logged by then.
        direct = sorted(user_mlflow_metrics(original, replay) & (orig_metrics.keys() | rep_metrics.keys()))
        if direct:
            notes.append(f"{', '.join(direct)} (logged through MLflow at the script's own steps) not compared: only a "
                         "whole run's are")
            orig_metrics = {k: v for k, v in orig_metrics.items() if k not in direct}
            rep_metrics = {k: v for k, v in rep_metrics.items() if k not in direct}
    stepped = {k: v for k, v in orig_metrics.items() if k not in own}  # the original's values at training steps
    if incomplete_original:
        last = max((int(s[-1]) for s, _ in stepped.values()), default=-1)
        rep_metrics = {**_upto(_without(rep_metrics, own), last), **_as_far(rep_metrics, orig_metrics, own)}
        steps = np.unique(np.concatenate([s for s, _ in stepped.values()])) if stepped else np.empty(0)
        reached = Reached(original.status, len(steps))
    elif first_steps is not None:
        # An index of its own is no step: the replay's values of one are what it logged before step K.
        orig_metrics = {**_upto(stepped, first_steps - 1), **_as_far(orig_metrics, rep_metrics, own)}
        rep_metrics = {**_upto(_without(rep_metrics, own), first_steps - 1), **_only(rep_metrics, own)}
        reached = FirstSteps(original.status, first_steps, original_steps(original))
    clamped = (not original.metrics_exact, not replay.metrics_exact)

    stats: list[MetricStats] = []
    firsts: list[Divergence] = []
    div: Divergence | None
    for name in sorted(orig_metrics.keys() | rep_metrics.keys()):
        if own_metric(name) and (name in orig_metrics) != (name in rep_metrics):
            # harness's own metric (the learning rate) in one run only: the other was recorded before harness logged
            # it, or stepped no optimizer (which its other values and weights show).
            notes.append(f"{name} recorded by {the(labels[0] if name in orig_metrics else labels[1])} only: not compared")
            continue
        rtol, atol = _tolerance_for(tol, name)
        if name not in rep_metrics:
            st, div = _metric_only_in_one(name, *orig_metrics[name], True, rtol, atol)
        elif name not in orig_metrics:
            st, div = _metric_only_in_one(name, *rep_metrics[name], False, rtol, atol)
        else:
            st, div = _compare_metric(name, *orig_metrics[name], *rep_metrics[name], rtol, atol, clamped)
        st.evaluation, st.counts = name in evaluation, own.get(name)
        stats.append(st)
        if div is not None:
            div.counts = own.get(name)
            firsts.append(div)

    # Smallest step wins, ties by metric name (stats are already in name order). A value at an index of its own (an
    # evaluation batch's, or a metric the script logged through MLflow at steps of its own) decides only where no
    # training step differs: its index cannot be set against training steps.
    own_steps = user_mlflow_metrics(original, replay)
    for d in firsts:
        if d.metric in own_steps:
            d.counts = MLFLOW_STEP
    metric_div = min(firsts, key=lambda d: (d.counts is not None, d.step, d.metric or "")) if firsts else None
    fps = _compare_fingerprints(original, replay, incomplete_original, first_steps)

    failure = replay_failed
    if failure is None and replay.status != tags.FINISHED:
        reason = replay.facts.get(tags.STATUS_REASON)
        failure = f"{labels[1]} status {replay.status}" + (f" ({reason})" if reason else "")
    failed_alike = bool(
        incomplete_original and failure is not None and replay.status == original.status
        and replay.facts.get(tags.STATUS_REASON) is not None
        and replay.facts.get(tags.STATUS_REASON) == original.facts.get(tags.STATUS_REASON)
    )
    if failed_alike:
        # A deterministic failure that recurs at the same point, for the same reason, is reproduced too.
        notes.append(f"{the(labels[1])} failed as {the(labels[0])} did: {replay.facts[tags.STATUS_REASON]}")
        failure = None

    divergence: Divergence | None
    if failure is not None:
        detail = f"{labels[1]} failed: {failure}"
        if metric_div is not None:
            detail += f"; first metric difference {metric_div.describe(labels)}"
            divergence = Divergence(KIND_REPLAY_FAILED, metric_div.step, metric_div.metric, metric_div.original,
                                    metric_div.replay, metric_div.abs_diff, metric_div.rel_diff, detail,
                                    metric_div.counts)
        else:
            divergence = Divergence(KIND_REPLAY_FAILED, None, detail=detail)
        verdict = DIVERGED
    elif not stats and fps.compared == 0:
        divergence, verdict = None, NOTHING_TO_COMPARE
    elif metric_div is not None:
        divergence, verdict = metric_div, DIVERGED
    elif not fps.all_equal and not weights_may_differ(tol):
        # Other weights are never within a tolerance set for the metrics: a fingerprint is a digest, so how far the
        # weights moved cannot be judged from it. Only an explicit weights=any leaves them to the metrics.
        if fps.first_mismatch_step is not None:
            step = fps.first_mismatch_step
            detail = f"{original.fingerprints.get(step, 'none')[:12]} vs {replay.fingerprints.get(step, 'none')[:12]}"
        elif first_steps is not None:  # the replay's weights after K steps against the original's checkpoint of K
            step = first_steps
            detail = (f"after {first_steps} steps: the original's checkpoint {original.checkpoints[first_steps][:12]} "
                      f"vs {(replay.final_fingerprint or 'none')[:12]}")
        else:
            step = None
            detail = f"final {(original.final_fingerprint or 'none')[:12]} vs {(replay.final_fingerprint or 'none')[:12]}"
        if stats and not all(s.bitwise_equal for s in stats):
            detail += "; every metric within its tolerance: --tolerance weights=any would let the metrics decide"
        divergence, verdict = Divergence(KIND_FINGERPRINT, step, detail=detail), DIVERGED
    else:
        divergence = None
        # What was observed decides: bit-identical values and fingerprints are BITWISE even where the delta
        # predicted otherwise (the changes are listed beside it).
        exact = all(s.bitwise_equal for s in stats) and fps.all_equal
        verdict = BITWISE if exact else WITHIN_TOLERANCE

    last_step = max((int(s[-1]) for s, _ in stepped.values()), default=None) if incomplete_original else None
    if first_steps is not None:  # a checkpoint of step K holds the weights after the K steps both ran
        checkpoints = diff_checkpoints(original, replay, labels, first_steps)
        data_order = diff_data_order(original, replay, labels, first_steps - 1)
    else:
        checkpoints = diff_checkpoints(original, replay, labels, last_step)
        data_order = diff_data_order(original, replay, labels, last_step)
    return Comparison(
        checkpoints=checkpoints,
        data_order=data_order,
        verdict=verdict,
        run_a=original.run_id,
        run_b=replay.run_id,
        delta=delta,
        bitwise_possible=not blockers,
        bitwise_blockers=blockers,
        metrics=stats,
        fingerprints=fps,
        divergence=divergence,
        tolerance=tol,
        config_delta=config_delta(original.config, replay.config, original.facts, replay.facts),
        of_replay=of_replay,
        weights_unchanged_in=[label for label, rec in zip(labels, (original, replay))
                           if rec.facts.get(tags.WEIGHTS_CHANGED) == "false"],
        reached=reached,
        notes=notes,
        failed_alike=failed_alike,
        speed=speed_delta(original, replay, labels),
    )


def judge_rounding(cmp: Comparison, original: RunRecord, replay: RunRecord, envelope: Envelope) -> Comparison:
    """A replay of a calibrated run that is not bit-identical, held step by step to the rounding envelope over the
    envelope's first M steps. Inside at every judged value: WITHIN_ROUNDING where the envelope covered every step
    compared, else the steps from M on are judged as without a calibration (the tolerance here, the seeds' noise by
    the caller) and the line says so. Outside: DIVERGED at the first step outside, naming the metric and the envelope.

    A failed replay, or one that logged other steps or metrics, stays as it is: rounding explains none of that.
    """
    if meets(cmp.verdict, Policy.SETTLED):
        return cmp
    if cmp.divergence is not None and cmp.divergence.kind not in (KIND_VALUE, KIND_FINGERPRINT):
        return cmp
    if any(m.missing_steps or m.extra_steps or not (m.in_original and m.in_replay) for m in cmp.metrics):
        return cmp
    first_steps = cmp.reached.steps if isinstance(cmp.reached, FirstSteps) else None
    orig = {k: as_series(*v) for k, v in original.metrics.items()}
    rep = {k: as_series(*v) for k, v in replay.metrics.items()}
    if first_steps is not None:
        orig, rep = _upto(orig, first_steps - 1), _upto(rep, first_steps - 1)
    judged = rounding.judge(envelope, orig, rep)
    m = envelope.steps
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
    cmp.rounding = judged
    outside = judged.first()
    if outside is not None:
        rel = outside.distance / abs(outside.original) if outside.original else math.inf
        detail = (f"at step {outside.step}: {outside.describe()}, outside {judged.describe_envelope()} "
                  f"(calibration {envelope.calibration_id})")
        cmp.verdict = DIVERGED
        cmp.divergence = Divergence(KIND_ROUNDING, outside.step, outside.metric, outside.original, outside.replay,
                                    outside.distance, rel, detail)
        return cmp
    if judged.covers_run:
        cmp.verdict, cmp.divergence = WITHIN_ROUNDING, None
        return cmp
    # The steps from M on, as without a calibration: metrics by the tolerance, weights by their fingerprints.
    rest = [d for d in (_first_outside(name, orig[name], rep[name], cmp.tolerance, m) for name in sorted(orig) if name in rep)
            if d is not None]
    fps = cmp.fingerprints
    late_fp = fps.first_mismatch_step is not None and fps.first_mismatch_step >= m or fps.final_equal is False
    if rest:
        cmp.verdict, cmp.divergence = DIVERGED, min(rest, key=lambda d: (d.step, d.metric or ""))
    elif late_fp and not weights_may_differ(cmp.tolerance):
        cmp.verdict = DIVERGED
        cmp.divergence = Divergence(KIND_FINGERPRINT, None, detail=(
            f"the weights after the first {m} steps differ (final {(original.final_fingerprint or 'none')[:12]} vs "
            f"{(replay.final_fingerprint or 'none')[:12]}); --tolerance weights=any would let the metrics decide"))
    else:
        exact = all(_bitwise_from(orig[n], rep[n], m) for n in orig if n in rep) and not late_fp
        cmp.verdict, cmp.divergence = (WITHIN_ROUNDING if exact else WITHIN_TOLERANCE), None
    return cmp


def _from(series: tuple[np.ndarray, np.ndarray], first: int) -> tuple[np.ndarray, np.ndarray]:
    s, v = series
    return s[s >= first], v[s >= first]


def _first_outside(name: str, a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray],
                   tol: Mapping[str, Any], first: int) -> Divergence | None:
    """The first value at a step >= `first` outside the tolerance (the steps after a rounding envelope)."""
    rtol, atol = _tolerance_for(tol, name)
    _, div = _compare_metric(name, *_from(a, first), *_from(b, first), rtol, atol, (False, False))
    return div


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
    if cmp.verdict != DIVERGED or cmp.divergence is None or cmp.divergence.kind not in (KIND_VALUE, KIND_FINGERPRINT):
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

    def curves(rec: RunRecord) -> dict[str, Any]:
        return {k: v for k, v in rec.metrics.items() if k not in skip}

    cmp.noise = noise.judge_curves(study_id, curves(replay), curves(original), [curves(m) for m in members],
                                   before=before)
    if cmp.noise.within:
        cmp.verdict = INCONCLUSIVE if cmp.noise.vacuous else WITHIN_NOISE
    return cmp


def _evaluation_only(metrics: list[MetricStats], own: list[str]) -> str:
    """Said beside a pass whose every value of the training code's came from an evaluation (Lightning's validation
    or test, a short run whose log_every_n_steps was never reached): it holds nothing training logged - harness's
    own per-step values (the learning rate) aside, which say nothing of what the model computed."""
    names = [m.name for m in metrics]
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    if not own:
        return f"none of its values is a training-step value (every metric compared was logged by an evaluation: {shown})"
    return (f"none of the code's values is a training-step value (every metric it logged was logged by an evaluation: "
            f"{shown}; only {', '.join(own)}, harness's own, was compared at training steps)")


def _changes(n: int) -> str:
    return f"{n} environment change{'s' if n != 1 else ''}"


def _sort_key(x: float) -> float:
    # nan marks "NaN on one side only", which is worse than any finite difference.
    return math.inf if math.isnan(x) else x


def _shape(metrics: list[MetricStats]) -> str:
    """"2 metrics x 25 steps + harness.lr": the training code's metrics, harness's own (the learning rate) named."""
    mine = [m for m in metrics if not own_metric(m.name)]
    own = ", ".join(m.name for m in metrics if own_metric(m.name))
    if not mine and own:
        return own
    counts = {m.steps_compared for m in mine}
    noun = "metric" if len(mine) == 1 else "metrics"
    if len(counts) <= 1 and not any(m.counts for m in mine):
        steps = counts.pop() if counts else 0
        shape = f"{len(mine)} {noun} x {steps} steps"
    else:
        shape = f"{len(mine)} {noun} ({sum(m.steps_compared for m in mine)} values)"
    return f"{shape} + {own}" if own else shape
