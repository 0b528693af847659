"""Op-level traces of one training step (every dispatched op, its module, its tensors' exact hashes
and the user's line that called it), and the diff that finds the first op whose outputs differ.

Pure torch: no tracking store, no run machinery. The capture is a TorchDispatchMode of our own
rather than torch.utils._debug_mode.DebugMode: DebugMode hashes with torch.hash_tensor over a
float64 copy (a reduction, not the exact bytes), stringifies every call's arguments (cost we do
not need), keeps its hooks in process-global lists, and its ModTracker names no module for a
backward op. What it does well - a dispatch mode under autograd - is what this module does too.

Rules that read a trace pair and name a likely cause are in harness/optrace/rules.py; the
Markdown and HTML pages in harness/optrace/report.py.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import linecache
import os
import sys
import weakref
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from importlib import metadata
from types import FrameType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from harness.errors import HarnessError
from harness.optrace import hooks
from harness.optrace.report import html, markdown
from harness.optrace.rules import likely_cause

FORMAT = "harness-optrace"
FORMAT_VERSION = 1

# Phases (OpTracer decides them; see _phase).
FORWARD = "forward"
BACKWARD = "backward"
OPTIMIZER = "optimizer"
OTHER = "other"
# Module name of a backward op whose autograd node was not made inside the tracer's forward.
BACKWARD_UNKNOWN_MODULE = "(backward)"

# Ops whose output holds undefined memory: hashing it would report garbage as a difference.
_UNINITIALIZED_OUTPUT = frozenset({
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted",
    "resize_",
})
# In-place ops that overwrite their first argument without reading it: its prior contents are
# not an input (torch.empty().normal_() must not count the empty memory as differing data).
_OVERWRITES_SELF = frozenset({
    "normal_", "uniform_", "random_", "exponential_", "geometric_", "cauchy_", "log_normal_",
    "bernoulli_", "fill_", "zero_", "copy_", "set_",
})


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


def _params_repr(args: tuple, kwargs: dict) -> str:
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


def _order_free(base: str, args: tuple, kwargs: dict) -> str:
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


ACCUMULATION_OPS = frozenset({
    "index_add", "index_add_", "scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_",
    "index_put", "index_put_", "_index_put_impl_", "embedding_dense_backward",
    "_embedding_bag_backward", "_embedding_bag_dense_backward", "index_reduce", "index_reduce_",
    "put_", "bincount", "histc",
})


_WRITES: dict[Any, tuple[tuple[int, str, bool], ...]] = {}


def _written_args(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
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
        written += [t for t in _flat_tensors(value) if isinstance(t, torch.Tensor)]
    return written


def _flat_tensors(x: Any) -> list[Any]:
    """Leaves of the (nested) tuples, lists and dicts an op takes and returns, in order."""
    if isinstance(x, (tuple, list)):
        if all(not isinstance(v, (tuple, list, dict)) for v in x):
            return list(x)
        return [leaf for v in x for leaf in _flat_tensors(v)]
    if isinstance(x, dict):
        return [leaf for v in x.values() for leaf in _flat_tensors(v)]
    return [x]


def _read(fn: Any) -> Any:
    """fn()'s answer as a JSON value; None where this torch (or its build) has no such setting."""
    try:
        value = fn()
    except (AttributeError, RuntimeError, AssertionError, ImportError):
        return None
    return value if isinstance(value, (bool, int, str, type(None))) else str(value)


