"""The Python API of the trace extra: `harness.trace`, and compare's meaning for two traces."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from harness import events, seeds
from harness.errors import UsageError
from harness.events import Listener
from harness.extras.trace import command as trace_command
from harness.extras.trace.command import TraceDiff, TraceResult
from harness.store.tracking import Tracker, full_ids

__all__ = ["TraceOptions", "trace"]


@dataclass(frozen=True)
class TraceOptions:
    """`harness trace RUN_ID --step STEP`: every op of one step, recorded as a trace run nested under RUN_ID."""

    run_id: str
    step: int
    ranks: tuple[int, ...] = (0,)
    tracking_uri: str | None = None
    repo: Path | None = None
    on_event: Listener | None = None


def trace(options: TraceOptions) -> TraceResult:
    o = options
    with events.listening(o.on_event), seeds.given_back():
        run_id = full_ids(o.tracking_uri, o.run_id)[0] or o.run_id
        return trace_command.trace(run_id, step=o.step, ranks=o.ranks, tracking_uri=o.tracking_uri, repo=o.repo)[0]


def compare_traces(tracker: Tracker, run_a: str, run_b: str, report: Path | None) -> TraceDiff | None:
    """`harness compare` of two trace runs: the first op that differs (and the report at `report`); None where
    neither is a trace, and one line where one of them only is."""
    traces = [trace_command.is_trace(tracker.harness_run(r)) for r in (run_a, run_b)]
    if not any(traces):
        return None
    if not all(traces):
        which, other = (run_a, run_b) if traces[0] else (run_b, run_a)
        raise UsageError(f"run {which} is a trace and run {other} is not; compare two traces (harness trace "
                         f"{other} --step K makes one) or two runs.")
    found = trace_command.diff(tracker, run_a, run_b)
    if report is not None:
        trace_command.write_report(found, report)
    return found
