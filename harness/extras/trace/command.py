"""`harness trace`: an op-level trace of one step of a recorded run, and the diff of two such traces; where a
DIVERGED replay first differed (`replay --localize`, `bisect --localize`: after_replay, the one place that does it).

A trace restarts from the run's checkpoint at or before step K (the audit machinery), re-executes up to
step K in real ranks with the recorded code and config, and wraps step K alone in an optrace.OpTracer
on the chosen ranks. The traces are artifacts of a small run nested under the traced one, so a trace
made on another machine (through a bundle) compares with one made here.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness import events, executors, scratch, tags as T
from harness.errors import EXIT_FAILED, EXIT_OK, HarnessError, RunRefused, UsageError
from harness.executors import Job
from harness.executors.base import SegmentMessages
from harness.extras.trace.optrace import tracefile
from harness.extras.trace.optrace.diff import localize, render_html, render_markdown
from harness.extras.trace.optrace.trace import IDENTICAL, INPUTS_DIFFER_FROM_START, Localization, Trace
from harness.judge import reproduced
from harness.judge.delta import config_delta, environment_delta
from harness.record import derived, loading, seal
from harness.store.tracking import RunRecord, RunSummary, Tracker

if TYPE_CHECKING:
    from harness.judge.compare import Comparison


@dataclass
class TraceResult:
    """One recorded trace run."""

    run_id: str  # the trace run (kind trace)
    traced: str  # the run whose step it traced
    step: int
    ranks: tuple[int, ...]
    from_checkpoint: int | None  # the checkpoint step it restarted from; None: from step 0
    reproduced: bool | None  # the re-execution matched the record up to the step (None: nothing to hold it to)
    detail: str = ""  # why it did not reproduce
    seconds: float = 0.0


@dataclass
class TraceDiff:
    """Two traces localized against each other, on one rank."""

    rank: int
    localization: Localization
    a: Trace
    b: Trace
    a_id: str = ""
    b_id: str = ""
    purpose: str = ""  # what the pair stands for (replay --localize)

    @property
    def differs(self) -> bool:
        return self.localization.status != IDENTICAL

    def lines(self) -> list[str]:
        """The culprit in a few human lines: op, module, shapes, dtypes, the user's line, the likely cause."""
        return describe(self.localization, self.rank)

    def markdown(self) -> str:
        return render_markdown(self.localization, self.a, self.b)

    def html(self) -> str:
        return render_html(self.localization, self.a, self.b)

    @property
    def exit_code(self) -> int:
        return EXIT_FAILED if self.differs else EXIT_OK

    def document(self) -> dict[str, Any]:
        """`compare`'s --json document of two traces (docs/json.md)."""
        from harness.commands import documents

        loc = self.localization
        return documents.document("compare", self.exit_code, {
            "relation": "traces", "run_a": self.a_id, "run_b": self.b_id, "rank": self.rank,
            "differs": self.differs, "status": loc.status, "op_index": loc.index, "likely_cause": loc.likely_cause,
            "lines": self.lines(),
        }, meanings=documents.TRACES)


def describe(loc: Any, rank: int | None = None) -> list[str]:
    on = f" (rank {rank})" if rank is not None else ""
    if loc.status == IDENTICAL:
        return [f"{IDENTICAL}: every op's inputs and outputs are equal{on}"]
    op = loc.b or loc.a
    out = [f"{loc.status}{on}" + (f" at op #{loc.index}" if loc.index is not None else "")]
    if op is not None:
        module = op.module or ("unknown (no model registered: ctx.register(model))"
                               if getattr(loc, "model_unknown", False) else "-")
        out.append(f"  op: {op.op}  module: {module}  phase: {getattr(op, 'phase', '-')}")
        out.append(f"  outputs: {_sigs(op.outputs)}")
        out.append(f"  inputs: {_sigs(op.inputs)}")
        out.append(f"  line: {op.user_line or '-'}")
    if loc.likely_cause:
        out.append(f"  likely cause: {loc.likely_cause}")
    out.extend(f"  {d}" for d in loc.detail[:5])
    return out


def _sigs(sigs: Any) -> str:
    shown = [f"{tuple(s.shape)} {s.dtype}" if s is not None else "-" for s in (sigs or [])]
    return ", ".join(shown[:4]) + (f", ... ({len(shown)})" if len(shown) > 4 else "") if shown else "-"


