"""A run's replays: their verdicts counted (`harness runs` shows them; the original's harness.replays tag holds them),
each verdict trusted only where its seal holds it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from harness import events, tags as T
from harness.errors import HarnessError
from harness.judge.compare import VERDICTS
from harness.record import seal
from harness.store.tracking import RunSummary, Tracker

# A verdict tag its seal does not hold (edited, or a seal removed): shown as this, never as the verdict it says.
UNVERIFIED = "UNVERIFIED"


def _order(verdict: str) -> tuple[int, str]:
    # Verdicts in their documented order; a replay without one (still running, crashed) shows its status after.
    return (VERDICTS.index(verdict), "") if verdict in VERDICTS else (len(VERDICTS), verdict)


def verdict_of(run: RunSummary, trusted: Callable[[RunSummary], bool] | None) -> str | None:
    """The run's verdict tag where `trusted` (its seal holds it) says so, else UNVERIFIED; None when it has none."""
    verdict = run.tags.get(T.VERDICT)
    if verdict is None or trusted is None or trusted(run):
        return verdict
    return UNVERIFIED


def tally(replays: list[RunSummary], trusted: Callable[[RunSummary], bool] | None = None) -> dict[str, str]:
    """original run id -> every replay's verdict counted, e.g. "BITWISE 2, DIVERGED 1 (with changes)". `trusted`: is a
    replay's verdict tag the sealed one (an edited one counts as UNVERIFIED)."""
    counts: dict[str, Counter[tuple[bool, str]]] = {}
    for r in replays:
        original = r.tags.get(T.REPLAY_OF)
        if original:
            # A replay with --allow-changes or --world-size answers another question than "does it reproduce".
            counts.setdefault(original, Counter())[(T.CHANGES in r.tags, verdict_of(r, trusted) or r.status)] += 1
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
