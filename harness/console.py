"""What the terminal shows while ranks run: rank 0's output and a progress bar over steps."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

from tqdm import tqdm


class Console:
    """Follows rank 0's log file and draws a progress bar on stderr (stdout is kept for the run id)."""

    def __init__(self, log_path: Path, description: str, show: bool = True) -> None:
        """`show=False`: nothing on the terminal (runs at once would interleave; rank 0's log is still kept)."""
        self._log_path = log_path
        # Only a terminal gets a bar: redrawn with carriage returns, it would fill a log file with them.
        self._bar = tqdm(
            total=None, unit="step", desc=description, file=sys.stderr, mininterval=0.5, leave=True,
            disable=not (show and sys.stderr.isatty()),
        )
        self._last = -1
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="harness-console", daemon=True)
        if show:
            self._thread.start()

    def total(self, steps: int) -> None:
        self._bar.total = steps
        self._bar.refresh()

    def step(self, step: int) -> None:
        # Steps may start at 0 and repeat (several log() calls per step): show the furthest one.
        done = step + 1
        if done > self._last:
            self._bar.update(done - max(self._last, 0))
            self._last = done

    def _follow(self) -> None:
        offset = 0
        pending = ""
        while True:
            stopping = self._stop.wait(0.2)
            try:
                with open(self._log_path, "r", errors="replace") as fh:
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
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._bar.close()