# ---------------------------------------------------------------------------------------------
# Tracing


def parse_ranks(text: str | None) -> tuple[int, ...]:
    """'0,1' -> (0, 1); a rank list that is not one says so."""
    if not text:
        return (0,)
    try:
        ranks = tuple(sorted({int(r) for r in text.split(",") if r.strip()}))
    except ValueError:
        raise UsageError(f"--ranks {text}: give rank numbers separated by commas, e.g. --ranks 0,1.") from None
    if not ranks or min(ranks) < 0:
        raise UsageError(f"--ranks {text}: give rank numbers >= 0 separated by commas, e.g. --ranks 0,1.")
    return ranks


@dataclass(frozen=True)
class Nesting:
    """Where trace runs go and how many are made: nested under `parent` (default: the traced run), `copies`
    independent traces of the one step (replay --localize takes two), each tagged with `purpose`."""

    parent: str | None = None
    copies: int = 1
    purpose: str = ""


def trace(
    run_id: str,
    *,
    step: int,
    ranks: tuple[int, ...] = (0,),
    tracker: Tracker | None = None,
    tracking_uri: str | None = None,
    repo: Path | None = None,
    nesting: Nesting = Nesting(),
) -> list[TraceResult]:
    """Trace step `step` of `run_id` on `ranks`, as `nesting` says (one trace nested under the traced run, by
    default). Bad input is said before anything runs or is recorded.
    """
    parent, copies, purpose = nesting.parent, nesting.copies, nesting.purpose
    from harness.record import checkpoints as checkpoint_store
    from harness.runtime.plan import CheckpointPlan

    tracker = tracker or Tracker(tracking_uri)
    loaded = loading.load(tracker, run_id, loading.TRACE)
    run, record = loaded.summary, loaded.record
    total = record.steps_total
    if total is None:
        raise RunRefused(f"run {run_id} is {run.status} and recorded no step count; only steps a run completed can be "
                           "traced. Resume it first (harness resume) if it has checkpoints.")
    if total == 0:
        raise RunRefused(f"run {run_id} completed no training step (no optimizer step was counted), so there is no step "
                           "to trace. Check that train() calls optimizer.step(), or replay it instead: harness replay "
                           f"{run_id}")
    if not 0 <= step < total:
        shown = "step 0" if total == 1 else f"steps 0-{total - 1}"
        raise UsageError(f"--step {step}: run {run_id} has {shown}. Pass a step in that range.")
    recorded = loaded.recorded
    recorded.restore_secrets([])  # from the environment variables they were read from
    cfg = recorded.cfg
    if max(ranks) >= cfg.world_size:
        raise UsageError(f"--ranks {','.join(map(str, ranks))}: run {run_id} ran {cfg.world_size} rank"
                           f"{'s' if cfg.world_size != 1 else ''} (0-{cfg.world_size - 1}).")
    executors.check_segments(cfg, "trace")
    start = max((s for s in record.checkpoints if s <= step), default=None)
    store = checkpoint_store.open_for(tracker, run_id) if start is not None else None
    if store is not None:  # the re-execution starts from it: its files must be there
        assert start is not None  # a store is opened only for a checkpoint to start from
        store.require([start], cfg.world_size, f"a trace of step {step}", run.tags.get(T.IMPORTED_FROM))
    data = recorded.check_data(repo)
    work = scratch.make("trace")
    try:
        dirs = [work / f"copy{i}" for i in range(copies)]
        for d in dirs:
            d.mkdir()
        plans = [
            CheckpointPlan(str(store.directory) if store is not None else str(work), 0, resume_step=start,
                           stop_at=step + 1, trace_step=step, trace_ranks=ranks, trace_dir=str(d))
            for d in dirs
        ]
        t0 = time.monotonic()
        with recorded.code(repo) as (tree, exp_dir):
            job = recorded.job(tree, exp_dir, data=data.paths)
            # Segments after the first restart from the checkpoint; from step 0 the RNGs are seeded once per
            # process, so each copy without a checkpoint needs ranks of its own.
            groups = [plans] if start is not None else [[p] for p in plans]
            outcomes = [o for g in groups for o in _run(job, g)]
        seconds = (time.monotonic() - t0) / copies
        results = []
        for d, (logged, end) in zip(dirs, outcomes):
            missing = [r for r in ranks if not (d / f"rank{r}.jsonl.gz").is_file()]
            if missing:
                raise HarnessError(f"rank {missing[0]} wrote no trace of step {step}: the training loop never asked "
                                   "ctx.loader's training loader for that batch.")
            ok, why = _reproduced(record, start or 0, step, logged, end)
            result = TraceResult("", run_id, step, ranks, start, ok, why, seconds)
            result.run_id = _record(tracker, run, result, d, parent or run_id, purpose)
            results.append(result)
        return results
    finally:
        if store is not None:
            store.cleanup()
        shutil.rmtree(work, ignore_errors=True)


