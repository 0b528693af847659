"""How the launcher reads a failed job: which rank caused it (a peer's connection error never did), where a silent
rank stands and in which collective it waits, and the failure that carries the rank and its traceback to whoever
records it. The ranks write what they died of (harness/runtime/rank/failure.py); this reads it."""

from __future__ import annotations

import contextlib
import json
import os
import re
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import version  # its file is in the package's folder
from harness.errors import RunFailed
from harness.executors import procs
from harness.runtime.rank.failure import last_line
from harness.runtime.rank.progress import DONE, TEARDOWN
from harness.runtime.rank.spec import LaunchSpec

# Signals that come from outside a rank (the OOM killer's SIGKILL, a user's kill), unlike a fault of its own code
# (SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL): a rank they killed says nothing of what the code does.
FROM_OUTSIDE = frozenset({"SIGKILL", "SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT"})


def phase(step: int) -> str:
    if step == TEARDOWN or step == DONE:
        return "in its teardown after training"
    return "before its first step" if step < 0 else f"at step {step}"


FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)', re.M)
# torch.distributed's own wrappers (the c10d logger's, a decorator's) around the call that names the collective.
_WRAPPERS = frozenset({"wrapper", "inner", "_wrapper", "decorate_context"})
_DISTRIBUTED = os.sep + os.path.join("torch", "distributed") + os.sep
_AUTOGRAD = os.sep + os.path.join("torch", "autograd") + os.sep
_DDP = os.sep + os.path.join("torch", "nn", "parallel") + os.sep


@dataclass(frozen=True)
class StackLocation:
    """Where a rank's main thread stood when its stacks were dumped."""

    frame: str | None  # "train.py:21 (train)": the experiment's innermost frame, else the innermost one
    kind: str  # own: the stack ends in the experiment's code; call: inside a library it called; other
    collective: str | None  # the torch.distributed call (all_reduce, barrier, ...) the thread waits in, if any
    waits: str | None = None  # DATALOADER, SUBPROCESS or CHILD: the thread waits for a process the rank started
    on: str = ""  # that process, once the launcher has looked: "DataLoader worker pid 4242"

    def describe(self) -> str:
        """' waiting in all_reduce called at train.py:21 (train)', or what of it is known."""
        if self.waits and not self.collective:
            what = self.on or _WAITED[self.waits]
            return f" waiting for {what}" + (f" at {self.frame}" if self.frame else "")
        if self.frame is None:
            return f" waiting in {self.collective}" if self.collective else ""
        if self.kind == "own":
            return f" in {self.frame}"
        if self.collective:
            return f" waiting in {self.collective} called at {self.frame}"
        return f" waiting in a call made at {self.frame}" if self.kind == "call" else f" in {self.frame}"


DATALOADER, SUBPROCESS, CHILD = "dataloader", "subprocess", "child"
_WAITED = {DATALOADER: "its DataLoader workers", SUBPROCESS: "a subprocess", CHILD: "a child process"}
_DATALOADER = os.sep + os.path.join("torch", "utils", "data") + os.sep
_STDLIB = os.path.dirname(os.__file__) + os.sep


def _collective(frames: list[re.Match[str]]) -> str | None:
    """The collective a stack (innermost frame first) waits in: torch.distributed's innermost public call, or DDP's
    gradient all-reduce for a thread inside backward() or DDP's forward."""
    for f in frames:
        path = f["file"]
        if _DISTRIBUTED in path and f["func"] not in _WRAPPERS and not f["func"].startswith("_"):
            return str(f["func"])
    for f in frames:
        if _DDP in f["file"]:
            return f"DDP's {f['func'].strip('_')}"
        if _AUTOGRAD in f["file"]:
            return "backward (DDP's gradient all-reduce)"
    return None


def _waits(frames: list[re.Match[str]]) -> str | None:
    """The kind of process a stack (innermost frame first) waits for: a DataLoader's worker, a subprocess, another
    child (multiprocessing's join)."""
    paths = [f["file"] for f in frames]
    if any(_DATALOADER in p for p in paths):
        return DATALOADER
    if _STDLIB + "subprocess.py" in paths:
        return SUBPROCESS
    if any(p.startswith(_STDLIB + "multiprocessing" + os.sep) and f["func"] in ("join", "wait", "poll")
           for p, f in zip(paths, frames)):
        return CHILD
    return None


def stack_location(path: Path, code_dir: str) -> StackLocation:
    """Where the main thread's dumped stack is, and in which collective it waits (see StackLocation)."""
    try:
        dump = path.read_text(errors="replace")
    except OSError:
        return StackLocation(None, "other", None)
    root = os.path.realpath(code_dir) + os.sep
    # faulthandler prints one block per thread, innermost frame first; the main thread runs rank_main
    # (harness/runtime/rank/process.py).
    for block in re.split(r"\n(?=(?:Current thread|Thread) 0x)", dump):
        frames = list(FRAME.finditer(block))
        if not any(f["func"] == "rank_main" for f in frames):
            continue
        collective, waits = _collective(frames), _waits(frames)
        for i, f in enumerate(frames):
            if os.path.realpath(f["file"]).startswith(root):
                where = f"{os.path.relpath(f['file'], code_dir)}:{f['line']} ({f['func']})"
                return StackLocation(where, "own" if i == 0 else "call", collective, waits)
        if frames:
            # Outside the experiment (harness's own teardown, a framework): the innermost frame that is not torch's.
            torch_dir = os.sep + "torch" + os.sep
            f = next((f for f in frames if torch_dir not in f["file"]), frames[0])
            return StackLocation(f"{_short(f['file'])}:{f['line']} ({f['func']})", "other", collective, waits)
    return StackLocation(None, "other", None)


