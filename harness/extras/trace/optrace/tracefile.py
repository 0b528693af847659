"""The op-trace file: gzip'd JSON lines, written and read back (a corrupt or unknown file is refused)."""

from __future__ import annotations

import gzip
import json
import zlib
from dataclasses import asdict
from typing import Any

from harness.errors import HarnessError
from harness.extras.trace.optrace.trace import OpRecord, TensorSig, Trace

FORMAT = "harness-optrace"
FORMAT_VERSION = 1


def _sig_json(s: TensorSig | None) -> list[Any] | None:
    return None if s is None else [list(s.shape), s.dtype, s.sha256]


def _sig_load(x: Any) -> TensorSig | None:
    if x is None:
        return None
    shape, dtype, sha = x
    return TensorSig(tuple(int(d) for d in shape), str(dtype), str(sha))


def dumps(trace: Trace) -> bytes:
    """gzip'd JSON lines: a header line (format, version, meta), then one line per op. The bytes
    are a function of the trace alone (gzip mtime 0, sorted keys)."""
    lines = [json.dumps({"format": FORMAT, "version": FORMAT_VERSION, "meta": trace.meta,
                         "ops": len(trace.ops)}, sort_keys=True, default=str)]
    for r in trace.ops:
        d = asdict(r)
        d["inputs"] = [_sig_json(s) for s in r.inputs]
        d["outputs"] = [_sig_json(s) for s in r.outputs]
        lines.append(json.dumps(d, sort_keys=True))
    return gzip.compress(("\n".join(lines) + "\n").encode("utf-8"), mtime=0)


def loads(data: bytes) -> Trace:
    """Read dumps' bytes back; a corrupt file or an unknown format version is a HarnessError."""
    how = "make the trace again with this harness (harness trace RUN_ID --step K)"
    try:
        text = gzip.decompress(data).decode("utf-8")
    except (OSError, EOFError, zlib.error, UnicodeDecodeError) as e:
        raise HarnessError(f"not a readable op trace (not gzip'd UTF-8: {e}); {how}") from None
    lines = text.splitlines()
    try:
        header = json.loads(lines[0]) if lines else None
    except json.JSONDecodeError:
        header = None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise HarnessError(f"not an op trace (its first line is not a {FORMAT} header); {how}")
    if header.get("version") != FORMAT_VERSION:
        raise HarnessError(f"op trace format version {header.get('version')!r} is not supported "
                           f"(this harness reads version {FORMAT_VERSION}); {how}")
    ops: list[OpRecord] = []
    try:
        for i, line in enumerate(lines[1:]):
            d = json.loads(line)
            ops.append(OpRecord(
                index=int(d["index"]), op=str(d["op"]), module=str(d["module"]),
                phase=str(d["phase"]), inputs=[_sig_load(s) for s in d["inputs"]],
                outputs=[_sig_load(s) for s in d["outputs"]], user_line=str(d["user_line"]),
                params=str(d.get("params", "")), order_free=str(d.get("order_free", ""))))
            if ops[-1].index != i:
                raise ValueError(f"op line {i + 1} has index {ops[-1].index}")
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise HarnessError(f"corrupt op trace at op line {len(ops) + 1} ({e}); {how}") from None
    if header.get("ops") != len(ops):
        raise HarnessError(f"truncated op trace: the header promises {header.get('ops')} ops, "
                           f"{len(ops)} are there; {how}")
    meta = header.get("meta")
    return Trace(ops=ops, meta=meta if isinstance(meta, dict) else {})

