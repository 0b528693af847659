"""Op-level traces of one training step, and the diff that finds the first op whose outputs differ."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from harness.errors import HarnessError

FORMAT_VERSION = 1


@dataclass(frozen=True)
class TensorSig:
    """A tensor's dtype, shape and the sha256 of its exact bytes (row-major, whatever its strides).

    sha256 "" means deliberately not hashed: the contents are undefined (torch.empty) or about to be
    overwritten by the op (the destination of normal_, fill_, copy_, out=).
    """

    shape: tuple[int, ...]
    dtype: str
    sha256: str


@dataclass
class OpRecord:
    index: int
    op: str
    module: str
    phase: str
    inputs: list[TensorSig | None]
    outputs: list[TensorSig | None]
    user_line: str
    # The non-tensor arguments (tensors shown as "T"), so a changed shift or size is an input change.
    params: str = ""
    # Accumulation ops only: sha256 of the multiset of (target, contribution) pairs, equal when the
    # same contributions arrive in another order.
    order_free: str = ""


@dataclass
class Trace:
    ops: list[OpRecord]
    meta: dict[str, Any] = field(default_factory=dict)


class OpTracer:
    """Context manager around one training step that records every dispatched op."""

    def __init__(self, code_dir: str, model: torch.nn.Module | None = None,
                 meta: dict | None = None) -> None:
        raise NotImplementedError

    def __enter__(self) -> "OpTracer":
        raise NotImplementedError

    def __exit__(self, *exc: object) -> None:
        raise NotImplementedError

    def result(self) -> Trace:
        raise NotImplementedError


def dumps(trace: Trace) -> bytes:
    raise NotImplementedError


def loads(data: bytes) -> Trace:
    raise NotImplementedError


IDENTICAL = "IDENTICAL"
CULPRIT = "CULPRIT"
INPUTS_DIFFER_FROM_START = "INPUTS_DIFFER_FROM_START"
NOT_ALIGNED = "NOT_ALIGNED"


@dataclass
class Localization:
    status: str
    index: int | None
    a: OpRecord | None
    b: OpRecord | None
    likely_cause: str | None
    detail: list[str]


def localize(a: Trace, b: Trace, hints: dict | None = None) -> Localization:
    raise NotImplementedError


def render_markdown(loc: Localization, a: Trace, b: Trace) -> str:
    raise NotImplementedError


def render_html(loc: Localization, a: Trace, b: Trace) -> str:
    raise NotImplementedError
