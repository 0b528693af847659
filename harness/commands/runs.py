"""`harness runs`: recent runs as a table, with the verdicts of every replay of each run and the runs folded under it."""

from __future__ import annotations

import datetime as dt
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from harness import tags as T
from harness.commands.options import RunsOptions
from harness.errors import UsageError
from harness.fmt import printable, text_table
from harness.record import nesting, seal
from harness.record.liveness import launcher_gone
from harness.record.replays import replay_verdicts, verdict_of
from harness.store.tracking import RunSummary, Tracker

STALE = T.STALE


def _when(start: str | None) -> str:
    """A row's start (ISO, local time) to the minute."""
    if not start:
        return "-"
    return dt.datetime.fromisoformat(start).strftime("%Y-%m-%d %H:%M")


def _digest(digest: str | None) -> str:
    digest = "unknown" if digest is None else digest
    return digest.split(":", 1)[1][:12] if digest.startswith("sha256:") else digest


# Runs that carry a verdict of their own (a run, or a study, shows its replays' verdicts instead).
_OWN_VERDICT = (T.KIND_REPLAY, T.KIND_AUDIT, T.KIND_STUDY_REPLAY, T.KIND_VERIFY)


def status_of(run: RunSummary, now: float) -> str:
    return STALE if run.status == T.RUNNING and launcher_gone(run.tags, now) is not None else run.status


def row(r: RunSummary, verdicts: dict[str, str], now: float,
        trusted: Callable[[RunSummary], bool] | None = None, nested: dict[str, int] | None = None,
        nested_under: str | None = None) -> dict[str, Any]:
    """One run as `harness runs` lists it (the table's columns; `runs --json`'s entries). `nested`: the runs folded
    under it, counted by name; `nested_under`: for a folded run, the run whose row counts it."""
    kind = r.tags.get(T.KIND)
    # A replay, audit, study replay or verify run carries its own verdict; a run shows its replays' verdicts.
    verdict = (verdict_of(r, trusted) or "") if kind in _OWN_VERDICT else verdicts.get(r.run_id, "")
    return {
        "run_id": r.run_id, "name": r.run_name, "experiment": r.experiment,
        "start": dt.datetime.fromtimestamp(r.start_time / 1000).isoformat(timespec="seconds") if r.start_time else None,
        "status": status_of(r, now), "kind": kind,
        "study_size": r.tags.get(T.STUDY_SIZE) if kind == T.KIND_STUDY else None,
        "world_size": r.tags.get(T.WORLD_SIZE), "commit": r.tags.get(T.GIT_COMMIT),
        "dirty": r.tags.get(T.GIT_DIRTY) == "true" if T.GIT_DIRTY in r.tags else None,
        "image_digest": r.tags.get(T.IMAGE_DIGEST), "verdicts": verdict or None,
        "nested": {name: (nested or {})[name] for name in nesting.ORDER if (nested or {}).get(name)},
        "nested_under": nested_under,
    }


HEADER = ["RUN ID", "EXPERIMENT", "START", "STATUS", "KIND", "WORLD", "COMMIT", "IMAGE DIGEST", "NESTED", "VERDICTS"]


def cells(one: dict[str, Any]) -> list[str]:
    """A `row` as the table's cells, in HEADER's order."""
    commit = (one["commit"] or "-")[:10] + ("+dirty" if one["dirty"] else "")
    kind = one["kind"] or "-"
    if kind == T.KIND_STUDY:  # its member count: the members are listed as runs of their own
        kind = f"{kind} ({one['study_size'] or '?'})"
    return [one["run_id"], printable(one["experiment"]), _when(one["start"]), str(one["status"]), kind,
            one["world_size"] or "-", commit, _digest(one["image_digest"]),
            nesting.said(Counter(one["nested"])) or "-", one["verdicts"] or "-"]


@dataclass
class Listing:
    """What `harness runs` lists: the newest runs of a store (or experiment), newest first."""

    store: str  # the tracking URI, as the tracker shows it
    experiment: str | None
    runs: list[dict[str, Any]]  # as `row` describes each: `runs --json`'s entries
    narrowed: str = ""  # the options that narrowed the listing, as given ("--kind trace"), for the empty answer

    def table(self) -> str:
        if not self.runs:
            return (f"No runs in {self.store}" + (f" for experiment '{self.experiment}'" if self.experiment else "")
                    + (f" match {self.narrowed}" if self.narrowed else "") + ".")
        return text_table([HEADER, *map(cells, self.runs)])


# The first page read; each next one is 4 times larger, up to the last. Runs folded under a listed run are newer than
# it, so the pages read down to the oldest listed run hold every run counted on the rows.
FIRST_PAGE = 200
LAST_PAGE = 50_000


def selected(options: RunsOptions, now: float) -> Callable[[RunSummary], bool]:
    """Which runs the listing shows: with --all, --kind or --status every run that matches them, else the runs a user
    made (nesting.folded_as)."""
    if not (options.all or options.kind or options.status):
        return lambda r: nesting.folded_as(r) is None
    return lambda r: ((options.kind is None or r.tags.get(T.KIND) == options.kind)
                      and (options.status is None or status_of(r, now) == options.status))


def _narrowed(options: RunsOptions) -> str:
    return " ".join(f"--{name} {value}" for name, value in (("kind", options.kind), ("status", options.status)) if value)


def listing(options: RunsOptions) -> Listing:
    """The `limit` newest runs (of `experiment`) the options select, newest first, as `row` describes each."""
    tracking_uri, experiment, limit = options.tracking_uri, options.experiment, options.limit
    for name, value, choices in (("kind", options.kind, T.KINDS), ("status", options.status, T.LISTED_STATUSES)):
        if value is not None and value not in choices:
            raise UsageError(f"--{name} {value}: no such {name}. Pass one of {', '.join(choices)}.")
    tracker = Tracker(tracking_uri, writable=False)  # listing only reads: a read-only store will do
    now = time.time()
    keep = selected(options, now)
    page = max(FIRST_PAGE, 4 * limit)
    while True:
        scanned = tracker.search(experiment, max_results=page)
        shown = [r for r in scanned if keep(r)][:limit]
        if len(shown) >= limit or len(scanned) < page or page >= LAST_PAGE:
            break
        page = min(4 * page, LAST_PAGE)
    counts, under = nesting.nesting(scanned)
    verdicts = replay_verdicts(tracker, experiment, {r.run_id for r in shown}) if shown else {}
    return Listing(tracker.uri, experiment,
                   [row(r, verdicts, now, trusted=lambda run: seal.verdict_sealed(tracker, run),
                        nested=counts.get(r.run_id), nested_under=under.get(r.run_id)) for r in shown],
                   _narrowed(options))


def render_runs(tracking_uri: str | None, experiment: str | None, limit: int) -> str:
    return listing(RunsOptions(experiment, limit, tracking_uri)).table()
