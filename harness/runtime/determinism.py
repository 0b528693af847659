"""Seeds and determinism settings for one rank, applied in one place and read back for the record: at the start,
and again during training (Watch), naming the user's line that changed one."""

from __future__ import annotations

import functools
import os
import random
import sys
from collections.abc import Callable
from types import FrameType, ModuleType
from typing import Any

import numpy as np
import torch
from torch.backends import ContextProp

from harness.config import Level
from harness.messages import DeterminismChanged, SettingChange

# cuBLAS needs a fixed workspace to be deterministic; must be in the environment before CUDA starts.
CUBLAS_WORKSPACE = ":4096:8"


def derive_rank_seeds(seed: int, world_size: int) -> list[int]:
    """One independent 32-bit seed per rank, derived from the base seed (recorded with the run)."""
    children = np.random.SeedSequence(seed).spawn(world_size)
    return [int(child.generate_state(1)[0]) for child in children]


def seed_everything(seed: int) -> None:
    """Seed every RNG a training step may draw from in this process."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def set_determinism(level: Level) -> dict[str, str]:
    """Apply `level` to this process and return the effective settings, read back from torch."""
    if level in (Level.strict, Level.warn):
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
        torch.use_deterministic_algorithms(True, warn_only=level == Level.warn)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        # TF32 changes results with the GPU generation; strict runs keep full fp32.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    return read_determinism(level)


def read_determinism(level: Level) -> dict[str, str]:
    return {
        "level": level.value,
        "deterministic_algorithms": str(torch.are_deterministic_algorithms_enabled()),
        "deterministic_warn_only": str(torch.is_deterministic_algorithms_warn_only_enabled()),
        "cudnn_deterministic": str(torch.backends.cudnn.deterministic),
        "cudnn_benchmark": str(torch.backends.cudnn.benchmark),
        "cuda_matmul_tf32": str(torch.backends.cuda.matmul.allow_tf32),
        "cudnn_tf32": str(torch.backends.cudnn.allow_tf32),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG", "unset"),
        "intra_op_threads": str(torch.get_num_threads()),
    }


# -- read-back during training -------------------------------------------------------------------
# User code may undo set_determinism (nanoGPT turns TF32 on at import), so the settings are read again
# at these points of training; what changed since the previous reading is sent to the launcher.
FIRST_STEP = "first step"  # the first training step of this launch starts (after a resume: the resumed step)
CHECKPOINT = "checkpoint"  # a checkpoint was saved
END = "end"  # training ended (Context.finish)

# The setting keys (of read_determinism) each watched setter can change: allow_tf32 and the matmul precision
# are one switch in torch (setting either changes how both read back).
_MATMUL = ("cuda_matmul_tf32", "float32_matmul_precision")
_CUDNN_KEYS = {"allow_tf32": ("cudnn_tf32",), "fp32_precision": ("cudnn_tf32", *_MATMUL),
               "benchmark": ("cudnn_benchmark",), "deterministic": ("cudnn_deterministic",)}
_FUNCTION_KEYS = {"set_float32_matmul_precision": _MATMUL,
                  "use_deterministic_algorithms": ("deterministic_algorithms", "deterministic_warn_only"),
                  "set_num_threads": ("intra_op_threads",)}
# The last watched call that may have changed each setting since the previous reading: key -> (where, call).
_calls: dict[str, tuple[str, str]] = {}
_watch: Watch | None = None


class Watch:
    """This process's determinism settings as last read back; observe() reads them again and names the changes."""

    def __init__(self, level: Level, settings: dict[str, str]) -> None:
        self.level = level
        self._last = {k: settings[k] for k in read_determinism(level)}  # only what read_determinism reads again
        self._first_step_seen = False

    def observe(self, step: int, when: str) -> DeterminismChanged | None:
        """Read the settings back at `step` (`when`: FIRST_STEP, CHECKPOINT or END); the changes since the
        previous reading as a message for the launcher, or None. FIRST_STEP after the first is ignored, so
        the training loop may call it at every step."""
        if when == FIRST_STEP:
            if self._first_step_seen:
                return None
            self._first_step_seen = True
        now = read_determinism(self.level)
        changes = []
        for key, before in self._last.items():
            after = now[key]
            if after != before:
                where, call = _calls.get(key, (None, None))
                changes.append(SettingChange(key, before, after, int(step), when, where, call))
        self._last = now
        _calls.clear()  # a later change is attributed only to calls made after this reading
        return DeterminismChanged(tuple(changes)) if changes else None


