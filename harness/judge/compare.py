"""Judge a replay against its original run: the verdict over every metric and the fingerprints, and its evidence.

One metric held to its original's is harness/judge/metricdiff.py, the fingerprints harness/judge/fingerprints.py,
the tolerance harness/judge/tolerance.py; what differs between the runs (and whether it rules out bitwise) is
harness/judge/delta.py; a verdict handed on to a rounding envelope or a study's noise is harness/judge/handoff.py.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from harness import tags
from harness.fmt import fmt_short, json_safe, the
from harness.judge.dataorder import DataOrderDiff, diff_data_order
from harness.judge.decisive import first_decisive
from harness.judge.delta import ConfigChange, FactDelta, config_delta, environment_delta
from harness.judge.fingerprints import FingerprintStats, compare_fingerprints
from harness.judge.metricdiff import (
    KIND_FINGERPRINT,
    KIND_REPLAY_FAILED,
    MLFLOW_STEP,
    Divergence,
    MetricStats,
    as_series,
    compare_metric,
    metric_only_in_one,
    up_to,
)
from harness.judge.noise import NoiseJudgement
from harness.judge.perf import SpeedDelta, speed_delta
from harness.judge.rounding import RoundingJudgement
from harness.judge.tensordiff import CheckpointDiff, diff_checkpoints
from harness.judge.tolerance import judged_tolerance, never_judged, tolerance_for, weights_may_differ
from harness.judge.undetermined import looks_like_clock, not_determined
from harness.judge.verdicts import Policy, Verdict, exit_code, meets
from harness.rundata import RunRecord, UiLinks, own_metric


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
    # Metrics that differ where every fingerprint and every other value is bit-identical: not determined by the
    # training (harness/judge/undetermined.py), named beside a BITWISE verdict.
    undetermined: list[str] = field(default_factory=list)
    # Where to look at run B in the MLflow UI (a judged replay: its curves too): the command's to set, which reads
    # the store (harness.commands.ui); never part of the verdict or its record.
    ui: UiLinks | None = None

    @property
    def exit_code(self) -> int:
        return exit_code(self.verdict)

    @property
    def labels(self) -> tuple[str, str]:
        return ("original", "replay") if self.of_replay else ("run A", "run B")

    def summary(self) -> str:
        """The verdict in one line, with what limits it (an incomplete original, weights that never changed)."""
        line = self._verdict_line()
        if self.rounding is not None and self.rounding.within and self.verdict != Verdict.WITHIN_ROUNDING:
            # The envelope held over its steps; what came after decided (the tolerance, or the seeds' noise).
            by = "the seeds' noise" if self.noise is not None else "the tolerance"
            line += f"; {self.rounding.after_line(by, self.run_a)}"
            if self.verdict == Verdict.DIVERGED and self.noise is None and not self.rounding.blown_up:
                # Most often one ulp after the calibrated steps, judged bit for bit: the fix is a longer envelope.
                line += (f" (to hold them to rounding too: harness calibrate {self.run_a} --steps N, up to the run's "
                         "steps; or replay --tolerance METRIC=ATOL,RTOL)")
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
        if self.verdict == Verdict.DIVERGED:
            return line
        if self.fingerprints.final_equal is None:
            held = self.rounding.weights if self.rounding is not None else None
            if held is not None:  # their sketch was held to the members' (in the line above): no fingerprint of K
                return (f"{line}; the weights held to the calibration's members' after step {held.step} only: the "
                        f"original has no checkpoint fingerprint of step {reached.steps}")
            return (f"{line}; weights after step {reached.steps} not compared: the original has no checkpoint "
                    f"fingerprint of step {reached.steps}")
        return f"{line}, including the weights after step {reached.steps} (the original's checkpoint of that step)"

    def checkpoint_lines(self) -> list[str]:
        """Where the weights parted, for the verdict output: said on a divergence, or whenever tensors differ."""
        ck = self.checkpoints
        if ck is None or (self.verdict != Verdict.DIVERGED and ck.first_diff_step is None and not ck.desynced_ranks):
            return []
        lines = [ck.describe(self.labels)]
        for label, steps in ck.desynced_ranks.items():
            step, ranks = next(iter(steps.items()))
            lines.append(f"checkpoint tensors: in {the(label)}, rank{'s' if len(ranks) > 1 else ''} "
                         f"{', '.join(map(str, ranks))} held other tensors than rank 0 at step {step}")
        return lines

    def _weights_as_members(self) -> str:
        """WITHIN_ROUNDING: how the weights compared, only as far as they were (replay --steps K without the original's
        checkpoint of step K compares none after step K: _early_line says so)."""
        fps = self.fingerprints
        if fps.final_equal is False:
            return "; the weights differ as the calibration's members' did"
        if fps.first_mismatch_step is not None:
            return f"; the weights differ from step {fps.first_mismatch_step} on, as the calibration's members' did"
        return ""

    def _verdict_line(self) -> str:
        if self.verdict == Verdict.NOTHING_TO_COMPARE:
            return (f"{Verdict.NOTHING_TO_COMPARE}: there was nothing to compare (no metrics, no fingerprints): "
                    "log metrics with ctx.log and register the model with ctx.ddp")
        if self.verdict == Verdict.WITHIN_ROUNDING and self.rounding is not None:
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
            return f"{Verdict.WITHIN_ROUNDING}: {what}, {self.rounding.headline()}; {why}{self._weights_as_members()}"
        if self.verdict == Verdict.INCONCLUSIVE and self.noise is None and self.rounding and self.rounding.undecided():
            return f"{Verdict.INCONCLUSIVE}: {self.rounding.undecided_line(self.run_a)}"
        if self.verdict == Verdict.INCONCLUSIVE and self.noise is not None and self.noise.power is not None:
            return (f"{Verdict.INCONCLUSIVE}: inside the noise of {self.noise.seeds} seeds, but {self.noise.power.describe()}; "
                    f"first outside the tolerance {self.divergence.describe(self.labels) if self.divergence else 'nowhere'}")
        if self.verdict == Verdict.WITHIN_NOISE and self.noise is not None:
            n = len(self.bitwise_blockers)
            why = f"bitwise impossible ({_changes(n)})" if n else "the config changed"
            return (f"{Verdict.WITHIN_NOISE}: {self.noise.headline()}; {why}, first outside the tolerance "
                    f"{self.divergence.describe(self.labels) if self.divergence else 'nowhere'}")
        if self.verdict == Verdict.DIVERGED and self.divergence is not None:
            if self.divergence.kind == KIND_REPLAY_FAILED:
                return f"{Verdict.DIVERGED}: {self.divergence.describe(self.labels)}"
            line = f"{Verdict.DIVERGED} {self.divergence.describe(self.labels)}"
            return line if self.noise is None else f"{line}; {self.noise.headline()}"
        shape = _shape(self.metrics)
        fps = self.fingerprints
        if self.verdict == Verdict.BITWISE:
            same = _shape([m for m in self.metrics if m.name not in self.undetermined])
            line = f"{Verdict.BITWISE}: {same} bit-identical, {fps.compared} fingerprint{'' if fps.compared == 1 else 's'} equal"
            if self.bitwise_blockers:
                names = [d.name for d in self.delta if d.breaks_bitwise]
                line += f"; bitwise despite {_changes(len(names))}: {', '.join(names)}"
            if self.undetermined:
                line += (f"; {', '.join(self.undetermined)} differ{'s' if len(self.undetermined) == 1 else ''}: not "
                         "determined by the training (every fingerprint and every other value bit-identical)")
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
                          "relation": RELATION_REPLAY if self.of_replay else RELATION_INDEPENDENT,
                          **{k: v for k, v in asdict(self).items() if k != "ui"}})


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
    """The keys the training code logged through MLflow itself, in any of `rundata`."""
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


def follows(judged: str, recorded: str, calibrated: bool, studied: bool, undetermined: bool = False) -> bool:
    """Can a replay recorded with verdict `recorded` be the one whose two records compare_runs judges `judged` now?

    Exactly equal where nothing else entered the judgement. A calibration's envelope (judge_rounding) may have
    turned any verdict but BITWISE and NOTHING_TO_COMPARE into another such, and a study's seeds (judge_noise) a
    DIVERGED into WITHIN_NOISE or INCONCLUSIVE: those are read from runs a bundle need not carry. `undetermined`: the
    judgement is BITWISE naming values the training does not determine (Comparison.undetermined), which a harness
    without that rule recorded as DIVERGED on those values - the stricter verdict on the same evidence."""
    if judged == recorded or (undetermined and judged == Verdict.BITWISE and recorded == Verdict.DIVERGED):
        return True
    if meets(judged, Policy.SETTLED) or meets(recorded, Policy.SETTLED):
        return False
    if calibrated:
        return True
    return studied and judged == Verdict.DIVERGED and recorded in (Verdict.WITHIN_NOISE, Verdict.INCONCLUSIVE)


def compare_runs(
    original: RunRecord,
    replay: RunRecord,
    tolerance: dict | None = None,
    replay_failed: str | None = None,
    incomplete_original: bool = False,
    first_steps: int | None = None,
) -> Comparison:
    """Compare a replay with its original and give the verdict (a Verdict).

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
    notes = _record_notes(original, replay, labels)
    series = _judged_series(original, replay, tol, notes, incomplete_original, first_steps)
    stats, firsts = _metric_stats(series, tol, (not original.metrics_exact, not replay.metrics_exact), labels, notes)
    fps = compare_fingerprints(original, replay, incomplete_original, first_steps)
    failure, failed_alike = _failure(original, replay, replay_failed, incomplete_original, labels, notes)
    # Where the judged steps end: a checkpoint of step K holds the weights after the K steps both ran.
    last_step = (max((int(s[-1]) for s, _ in series.stepped.values()), default=None)
                 if incomplete_original and first_steps is None else None)
    checkpoints = diff_checkpoints(original, replay, labels, first_steps if first_steps is not None else last_step)
    data_order = diff_data_order(original, replay, labels, first_steps - 1 if first_steps is not None else last_step)
    unchanged = [label for label, rec in zip(labels, (original, replay)) if rec.facts.get(tags.WEIGHTS_CHANGED) == "false"]
    undetermined = not_determined(stats, fps, failed=failure is not None, weights_unchanged=bool(unchanged),
                                  checkpoints=checkpoints, data_order=data_order)
    decisive = first_decisive(firsts, data_order, original.facts.get(tags.SEED) == replay.facts.get(tags.SEED))
    divergence, verdict = _decide(original, replay, labels, stats, firsts, fps, failure, decisive,
                                  bool(undetermined), not fps.all_equal and not weights_may_differ(tol), first_steps,
                                  notes)
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
        weights_unchanged_in=unchanged,
        reached=series.reached,
        notes=notes,
        failed_alike=failed_alike,
        speed=speed_delta(original, replay, labels),
        undetermined=undetermined if verdict == Verdict.BITWISE else [],
    )


