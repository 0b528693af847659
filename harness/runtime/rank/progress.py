"""What a rank tells its launcher through the shared progress array: per local rank, the step it is at and when it
last made progress (time.monotonic()), then the port of the job's store once the first rank hosts it (0 until then).
The launcher's progress check (harness/executors/launch.py) reads it."""

from __future__ import annotations

import time
from typing import Any

TEARDOWN = -2  # a rank's step once its training is over: it is tearing down (the process group, the interpreter)
DONE = -3.0  # a rank's step in the progress array once it no longer needs the job's store


def beat(progress: Any, rank: int, step: int) -> None:
    """This rank is alive and at `step` (-1: before the first one; TEARDOWN: its training is over); read by the
    launcher's progress check. A teardown is judged as a step is: a rank stuck in it (a collective a finalizer
    started, a group's destructor) ends the job after timeout_s like a rank stuck in training."""
    if progress is not None:
        progress[2 * rank] = step
        progress[2 * rank + 1] = time.monotonic()  # CLOCK_MONOTONIC is one clock for every process

