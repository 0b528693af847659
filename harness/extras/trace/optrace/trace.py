"""What an op trace holds (its ops, their tensors' signatures) and what the diff of two traces says about them.

Plain data, no torch: the trace file, the diff, its rules and its report read these without loading torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Phases (harness.optrace.tracer.OpTracer decides them; see _phase_and_origin).
FORWARD = "forward"
BACKWARD = "backward"
OPTIMIZER = "optimizer"
OTHER = "other"
# Module name of a backward op whose autograd node was not made inside the tracer's forward.
BACKWARD_UNKNOWN_MODULE = "(backward)"


@dataclass(frozen=True)
class TensorSig:
    """A tensor's shape, dtype and the sha256 of its exact bytes in row-major order (whatever its
    strides, so a view and its contiguous copy have the same signature).

    sha256 "" means deliberately not hashed: the contents are undefined (torch.empty), about to be
    overwritten by the op (the destination of normal_, fill_, copy_, out=), or still in flight (a
    functional collective before its wait_tensor). Layouts without plain bytes (sparse, meta) get
    "unhashable:<layout>".
    """

    shape: tuple[int, ...]
    dtype: str
    sha256: str


@dataclass
class OpRecord:
    """One dispatched op."""

    index: int
    op: str  # e.g. "aten.addmm.default"
    # Qualified module path it ran in ("fc1", "layer4.conv2"); the root model is its class name;
    # "" = outside the model. Backward ops: the module whose forward made their autograd node.
    module: str
    phase: str  # FORWARD | BACKWARD | OPTIMIZER | OTHER
    inputs: list[TensorSig | None]  # None for a non-tensor argument
    outputs: list[TensorSig | None]  # in-place ops and collectives: the state after the op
    # "train.py:42  loss = model(x)": the innermost frame under code_dir ("" when none). Backward
    # ops: the forward line that made their autograd node.
    user_line: str
    # The non-tensor arguments (tensors shown as "T"), so a changed shift or size is an input change.
    params: str = ""
    # Accumulation ops only: sha256 of the accumulator plus the multiset of (target, contribution)
    # pairs - equal when the same contributions arrive in another order.
    order_free: str = ""


@dataclass
class Trace:
    ops: list[OpRecord]
    # rank, world_size, step, torch version, determinism and precision settings, plus caller's meta
    meta: dict[str, Any] = field(default_factory=dict)


def op_base(op: str) -> str:
    """"aten.index_add_.default" -> "index_add_"."""
    parts = op.split(".")
    return parts[1] if len(parts) >= 2 else op


# Accumulation ops: OpRecord.order_free holds the digest of their contributions (signatures.order_free_digest), so
# that the same contributions in another order are told from other contributions.
ACCUMULATION_OPS = frozenset({
    "index_add", "index_add_", "scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_",
    "index_put", "index_put_", "_index_put_impl_", "embedding_dense_backward",
    "_embedding_bag_backward", "_embedding_bag_dense_backward", "index_reduce", "index_reduce_",
    "put_", "bincount", "histc",
})


# What the diff of two traces found (harness.optrace.diff.localize).
IDENTICAL = "IDENTICAL"
CULPRIT = "CULPRIT"
INPUTS_DIFFER_FROM_START = "INPUTS_DIFFER_FROM_START"
NOT_ALIGNED = "NOT_ALIGNED"


@dataclass
class Localization:
    status: str  # IDENTICAL | CULPRIT | INPUTS_DIFFER_FROM_START | NOT_ALIGNED
    index: int | None  # the op (same index in both traces); None when IDENTICAL
    a: OpRecord | None
    b: OpRecord | None
    likely_cause: str | None  # from harness.extras.trace.optrace.rules; None when no rule knows
    detail: list[str]  # human lines: shapes, dtypes, which tensors differ, ops matched before
    # True when the culprit's inputs are equal only as a multiset of contributions (see order_free)
    order_only: bool = False
    # True when a trace was made with no model given (meta "model" None): an op's empty module means "not known",
    # not "outside the model"
    model_unknown: bool = False
    # True at INPUTS_DIFFER_FROM_START when the op's tensor inputs are equal and only its non-tensor arguments
    # differ (a hyper-parameter such as the learning rate): the difference is pinned on this op already
    arguments_only: bool = False


def describe_sig(s: TensorSig | None) -> str:
    if s is None:
        return "(not a tensor)"
    shape = "[" + ", ".join(str(d) for d in s.shape) + "]"
    digest = s.sha256[:12] if s.sha256 else "not hashed"
    return f"{s.dtype}{shape} {digest}"