def _record_notes(original: RunRecord, replay: RunRecord, labels: tuple[str, str]) -> list[str]:
    """What the two records leave out that the judgement cannot see: exact series, a config."""
    notes = [
        f"metrics of {the(label)} {rec.run_id} were read from MLflow's metric history ({tags.ARTIFACT_SERIES} is missing), "
        "which stores +-inf as +-1.8e308: such values are not counted as bit-identical"
        for label, rec in zip(labels, (original, replay)) if not rec.metrics_exact
    ]
    if bool(original.config) != bool(replay.config):
        notes.append(f"config recorded in {the(labels[0] if original.config else labels[1])} only: no config delta")
    return notes


@dataclass
class _Series:
    """The metric series a comparison judges, cut to the steps both runs are held to."""

    original: dict[str, tuple[np.ndarray, np.ndarray]]
    replay: dict[str, tuple[np.ndarray, np.ndarray]]
    evaluation: dict[str, str]  # every evaluation metric, and the index it counts (tags.EVAL_AT_STEP: training steps)
    own: dict[str, str]  # the evaluation metrics at an index of their own (not training steps)
    stepped: dict[str, tuple[np.ndarray, np.ndarray]]  # the original's values at training steps
    reached: Reached | None = None


def _judged_series(original: RunRecord, replay: RunRecord, tol: Mapping[str, Any], notes: list[str],
                   incomplete_original: bool, first_steps: int | None) -> _Series:
    """Both runs' metric series that are judged: none without values, none whose tolerance is inf, and, for an
    incomplete original or replay --steps K, only the steps both runs are held to (said in `notes`)."""
    # A key with no logged values carries no evidence; treat it as absent.
    orig_metrics = {k: s for k, v in original.metrics.items() if (s := as_series(*v))[0].size}
    rep_metrics = {k: s for k, v in replay.metrics.items() if (s := as_series(*v))[0].size}
    unjudged = sorted(k for k in orig_metrics.keys() | rep_metrics.keys() if never_judged(tol, k))
    if unjudged:
        notes.append(f"{', '.join(unjudged)} not judged: {'its' if len(unjudged) == 1 else 'their'} tolerance is inf")
    if incomplete_original or first_steps is not None:
        # The script's own MLflow metrics are at its own steps (an epoch, MLflow's default 0), not training steps: a
        # cut by training step cannot tell which of them the original had logged by then.
        direct = sorted((user_mlflow_metrics(original, replay) & (orig_metrics.keys() | rep_metrics.keys()))
                        - set(unjudged))
        if direct:
            notes.append(f"{', '.join(direct)} (logged through MLflow at the script's own steps) not compared: only a "
                         "whole run's are")
        unjudged += direct
    orig_metrics = {k: v for k, v in orig_metrics.items() if k not in unjudged}
    rep_metrics = {k: v for k, v in rep_metrics.items() if k not in unjudged}
    evaluation = evaluation_keys(original, replay)
    own = {k: counts for k, counts in evaluation.items() if counts != tags.EVAL_AT_STEP}
    out = _Series(orig_metrics, rep_metrics, evaluation, own, {k: v for k, v in orig_metrics.items() if k not in own})
    if incomplete_original:
        last = max((int(s[-1]) for s, _ in out.stepped.values()), default=-1)
        out.replay = {**up_to(_without(rep_metrics, own), last), **_as_far(rep_metrics, orig_metrics, own)}
        steps = np.unique(np.concatenate([s for s, _ in out.stepped.values()])) if out.stepped else np.empty(0)
        out.reached = Reached(original.status, len(steps))
    elif first_steps is not None:
        # An index of its own is no step: the replay's values of one are what it logged before step K.
        out.original = {**up_to(out.stepped, first_steps - 1), **_as_far(orig_metrics, rep_metrics, own)}
        out.replay = {**up_to(_without(rep_metrics, own), first_steps - 1), **_only(rep_metrics, own)}
        out.reached = FirstSteps(original.status, first_steps, original_steps(original))
    return out


