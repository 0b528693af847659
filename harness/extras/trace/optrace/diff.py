"""The diff of two op traces: the first op whose outputs differ while its inputs were equal (or why there is none),
with the likely causes the rules name, and its Markdown and HTML pages."""

from __future__ import annotations

import functools
from collections.abc import Callable

from harness.extras.trace.optrace.report import html, markdown
from harness.extras.trace.optrace.rules import likely_cause
from harness.extras.trace.optrace.trace import (
    CULPRIT,
    IDENTICAL,
    INPUTS_DIFFER_FROM_START,
    NOT_ALIGNED,
    Localization,
    OpRecord,
    TensorSig,
    Trace,
    describe_sig,
)

# Said when no model was given to the tracer: ops inside the model cannot be told from ops outside it.
UNREGISTERED_MODEL = ("harness was given no model (neither ctx.ddp nor ctx.register), so the trace cannot name the "
                      "module an op ran in: where the script wraps the model itself (its own DDP, FSDP, "
                      "torch.compile), call ctx.register(model) with the module inside the wrapper")


def _where(r: OpRecord, model_unknown: bool = False) -> str:
    where = f"in {r.module}" if r.module else ("in a module harness does not know" if model_unknown
                                               else "outside the model")
    return f"{r.op} {where} ({r.phase}) at {r.user_line or 'no line in the user code'}"


def model_unknown(a: Trace, b: Trace) -> bool:
    """A trace made with no model given (a trace from before this was recorded says nothing)."""
    return any("model" in t.meta and t.meta["model"] is None for t in (a, b))


def _differing(xs: list[TensorSig | None], ys: list[TensorSig | None], what: str) -> list[str]:
    lines = []
    for i in range(max(len(xs), len(ys))):
        x = xs[i] if i < len(xs) else None
        y = ys[i] if i < len(ys) else None
        if x != y:
            lines.append(f"{what} {i} differs: {describe_sig(x)} vs {describe_sig(y)}")
    return lines


def localize(a: Trace, b: Trace, hints: dict | None = None) -> Localization:
    """Walk both op sequences in step; the first op with any difference decides:
    equal inputs, different outputs -> CULPRIT; different inputs -> INPUTS_DIFFER_FROM_START (the
    values came from outside the traced step: data, parameters, state, or a non-tensor argument such as
    a learning rate); different op names or lengths -> NOT_ALIGNED; no difference -> IDENTICAL."""
    unknown = model_unknown(a, b)
    loc = _localize(a, b, hints, functools.partial(_where, model_unknown=unknown))
    if unknown and loc.status != IDENTICAL:
        loc.model_unknown = True
        loc.detail.append(UNREGISTERED_MODEL)
    return loc


def _localize(a: Trace, b: Trace, hints: dict | None, _where: Callable[[OpRecord], str]) -> Localization:
    n = min(len(a.ops), len(b.ops))
    for i in range(n):
        x, y = a.ops[i], b.ops[i]
        matched = f"{i} ops before it matched exactly (names, inputs, outputs)"
        if x.op != y.op:
            return Localization(NOT_ALIGNED, i, x, y, None, [
                f"the traces take different paths at op {i}: {x.op} vs {y.op}",
                f"A: {_where(x)}", f"B: {_where(y)}", matched,
                "different ops mean different code or control flow (a data-dependent branch, "
                "another library version): compare the code and the environment first"])
        inputs_equal = x.inputs == y.inputs and x.params == y.params
        if inputs_equal and x.outputs == y.outputs:
            continue
        order_only = (not inputs_equal and x.order_free != "" and x.order_free == y.order_free
                      and x.params == y.params)
        if order_only and x.outputs == y.outputs:
            continue  # same contributions, other order, same bits: nothing differs downstream
        shapes = ", ".join(describe_sig(s).rsplit(" ", 1)[0] for s in x.inputs if s is not None)
        if inputs_equal or order_only:
            detail = [f"op {i}: {_where(x)}",
                      ("its inputs hold the same contributions in a different order"
                       if order_only else "its inputs are identical in both traces")
                      + (f": {shapes}" if shapes else " (it has no tensor inputs)")]
            detail += _differing(x.outputs, y.outputs, "output")
            detail.append(matched)
            loc = Localization(CULPRIT, i, x, y, None, detail, order_only)
            loc.likely_cause = likely_cause(loc, a, b, hints)
            return loc
        arguments_only = x.inputs == y.inputs
        detail = [f"op {i}: {_where(x)}",
                  "its tensor inputs are identical but its non-tensor arguments differ: they came from outside "
                  "the traced step (a setting or hyper-parameter)" if arguments_only else
                  "its inputs already differ, and no earlier op in the step produced them differently: they "
                  "came from outside the traced step (data, parameters or state from before it)"]
        detail += _differing(x.inputs, y.inputs, "input")
        if x.params != y.params:
            detail.append(f"non-tensor arguments differ: ({x.params}) vs ({y.params})")
        detail.append(matched)
        loc = Localization(INPUTS_DIFFER_FROM_START, i, x, y, None, detail, arguments_only=arguments_only)
        loc.likely_cause = likely_cause(loc, a, b, hints)
        return loc
    if len(a.ops) != len(b.ops):
        longer, which = (a, "A") if len(a.ops) > len(b.ops) else (b, "B")
        extra = longer.ops[n]
        return Localization(
            NOT_ALIGNED, n, a.ops[n] if n < len(a.ops) else None,
            b.ops[n] if n < len(b.ops) else None, None,
            [f"trace A has {len(a.ops)} ops, trace B {len(b.ops)}; the first {n} match exactly",
             f"{which} goes on with {_where(extra)}"])
    if n == 0:
        return Localization(IDENTICAL, None, None, None, None,
                            ["both traces are empty: no op was compared (was the step inside "
                             "the tracer?)"])
    sigs = [s for r in a.ops for s in r.inputs + r.outputs if s is not None]
    hashed = sum(bool(s.sha256) and not s.sha256.startswith("unhashable:") for s in sigs)
    detail = [f"no difference found: {n} ops compared, with {hashed} tensor signatures "
              "(shape, dtype, sha256 of the bytes), all identical"]
    if hashed < len(sigs):
        detail.append(f"{len(sigs) - hashed} more tensors were compared by shape and dtype only "
                      "(undefined or overwritten memory, in-flight collectives, tensor subclasses)")
    return Localization(IDENTICAL, None, None, None, None, detail)


def render_markdown(loc: Localization, a: Trace, b: Trace) -> str:
    return markdown(loc, a, b)


def render_html(loc: Localization, a: Trace, b: Trace) -> str:
    return html(loc, a, b)
