"""What the person watching a run here is told while its ranks run, as events (harness/events.py): rank 0's
output, read from its log as it grows, and its step count. The CLI draws them (harness/cli/progress.py); with no
one listening nothing is followed, and rank 0's log is written by the rank all the same."""

from __future__ import annotations

import threading
from collections.abc import Set
from pathlib import Path

from harness import events
from harness.messages import Total
from harness.record.recorder import Line
from harness.secrets import scrub_known


def said(text: str) -> events.Notice | events.Warning:
    """A line of the launcher's own (the recorder's `Line`) as the event it is."""
    if text.startswith("Warning: "):
        return events.Warning(text.removeprefix("Warning: "))
    return events.Notice(text)


class Follower:
    """Follows rank 0's log file and step clock while the ranks run, and tells them as RankOutput and Steps."""

    def __init__(self, log_path: Path, label: str, show: bool = True, hidden: Set[str] = frozenset(),
                 segments: tuple[int, int] | None = None) -> None:
        """`show=False`: rank 0's output, its steps and the launcher's lines are not told while the ranks run (runs
        at once would interleave; rank 0's log is still kept). `hidden`: the secret values harness knows of the
        run (secrets.known_values), cut from rank 0's lines as they are from its stored log. `segments`: (count,
        steps each) of a calibration's members run one after another by these ranks: one count over all of them
        (`segment` says which runs), and rank 0's output, the same training again and again, is not told."""
        self._log_path = log_path
        self._hidden = set(hidden)
        self._label = label
        self._show = show and events.heard()
        self._total: int | None = None
        self._done = 0
        self._progress: object = None  # the ranks' progress array: rank 0's step is at index 0
        self._segments = segments
        self._base = 0  # the steps of the segments before the one running
        if segments is not None:
            self._total = segments[0] * segments[1]
        self._stop = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=events.carry(self._follow), name="harness-follow", daemon=True)
        if self._show:
            events.emit(events.Steps(label, 0, self._total))
            self._thread.start()

    def segment(self, index: int) -> None:
        """Segment `index` starts (its ranks' step clock was reset before it was said)."""
        if self._segments is not None:
            self._base = index * self._segments[1]
            self._done = max(self._done, self._base)

    def total(self, steps: int) -> None:
        if self._segments is not None:  # each member's own count: the bar counts them all
            return
        self._total = steps
        if self._show and not self._closed:
            events.emit(events.Steps(self._label, self._done, steps))

    def follow_steps(self, progress: object) -> None:
        """Count the steps from rank 0's step clock (launch's progress array), read as the log is followed."""
        self._progress = progress

    def _poll_steps(self) -> None:
        progress = self._progress
        if progress is None:
            return
        # Steps may start at 0 (or at a resumed step) and repeat (several log() calls per step): the furthest counts.
        step = int(progress[0])  # type: ignore[index]
        if self._segments is not None:
            step = self._base + min(step, self._segments[1] - 1)
        if step >= 0 and step + 1 > self._done:
            done = step + 1
            self._done = done
            events.emit(events.Steps(self._label, done, self._total))

    def show(self, shown: Total | Line) -> None:
        """The recorder's view (record/recorder.py): the number of steps, or a line; a line is told while the ranks
        run where their output is, and once they ended even with show=False (the run is over, nothing interleaves)."""
        if isinstance(shown, Total):
            self.total(shown.steps)
        elif self._show or self._closed:
            events.emit(said(shown.text))

    def _follow(self) -> None:
        offset = 0
        pending = ""
        while True:
            stopping = self._stop.wait(0.2)
            self._poll_steps()
            try:
                with open(self._log_path, errors="replace") as fh:
                    fh.seek(offset)
                    chunk = fh.read()
                    offset = fh.tell()
            except FileNotFoundError:
                chunk = ""
            pending += chunk
            *lines, pending = pending.split("\n")
            for line in lines if self._segments is None else ():
                events.emit(events.RankOutput(scrub_known(line, self._hidden)))
            if stopping:
                if pending and self._segments is None:
                    events.emit(events.RankOutput(scrub_known(pending, self._hidden)))
                return

    def close(self, finished: bool = False, steps: int | None = None) -> None:
        """Stop following. `finished`: the ranks ended well, so they ran every step they were to run - `steps` as
        the record counts them (None: no count came; then the total, or the furthest step seen): the last Steps
        says that many of that many. Rank 0's step clock is read every 0.2 s, so the furthest step seen can lag
        the last one by the steps of a fraction of a second."""
        self._closed = True
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if not self._show:
            return
        done, total = self._done, self._total
        if finished:
            done = steps if steps is not None and self._segments is None else max(done, total or 0)
            total = done
        events.emit(events.Steps(self._label, done, total, ended=True))