def _metric_stats(series: _Series, tol: Mapping[str, Any], clamped: tuple[bool, bool], labels: tuple[str, str],
                  notes: list[str]) -> tuple[list[MetricStats], list[Divergence]]:
    """Each judged metric held to its tolerance, in name order: its stats, and the first divergence of each that has
    one. `clamped`: whether each run's series were read back from MLflow's history (inf clamped)."""
    stats: list[MetricStats] = []
    firsts: list[Divergence] = []
    div: Divergence | None
    orig_metrics, rep_metrics = series.original, series.replay
    for name in sorted(orig_metrics.keys() | rep_metrics.keys()):
        if own_metric(name) and (name in orig_metrics) != (name in rep_metrics):
            # harness's own metric (the learning rate) in one run only: the other was recorded before harness logged
            # it, or stepped no optimizer (which its other values and weights show).
            notes.append(f"{name} recorded by {the(labels[0] if name in orig_metrics else labels[1])} only: not compared")
            continue
        rtol, atol = tolerance_for(tol, name)
        if name not in rep_metrics:
            st, div = metric_only_in_one(name, *orig_metrics[name], True, rtol, atol)
        elif name not in orig_metrics:
            st, div = metric_only_in_one(name, *rep_metrics[name], False, rtol, atol)
        else:
            st, div = compare_metric(name, *orig_metrics[name], *rep_metrics[name], rtol, atol, clamped)
        st.evaluation, st.counts = name in series.evaluation, series.own.get(name)
        stats.append(st)
        if div is not None:
            div.counts = series.own.get(name)
            firsts.append(div)
    return stats, firsts