def _settings() -> dict[str, Any]:
    """Determinism and precision settings of this process, read back (not what was asked for)."""
    read = _read
    b = torch.backends
    return {
        "deterministic_algorithms": read(torch.are_deterministic_algorithms_enabled),
        "deterministic_warn_only": read(torch.is_deterministic_algorithms_warn_only_enabled),
        # torch fills the memory of torch.empty & co. with NaN (or the integer maximum) under deterministic
        # algorithms unless this is off: off, such memory holds whatever was there before.
        "fill_uninitialized_memory": read(lambda: torch.utils.deterministic.fill_uninitialized_memory),  # type: ignore[attr-defined]  # a module property torch's stubs do not declare
        "cudnn_deterministic": read(lambda: b.cudnn.deterministic),
        "cudnn_benchmark": read(lambda: b.cudnn.benchmark),
        "num_threads": read(torch.get_num_threads),
        "float32_matmul_precision": read(torch.get_float32_matmul_precision),
        "cuda_matmul_allow_tf32": read(lambda: b.cuda.matmul.allow_tf32),
        "cudnn_allow_tf32": read(lambda: b.cudnn.allow_tf32),
        "cuda_matmul_allow_fp16_reduced_precision_reduction":
            read(lambda: b.cuda.matmul.allow_fp16_reduced_precision_reduction),
        "cuda_matmul_allow_bf16_reduced_precision_reduction":
            read(lambda: b.cuda.matmul.allow_bf16_reduced_precision_reduction),
        "mkldnn_enabled": read(lambda: b.mkldnn.enabled),
        "mkldnn_matmul_fp32_precision": read(lambda: b.mkldnn.matmul.fp32_precision),  # type: ignore[attr-defined]  # newer torch only; read() answers None without it
        "mkldnn_conv_fp32_precision": read(lambda: b.mkldnn.conv.fp32_precision),  # type: ignore[attr-defined]  # newer torch only; read() answers None without it
        # The TF32 API of torch >= 2.9 ("ieee" | "tf32" | "none" = inherit from the level above); older torch has
        # none of these (read() answers None), and allow_tf32 above is then the whole story.
        "fp32_precision": read(lambda: b.fp32_precision),  # type: ignore[attr-defined]  # newer torch only
        "cuda_matmul_fp32_precision": read(lambda: b.cuda.matmul.fp32_precision),
        "cudnn_fp32_precision": read(lambda: b.cudnn.fp32_precision),
        "cudnn_conv_fp32_precision": read(lambda: b.cudnn.conv.fp32_precision),  # type: ignore[attr-defined]  # newer torch only
        "cudnn_rnn_fp32_precision": read(lambda: b.cudnn.rnn.fp32_precision),  # type: ignore[attr-defined]  # newer torch only
        "mkldnn_fp32_precision": read(lambda: b.mkldnn.fp32_precision),
        # Which scaled_dot_product_attention kernels may be picked: each computes attention in its own order.
        "flash_sdp_enabled": read(b.cuda.flash_sdp_enabled),
        "mem_efficient_sdp_enabled": read(b.cuda.mem_efficient_sdp_enabled),
        "math_sdp_enabled": read(b.cuda.math_sdp_enabled),
        "cudnn_sdp_enabled": read(b.cuda.cudnn_sdp_enabled),
        "flush_denormal": _flush_denormal(),
    }


# The global generators a step may draw from, as meta keys: their state digests at the start of the traced step
# tell a generator reseeded (or drawn from more often) before the step from arithmetic inside it.
GENERATOR_KEYS = ("rng_torch", "rng_cuda", "rng_numpy", "rng_python")


def _generator_states() -> dict[str, str | None]:
    """sha256 (16 hex) of each global generator's state now; None for CUDA's before CUDA is in use."""
    import random

    import numpy as np

    def digest(data: bytes) -> str:
        return hashlib.sha256(data).hexdigest()[:16]

    kind, keys, pos, gauss, cached = np.random.get_state()
    return {
        "rng_torch": digest(torch.get_rng_state().numpy().tobytes()),
        "rng_cuda": digest(torch.cuda.get_rng_state().numpy().tobytes()) if torch.cuda.is_initialized() else None,
        "rng_numpy": digest(f"{kind}:{pos}:{gauss}:{cached}:".encode() + np.asarray(keys).tobytes()),
        "rng_python": digest(repr(random.getstate()).encode()),
    }


