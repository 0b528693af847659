"""Nothing a job started outlives it: every rank's process group is ended with the job, and a guardian ends them when
the launcher itself could not (SIGKILLed, OOM-killed).

Each rank leads a process group of its own (runtime/rank/family.py): its DataLoader workers, its subprocesses and
theirs are in it unless they made a session of their own. Once the ranks are gone the launcher signals each group
(`end_groups`); a group that is already empty costs one ESRCH. The guardian is a `sh` in a session of its own that
reads the ranks' group ids from a pipe whose only writer is the launcher: at end of file without the launcher's last
word - the launcher died - it ends those groups itself, then exits. It holds nothing else and costs one fork and exec
per launch.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterable

_GRACE_S = 2.0  # SIGTERM, then SIGKILL

# Reads group ids, one a line; "done" means the launcher ended them itself. At end of file (the launcher is gone)
# it ends every group it was told of. A group id is a number written by harness, never user input.
_GUARD = r"""
groups=""
while read -r word; do
  case $word in
    done) exit 0 ;;
    *[!0-9]*|"") ;;
    *) groups="$groups $word" ;;
  esac
done
[ -n "$groups" ] || exit 0
for g in $groups; do kill -TERM "-$g" 2>/dev/null; done
sleep 2
for g in $groups; do kill -KILL "-$g" 2>/dev/null; done
exit 0
"""


class Guardian:
    """The process that ends the ranks' groups if the launcher dies before it could."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        with contextlib.suppress(OSError):  # no sh: the launcher's own ending is all there is
            self._proc = subprocess.Popen(
                # Named, with the launcher's pid, for whoever reads the process list.
                ["sh", "-c", _GUARD, "harness-guardian", str(os.getpid())],
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True, cwd="/",  # no terminal's signals; no folder held open
            )

    def watch(self, pgid: int) -> None:
        self._say(f"{int(pgid)}\n")

    def close(self) -> None:
        """The launcher ended the groups itself: the guardian leaves without touching them."""
        if self._proc is None:
            return
        self._say("done\n")
        with contextlib.suppress(OSError):
            assert self._proc.stdin is not None
            self._proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=5)
        self._proc = None

    def _say(self, line: str) -> None:
        if self._proc is None or self._proc.stdin is None:
            return
        with contextlib.suppress(OSError, ValueError):
            self._proc.stdin.write(line.encode())
            self._proc.stdin.flush()


def group_members(pgid: int) -> list[int]:
    """The living processes of process group `pgid` (zombies left out: they are gone, only not yet reaped)."""
    import psutil

    found = []
    for p in psutil.process_iter(["pid"]):
        with contextlib.suppress(psutil.Error, OSError):
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p.pid)
    return found


def end_groups(pgids: Iterable[int], grace_s: float = _GRACE_S) -> list[int]:
    """End what is left of each process group (SIGTERM, up to `grace_s`, SIGKILL); the pids that were left."""
    pgids = [int(g) for g in pgids if g]
    left = [pid for g in pgids for pid in group_members(g)]
    if not left:
        return []
    for g in pgids:
        with contextlib.suppress(OSError):
            os.killpg(g, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(group_members(g) for g in pgids):
        time.sleep(0.05)
    for g in pgids:
        with contextlib.suppress(OSError):
            os.killpg(g, signal.SIGKILL)
    return left