def _run(job: Job, plans: list[Any]) -> list[tuple[dict, tuple | None]]:
    """Run `plans` in one set of ranks; per plan, rank 0's logged values {(key, step): value} and its end."""
    messages = SegmentMessages(len(plans))
    executors.run_segments(job, plans, messages, "trace")
    return [(report.logged, report.end) for report in messages.reports]


def _reproduced(record: RunRecord, first: int, step: int, logged: dict[tuple[str, int], float],
                end: tuple[int, str | None] | None) -> tuple[bool | None, str]:
    """Did the re-execution log the run's values bit for bit, and end with the weights it recorded after the step?"""
    held = reproduced.values(reproduced.series(record.metrics), logged, complete=record.status == T.FINISHED,
                             first=first, end=step + 1)
    if held.unheld_line:
        events.emit(events.Notice(f"trace: {held.unheld_line}."))
    if held.mismatch:
        return False, held.mismatch
    checked = held.checked
    if end is not None:
        at, sha = end
        expected = record.checkpoints.get(at) if at == step + 1 else None
        if at == record.steps_total and at == step + 1:
            expected = record.final_fingerprint
        if expected is not None and sha is not None:
            checked += 1
            if sha != expected:
                return False, f"weights after step {step}: {sha[:12]}, the run recorded {expected[:12]}"
    return (True, "") if checked else (None, "nothing recorded to hold the re-execution to")


def _record(tracker: Tracker, run: RunSummary, result: TraceResult, files: Path, parent: str, purpose: str) -> str:
    tags = derived.tags(T.KIND_TRACE, run, parent=parent, version=run.tags[T.VERSION], runtime=True, extra={
        T.TRACE_STEP: str(result.step),
        T.TRACE_RANKS: ",".join(map(str, result.ranks)),
        T.TRACE_FROM_CHECKPOINT: "none" if result.from_checkpoint is None else str(result.from_checkpoint),
        T.TRACE_REPRODUCED: {True: "true", False: "false", None: "unknown"}[result.reproduced],
    })
    if purpose:
        tags[T.TRACE_PURPOSE] = purpose
    with derived.opened(tracker, run.experiment, tags, f"trace-{run.run_name}-step{result.step}") as trace_id:
        meta = {"traced": run.run_id, "step": result.step, "ranks": list(result.ranks),
                "from_checkpoint": result.from_checkpoint, "reproduced": result.reproduced, "detail": result.detail,
                "seconds": round(result.seconds, 3), "purpose": purpose,
                "bytes": {p.name: p.stat().st_size for p in sorted(files.iterdir())}}
        (files / Path(T.ARTIFACT_TRACE_META).name).write_text(json.dumps(meta, indent=2))
        tracker.log_dir(trace_id, files, T.ARTIFACT_TRACE_DIR)
    return trace_id


# ---------------------------------------------------------------------------------------------
# Comparing


def is_trace(run: RunSummary) -> bool:
    return run.tags.get(T.KIND) == T.KIND_TRACE


def load_traces(tracker: Tracker, trace_id: str) -> dict[int, Any]:
    """rank -> optrace Trace of a trace run (its artifacts, read as bytes)."""
    run = tracker.harness_run(trace_id)
    if not is_trace(run):
        raise RunRefused(f"run {trace_id} is not a trace (harness.kind={run.tags.get(T.KIND, 'none')}); "
                           "make one with `harness trace RUN_ID --step K`.")
    out = {}
    for rank in parse_ranks(run.tags.get(T.TRACE_RANKS, "")):
        data = tracker.read_bytes(trace_id, f"{T.ARTIFACT_TRACE_DIR}/rank{rank}.jsonl.gz")
        if data is None:
            raise RunRefused(f"trace run {trace_id} lacks its artifact {T.ARTIFACT_TRACE_DIR}/rank{rank}.jsonl.gz; "
                               "trace the step again.")
        out[rank] = tracefile.loads(data)
    return out


