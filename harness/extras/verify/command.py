"""`harness verify`: does the paper print what the recorded runs produced, and does it survive a replay?"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import numpy as np

from harness import events, tags as T
from harness.commands.options import VerifyOptions
from harness.errors import EXIT_FAILED, EXIT_OK, HarnessError, RunRefused, UsageError
from harness.extras.verify.claims import (
    CLAIM_WITHIN_NOISE,
    HOLDS,
    MISPRINTED,
    NOT_REPRODUCED,
    Claim,
    Source,
    Verdict,
    as_decimal,
    load_claims,
    possible_typo,
    prints_as,
)
from harness.extras.verify.report import render_html, render_markdown
from harness.judge import perf
from harness.judge.noise import MIN_SEEDS, another_mean, claims_level, spread
from harness.judge.verdicts import Policy, meets
from harness.record import derived, loading, seal
from harness.record.study import is_study, load_study, member_records
from harness.store.tracking import RunRecord, RunSummary, Tracker
from harness.version import __version__

# The verify run's verdict (harness.verdict): every claim holds, or not.
ALL_HOLD, SOME_FAIL = "HOLDS", "FAILS"
# Replay verdicts under which a claim stands: the replay reproduced the runs, bit for bit, within the
# experiment's tolerance, or within the seeds' noise.


@dataclass
class VerifyResult:
    claims_file: Path
    verdicts: list[Verdict]
    run_id: str
    report_path: str
    replayed: bool

    @property
    def held(self) -> int:
        return sum(v.holds for v in self.verdicts)

    @property
    def exit_code(self) -> int:
        return EXIT_OK if self.held == len(self.verdicts) else EXIT_FAILED



def run_value(record: RunRecord, metric: str, which: str) -> float:
    """One run's number for a claim: its value at the last logged step, or its max or min over all steps."""
    steps, values = record.metrics[metric]
    v = np.asarray(values, dtype=np.float64)
    if which == "final":
        return float(v[int(np.argmax(np.asarray(steps)))])
    return float(v.max() if which == "max" else v.min())


_STATISTICS: dict[str, Callable[[list[float]], float]] = {
    "mean": statistics.fmean, "median": statistics.median, "min": min, "max": max,
}


def statistic(values: list[float], which: str) -> float:
    return _STATISTICS[which](values)


def spread_of(values: list[float], which: str) -> float | None:
    """The +- a paper prints: the sample sd, the mean's standard error, or the 95% CI's half-width."""
    if len(values) < 2:
        return None
    s = spread(values)
    if which == "std":
        return s.std
    if which == "sem":
        return s.std / math.sqrt(s.n)
    return (s.ci95[1] - s.ci95[0]) / 2


def _scaled(x: float, scale: Decimal) -> float:
    # In decimal: 0.973 * 100 is 97.3, where float arithmetic gives 97.30000000000001.
    return x if scale == 1 else float(as_decimal(x) * scale)


def _resolve(tracker: Tracker, claim: Claim, where: str) -> RunSummary:
    """The run a claim names, also when this store holds it under a new id (a bundle import)."""
    try:
        return tracker.harness_run(claim.source)
    except HarnessError as err:
        found = tracker.imported(claim.source)
        if found is None:
            raise type(err)(f"{where}: {err}", err.exit_code) from None  # the same case, said for the claim
        return found


def load_source(tracker: Tracker, claim: Claim, where: str) -> Source:
    run = _resolve(tracker, claim, where)
    seal.check(tracker, run.run_id)
    if claim.study is not None:
        if not is_study(run):
            raise RunRefused(f"{where}: study: {claim.study} is a {run.tags.get(T.KIND, 'run')}, not a study "
                               f"(harness run --seeds N); write run: {claim.study} for a single run.")
        study = load_study(tracker, run.run_id)
        records = member_records(tracker, study)
        for record in records:
            seal.check(tracker, record.run_id)
        if not records:
            raise RunRefused(f"{where}: study {claim.study} has no FINISHED member run to check the claim against.")
        return Source(claim.source, run, records, True)
    if is_study(run):
        raise RunRefused(f"{where}: run: {claim.run} is a study; write study: {claim.run}.")
    why = loading.refusal(loading.VERIFY, run, name=claim.run)  # said for the claim that rests on the run
    if why is not None:
        raise RunRefused(f"{where}: {why}")
    return Source(claim.source, run, [tracker.load_record(run.run_id)], False)


def _speeds(records: list[RunRecord], claim: Claim, where: str | None) -> list[float]:
    """Each run's median of the claim's wall-clock metric, scaled; a run without one is refused (`where`) or skipped."""
    out = []
    for record in records:
        value = perf.run_speed(record, claim.metric)
        if value is None:
            if where is None:
                continue
            raise HarnessError(f"{where}: metric: run {record.run_id} recorded no step times, so no {claim.metric!r} "
                               "(a run recorded before harness timed steps, or one that did not finish). Point the claim "
                               "at a run made since.")
        out.append(_scaled(value, claim.scale))
    return out


