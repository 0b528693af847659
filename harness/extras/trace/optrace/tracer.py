"""Records the op-level trace of one training step: every dispatched op, its module, its tensors' exact hashes
and the user's line that called it.

Pure torch: no tracking store, no run machinery. The capture is a TorchDispatchMode of our own
rather than torch.utils._debug_mode.DebugMode: DebugMode hashes with torch.hash_tensor over a
float64 copy (a reduction, not the exact bytes), stringifies every call's arguments (cost we do
not need), keeps its hooks in process-global lists, and its ModTracker names no module for a
backward op. What it does well - a dispatch mode under autograd - is what this module does too.

What a trace holds is in trace.py, the tensors' signatures in signatures.py, the step's settings
in environment.py, the file in tracefile.py and the diff of two traces in diff.py.
"""

from __future__ import annotations

import linecache
import os
import sys
import weakref
from types import FrameType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from harness.errors import HarnessError
from harness.extras.trace.optrace.environment import device_facts, generator_states, settings
from harness.extras.trace.optrace.signatures import (
    flat_tensors,
    order_free_digest,
    params_repr,
    tensor_sig,
    written_args,
)
from harness.extras.trace.optrace.trace import (
    ACCUMULATION_OPS,
    BACKWARD,
    BACKWARD_UNKNOWN_MODULE,
    FORWARD,
    OPTIMIZER,
    OTHER,
    OpRecord,
    TensorSig,
    Trace,
    op_base,
)
from harness.runtime import hooks

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
            roots = [t.grad_fn for t in flat_tensors(out)
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
        meta.update(settings())
        meta.update(device_facts(self.device))
        meta.update(generator_states())  # at the start of the traced step (a trace begun earlier starts over)
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
                                           for a in flat_tensors(args)):
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
        flat_in = flat_tensors((args, kwargs))
        inputs = [self._sig(t, hashed=id(t) not in overwritten) if isinstance(t, torch.Tensor)
                  else None for t in flat_in]
        order_free = order_free_digest(base, args, kwargs) if base in ACCUMULATION_OPS else ""
        params = params_repr(args, kwargs)

        out = func(*args, **kwargs)

        flat_out = flat_tensors(out)
        if namespace == "c10d":
            # c10d ops return (tensors, Work): the tensors hold the result only after the wait.
            for w in flat_out:
                if not isinstance(w, torch.Tensor) and hasattr(w, "wait"):
                    w.wait()
        in_flight = namespace == "_c10d_functional" and base != "wait_tensor"
        hashed = base not in _UNINITIALIZED_OUTPUT and not in_flight
        # Written arguments that the op does not return (_foreach_add_ returns nothing) are
        # outputs too: their state after the op.
        flat_out += [t for t in written_args(func, args, kwargs)
                     if not any(t is o for o in flat_out)]
        outputs = [self._sig(t, hashed=hashed, fresh=True) if isinstance(t, torch.Tensor)
                   else None for t in flat_out]
        self.ops.append(OpRecord(index=len(self.ops), op=name, module=module, phase=phase,
                                 inputs=inputs, outputs=outputs, user_line=line,
                                 params=params, order_free=order_free))
        return out