def hints(a: RunRecord, b: RunRecord) -> dict[str, Any]:
    """What localize's rules may blame besides the ops: package versions, config keys and world sizes that differ."""
    packages = {d.name.removeprefix("lock:"): (d.a, d.b) for d in environment_delta(a, b) if d.name.startswith("lock:")}
    config = {c.key: (c.a, c.b) for c in config_delta(a.config, b.config, a.facts, b.facts)}
    ws = (a.config.get("world_size"), b.config.get("world_size"))
    return {"packages": packages, "config": config, "world_size": ws}


def diff(tracker: Tracker, a_id: str, b_id: str) -> TraceDiff:
    """Localize two trace runs against each other: the first of their common ranks whose traces differ
    (else the lowest), with hints from the traced runs' deltas."""
    loading.load(tracker, a_id, loading.COMPARE)
    loading.load(tracker, b_id, loading.COMPARE)
    ta, tb = load_traces(tracker, a_id), load_traces(tracker, b_id)
    common = sorted(ta.keys() & tb.keys())
    if not common:
        raise UsageError(f"traces {a_id} (ranks {','.join(map(str, ta))}) and {b_id} (ranks "
                           f"{','.join(map(str, tb))}) share no rank. Trace the same rank in both (--ranks).")
    ra, rb = tracker.harness_run(a_id), tracker.harness_run(b_id)
    runs = (ra.tags.get(T.TRACE_OF, ""), rb.tags.get(T.TRACE_OF, ""))
    try:
        h = hints(tracker.load_record(runs[0]), tracker.load_record(runs[1]))
    except HarnessError:  # a traced run not in this store (an imported trace alone): no hints, still a diff
        h = {}
    first = None
    for rank in common:
        d = TraceDiff(rank, localize(ta[rank], tb[rank], h), ta[rank], tb[rank], a_id, b_id)
        first = first or d
        if d.differs:
            return d
    assert first is not None
    return first


def write_report(d: TraceDiff, path: Path) -> None:
    """--report PATH: HTML when PATH ends in .html, else markdown."""
    try:
        Path(path).write_text(d.html() if str(path).endswith((".html", ".htm")) else d.markdown())
    except OSError as err:
        raise HarnessError(f"--report {path}: cannot write it ({err.strerror}). Pick a writable path.") from None


# ---------------------------------------------------------------------------------------------
# replay --localize


@dataclass
class Localized:
    """What replay --localize found: the diff that names the culprit, and every trace it made."""

    step: int | None  # None: no step could be chosen
    diff: TraceDiff | None
    traces: list[str] = field(default_factory=list)
    nondeterministic: bool = False  # the original's step traced twice here already differed
    note: str = ""

    def lines(self) -> list[str]:
        head = "Localization" if self.step is None else f"Localization of step {self.step}"
        if self.diff is None:
            return [f"{head}: {self.note}"]
        why = ("the original's step traced twice on this machine differs (same-machine nondeterminism)"
               if self.nondeterministic else "the original's step traced under the original's and the replay's config")
        return [f"{head}: {why}", *([f"  {self.note}"] if self.note else []), *self.diff.lines()]

    def markdown(self) -> str:
        out = ["", "## Where it diverged", "", *(f"    {line}" for line in self.lines()), ""]
        if self.diff is not None:
            out += [self.diff.markdown(), ""]
        if self.traces:
            out.append("Trace runs: " + ", ".join(f"`{t}`" for t in self.traces))
        return "\n".join(out) + "\n"


