"""`harness runs`: recent runs as a table, with the verdict of each run's latest replay."""

from __future__ import annotations

import datetime as dt

from harness import tags as T
from harness.tracking import RunSummary, Tracker


def _when(ms: int | None) -> str:
    if not ms:
        return "-"
    return dt.datetime.fromtimestamp(ms / 1000).strftime("%Y-%m-%d %H:%M")


def _digest(tags: dict[str, str]) -> str:
    digest = tags.get(T.IMAGE_DIGEST, "unknown")
    return digest.split(":", 1)[1][:12] if digest.startswith("sha256:") else digest


def latest_verdicts(tracker: Tracker, experiment: str | None) -> dict[str, str]:
    """original run id -> verdict of its most recent replay."""
    replays = tracker.search(experiment, max_results=1000, filter_string=f"tags.`{T.KIND}` = 'replay'")
    latest: dict[str, str] = {}
    for r in replays:  # newest first
        original = r.tags.get(T.REPLAY_OF)
        if original and original not in latest:
            latest[original] = r.tags.get(T.VERDICT, r.status)
    return latest


def rows(runs: list[RunSummary], verdicts: dict[str, str]) -> list[list[str]]:
    out = []
    for r in runs:
        commit = r.tags.get(T.GIT_COMMIT, "-")[:10]
        if r.tags.get(T.GIT_DIRTY) == "true":
            commit += "+dirty"
        kind = r.tags.get(T.KIND, "-")
        # A replay or audit carries its own verdict; a run shows its latest replay's.
        verdict = r.tags.get(T.VERDICT, "") if kind in ("replay", "audit") else verdicts.get(r.run_id, "")
        out.append(
            [r.run_id, r.experiment, _when(r.start_time), r.status, kind, r.tags.get(T.WORLD_SIZE, "-"),
             commit, _digest(r.tags), verdict or "-"]
        )
    return out


def render_runs(tracking_uri: str | None, experiment: str | None, limit: int) -> str:
    tracker = Tracker(tracking_uri, writable=False)  # listing only reads: a read-only store will do
    runs = tracker.search(experiment, max_results=limit)
    if not runs:
        return f"No runs in {tracker.uri}" + (f" for experiment '{experiment}'." if experiment else ".")
    header = ["RUN ID", "EXPERIMENT", "START", "STATUS", "KIND", "WORLD", "COMMIT", "IMAGE DIGEST", "VERDICT"]
    table = [header, *rows(runs, latest_verdicts(tracker, experiment))]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table)
