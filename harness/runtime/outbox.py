"""Rank 0's end of the pipe to the launcher: logged points leave in batches from a sender thread."""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np

from harness.errors import HarnessError
from harness.messages import Message, MetricsBatch
from harness.runtime import forkgate

# Rank 0's logged points leave in batches: the sender thread takes whatever was logged once it has been
# idle for SEND_EVERY_S (so a slow loop's points go out within milliseconds, and a rank that is killed
# loses at most that much), and the loop itself queues a batch when BATCH_POINTS have piled up.
BATCH_POINTS = 4096
SEND_EVERY_S = 0.005
# Batches waiting for the pipe, at most: a launcher that falls behind slows the loop down rather than
# letting rank 0's memory grow without bound.
QUEUED_BATCHES = 64
_CLOSE_TIMEOUT_S = 120.0
_IDLE_S = 1.0
_STOP = object()


class Outbox:
    """Rank 0's end of the pipe to the launcher: logged points are appended to lists and leave as
    MetricsBatch arrays; one sender thread writes those and every other message to the pipe, in the
    order they were made, so the training loop never waits on a pipe write or a pickle per point.
    """

    def __init__(self, channel: Any) -> None:
        self._channel = channel
        self._lock = threading.Lock()  # the buffer, and the order in which things enter the queue
        self._queue: queue.Queue = queue.Queue(QUEUED_BATCHES)
        self._wake = threading.Event()  # set with the first point of a buffer and with every queued item
        self._key_ids: dict[str, int] = {}
        self._keys: list[str] = []
        self._key_index: list[int] = []
        self._steps: list[int] = []
        self._values: list[float] = []
        self._unix_ms: list[int] = []
        self._thread = threading.Thread(target=self._run, name="harness-outbox", daemon=True)
        self._closed = False
        self.error: BaseException | None = None  # the pipe broke (the launcher is gone): later sends are dropped
        # Started now, before the training code runs, and ended by close(): never created or torn down at a moment the
        # code may fork (runtime/forkgate.py).
        self._start()

    def add(self, step: int, values: Mapping[str, float], unix_ms: int) -> None:
        with self._lock:
            if not self._steps:
                self._wake.set()
            for key, value in values.items():
                k = self._key_ids.get(key)
                if k is None:
                    k = self._key_ids[key] = len(self._keys)
                    self._keys.append(key)
                self._key_index.append(k)
                self._steps.append(step)
                self._values.append(value)
                self._unix_ms.append(unix_ms)
            if len(self._steps) >= BATCH_POINTS:
                self._put(self._take())

    def send(self, message: Message) -> None:
        """Queue `message` after every point logged before it."""
        with self._lock:
            if self._closed:  # after close(): straight to the pipe, as before there was a sender
                self._channel.send(message)
                return
            if self._steps:
                self._put(self._take())
            self._put(message)

    def flush(self, timeout_s: float = _CLOSE_TIMEOUT_S) -> None:
        """Wait (at most `timeout_s`) until everything logged or sent so far is in the pipe: what is in the pipe
        reaches the launcher even if this process dies the next instant."""
        done = threading.Event()
        with self._lock:
            if self._closed:
                return  # closed: sends go straight to the pipe
            if self._steps:
                self._put(self._take())
            self._put(done)
        done.wait(timeout_s)

    def close(self, timeout_s: float = _CLOSE_TIMEOUT_S) -> None:
        """Send what is buffered, wait (at most `timeout_s`) for the queue to reach the pipe, stop the thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._steps:
                self._put(self._take())
            self._queue.put(_STOP)
            self._wake.set()  # an idle sender sleeps on the wake for up to _IDLE_S: every close would wait that long
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            print(f"harness: rank 0 could not hand {self._queue.qsize()} queued metric batches to the launcher within "
                  f"{timeout_s:g} s; the run's last logged values may be missing.", file=sys.stderr)

    def _take(self) -> tuple:
        # O(1) under the lock: the lists are swapped out; the sender thread makes the arrays.
        taken = (tuple(self._keys), self._key_index, self._steps, self._values, self._unix_ms)
        self._key_index, self._steps, self._values, self._unix_ms = [], [], [], []
        return taken

    def _put(self, item: Any) -> None:
        # Called with the lock held: what enters the queue enters in program order.
        try:
            self._queue.put(item, timeout=_CLOSE_TIMEOUT_S)
        except queue.Full:
            raise HarnessError(
                f"the launcher has taken none of rank 0's {QUEUED_BATCHES} queued metric batches for "
                f"{_CLOSE_TIMEOUT_S:g} s; it is stuck or gone. Check the launcher process (logs/rank0.log)."
            ) from None
        self._wake.set()

    def _start(self) -> None:
        forkgate.install()
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=SEND_EVERY_S)
            except queue.Empty:
                if self._wake.is_set():
                    with forkgate.working():
                        self._take_buffered()
                else:
                    self._wake.wait(_IDLE_S)  # nothing logged or queued: sleep until something is
                continue
            if item is _STOP:
                return
            with forkgate.working():  # a fork the training code makes waits for this batch to be in the pipe
                self._hand_on(item)

    def _hand_on(self, item: Any) -> None:
        """One queued item to the pipe (a flush's event set once everything before it is there)."""
        if isinstance(item, threading.Event):  # a flush: everything queued before it is in the pipe
            item.set()
            return
        if self.error is not None:
            return  # keep draining so the loop never blocks on a full queue
        if isinstance(item, tuple):
            keys, key_index, steps, values, unix_ms = item
            item = MetricsBatch(
                keys,
                np.array(key_index, dtype=np.int32),
                np.array(steps, dtype=np.int64),
                np.array(values, dtype=np.float64),  # Python floats are float64: exact
                np.array(unix_ms, dtype=np.int64),
            )
        try:
            self._channel.send(item)
        except (OSError, ValueError) as err:  # the launcher closed its end or died
            self.error = err

    def _take_buffered(self) -> None:
        """The queue is empty: move what the loop logged since into it."""
        # Never block here: the loop may hold the lock while it waits for room in the queue this thread drains.
        if not self._lock.acquire(blocking=False):
            return
        try:
            # With the lock held nothing else enters the queue, and only this thread takes from it.
            if self._steps and not self._closed and not self._queue.full():
                self._queue.put_nowait(self._take())
            elif not self._steps:
                self._wake.clear()  # anything queued is taken by the next get()
        finally:
            self._lock.release()
