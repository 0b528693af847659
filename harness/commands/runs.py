"""`harness runs`: recent runs as a table, with the verdicts of every replay of each run."""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from harness import tags as T
from harness.commands.options import RunsOptions
from harness.fmt import printable, text_table
from harness.record import seal
from harness.record.liveness import launcher_gone
from harness.record.replays import replay_verdicts, verdict_of
from harness.store.tracking import RunSummary, Tracker

STALE = "STALE"


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
        trusted: Callable[[RunSummary], bool] | None = None) -> dict[str, Any]:
    """One run as `harness runs` lists it (the table's columns; `runs --json`'s entries)."""
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
    }


HEADER = ["RUN ID", "EXPERIMENT", "START", "STATUS", "KIND", "WORLD", "COMMIT", "IMAGE DIGEST", "VERDICTS"]


def cells(one: dict[str, Any]) -> list[str]:
    """A `row` as the table's cells, in HEADER's order."""
    commit = (one["commit"] or "-")[:10] + ("+dirty" if one["dirty"] else "")
    kind = one["kind"] or "-"
    if kind == T.KIND_STUDY:  # its member count: the members are listed as runs of their own
        kind = f"{kind} ({one['study_size'] or '?'})"
    return [one["run_id"], printable(one["experiment"]), _when(one["start"]), str(one["status"]), kind,
            one["world_size"] or "-", commit, _digest(one["image_digest"]), one["verdicts"] or "-"]


@dataclass
class Listing:
    """What `harness runs` lists: the newest runs of a store (or experiment), newest first."""

    store: str  # the tracking URI, as the tracker shows it
    experiment: str | None
    runs: list[dict[str, Any]]  # as `row` describes each: `runs --json`'s entries

    def table(self) -> str:
        if not self.runs:
            return f"No runs in {self.store}" + (f" for experiment '{self.experiment}'." if self.experiment else ".")
        return text_table([HEADER, *map(cells, self.runs)])


def listing(options: RunsOptions) -> Listing:
    """The `limit` newest runs (of `experiment`), newest first, as `row` describes each."""
    tracking_uri, experiment, limit = options.tracking_uri, options.experiment, options.limit
    tracker = Tracker(tracking_uri, writable=False)  # listing only reads: a read-only store will do
    runs = tracker.search(experiment, max_results=limit)
    verdicts = replay_verdicts(tracker, experiment, {r.run_id for r in runs}) if runs else {}
    now = time.time()
    return Listing(tracker.uri, experiment,
                   [row(r, verdicts, now, trusted=lambda run: seal.verdict_sealed(tracker, run)) for r in runs])


def render_runs(tracking_uri: str | None, experiment: str | None, limit: int) -> str:
    return listing(RunsOptions(experiment, limit, tracking_uri)).table()