def start_watch(level: Level, settings: dict[str, str]) -> Watch:
    """Watch this process from `settings` (set_determinism's reading) on: wrap torch's setters so that a change
    names the user's line, and make observe() read against this watch. Call after set_determinism."""
    global _watch
    _wrap_setters()
    _calls.clear()
    _watch = Watch(level, settings)
    return _watch


def observe(step: int, when: str) -> DeterminismChanged | None:
    """The watch of this process (start_watch) reads the settings back at `step`; None without a watch."""
    return _watch.observe(step, when) if _watch is not None else None


def _package_dir(module: ModuleType) -> str:
    assert module.__file__ is not None  # torch and harness are regular packages, never namespace ones
    return os.path.dirname(os.path.abspath(module.__file__)) + os.sep


def _caller() -> str:
    """'train.py:12': the innermost frame outside torch and harness (relative to the cwd, the experiment folder)."""
    skip = tuple(_package_dir(m) for m in (torch, sys.modules["harness"]))
    frame: FrameType | None = sys._getframe(2)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(skip):
        frame = frame.f_back
    if frame is None:
        return "unknown"
    path = os.path.abspath(frame.f_code.co_filename)
    rel = os.path.relpath(path)
    return f"{path if rel.startswith('..') else rel}:{frame.f_lineno}"


def _note(keys: tuple[str, ...], call: str) -> None:
    where = _caller()
    for key in keys:
        _calls[key] = (where, call)


def _wrap_setters() -> None:
    """Note where user code sets a determinism setting; each setter still does exactly what it did (it runs first,
    and a call that raises is not noted). Idempotent: a process is wrapped once."""
    matmul_cls = type(torch.backends.cuda.matmul)  # an object whose class defines __setattr__
    if getattr(matmul_cls.__setattr__, "_harness_watched", False):
        return
    original_setattr = matmul_cls.__setattr__

    def matmul_setattr(self: Any, name: str, value: Any) -> Any:
        result = original_setattr(self, name, value)
        if name in ("allow_tf32", "fp32_precision"):
            _note(_MATMUL, f"torch.backends.cuda.matmul.{name} = {value!r}")
        return result

    matmul_setattr._harness_watched = True  # type: ignore[attr-defined]
    matmul_cls.__setattr__ = matmul_setattr  # type: ignore[method-assign]  # wrapping the class's own setter is the point

    cudnn_cls = type(torch.backends.cudnn)  # a module whose class holds ContextProp descriptors
    for name, keys in _CUDNN_KEYS.items():
        prop = vars(cudnn_cls).get(name)
        if isinstance(prop, ContextProp):
            setattr(cudnn_cls, name, _NotedProp(prop, f"torch.backends.cudnn.{name}", keys))

    for name, keys in _FUNCTION_KEYS.items():
        setattr(torch, name, _noted_function(getattr(torch, name), keys))


class _NotedProp(ContextProp):
    """torch's ContextProp, same getter and setter, that notes who set it."""

    def __init__(self, prop: Any, path: str, keys: tuple[str, ...]) -> None:
        super().__init__(prop.getter, prop.setter)
        self._prop, self._path, self._keys = prop, path, keys

    def __get__(self, obj: Any, objtype: Any) -> Any:
        return self._prop.__get__(obj, objtype)

    def __set__(self, obj: Any, val: Any) -> None:
        self._prop.__set__(obj, val)
        _note(self._keys, f"{self._path} = {val!r}")


def _noted_function(fn: Callable[..., Any], keys: tuple[str, ...]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def noted(*args: Any, **kwargs: Any) -> Any:
        result = fn(*args, **kwargs)
        shown = ", ".join([repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()])
        _note(keys, f"torch.{fn.__name__}({shown})")
        return result

    return noted