def _failure(original: RunRecord, replay: RunRecord, replay_failed: str | None, incomplete_original: bool,
             labels: tuple[str, str], notes: list[str]) -> tuple[str | None, bool]:
    """(how the replay failed, None: it did not; whether it failed as the incomplete original did, which is no
    failure: a deterministic failure that recurs at the same point, for the same reason, is reproduced too)."""
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
        notes.append(f"{the(labels[1])} failed as {the(labels[0])} did: {replay.facts[tags.STATUS_REASON]}")
        return None, True
    return failure, False


def _first_metric_divergence(original: RunRecord, replay: RunRecord, firsts: list[Divergence]) -> Divergence | None:
    """Smallest step wins, ties by metric name (`firsts` is in name order). A value at an index of its own (an
    evaluation batch's, or a metric the script logged through MLflow at steps of its own) decides only where no
    training step differs: its index cannot be set against training steps. A metric named like a clock (mfu,
    train_runtime) decides only where no other metric differs: a clock differs whenever anything else does."""
    own_steps = user_mlflow_metrics(original, replay)
    for d in firsts:
        if d.metric in own_steps:
            d.counts = MLFLOW_STEP
    return (min(firsts, key=lambda d: (looks_like_clock(d.metric or ""), d.counts is not None, d.step, d.metric or ""))
            if firsts else None)


