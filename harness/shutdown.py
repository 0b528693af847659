"""Leaving a process whose work is done without Python's teardown of its modules.

Freeing MLflow's, SQLAlchemy's and pandas' modules one by one took 0.6 s of a core at the end of every `harness
run` (measured), and torch's 0.3-0.6 s at the end of every rank, which the launcher waits for: work a bare training
script does not pay in the launcher, and nothing depends on once everything written is closed. The exit handlers
still run (temporary folders, logging), then what Python's teardown would have written is written: the buffers of
the files still open (flush_open_files) and the standard streams.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import io
import itertools
import os
import sys
import threading
from collections.abc import Callable

# The buffered file objects whose unwritten bytes Python's teardown would write when it closes them (a gzip or csv
# writer over one of them keeps its own buffer in one of these too).
_BUFFERED = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom, io.BufferedRWPair)
# How long the flush of the open files may take (a pipe nobody reads, a stalled network filesystem) before the
# process leaves all the same.
FLUSH_S = 5.0


def leave(code: int, first: Callable[[], None] | None = None) -> None:
    """End the process now with `code`, after `first` (a caller's own last step), the exit handlers and a flush of
    the files still open and the standard streams. Returns, doing nothing, while a thread other than the main one is
    still alive and not a daemon (a pool's worker writing a file, a user's saver): the caller then exits as Python
    does, which waits for it.
    """
    if any(t is not threading.main_thread() and not t.daemon and t.is_alive() for t in threading.enumerate()):
        return
    if first is not None:
        first()
    atexit._run_exitfuncs()
    flush_open_files()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a reader that went away (`| head`) has nothing left to read
            stream.flush()
    os._exit(code)


def flush_open_files(deadline_s: float = FLUSH_S) -> None:
    """Flush every buffered Python file still open for writing: what the training code (or any code in this process)
    wrote to a file it never closed or flushed, which Python's teardown writes as it closes the file and os._exit
    would drop. Each file's error (closed meanwhile, a full disk, a reader gone) is its own; a flush that blocks holds
    the process `deadline_s` at most.

    A flush, not a close: closing wrappers in the heap's order could close a file before the wrapper that still writes
    into it. What a close adds beyond the buffer (a gzip trailer, a zip's directory) stays the code's to write (close(),
    a `with` block). Its cost is a walk of the heap, 46-48 ms of a core in a rank with torch loaded (320,000 objects)
    and 24-28 ms in the command's process with MLflow loaded (190,000), against the 0.3-0.6 s of teardown os._exit
    saves (2 cores; at a load of 11, 0.1-0.2 s against 2.5-3 s): cheaper than a normal exit, which is why ranks keep
    leaving fast, and flush first.
    """
    heap = gc.get_objects()
    # The files among them, at C speed: a loop of isinstance() over 320,000 objects (a rank with torch loaded) takes
    # twice as long as looking each one's type up in the few file types found among the heap's 1,100 or so.
    kinds = {kind for kind in set(map(type, heap)) if issubclass(kind, _BUFFERED)}
    files = list(itertools.compress(heap, map(kinds.__contains__, map(type, heap))))
    del heap

    def flush() -> None:
        for file in files:
            with contextlib.suppress(Exception):
                if not file.closed and file.writable():
                    file.flush()

    worker = threading.Thread(target=flush, name="harness-flush", daemon=True)
    worker.start()
    worker.join(deadline_s)
