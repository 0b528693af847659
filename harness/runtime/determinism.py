"""Seeds and determinism settings for one rank, applied in one place and read back for the record: at the start,
and again during training (Watch), naming the user's line that changed one."""

from __future__ import annotations

import functools
import os
import random
import sys
import warnings
from collections.abc import Callable
from types import FrameType, ModuleType
from typing import Any

import numpy as np
import torch
from torch.backends import ContextProp

from harness.configschema import Level
from harness.messages import DeterminismChanged, SettingChange
from harness.runtime.callsite import Sites

# cuBLAS needs a fixed workspace to be deterministic; must be in the environment before CUDA starts.
CUBLAS_WORKSPACE = ":4096:8"


def seed_everything(seed: int) -> None:
    """Seed every RNG a training step may draw from in this process."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


# torch >= 2.9 sets TF32 per backend and op (torch.backends.cuda.matmul.fp32_precision, cudnn.conv/.rnn, mkldnn.*),
# deprecates allow_tf32 and raises when a legacy getter finds the two APIs disagreeing (ATen Context.cpp:
# allowTF32CuBLAS, allowTF32CuDNN, float32MatmulPrecision). Where it exists, harness sets and reads the new one;
# the legacy keys stay in the record, derived from the same values, so no legacy getter is called.
NEW_TF32_API = hasattr(torch._C, "_get_fp32_precision_getter")
# (backend, op) of torch's fp32_precision leaves -> the setting key (read back resolved: "none" falls to the
# backend's "all", then to the generic one).
FP32_PRECISION_KEYS: dict[tuple[str, str], str] = {
    ("cuda", "matmul"): "cuda_matmul_fp32_precision",
    ("cuda", "conv"): "cudnn_conv_fp32_precision",
    ("cuda", "rnn"): "cudnn_rnn_fp32_precision",
    ("mkldnn", "matmul"): "mkldnn_matmul_fp32_precision",  # oneDNN on CPU: "bf16" rounds fp32 matmuls on AMX
    ("mkldnn", "conv"): "mkldnn_conv_fp32_precision",
    ("mkldnn", "rnn"): "mkldnn_rnn_fp32_precision",
}


def set_determinism(level: Level) -> dict[str, str]:
    """Apply `level` to this process and return the effective settings, read back from torch."""
    if level in (Level.strict, Level.warn):
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
        # NVLink SHARP (NVSwitch nodes) reduces in the switch, documented as not deterministic between calls
        # (NVIDIA/nccl#1497): off unless the user chose. NCCL reads it when the ranks' communicator starts.
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        torch.use_deterministic_algorithms(True, warn_only=level == Level.warn)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        # TF32 changes results with the GPU generation; strict runs keep full fp32.
        if NEW_TF32_API:
            _set_ieee()
        else:
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
    return read_determinism(level)


def _set_ieee() -> None:
    """Every fp32_precision leaf to "ieee", the legacy flags to agree with them (so that the training code, or
    torch.compile, reading allow_tf32 gets False rather than torch's mixed-API error)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the legacy setters' deprecation notice: set only to agree
        torch.set_float32_matmul_precision("highest")  # legacy HIGHEST, cuda and mkldnn matmul "ieee"
        torch.backends.cudnn.allow_tf32 = False  # legacy cuDNN flag; conv and rnn to "none"
    for backend, op in FP32_PRECISION_KEYS:
        torch._C._set_fp32_precision_setter(backend, op, "ieee")


def _fp32_precisions() -> dict[str, str]:
    return {key: torch._C._get_fp32_precision_getter(backend, op) for (backend, op), key in FP32_PRECISION_KEYS.items()}


def _tf32_settings() -> dict[str, str]:
    """The TF32 and matmul-precision keys. With the new API the legacy three are derived from its values (what
    the kernels read), as torch's legacy getters would return them when the two APIs agree."""
    if not NEW_TF32_API:
        return {"cuda_matmul_tf32": str(torch.backends.cuda.matmul.allow_tf32),
                "cudnn_tf32": str(torch.backends.cudnn.allow_tf32),
                "float32_matmul_precision": torch.get_float32_matmul_precision()}
    p = _fp32_precisions()
    cuda_mm, mkl_mm = p["cuda_matmul_fp32_precision"], p["mkldnn_matmul_fp32_precision"]
    if mkl_mm == "bf16":
        matmul = "medium"
    elif "tf32" in (cuda_mm, mkl_mm):
        matmul = "high"
    else:
        matmul = "highest"
    return {"cuda_matmul_tf32": str(cuda_mm == "tf32"),
            "cudnn_tf32": str("tf32" in (p["cudnn_conv_fp32_precision"], p["cudnn_rnn_fp32_precision"])),
            "float32_matmul_precision": matmul, **p}


def read_determinism(level: Level) -> dict[str, str]:
    tf32 = _tf32_settings()
    return {
        "level": level.value,
        "deterministic_algorithms": str(torch.are_deterministic_algorithms_enabled()),
        "deterministic_warn_only": str(torch.is_deterministic_algorithms_warn_only_enabled()),
        "cudnn_deterministic": str(torch.backends.cudnn.deterministic),
        "cudnn_benchmark": str(torch.backends.cudnn.benchmark),
        "cuda_matmul_tf32": tf32.pop("cuda_matmul_tf32"),
        "cudnn_tf32": tf32.pop("cudnn_tf32"),
        "float32_matmul_precision": tf32.pop("float32_matmul_precision"),
        **tf32,  # the new API's values, where it exists
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG", "unset"),
        "intra_op_threads": str(torch.get_num_threads()),
        # oneDNN's kernels (convolutions, some matmuls on CPU) or ATen's own: the same math, other rounding.
        "onednn_enabled": str(torch.backends.mkldnn.enabled),
    }


# -- read-back during training -------------------------------------------------------------------
# User code may undo set_determinism (nanoGPT turns TF32 on at import), so the settings are read again
# at these points of training; what changed since the previous reading is sent to the launcher.
FIRST_STEP = "first step"  # the first training step of this launch starts (after a resume: the resumed step)
CHECKPOINT = "checkpoint"  # a checkpoint was saved
END = "end"  # training ended (Context.finish)

# The setting keys (of read_determinism) each watched setter can change: allow_tf32 and the matmul precision
# are one switch in torch (setting either changes how both read back), and so are the legacy flags and the new
# API's fp32_precision leaves they set (a parent's fp32_precision reaches every leaf left at "none").
_CUDA_MM, _CONV, _RNN = (FP32_PRECISION_KEYS[("cuda", op)] for op in ("matmul", "conv", "rnn"))
_MKL = tuple(FP32_PRECISION_KEYS[("mkldnn", op)] for op in ("matmul", "conv", "rnn"))
_MATMUL = ("cuda_matmul_tf32", "float32_matmul_precision", _CUDA_MM)
_CUDNN_TF32 = ("cudnn_tf32", _CONV, _RNN)
_ALL_PRECISION = (*_MATMUL, *_CUDNN_TF32, *_MKL)
_CUDNN_KEYS = {"allow_tf32": _CUDNN_TF32, "fp32_precision": (*_CUDNN_TF32, *_MATMUL),
               "benchmark": ("cudnn_benchmark",), "deterministic": ("cudnn_deterministic",)}
_FUNCTION_KEYS = {"set_float32_matmul_precision": (*_MATMUL, _MKL[0]),
                  "use_deterministic_algorithms": ("deterministic_algorithms", "deterministic_warn_only"),
                  "set_num_threads": ("intra_op_threads",)}
# The new API's other setters: (module of torch.backends, its fp32_precision's path as written, keys).
_PRECISION_PROPS = (("", "torch.backends.fp32_precision", _ALL_PRECISION),
                    ("cudnn.rnn", "torch.backends.cudnn.rnn.fp32_precision", ("cudnn_tf32", _RNN)),
                    ("mkldnn", "torch.backends.mkldnn.fp32_precision", _ALL_PRECISION))  # it sets the generic one
# torch.backends.cudnn.conv and torch.backends.mkldnn.matmul/conv/rnn: objects of one class, by (backend, op).
_LEAF_PATHS = {("cuda", "conv"): ("torch.backends.cudnn.conv", ("cudnn_tf32", _CONV)),
               ("mkldnn", "matmul"): ("torch.backends.mkldnn.matmul", ("float32_matmul_precision", _MKL[0])),
               ("mkldnn", "conv"): ("torch.backends.mkldnn.conv", (_MKL[1],)),
               ("mkldnn", "rnn"): ("torch.backends.mkldnn.rnn", (_MKL[2],))}
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
    """'train.py:12': the innermost frame in the experiment's code (the cwd), with the framework function called there
    ('train.py:30 (lightning.pytorch.trainer.trainer.Trainer.__init__)'); without one, the innermost frame outside
    torch and harness."""
    skip = tuple(_package_dir(m) for m in (torch, sys.modules["harness"]))
    line = Sites(os.getcwd(), passed=skip).user_line(sys._getframe(2))
    if line is not None:
        return line
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
    if NEW_TF32_API:
        _wrap_precision_setters()

    for name, keys in _FUNCTION_KEYS.items():
        setattr(torch, name, _noted_function(getattr(torch, name), keys))


def _wrap_precision_setters() -> None:
    """The new TF32 API's setters beyond torch.backends.cuda.matmul's and torch.backends.cudnn's own."""
    for module, path, keys in _PRECISION_PROPS:
        owner = type(functools.reduce(getattr, module.split(".") if module else [], torch.backends))
        prop = vars(owner).get("fp32_precision")
        if prop is not None and hasattr(prop, "__set__"):
            owner.fp32_precision = _NotedProp(prop, path, keys)  # type: ignore[attr-defined]
    # torch.backends._FP32Precision, whose __setattr__ takes fp32_precision (torch's stubs do not declare it).
    leaf_cls: Any = type(torch.backends.cudnn.conv)  # type: ignore[attr-defined]
    original_setattr = leaf_cls.__setattr__

    def leaf_setattr(self: Any, name: str, value: Any) -> Any:
        result = original_setattr(self, name, value)
        where = _LEAF_PATHS.get((getattr(self, "backend", ""), getattr(self, "op", "")))
        if name == "fp32_precision" and where is not None:
            _note(where[1], f"{where[0]}.fp32_precision = {value!r}")
        return result

    leaf_cls.__setattr__ = leaf_setattr  # as for matmul's class above


class _NotedProp(ContextProp):
    """torch's ContextProp, same getter and setter, that notes who set it."""

    def __init__(self, prop: Any, path: str, keys: tuple[str, ...]) -> None:
        super().__init__(getattr(prop, "getter", None), getattr(prop, "setter", None))
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