def localize_replay(tracker: Tracker, original: str, replay_id: str, step: int, repo: Path | None = None) -> Localized:
    """Trace step `step` of the original twice here (nondeterminism check); if those agree, against the replay's.

    Every trace is a run nested under the replay.
    """
    events.emit(events.Progress(f"Localizing step {step}: tracing the original's step twice on this machine", 1, 2))
    mine = trace(original, step=step, tracker=tracker, repo=repo,
                 nesting=Nesting(replay_id, copies=2, purpose="original (nondeterminism check)"))
    ids = [t.run_id for t in mine]
    first = diff(tracker, ids[0], ids[1])
    first.purpose = "the original's step, twice on this machine"
    if first.differs:
        return Localized(step, first, ids, nondeterministic=True)
    replay_run = tracker.harness_run(replay_id)
    if replay_run.status != T.FINISHED:
        return Localized(step, None, ids, note=f"the replay {replay_run.status}; its step cannot be traced")
    events.emit(events.Progress(f"Localizing step {step}: tracing the replay's step", 2, 2))
    theirs = trace(replay_id, step=step, tracker=tracker, repo=repo, nesting=Nesting(replay_id, purpose="replay"))
    ids.append(theirs[0].run_id)
    second = diff(tracker, ids[0], ids[2])
    second.purpose = "the original's step and the replay's"
    loc = second.localization
    if loc.status != INPUTS_DIFFER_FROM_START or loc.arguments_only or step == 0:
        return Localized(step, second, ids)
    # The step's first differing op read tensors that already differed (weights an lr change updated the step
    # before, say, read first by an embedding lookup): the step before holds the op that made them differ.
    events.emit(events.Progress(f"Localizing step {step - 1}: step {step}'s inputs already differed; tracing the "
                                "step before in both", 2, 2))
    before = [trace(run, step=step - 1, tracker=tracker, repo=repo, nesting=Nesting(replay_id, purpose=purpose))[0].run_id
              for run, purpose in ((original, "original (the step before)"), (replay_id, "replay (the step before)"))]
    ids += before
    earlier = diff(tracker, *before)
    earlier.purpose = "the original's step before and the replay's"
    if not earlier.differs:
        return Localized(step, second, ids, note=f"step {step - 1} traced too: identical in both, so the difference "
                                                 f"arose between the two steps")
    return Localized(step - 1, earlier, ids, note=f"step {step}'s inputs already differed at its first differing op "
                                                  f"({loc.a.op if loc.a else '-'}); the step before shows where")


def localize_after_replay(tracker: Tracker, comparison: Any, a: RunRecord, b: RunRecord, repo: Path | None) -> Localized:
    """replay --localize on a DIVERGED comparison: trace its first divergent step; a failure to trace is a note,
    never the loss of the replay's verdict."""
    div = comparison.divergence
    total = min(a.steps_total or 0, b.steps_total or 0)
    if div is None or div.step is None or total == 0:
        return Localized(None, None, note="no divergent training step to trace (the replay failed, or differs only at the end)")
    if div.counts is not None:  # an evaluation's own index, or the steps of the script's own MLflow metrics
        return Localized(None, None, note=f"no training step to trace: {div.metric} first differs at {div.counts} "
                                          f"{div.step}, an index of its own")
    step = min(div.step, total - 1)
    try:
        return localize_replay(tracker, a.run_id, b.run_id, step, repo)
    except HarnessError as err:
        return Localized(step, None, note=f"could not trace it: {err}")


# ---------------------------------------------------------------------------------------------
# Localisation after a replay: replay --localize and bisect --localize both come here (through the API, which hands
# after_replay to them: neither imports this verb).


def after_replay(tracker: Tracker, replay_id: str, comparison: Comparison, changes: list[str], a: RunRecord, b: RunRecord,
                 repo: Path | None) -> Localized:
    """Where the DIVERGED replay `replay_id` (`b`) of `a` first differed, traced and recorded on the replay."""
    localized = localize_after_replay(tracker, comparison, a, b, repo)
    record_localization(tracker, replay_id, comparison, changes, localized)
    return localized


def record_localization(tracker: Tracker, replay_id: str, comparison: Comparison, changes: list[str],
                        localized: Localized) -> None:
    """The report ends with where the replay diverged: the first differing op, its module, the user's line."""
    from harness.judge.report import render_markdown

    seal.open_for_verdict(tracker, replay_id)
    markdown = render_markdown(comparison, changes) + localized.markdown()
    status = localized.diff.localization.status if localized.diff is not None else "NONE"
    tracker.set_tags(replay_id, {T.MLFLOW_RUN_NOTE: markdown, T.LOCALIZED: status})
    tracker.log_text(replay_id, markdown, T.ARTIFACT_REPORT)
    tracker.log_text(replay_id, localized.markdown(), T.ARTIFACT_LOCALIZATION)
    if localized.diff is not None:
        tracker.log_text(replay_id, localized.diff.html(), T.ARTIFACT_LOCALIZATION_HTML)
    seal.seal(tracker, replay_id)  # the replay closed before its localization was written: sealed again with it
