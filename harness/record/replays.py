"""A run's replays: their verdicts counted (`harness runs` shows them; the original's harness.replays tag holds them),
each verdict trusted only where its seal holds it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from harness import events, tags as T
from harness.errors import HarnessError, UsageError
from harness.judge.verdicts import Verdict
from harness.record import nesting, seal
from harness.store.tracking import RunSummary, Tracker

# A verdict tag its seal does not hold (edited, or a seal removed): shown as this, never as the verdict it says.
UNVERIFIED = "UNVERIFIED"


_VERDICTS = tuple(Verdict)


def _order(verdict: str) -> tuple[int, str]:
    # Verdicts in their documented order; a replay without one (still running, crashed) shows its status after.
    return (_VERDICTS.index(verdict), "") if verdict in _VERDICTS else (len(_VERDICTS), verdict)


def verdict_of(run: RunSummary, trusted: Callable[[RunSummary], bool] | None) -> str | None:
    """The run's verdict tag where `trusted` (its seal holds it) says so, else UNVERIFIED; None when it has none."""
    verdict = run.tags.get(T.VERDICT)
    if verdict is None or trusted is None or trusted(run):
        return verdict
    return UNVERIFIED


def tally(replays: list[RunSummary], trusted: Callable[[RunSummary], bool] | None = None) -> dict[str, str]:
    """original run id -> every replay's verdict counted, e.g. "BITWISE 2, DIVERGED 1 (with changes)": the replays a user
    made (not a calibration's members, not a bisect's probes); one without a verdict by its status while that says
    something (RUNNING, FAILED, KILLED), a FINISHED one never judged not at all. `trusted`: is a replay's verdict tag
    the sealed one (an edited one counts as UNVERIFIED)."""
    counts: dict[str, Counter[tuple[bool, str]]] = {}
    for r in replays:
        original = r.tags.get(T.REPLAY_OF)
        # A calibration member or a bisect probe answers its command's question, not "does the run reproduce".
        if not original or not nesting.made_by_user(r):
            continue
        verdict = verdict_of(r, trusted)
        if verdict is None and r.status == T.FINISHED:  # ended, never judged: no verdict to count
            continue
        # A replay with --allow-changes or --world-size answers another question than "does it reproduce".
        counts.setdefault(original, Counter())[(T.CHANGES in r.tags, verdict or r.status)] += 1
    out: dict[str, str] = {}
    for original, counter in counts.items():
        parts = [f"{verdict} {n}" + (" (with changes)" if changed else "")
                 for (changed, verdict), n in sorted(counter.items(), key=lambda kv: (kv[0][0], _order(kv[0][1])))]
        out[original] = ", ".join(parts)
    return out


def replay_verdicts(tracker: Tracker, experiment: str | None, of: set[str] | None = None) -> dict[str, str]:
    """The verdicts of every replay in the store (or experiment; of the runs `of`), in one store query, each checked
    against its seal's manifest."""
    replays = tracker.search(experiment, max_results=5000, filter_string=f"tags.`{T.KIND}` = 'replay'")
    if of is not None:
        replays = [r for r in replays if r.tags.get(T.REPLAY_OF) in of]
    return tally(replays, lambda r: seal.verdict_sealed(tracker, r))


def record_replay_verdicts(tracker: Tracker, original: RunSummary) -> None:
    """The original's harness.replays tag: every replay's verdict so far, counted as `harness runs` counts them."""
    replays = tracker.search(original.experiment, max_results=5000,
                             filter_string=f"tags.`{T.REPLAY_OF}` = '{original.run_id}'")
    counted = tally([r for r in replays if r.tags.get(T.KIND) == T.KIND_REPLAY]).get(original.run_id)
    if not counted:
        return
    try:
        tracker.set_tags(original.run_id, {T.REPLAYS: counted})
    except HarnessError as err:  # the replay and its verdict are recorded; only the original's summary is behind
        events.emit(events.Warning(f"the verdicts of run {original.run_id}'s replays could not be written on it "
                                   f"({err}); `harness runs` counts them from the replays."))


def newest_replay(tracker: Tracker, run_id: str) -> str:
    """The id of the newest replay a user made of `run_id` (not a calibration member, not a bisect probe): what
    `harness compare RUN` compares the run with."""
    tracker.harness_run(run_id)  # an unknown run is said as such, not as one never replayed
    replays = [r for r in tracker.search(filter_string=f"tags.`{T.REPLAY_OF}` = '{run_id}'", max_results=5000)
               if r.tags.get(T.KIND) == T.KIND_REPLAY and nesting.made_by_user(r)]
    if not replays:
        raise UsageError(f"run {run_id} has no replay to compare it with. Run `harness replay {run_id}` first, or pass "
                         f"the run to compare it with: harness compare {run_id} RUN_B.")
    newest = replays[0]  # the store lists the newest first
    events.emit(events.Notice(f"comparing run {run_id} with its newest replay, {newest.run_id}"
                              + (f" (of {len(replays)})" if len(replays) > 1 else "")))
    return newest.run_id