def _device_facts(device: torch.device) -> dict[str, Any]:
    """The device the step ran on and the numerical libraries this process has loaded for it: a trace made on
    another GPU, or with another cuDNN, may differ without any setting having changed."""
    facts: dict[str, Any] = {"device": str(device), "device_name": None, "compute_capability": None,
                             "cpu_capability": _read(torch.backends.cpu.get_cpu_capability)}
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        facts["device_name"] = _read(lambda: torch.cuda.get_device_name(index))
        facts["compute_capability"] = _read(lambda: ".".join(map(str, torch.cuda.get_device_capability(index))))
    facts["cuda_version"] = torch.version.cuda  # the toolkit torch was built with: None on a CPU build
    facts["cudnn_version"] = _read(torch.backends.cudnn.version)  # None without cuDNN
    # A CPU build uses no cuBLAS, whatever nvidia-cublas package an earlier CUDA install left in site-packages.
    facts["cublas_version"] = _cublas_version() if torch.version.cuda is not None else None
    facts["nccl_version"] = _read(lambda: ".".join(map(str, torch.cuda.nccl.version())))  # no NCCL: None
    return facts


def _cublas_version() -> str | None:
    """The cuBLAS of torch's CUDA wheels (the nvidia-cublas package they depend on); None when it is not a
    package (a CPU build, or CUDA from the system, where torch.version.cuda is what there is to say)."""
    for name in ("nvidia-cublas-cu12", "nvidia-cublas-cu13", "nvidia-cublas", "nvidia-cublas-cu11"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _flush_denormal() -> bool:
    # torch has a setter (set_flush_denormal) but no getter: a denormal times one reads back as
    # zero exactly when the CPU flushes denormals (FTZ/DAZ).
    tiny = torch.tensor([1e-40], dtype=torch.float32)
    return bool((tiny * 1.0).item() == 0.0)


# code_dir -> {co_filename: its absolute path when it lies under code_dir, else ""}, shared by tracers of the
# same code.
_USER_FILES: dict[str, dict[str, str]] = {}


class _Origins(TorchFunctionMode):
    """Above autograd: tags each autograd node made in the step with the module and user line of
    the torch call that made it, so a backward op can name the forward that caused it."""

    def __init__(self, tracer: OpTracer) -> None:
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        tracer = self.tracer
        if func is torch.Tensor.backward:
            tracer._in_backward_call += 1
            try:
                return func(*args, **kwargs)
            finally:
                tracer._in_backward_call -= 1
        out = func(*args, **kwargs)
        if torch.is_grad_enabled() and tracer._in_backward_call == 0:
            roots = [t.grad_fn for t in _flat_tensors(out)
                     if isinstance(t, torch.Tensor) and t.grad_fn is not None]
            if roots:
                tracer._tag_nodes(roots)
        return out


class _Dispatch(TorchDispatchMode):
    def __init__(self, tracer: OpTracer) -> None:
        super().__init__()
        self.tracer = tracer

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        # The hashing below calls torch; the function mode must not see (and tag) those calls.
        with torch._C.DisableTorchFunction():
            return self.tracer._record(func, args, kwargs or {})


class _Push(hooks.ModuleHook):
    """A module's forward begins: its name goes on the tracer's module stack."""

    def __init__(self, stack: list[str], name: str) -> None:
        self.stack, self.name = stack, name

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        self.stack.append(self.name)


class _Pop(hooks.ModuleHook):
    """A module's forward ended (or raised: registered with always_call)."""

    def __init__(self, stack: list[str]) -> None:
        self.stack = stack

    def __call__(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self.stack:
            self.stack.pop()


class OpTracer:
    """Context manager around ONE training step: records every dispatched op (forward, backward,
    optimizer) with its module, phase, exact tensor hashes and the user's line.

    code_dir: the user's code; the innermost stack frame under it is an op's user_line.
    model: hooks on its submodules keep the module stack (None: every op's module is "").
    meta: merged into the trace's meta (e.g. {"step": 412}).
    device: where the step runs (the rank's ctx.device); the meta names it, its GPU and the libraries for it.
        None: this process's current CUDA device once CUDA is in use here, else the CPU.
    """

    def __init__(self, code_dir: str, model: torch.nn.Module | None = None,
                 meta: dict | None = None, optimizer_hooks: bool = True,
                 device: torch.device | str | None = None) -> None:
        self.code_dir = os.path.realpath(code_dir) + os.sep
        self.model = model
        if device is None:
            cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
            device = torch.device("cuda", torch.cuda.current_device()) if cuda else "cpu"
        self.device = torch.device(device)
        self.user_meta = dict(meta or {})
        self.ops: list[OpRecord] = []
        self.meta: dict[str, Any] = {}
        self._module_stack: list[str] = []
        self._handles: list[Any] = []
        self._in_optimizer = 0
        self._in_backward_call = 0
        # id(autograd node) -> (node, module, user_line) of the forward call that made it; the
        # node is held so that its id cannot be reused by another node during the step.
        self._node_origin: dict[int, tuple[Any, str, str]] = {}
        self._hash_cache: dict[int, tuple[Any, tuple[int, int], TensorSig]] = {}
        self._line_cache: dict[tuple[str, int], str] = {}
        self._is_user_file = _USER_FILES.setdefault(self.code_dir, {})
        self._modes: tuple[_Origins, _Dispatch] | None = None
        self._done = False
        # False: the caller reports optimizer steps (optimizer_event) - a tracer started from inside an
        # optimizer hook must not register hooks on the dict torch is iterating.
        self._optimizer_hooks = optimizer_hooks

    # -- context -----------------------------------------------------------------------------
    def __enter__(self) -> OpTracer:
        if self._modes is not None or self._done:
            raise HarnessError("an OpTracer traces one step: make a new OpTracer for another step")
        self.meta = self._meta()
        self._hook_modules()
        if self._optimizer_hooks:
            from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

            self._handles.append(register_optimizer_step_pre_hook(self._optimizer_enter))
            self._handles.append(register_optimizer_step_post_hook(self._optimizer_exit))
        self._modes = (_Origins(self), _Dispatch(self))
        self._modes[0].__enter__()
        self._modes[1].__enter__()
        return self

    def _hook_modules(self) -> None:
        if self.model is not None:
            root = type(self.model).__name__
            for name, mod in self.model.named_modules():
                qual = name or root
                self._handles.append(hooks.add(mod, _Push(self._module_stack, qual)))
                self._handles.append(hooks.add(mod, _Pop(self._module_stack), after=True))

    def attach(self, model: torch.nn.Module) -> None:
        """The model registered after tracing began (a step traced from the start of train): its modules from now on."""
        if self.model is None and self._modes is not None:
            self.model = model
            self.meta["model"] = type(model).__name__
            self._hook_modules()

    def optimizer_event(self, phase: str, optimizer: Any) -> None:
        """An optimizer step begins ("pre") or ends ("post"), told by the caller (optimizer_hooks=False)."""
        (self._optimizer_enter if phase == "pre" else self._optimizer_exit)(optimizer, (), {})

    def __exit__(self, *exc: object) -> None:
        if self._modes is None:  # never entered, or already left
            return
        try:
            self._modes[1].__exit__(*exc)
        finally:
            self._modes[0].__exit__(*exc)
            for h in self._handles:
                h.remove()
            self._handles.clear()
            self._modes = None
            self._done = True
            self._node_origin.clear()
            self._hash_cache.clear()

    def result(self) -> Trace:
        if not self._done:
            raise HarnessError("OpTracer.result() is read after the traced step (after the with block)")
        return Trace(ops=self.ops, meta=dict(self.meta))

    # -- meta --------------------------------------------------------------------------------
    def _meta(self) -> dict[str, Any]:
        rank, world = 0, 1
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        meta: dict[str, Any] = {"rank": rank, "world_size": world, "torch": torch.__version__,
                                "python": sys.version.split()[0]}
        meta.update(_settings())
        meta.update(_device_facts(self.device))
        meta.update(_generator_states())  # at the start of the traced step (a trace begun earlier starts over)
        # None: no model was given, so no op can be placed in a module (the diff says so, and how to register one).
        meta["model"] = type(self.model).__name__ if self.model is not None else None
        meta.update(self.user_meta)
        return meta

    # -- hooks -------------------------------------------------------------------------------
    def _optimizer_enter(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._in_optimizer += 1

    def _optimizer_exit(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._in_optimizer -= 1

    def _tag_nodes(self, roots: list[Any]) -> None:
        # Every node reachable from the call's outputs that is not yet tagged was made by this
        # call (nodes made earlier are tagged already), so the walk stops at tagged nodes.
        module = self._module_stack[-1] if self._module_stack else ""
        line = self._user_line()
        todo = list(roots)
        while todo:
            node = todo.pop()
            if node is None or id(node) in self._node_origin:
                continue
            self._node_origin[id(node)] = (node, module, line)
            todo.extend(n for n, _ in node.next_functions)

    # -- recording ---------------------------------------------------------------------------
    def _user_line(self) -> str:
        frame: FrameType | None = sys._getframe(2)
        is_user = self._is_user_file
        while frame is not None:
            path = frame.f_code.co_filename
            where = is_user.get(path)
            if where is None:
                where = is_user[path] = self._user_path(path)
            if where:
                key = (path, frame.f_lineno)
                line = self._line_cache.get(key)
                if line is None:
                    rel = os.path.relpath(where, self.code_dir)
                    line = f"{rel}:{frame.f_lineno}  {linecache.getline(where, frame.f_lineno).strip()}"
                    self._line_cache[key] = line
                return line
            frame = frame.f_back
        return ""

    def _user_path(self, co_filename: str) -> str:
        """The absolute path of a code object's file when it lies under code_dir, else "".

        Never against the current directory: the training code may have os.chdir()'d away (to "/", a
        pseudo name such as "<string>" would then resolve under any code_dir). A relative name was
        relative to the cwd the module was imported in, which for a rank is its experiment folder.
        """
        if co_filename.startswith("<"):  # <string>, <frozen ...>: no file
            return ""
        path = os.path.realpath(os.path.join(self.code_dir, co_filename))
        return path if path.startswith(self.code_dir) else ""

    def _sig(self, t: torch.Tensor, hashed: bool = True, fresh: bool = False) -> TensorSig:
        if not hashed:
            return tensor_sig(t, hashed=False)
        # Same live tensor, same version counter (shared by views, bumped by in-place writes):
        # same bytes, so the output of one op is not hashed again as the input of the next.
        # Outputs are always hashed (fresh): an in-place op's version bump comes only after the
        # dispatch returns, and collectives write without one.
        try:
            # data_ptr too: `p.data = other` swaps the storage without bumping the version.
            version = (t._version, t.data_ptr())
        except RuntimeError:  # inference tensors have no version counter
            return tensor_sig(t)
        hit = self._hash_cache.get(id(t))
        if not fresh and hit is not None and hit[0]() is t and hit[1] == version:
            return hit[2]
        sig = tensor_sig(t)
        try:
            self._hash_cache[id(t)] = (weakref.ref(t), version, sig)
        except TypeError:
            pass
        return sig

    def _phase_and_origin(self, args: tuple) -> tuple[str, str, str | None]:
        node = torch._C._current_autograd_node()
        if node is not None or self._in_backward_call:
            origin = self._node_origin.get(id(node)) if node is not None else None
            if origin is not None and origin[0] is node:
                return BACKWARD, origin[1], origin[2]
            return BACKWARD, BACKWARD_UNKNOWN_MODULE, None
        module = self._module_stack[-1] if self._module_stack else ""
        if self._in_optimizer:
            return OPTIMIZER, module, None
        if self._module_stack:
            return FORWARD, module, None
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad
                                           for a in _flat_tensors(args)):
            return FORWARD, module, None  # e.g. the loss, computed outside the model
        return OTHER, module, None

    def _record(self, func: Any, args: tuple, kwargs: dict) -> Any:
        name = str(func)
        if name.startswith("profiler."):
            return func(*args, **kwargs)  # record_function markers: annotations, not computation
        base = op_base(name)
        phase, module, line = self._phase_and_origin(args)
        namespace = name.split(".", 1)[0]
        if phase == BACKWARD and namespace in ("c10d", "_c10d_functional"):
            # DDP's bucket all-reduce fires from the gradient hook of whichever parameter
            # completed the bucket; naming that parameter's module would blame one of many.
            module, line = BACKWARD_UNKNOWN_MODULE, None
        if not line:  # no forward line for this node: the innermost user frame now
            line = self._user_line()
        overwritten = {id(v) for k, v in kwargs.items() if k == "out" or k.startswith("out")}
        if base in _OVERWRITES_SELF and args and isinstance(args[0], torch.Tensor):
            overwritten.add(id(args[0]))
        flat_in = _flat_tensors((args, kwargs))
        inputs = [self._sig(t, hashed=id(t) not in overwritten) if isinstance(t, torch.Tensor)
                  else None for t in flat_in]
        order_free = _order_free(base, args, kwargs) if base in ACCUMULATION_OPS else ""
        params = _params_repr(args, kwargs)

        out = func(*args, **kwargs)

        flat_out = _flat_tensors(out)
        if namespace == "c10d":
            # c10d ops return (tensors, Work): the tensors hold the result only after the wait.
            for w in flat_out:
                if not isinstance(w, torch.Tensor) and hasattr(w, "wait"):
                    w.wait()
        in_flight = namespace == "_c10d_functional" and base != "wait_tensor"
        hashed = base not in _UNINITIALIZED_OUTPUT and not in_flight
        # Written arguments that the op does not return (_foreach_add_ returns nothing) are
        # outputs too: their state after the op.
        flat_out += [t for t in _written_args(func, args, kwargs)
                     if not any(t is o for o in flat_out)]
        outputs = [self._sig(t, hashed=hashed, fresh=True) if isinstance(t, torch.Tensor)
                   else None for t in flat_out]
        self.ops.append(OpRecord(index=len(self.ops), op=name, module=module, phase=phase,
                                 inputs=inputs, outputs=outputs, user_line=line,
                                 params=params, order_free=order_free))
        return out


# -- serialisation -----------------------------------------------------------------------------
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


# -- the diff ------------------------------------------------------------------------------------
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
    likely_cause: str | None  # from harness.optrace.rules; None when no rule knows
    detail: list[str]  # human lines: shapes, dtypes, which tensors differ, ops matched before
    # True when the culprit's inputs are equal only as a multiset of contributions (see order_free)
    order_only: bool = False
    # True when a trace was made with no model given (meta "model" None): an op's empty module means "not known",
    # not "outside the model"
    model_unknown: bool = False
    # True at INPUTS_DIFFER_FROM_START when the op's tensor inputs are equal and only its non-tensor arguments
    # differ (a hyper-parameter such as the learning rate): the difference is pinned on this op already
    arguments_only: bool = False


# Said when no model was given to the tracer: ops inside the model cannot be told from ops outside it.
UNREGISTERED_MODEL = ("harness was given no model (neither ctx.ddp nor ctx.register), so the trace cannot name the "
                      "module an op ran in: where the script wraps the model itself (its own DDP, FSDP, "
                      "torch.compile), call ctx.register(model) with the module inside the wrapper")


def describe_sig(s: TensorSig | None) -> str:
    if s is None:
        return "(not a tensor)"
    shape = "[" + ", ".join(str(d) for d in s.shape) + "]"
    digest = s.sha256[:12] if s.sha256 else "not hashed"
    return f"{s.dtype}{shape} {digest}"


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
