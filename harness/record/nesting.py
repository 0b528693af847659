"""Which runs a listing folds under the run they were made from, and the name each is counted by on that run's row.

A user makes runs, replays, studies, study replays, bisects and verify runs: `harness runs` lists those. What a command
makes on its own way to an answer - a calibration and its member replays, a trace, an audit, a study's seeds, a
bisect's probes, a study replay's member replays - is counted on the row of the run it was made from (the nearest
listed run up its `mlflow.parentRunId` chain, the MLflow UI's nesting), and listed itself with `harness runs --all`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from harness import tags as T
from harness.rundata import RunSummary

# The names a folded run is counted by, in the order a row lists them.
CALIBRATION = "calibration"
TRACE = "trace"
AUDIT = "audit"
SEED = "seed"
PROBE = "probe"
MEMBER_REPLAY = "member replay"
ORDER = (CALIBRATION, TRACE, AUDIT, SEED, PROBE, MEMBER_REPLAY)


def folded_as(run: RunSummary) -> str | None:
    """The name `run` is counted by on its parent's row; None for a run a listing shows by default (also one that
    names no run it was made from: there is no row to count it on)."""
    tags, kind = run.tags, run.tags.get(T.KIND)
    if not _parent(run):
        return None
    if kind == T.KIND_CALIBRATION or (kind == T.KIND_REPLAY and tags.get(T.CALIBRATION)):
        return CALIBRATION
    if kind == T.KIND_TRACE:
        return TRACE
    if kind == T.KIND_AUDIT:
        return AUDIT
    if kind == T.KIND_REPLAY and tags.get(T.BISECT_OF):
        return PROBE
    if kind == T.KIND_REPLAY and tags.get(T.STUDY_REPLAY):
        return MEMBER_REPLAY
    if kind == T.KIND_RUN and tags.get(T.STUDY):
        return SEED
    return None


def made_by_user(replay: RunSummary) -> bool:
    """A replay someone asked for, not one a command made on its way (a calibration member, a bisect probe): only such
    replays' verdicts say whether their run reproduces."""
    return not (replay.tags.get(T.CALIBRATION) or replay.tags.get(T.BISECT_OF))


def _parent(run: RunSummary) -> str | None:
    # A study replay's member replays nest under the member they replay; they count on the study replay that made them.
    return run.tags.get(T.STUDY_REPLAY) or run.tags.get(T.MLFLOW_PARENT_RUN_ID)


def nesting(runs: Iterable[RunSummary]) -> tuple[dict[str, Counter[str]], dict[str, str]]:
    """Each listed run's folded runs counted by name (run id -> Counter), and each folded run's row (folded run id ->
    the listed run it is counted on). A folded run whose listed ancestor is not among `runs` (an older page of the
    store) is counted nowhere."""
    by_id = {r.run_id: r for r in runs}
    counts: dict[str, Counter[str]] = {}
    under: dict[str, str] = {}
    for run in by_id.values():
        name = folded_as(run)
        if name is None:
            continue
        seen = {run.run_id}
        parent = by_id.get(_parent(run) or "")
        while parent is not None and parent.run_id not in seen and folded_as(parent) is not None:
            seen.add(parent.run_id)  # a hand-edited tag could close a loop
            parent = by_id.get(_parent(parent) or "")
        if parent is not None and parent.run_id not in seen:
            counts.setdefault(parent.run_id, Counter())[name] += 1
            under[run.run_id] = parent.run_id
    return counts, under


def said(counted: Counter[str] | None) -> str:
    """A row's folded runs, e.g. "calibration 10, trace 3" ("" when none)."""
    if not counted:
        return ""
    return ", ".join(f"{name} {counted[name]}" for name in ORDER if counted.get(name))
