"""What a rank died of: one line naming the user's file and line, whether it is only a peer's consequence, and the
traceback from the user's code on, written where the launcher reads it (harness/executors/failures.py)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
import traceback
from pathlib import Path
from typing import Any

from harness import version  # its file is in the package's folder
from harness.errors import HarnessError
from harness.runtime.rank.spec import LaunchSpec
from harness.runtime.refusals import refusal_line, refused_op

# Errors a rank raises only because a peer died or hung: they are consequences, never the cause. An NCCL error
# is one only where it says so (ncclRemoteError's "remote process exited", a connection the peer closed, a
# communicator aborted on another rank): "ProcessGroupNCCL" names the layer, not who failed, and a rank's own
# ncclInternalError, invalid usage or watchdog timeout is the cause of its job's failure.
_PEER_ERROR = re.compile(
    r"Connection (closed|reset) by (remote )?peer|Broken pipe|Connection refused|ProcessGroupGloo|"
    r"remote process exited|ncclRemoteError|NCCL communicator was aborted|Socket Timeout|Timed out waiting|"
    r"recvBytes|sendBytes|DistNetworkError",
    re.I,
)
# "NCCL communicator was aborted on rank N": on another rank, a consequence; on this one, its own abort, which the
# rest of the message (torch adds "Original reason for failure was: ...") judges.
_ABORTED_ON = re.compile(r"NCCL communicator was aborted on rank (\d+)", re.I)


def user_frame(err: BaseException, code_dir: str) -> str | None:
    """'train.py, line 12' for the innermost frame of the traceback that lies in the experiment's code."""
    root = os.path.realpath(code_dir) + os.sep
    found = None
    for frame in traceback.extract_tb(err.__traceback__):
        if os.path.realpath(frame.filename).startswith(root):
            found = f"{os.path.relpath(frame.filename, code_dir)}, line {frame.lineno}"
    return found


def _from_user_code(tb: Any) -> Any:
    """The traceback without harness's own outer frames (the rank's set-up): it starts where the user's code does."""
    own = os.path.dirname(os.path.abspath(version.__file__)) + os.sep  # the whole package, not this layer's folder
    start = tb
    while start is not None and start.tb_frame.f_code.co_filename.startswith(own):
        start = start.tb_next
    return start or tb


def is_peer_error(err: BaseException, rank: int) -> bool:
    """Whether rank `rank` raised `err` only because a peer died, hung or broke the connection (a consequence)."""
    import torch.distributed as dist

    dist_error = getattr(dist, "DistNetworkError", ())
    if isinstance(err, dist_error):
        return True
    text = f"{type(err).__name__}: {err}"
    for own in [m for m in _ABORTED_ON.finditer(text) if int(m.group(1)) == rank][::-1]:
        text = text[: own.start()] + text[own.end() :]
    return bool(_PEER_ERROR.search(text))


def failure_record(spec: LaunchSpec, rank: int, err: BaseException) -> dict[str, Any]:
    """What this rank died of: one line (with the user's file and line), whether that says it all, whether
    it is only a peer's consequence, and the traceback from the user's code on."""
    message = str(err).strip()
    first = message.splitlines()[0] if message else ""
    expected = isinstance(err, HarnessError)
    op = None if expected else refused_op(message)
    if expected:
        line = first
    elif op is not None:  # strict mode's refusal says all there is to say: the op, the line, the way out
        line = refusal_line(op, user_frame(err, spec.code_dir))
        expected = True
    else:
        where = user_frame(err, spec.code_dir)
        line = f"{type(err).__name__}: {first}" + (f" ({where})" if where else "")
    return {
        "rank": rank,
        "time": time.time(),
        "line": line,
        "expected": expected,
        "peer": is_peer_error(err, rank),
        "traceback": "".join(traceback.format_exception(type(err), err, _from_user_code(err.__traceback__))),
    }


def write_failure(spec: LaunchSpec, rank: int, err: BaseException) -> None:
    """What this rank died of, for the launcher to tell cause from consequence; the traceback stays out of the log."""
    record = failure_record(spec, rank, err)
    path = Path(spec.log_dir) / f"rank{rank}.error.json"
    with contextlib.suppress(OSError):
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)  # whole or absent: the launcher may read it while this rank is being stopped


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "unknown error"

