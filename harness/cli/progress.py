"""What the terminal shows while ranks run: rank 0's output and a progress bar over steps, drawn from the library's
events (`Steps`, `RankOutput`: harness/executors/follow.py tells them), and the library's other lines above the bar."""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

import click

from harness import events

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
    from tqdm import tqdm  # loaded when a bar is drawn: `harness --help` stays fast

    note = f"{rate:.3g} step/s"
    if eta_s is not None:
        note += f", {tqdm.format_interval(eta_s)} left"
    return note


class Bar:
    """The step bar on stderr (stdout is kept for the run id), and the lines said while it is up, written above it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # events come from the command's thread and the follower's
        self._bar: Any = None  # a tqdm bar while ranks run
        self._done = 0
        self._first: tuple[int, float] | None = None  # (steps done, when): the first step seen

    def steps(self, event: events.Steps) -> None:
        with self._lock:
            if event.ended:
                if self._bar is not None:
                    self._advance(self._bar, event)  # ranks that ended well say where: the bar ends there, full
                    self._bar.close()
                self._bar, self._done, self._first = None, 0, None
                return
            if self._bar is None:
                from tqdm import tqdm

                # Only a terminal gets a bar: redrawn with carriage returns, it would fill a log file with them.
                self._bar = tqdm(total=None, unit="step", desc=event.label, file=sys.stderr, mininterval=0.5,
                                 leave=True, disable=not sys.stderr.isatty(), bar_format=_FORMAT_NO_TOTAL)
            self._advance(self._bar, event)

    def _advance(self, bar: Any, event: events.Steps) -> None:
        if event.total is not None and bar.total != event.total:
            bar.total = event.total
            bar.bar_format = _FORMAT
            bar.refresh()
        if event.done > self._done:
            now = time.monotonic()
            if self._first is None:
                self._first = (event.done, now)
            rate, eta = rate_and_eta(self._first, (event.done, now), bar.total)
            bar.set_postfix_str(progress_note(rate, eta), refresh=False)
            bar.update(event.done - self._done)
            self._done = event.done

    def write(self, line: str) -> None:
        """A line on stderr: above the bar while there is one."""
        with self._lock:
            if self._bar is not None:
                # tqdm writes what it is given: a colour only where click.echo would keep it (a terminal).
                self._bar.write(line if sys.stderr.isatty() else click.unstyle(line), file=sys.stderr)
                return
        click.echo(line, err=True)