def _short(path: str) -> str:
    """A path under site-packages or harness's own folder from the package's name on (harness/executors/launch.py)."""
    own = os.path.dirname(os.path.dirname(os.path.abspath(version.__file__))) + os.sep
    if path.startswith(own):
        return path[len(own):]
    marker = os.sep + "site-packages" + os.sep
    return path.split(marker, 1)[1] if marker in path else path


def diagnose(spec: LaunchSpec, err: procs.RankFailed) -> tuple[int, str, str, bool, bool]:
    """(rank, one line, traceback, whether the line says it all, whether it only lost a peer) of the failure that
    caused the others: a peer's connection error never is."""
    records: list[dict[str, Any]] = []
    for path in sorted(Path(spec.log_dir).glob("rank*.error.json")):
        with contextlib.suppress(OSError, ValueError):
            records.append(json.loads(path.read_text()))
    failing = spec.global_rank(err.error_index)
    root: dict[str, Any]
    if isinstance(err, procs.RankExited) and not any(r["rank"] == failing for r in records):
        how = f"was killed by {err.signal_name}" if err.signal_name else f"exited with code {err.exit_code}"
        root = {"rank": failing, "line": how, "expected": True, "traceback": str(err)}
        line = f"rank {failing} {how}"
    else:
        causes = [r for r in records if not r["peer"]] or records
        if causes:
            first = min(causes, key=lambda r: r["time"])
            # Ranks that failed alike (every rank importing a broken entry) are one cause: name the lowest.
            root = min((r for r in causes if r["line"] == first["line"]), key=lambda r: r["rank"])
        else:  # it died before it could say why: spawn's own report is all there is
            text = err.traceback_text if isinstance(err, procs.RankRaised) else str(err)
            root = {"rank": failing, "line": last_line(text), "expected": False, "traceback": text}
        line = f"rank {root['rank']}: {root['line']}" if root["expected"] else f"rank {root['rank']} raised: {root['line']}"
    others = [r for r in records if r["rank"] != root["rank"]]
    for words, group in (
        ("failed the same way", [r for r in others if not r["peer"] and r["line"] == root["line"]]),
        ("failed too", [r for r in others if not r["peer"] and r["line"] != root["line"]]),
        ("stopped as a consequence", [r for r in others if r["peer"]]),
    ):
        if group:
            ranks = sorted(r["rank"] for r in group)
            line += f" ({'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))} {words})"
    return root["rank"], line, root["traceback"], bool(root["expected"]), bool(root.get("peer"))


class RankError(Exception):
    """Carries the failing rank and its traceback from launch() to whoever records the failure."""

    def __init__(self, rank: int | None, traceback_text: str, expected: bool = False, peer: bool = False,
                 signal_name: str | None = None) -> None:
        super().__init__(traceback_text)
        self.signal_name = signal_name  # the failing rank was killed by this signal (none the launcher sent)
        self.rank = rank
        self.traceback_text = traceback_text
        self.expected = expected  # the one line says it all: no traceback for the terminal
        self.peer = peer  # the failing rank only lost a peer: the cause is elsewhere (another node)


def failed(line: str, rank: int | None, cls: type[RunFailed] = RunFailed, traceback_text: str | None = None,
           signal_name: str | None = None) -> RunFailed:
    """A failure blamed on `rank` when known; without `traceback_text` its one line says it all; `signal_name`: what
    killed that rank, from outside."""
    err = cls(line)
    err.__cause__ = RankError(rank, traceback_text or line, traceback_text is None, signal_name=signal_name)
    return err


def is_peer_failure(err: BaseException) -> bool:
    return isinstance(err.__cause__, RankError) and err.__cause__.peer


def killed_by(err: BaseException) -> str | None:
    """The signal that killed the failing rank (SIGKILL: the OOM killer, a user's kill -9), when that is the failure."""
    cause = err.__cause__
    return cause.signal_name if isinstance(cause, RankError) else None


def failure_details(err: BaseException) -> tuple[int | None, str, bool]:
    """(failing rank, its traceback, whether the error's one line says it all)."""
    cause = err.__cause__
    if isinstance(cause, RankError):
        return cause.rank, cause.traceback_text, cause.expected
    return None, "".join(traceback.format_exception(err)), False


def rank_failed(record: dict[str, Any]) -> RunFailed:
    """The job's failure for a rank's failure record (see failure_record)."""
    rank, line = record["rank"], record["line"]
    err = RunFailed(f"rank {rank}: {line}" if record["expected"] else f"rank {rank} raised: {line}")
    err.__cause__ = RankError(rank, record["traceback"], bool(record["expected"]), bool(record["peer"]))
    return err

