"""What the terminal shows while ranks run: rank 0's output and a progress bar over steps."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

from tqdm import tqdm

from harness import events
from harness.messages import Total
from harness.record.recorder import Line

# tqdm's own rate and remaining time count from the bar's creation, so start-up (imports, rendezvous, the
# first batch) would be a step: the bar shows ours instead, measured from the first training step.
_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"
_FORMAT_NO_TOTAL = "{desc}: {n_fmt} [{elapsed}{postfix}]"


def rate_and_eta(first: tuple[int, float], last: tuple[int, float], total: int | None) -> tuple[float | None, float | None]:
    """(steps per second, seconds left) from the steps done between the first step seen and the latest,
    `(done, monotonic time)` each; None where there is nothing to measure yet. Start-up never counts."""
    steps, seconds = last[0] - first[0], last[1] - first[1]
    if steps <= 0 or seconds <= 0:
        return None, None
    rate = steps / seconds
    if total is None:
        return rate, None
    return rate, max(total - last[0], 0) / rate


def progress_note(rate: float | None, eta_s: float | None) -> str:
    """The bar's tail: '12.3 step/s, 0:41 left' (nothing until two steps have been seen)."""
    if rate is None:
        return ""
    note = f"{rate:.3g} step/s"
    if eta_s is not None:
        note += f", {tqdm.format_interval(eta_s)} left"
    return note


class Console:
    """Follows rank 0's log file and draws a progress bar on stderr (stdout is kept for the run id)."""

    def __init__(self, log_path: Path, description: str, show: bool = True) -> None:
        """`show=False`: nothing on the terminal (runs at once would interleave; rank 0's log is still kept). A
        listener that asked for quiet (`harness --quiet`) hides the bar and rank 0's output too, not the warnings."""
        self._log_path = log_path
        self._quiet = show and events.quiet()  # its warnings still go out, as the library's other words do
        show = show and not self._quiet
        self._show = show
        # Only a terminal gets a bar: redrawn with carriage returns, it would fill a log file with them.
        self._bar = tqdm(
            total=None, unit="step", desc=description, file=sys.stderr, mininterval=0.5, leave=True,
            disable=not (show and sys.stderr.isatty()), bar_format=_FORMAT_NO_TOTAL,
        )
        self._last = -1
        self._first: tuple[int, float] | None = None  # (steps done, when): the first step seen
        self._progress: object = None  # the ranks' progress array: rank 0's step is at index 0
        self._stop = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._follow, name="harness-console", daemon=True)
        if show:
            self._thread.start()

    def total(self, steps: int) -> None:
        self._bar.total = steps
        self._bar.bar_format = _FORMAT
        self._bar.refresh()

    def step(self, step: int) -> None:
        # Steps may start at 0 (or at a resumed step) and repeat (several log() calls per step): show the furthest.
        done = step + 1
        if done > self._last:
            now = time.monotonic()
            if self._first is None:
                self._first = (done, now)
            rate, eta = rate_and_eta(self._first, (done, now), self._bar.total)
            self._bar.set_postfix_str(progress_note(rate, eta), refresh=False)
            self._bar.update(done - max(self._last, 0))
            self._last = done

    def follow_steps(self, progress: object) -> None:
        """Count the bar from rank 0's step clock (launch's progress array), read as the log is followed."""
        self._progress = progress

    def _poll_steps(self) -> None:
        progress = self._progress
        if progress is not None:
            step = int(progress[0])  # type: ignore[index]
            if step >= 0:
                self.step(step)

    def write(self, line: str) -> None:
        """A line of the launcher's own (a warning) among rank 0's output, above the bar."""
        if self._show:
            self._bar.write(line, file=sys.stderr)
        elif self._quiet:
            events.emit(events.Warning(line.removeprefix("Warning: ")) if line.startswith("Warning: ")
                        else events.Notice(line))

    def show(self, shown: Total | Line) -> None:
        """The recorder's view (record/recorder.py): the bar's length, or a warning, above the bar while the ranks
        run and on stderr once the bar is closed (shown even with show=False: the run is over, nothing interleaves)."""
        if isinstance(shown, Total):
            self.total(shown.steps)
        elif self._closed:  # the bar is gone: the line goes out as the library's other words do (the CLI draws it)
            events.emit(events.Notice(shown.text))
        else:
            self.write(shown.text)

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
            for line in lines:
                self._bar.write(line, file=sys.stderr)
            if stopping:
                if pending:
                    self._bar.write(pending, file=sys.stderr)
                return

    def close(self) -> None:
        self._closed = True
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._bar.close()
