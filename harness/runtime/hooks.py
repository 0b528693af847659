"""Hooks harness puts on the user's modules, kept out of every copy: a module copies, pickles and saves as without them.

A hook's own references (the rank's context, a tracer) must not travel with the module. `copy.deepcopy(model)` (the
EMA of torchvision's references and timm, `torch.optim.swa_utils.AveragedModel`) would copy the context with its
pipe and shared memory, which fails, and the half-made copy's finaliser closed the rank's descriptors;
`torch.save(model)` would fail to pickle it; and a copy's forwards would run the hook as if they were the training
model's. So while harness hooks a module, the module's `__getstate__` (what `copy`, `pickle` and `torch.save` read)
is its class's own less harness's entries: the copy, the file and a shallow `copy.copy` hold the user's hooks only,
in plain dicts, and a model saved in a run loads where harness is not installed, `torch.load(weights_only=True)`
included.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Any

# The hook dicts of torch.nn.Module keyed by a hook's handle id (forward hooks registered with always_call=True are
# also listed in _forward_hooks_always_called).
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
               "_forward_hooks_always_called")

# Where a hook object is pickled anyway (its dict taken on its own, not through the module): a built-in that accepts
# any positional arguments and returns None (tuple's __init__ is object's, which ignores extra arguments for a type
# with its own __new__), so that a call changes nothing and the pickle names only builtins.
_INERT = (getattr, ((), "__init__"))


class ModuleHook:
    """Base of the hook objects harness registers with `add`."""

    def __reduce__(self) -> tuple[Any, ...]:
        return _INERT


class _Unhooked:
    """A hooked module's `__getstate__`, in its instance dict (where attribute lookup, and so copy and pickle, find it
    before the class's): the class's own state, less harness's hooks and itself."""

    def __init__(self, module: Any) -> None:
        self._module = weakref.ref(module)
        self.ids: set[int] = set()  # handle ids of harness's hooks on the module

    def __call__(self) -> Any:
        module = self._module()
        assert module is not None  # the module being copied is what calls it
        state = type(module).__getstate__(module)
        if not isinstance(state, dict):
            return state
        state = dict(state)
        state.pop("__getstate__", None)
        for name in _HOOK_DICTS:
            hooks = state.get(name)
            if hooks and not self.ids.isdisjoint(hooks):
                state[name] = OrderedDict((k, v) for k, v in hooks.items() if k not in self.ids)
        return state


class Handle:
    """Removes a hook `add` registered, and the module's `__getstate__` with its last one."""

    def __init__(self, handle: Any, unhooked: _Unhooked) -> None:
        self._handle, self._unhooked = handle, unhooked

    def remove(self) -> None:
        self._handle.remove()
        unhooked = self._unhooked
        unhooked.ids.discard(self._handle.id)
        module = unhooked._module()
        if not unhooked.ids and module is not None and module.__dict__.get("__getstate__") is unhooked:
            del module.__dict__["__getstate__"]


def add(module: Any, hook: ModuleHook, *, after: bool = False) -> Handle:
    """Register `hook` on `module` as a forward pre-hook, or (`after`) a forward hook that runs even when the forward
    raises, left out of the module's copies."""
    handle = module.register_forward_hook(hook, always_call=True) if after else module.register_forward_pre_hook(hook)
    unhooked = module.__dict__.get("__getstate__")
    if not isinstance(unhooked, _Unhooked):
        unhooked = module.__dict__["__getstate__"] = _Unhooked(module)
    unhooked.ids.add(handle.id)
    return Handle(handle, unhooked)
