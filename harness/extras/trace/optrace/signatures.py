"""Signatures of what an op reads and writes: the exact hash of a tensor's bytes, its non-tensor arguments, the
order-free digest of an accumulation's contributions, and the tensors its schema says it writes."""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from harness.extras.trace.optrace.trace import TensorSig


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer)


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 of a tensor's elements' bytes in row-major order (views and strides resolved)."""
    if t.layout != torch.strided or t.device.type == "meta":
        return f"unhashable:{str(t.layout).removeprefix('torch.')}"
    if type(t) not in _PLAIN_TENSORS:
        # A tensor subclass (DTensor, FakeTensor...) has no bytes of its own on this rank to read.
        return f"unhashable:{type(t).__name__}"
    try:
        # force=True: detached, on the CPU, conjugate and negative bits resolved.
        array = t.numpy(force=True)
    except TypeError:  # a dtype numpy lacks (bfloat16, float8): its bytes through a uint8 view
        c = t.detach().resolve_conj().resolve_neg().cpu().contiguous().reshape(-1)
        return hashlib.sha256(c.view(torch.uint8).numpy().data).hexdigest()
    if not array.flags.c_contiguous:
        import numpy as np

        array = np.ascontiguousarray(array)  # row-major, whatever the view's strides were
    return hashlib.sha256(array.reshape(-1).view("u1").data).hexdigest()


def tensor_sig(t: torch.Tensor, hashed: bool = True) -> TensorSig:
    return TensorSig(tuple(t.shape), _dtype_name(t.dtype), tensor_sha256(t) if hashed else "")


_PLAIN = (bool, int, float, complex, str, type(None), torch.dtype, torch.device, torch.layout,
          torch.memory_format, slice, type(Ellipsis))


def params_repr(args: tuple, kwargs: dict) -> str:
    def show(x: Any) -> str:
        if isinstance(x, torch.Tensor):
            return "T"
        if isinstance(x, (list, tuple)):
            inner = ", ".join(show(v) for v in x)
            return f"[{inner}]" if isinstance(x, list) else f"({inner})"
        if isinstance(x, _PLAIN):
            return repr(x)
        # Anything else (a Generator, a ScriptObject) would show its address, which differs in
        # every process: its type is what can be compared.
        return type(x).__name__

    parts = [show(a) for a in args] + [f"{k}={show(v)}" for k, v in sorted(kwargs.items())]
    return ", ".join(parts)


def _rows_bytes(t: torch.Tensor, n: int) -> Any:
    """(n, k) uint8 numpy array: row i holds the exact bytes of t's i-th slice along dim 0."""
    c = t.detach().resolve_conj().resolve_neg().cpu().contiguous()
    return c.reshape(-1).view(torch.uint8).numpy().reshape(n, -1)


def _multiset_digest(accumulator: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> str:
    """sha256 of the accumulator's bytes plus the sorted (key, value-bytes) rows: any order of the
    same contributions gives the same digest."""
    import numpy as np

    n = keys.numel()
    k = _rows_bytes(keys.reshape(n, -1).to(torch.int64), n) if n else np.zeros((0, 8), np.uint8)
    v = _rows_bytes(values.reshape(n, -1), n) if n else np.zeros((0, 0), np.uint8)
    rows = np.concatenate([k, v], axis=1)
    if len(rows):
        rows = rows[np.lexsort(rows.T[::-1])]
    h = hashlib.sha256(tensor_sha256(accumulator).encode())
    h.update(rows.tobytes())
    return h.hexdigest()


def order_free_digest(base: str, args: tuple, kwargs: dict) -> str:
    """The order-free digest of an accumulation op's contributions ("" for other ops or shapes
    this does not cover)."""
    try:
        if base in ("index_add", "index_add_"):
            self_, dim, index, source = args[:4]
            src = source.movedim(dim, 0) if source.dim() else source.reshape(1)
            return _multiset_digest(self_, index.reshape(-1), src)
        if base in ("index_put", "index_put_", "_index_put_impl_"):
            self_, indices, values = args[:3]
            accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
            idx = [i for i in indices if i is not None]
            if not accumulate or len(idx) != 1 or idx[0].dtype == torch.bool or idx[0].dim() != 1:
                return ""
            n = idx[0].numel()
            return _multiset_digest(self_, idx[0], values.expand(n, *self_.shape[1:]))
        if base in ("scatter_add", "scatter_add_"):
            self_, dim, index, src = args[:4]
            # Each contribution's target is the element index with `dim` replaced by its index.
            coords = torch.stack(torch.meshgrid(
                *[torch.arange(s) for s in index.shape], indexing="ij"), dim=-1)
            coords[..., dim] = index
            strides = torch.tensor(self_.stride() if self_.is_contiguous()
                                   else torch.empty(self_.shape).stride())
            target = (coords * strides).sum(-1).reshape(-1)
            vals = src[tuple(slice(0, s) for s in index.shape)].reshape(-1, 1)
            return _multiset_digest(self_, target, vals)
        if base == "embedding_dense_backward":
            grad, indices = args[:2]
            n = indices.numel()
            return _multiset_digest(torch.empty(0), indices.reshape(-1), grad.reshape(n, -1))
    except (TypeError, ValueError, IndexError, RuntimeError):
        return ""  # an overload whose arguments this does not read: compare the plain inputs
    return ""


_WRITES: dict[Any, tuple[tuple[int, str, bool], ...]] = {}


def written_args(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors the op's schema marks as written (Tensor(a!)), in argument order."""
    writes = _WRITES.get(func)
    if writes is None:
        schema = getattr(func, "_schema", None)
        writes = tuple((i, a.name, a.kwarg_only) for i, a in enumerate(schema.arguments)
                       if a.alias_info is not None and a.alias_info.is_write) if schema else ()
        _WRITES[func] = writes
    written: list[torch.Tensor] = []
    for i, name, kwarg_only in writes:
        value = args[i] if i < len(args) and not kwarg_only else kwargs.get(name)
        written += [t for t in flat_tensors(value) if isinstance(t, torch.Tensor)]
    return written


def flat_tensors(x: Any) -> list[Any]:
    """Leaves of the (nested) tuples, lists and dicts an op takes and returns, in order."""
    if isinstance(x, (tuple, list)):
        if all(not isinstance(v, (tuple, list, dict)) for v in x):
            return list(x)
        return [leaf for v in x for leaf in flat_tensors(v)]
    if isinstance(x, dict):
        return [leaf for v in x.values() for leaf in flat_tensors(v)]
    return [x]