def judge_speed(claim: Claim, source: Source, where: str) -> Verdict:
    """A speed claim: the runs' statistic within the claim's rtol of the printed number."""
    assert claim.rtol is not None
    values = _speeds(source.records, claim, where)
    recorded = statistic(values, claim.statistic)
    ok = perf.within(recorded, float(claim.paper.value), claim.rtol)
    return Verdict(claim, source, values, recorded, None, ok, True, outcome=HOLDS if ok else MISPRINTED)


def judge(claim: Claim, source: Source, where: str, level: float = claims_level(1)) -> Verdict:
    """The recorded number against the printed one (MISPRINTED or not); the replay is judged later. `level`: of the
    noise interval, set for the whole claims file (noise.claims_level)."""
    if claim.rtol is not None:
        return judge_speed(claim, source, where)
    for record in source.records:
        if claim.metric not in record.metrics or not len(record.metrics[claim.metric][1]):
            logged = ", ".join(sorted(record.metrics)) or "none"
            raise HarnessError(f"{where}: metric: run {record.run_id} logged no {claim.metric!r} (logged: {logged}).")
    values = [_scaled(run_value(r, claim.metric, claim.value), claim.scale) for r in source.records]
    if claim.paper.pm is not None and len(values) < 2:
        raise HarnessError(f"{where}: paper: {claim.paper_text!r} prints a ± but the claim rests on one run, which has "
                           "no spread; point it at a study (study: <id>) or drop the ± part.")
    recorded = statistic(values, claim.statistic)
    spread = spread_of(values, claim.spread)
    value_ok = prints_as(recorded, claim.paper.value)
    spread_ok = claim.paper.pm is None or (spread is not None and prints_as(spread, claim.paper.pm))
    outcome = HOLDS if value_ok and spread_ok else MISPRINTED
    interval = None
    # A slipped digit (2.858 for 2.885) is a misprint even where the seeds' noise would cover the number.
    typo = None if value_ok else possible_typo(recorded, claim.paper.value)
    if source.is_study and claim.statistic == "mean" and len(values) >= MIN_SEEDS:
        interval = another_mean(values, level)
        if not value_ok and typo is None and interval[0] <= float(claim.paper.value) <= interval[1]:
            outcome = CLAIM_WITHIN_NOISE
    return Verdict(claim, source, values, recorded, spread, value_ok, spread_ok, outcome=outcome,
                   noise_interval=interval, noise_level=level if interval is not None else None, typo=typo)


@dataclass(frozen=True)
class Replays:
    """What replays a claim's source: commands/replay.py's replay and replay_study, handed in by the API. verify
    --replay composes the replay verb; it is given it rather than importing it, so that no verb imports another
    (pyproject.toml's independence contract)."""

    run: Callable[..., Any]
    study: Callable[..., Any]


def replay_source(source: Source, *, replays: Replays, members: int | None, world_size: int | None,
                  overrides: list[str], allow_changes: bool, executor: str | None, tracker: Tracker) -> None:
    """Replay a study (replay_study) or a single run (replay) once; keep the verdict and the replays' records."""
    if source.is_study:
        result = replays.study(source.run_id, members=members, world_size=world_size, overrides=overrides,
                               allow_changes=allow_changes, tracker=tracker, executor=executor)
        source.replay_id, source.replay_verdict, source.replay_summary = result.run_id, result.verdict, result.summary()
        outcomes = [(m.outcome.run_id, m.comparison) for m in result.members]
        source.replayed_originals = [m.original.run_id for m in result.members]
    else:
        one = replays.run(source.run_id, world_size=world_size, overrides=overrides, allow_changes=allow_changes,
                          tracker=tracker, executor=executor)
        assert one.comparison is not None  # a single-node replay judges itself
        source.replay_id, source.replay_verdict = one.outcome.run_id, one.comparison.verdict
        source.replay_summary = one.comparison.summary()
        outcomes = [(one.outcome.run_id, one.comparison)]
        source.replayed_originals = [source.run_id]
    for run_id, comparison in outcomes:
        source.replays.append(tracker.load_record(run_id))
        for blocker in (comparison.bitwise_blockers if comparison is not None else []):
            if blocker not in source.blockers:
                source.blockers.append(blocker)


def judge_replay(verdict: Verdict) -> None:
    c, s = verdict.claim, verdict.source
    if c.rtol is not None:  # a speed claim: the replays' speed within its rtol (the numbers' verdict is not its)
        verdict.replayed_values = _speeds(s.replays, c, None)
        if verdict.replayed_values:
            verdict.replayed = statistic(verdict.replayed_values, c.statistic)
        if verdict.holds and (verdict.replayed is None or not perf.within(verdict.replayed, float(c.paper.value), c.rtol)):
            verdict.outcome = NOT_REPRODUCED
        return
    verdict.replayed_values = [_scaled(run_value(r, c.metric, c.value), c.scale)
                               for r in s.replays if c.metric in r.metrics]
    if verdict.replayed_values:
        verdict.replayed = statistic(verdict.replayed_values, c.statistic)
    drawn = set(s.replayed_originals)
    if s.is_study and drawn and len(drawn) < len(s.records):
        same = [v for r, v in zip(s.records, verdict.values) if r.run_id in drawn]
        verdict.recorded_replayed_members = statistic(same, c.statistic) if same else None
    if verdict.holds and not meets(s.replay_verdict, Policy.REPRODUCED):
        verdict.outcome = NOT_REPRODUCED