def _decide(original: RunRecord, replay: RunRecord, labels: tuple[str, str], stats: list[MetricStats],
            firsts: list[Divergence], fps: FingerprintStats, failure: str | None, decisive: Divergence | None,
            undetermined: bool, weights_differ: bool, first_steps: int | None,
            notes: list[str]) -> tuple[Divergence | None, Verdict]:
    """The verdict, and the divergence that decides it, from what was compared: a failure first, then a decisive
    value, then the metrics, then the weights."""
    metric_div = _first_metric_divergence(original, replay, firsts)
    clocks_only = bool(firsts) and all(looks_like_clock(d.metric or "") for d in firsts)
    if failure is not None:
        detail = f"{labels[1]} failed: {failure}"
        if metric_div is None:
            return Divergence(KIND_REPLAY_FAILED, None, detail=detail), Verdict.DIVERGED
        detail += f"; first metric difference {metric_div.describe(labels)}"
        return Divergence(KIND_REPLAY_FAILED, metric_div.step, metric_div.metric, metric_div.original,
                          metric_div.replay, metric_div.abs_diff, metric_div.rel_diff, detail,
                          metric_div.counts), Verdict.DIVERGED
    if decisive is not None:
        # A value neither rounding nor a seed moves (the learning rate, the data order) decides, at its step, what
        # else differed and whatever an envelope or a study would say (harness/judge/decisive.py).
        return decisive, Verdict.DIVERGED
    if not stats and fps.compared == 0:
        return None, Verdict.NOTHING_TO_COMPARE
    if undetermined and metric_div is not None:
        # The weights and every other value bit-identical: what differs is no function of the training. (Values that
        # differ within their tolerance stay WITHIN_TOLERANCE, a pass already.)
        return None, Verdict.BITWISE
    if metric_div is not None and not (clocks_only and weights_differ):
        if clocks_only:
            notes.append(_clock_hint(sorted({d.metric or "" for d in firsts})))
        return metric_div, Verdict.DIVERGED
    if weights_differ:
        return _weights_divergence(original, replay, fps, first_steps, stats, firsts, clocks_only), Verdict.DIVERGED
    # What was observed decides: bit-identical values and fingerprints are BITWISE even where the delta
    # predicted otherwise (the changes are listed beside it).
    exact = all(s.bitwise_equal for s in stats) and fps.all_equal
    return None, Verdict.BITWISE if exact else Verdict.WITHIN_TOLERANCE


def _weights_divergence(original: RunRecord, replay: RunRecord, fps: FingerprintStats, first_steps: int | None,
                        stats: list[MetricStats], firsts: list[Divergence], clocks_only: bool) -> Divergence:
    """Where the weights first differed. Other weights are never within a tolerance set for the metrics: a fingerprint
    is a digest, so how far the weights moved cannot be judged from it. Only an explicit weights=any leaves them to
    the metrics."""
    step: int | None
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
    if clocks_only:
        detail += f"; besides, {', '.join(sorted({d.metric or '' for d in firsts}))} (named like a clock) differ"
    elif stats and not all(s.bitwise_equal for s in stats):
        detail += "; every metric within its tolerance: --tolerance weights=any would let the metrics decide"
    return Divergence(KIND_FINGERPRINT, step, detail=detail)


def _clock_hint(names: list[str]) -> str:
    """Said where only metrics named like a clock differ, but nothing proves the training bit-identical."""
    shown, one = ", ".join(names), len(names) == 1
    return (f"only {shown} differ{'s' if one else ''}, named like a wall-clock value, but nothing shows the training "
            "bit-identical (every fingerprint equal, the final one among them, and another value bit-identical): if "
            f"{'it is one' if one else 'they are'}, --tolerance {names[0]}=inf leaves {'it' if one else 'that one'} "
            "unjudged")


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