def verify(options: VerifyOptions, *, replays: Replays | None = None) -> VerifyResult:
    """The claims of `options.claims_file` judged against the record; with `options.replay`, against replays too
    (`replays`: how, handed in by the API)."""
    claims_file, replay, members, world_size = options.claims_file, options.replay, options.members, options.world_size
    overrides, allow_changes, executor = list(options.overrides), options.allow_changes, options.executor
    tracking_uri = options.tracking_uri
    claims = load_claims(claims_file)
    tracker = Tracker(tracking_uri)
    sources: dict[str, Source] = {}
    verdicts: list[Verdict] = []
    # Everything is checked before anything runs or is recorded: bad input records nothing.
    for claim in claims:
        key = ("study:" if claim.study else "run:") + claim.source
        if key not in sources:
            sources[key] = load_source(tracker, claim, f"{claims_file}: claim {claim.id!r}")
    # One bound for the file: every claim that could be judged against its seeds' noise shares it.
    noisy = sum(1 for c in claims if c.study and c.statistic == "mean")
    for claim in claims:
        key = ("study:" if claim.study else "run:") + claim.source
        verdicts.append(judge(claim, sources[key], f"{claims_file}: claim {claim.id!r}", claims_level(noisy)))
    if overrides and not allow_changes:
        raise UsageError(f"overrides {' '.join(overrides)} would change the replays' config. Pass --allow-changes "
                           "with --replay to replay with them (they are recorded and reported).")
    if (overrides or members or world_size or executor) and not replay:
        raise UsageError("--members, --world-size, --executor and KEY=VALUE changes apply to replays; add --replay.")
    if replay:
        assert replays is not None, "verify(replay=True) replays through the replays it is given (harness.verify's)"
        for source in sources.values():  # each study or run once, however many claims rest on it
            events.emit(events.Progress(f"replaying {'study' if source.is_study else 'run'} {source.run_id} ..."))
            replay_source(source, replays=replays, members=members, world_size=world_size, overrides=list(overrides or []),
                          allow_changes=allow_changes, executor=executor, tracker=tracker)
        for verdict in verdicts:
            judge_replay(verdict)
    return record(tracker, claims_file, verdicts, replay, list(overrides or []))


def record(tracker: Tracker, claims_file: Path, verdicts: list[Verdict], replayed: bool,
           changes: list[str]) -> VerifyResult:
    """One MLflow run (kind verify) in the first claim's experiment: the reports, claims.json, the claims file."""
    held = sum(v.holds for v in verdicts)
    verdict = ALL_HOLD if held == len(verdicts) else SOME_FAIL
    # It rests on many runs (every claim's): no of-tag, no parent.
    # Its verdict in words, as its row in the MLflow UI and in `harness runs` shows it: "3 of 4 hold" (claims.json
    # keeps HOLDS / FAILS).
    tags = derived.tags(T.KIND_VERIFY, version=__version__, extra={
        T.VERIFY_CLAIMS_FILE: str(claims_file), T.VERIFY_HELD: f"{held}/{len(verdicts)}",
        T.VERDICT: f"{held} of {len(verdicts)} hold"})
    if changes:
        tags[T.CHANGES] = " ".join(changes)
    with derived.opened(tracker, verdicts[0].source.run.experiment, tags, f"verify-{claims_file.stem}") as run_id:
        markdown = render_markdown(verdicts, replayed, changes, run_id)
        tracker.set_tags(run_id, {T.MLFLOW_RUN_NOTE: markdown})
        tracker.log_text(run_id, markdown, f"{T.ARTIFACT_VERIFY_DIR}/report.md")
        tracker.log_text(run_id, render_html(verdicts, replayed, changes, run_id), f"{T.ARTIFACT_VERIFY_DIR}/report.html")
        summary = {"claims_file": str(claims_file), "held": held, "total": len(verdicts), "verdict": verdict,
                   "replayed": replayed, "changes": changes, "claims": [v.to_dict() for v in verdicts]}
        tracker.log_text(run_id, json.dumps(summary, indent=2), f"{T.ARTIFACT_VERIFY_DIR}/claims.json")
        # The claims file as it was checked, byte for byte.
        tracker.log_bytes(run_id, claims_file.read_bytes(), f"{T.ARTIFACT_VERIFY_DIR}/{claims_file.name}")
    local = tracker.local_artifact_dir(run_id)
    where = (str(local / T.ARTIFACT_VERIFY_DIR / "report.html") if local is not None
             else f"{tracker.get_run(run_id).artifact_uri}/{T.ARTIFACT_VERIFY_DIR}/report.html")
    return VerifyResult(claims_file, verdicts, run_id, where, replayed)
