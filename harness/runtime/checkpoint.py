"""Deterministic checkpoints: what a step depends on, saved atomically, to continue a run bit for bit."""

from __future__ import annotations

import collections
import errno
import functools
import hashlib
import json
import os
import pickle
import random
import re
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

import numpy as np
import torch

from harness.errors import ExperimentError, HarnessError
from harness.runtime import forkgate, states as states_mod
from harness.runtime.fingerprint import fingerprint, tensor_sha256

# The key that marks a file as a harness checkpoint, and the layout version stored under it.
FORMAT_KEY = "harness_checkpoint_format"
FORMAT_VERSION = 1

COMPLETE_MARKER = "COMPLETE"
# What a per-tensor digest covers, stored with them: a reader of another format must not compare across.
FINGERPRINT_FORMAT = "sha256(dtype|shape|raw bytes) per tensor; v1"
_STEP_DIR = re.compile(r"^step-(\d+)$")

# What torch.load(weights_only=True) accepts; anything else would make the file unloadable there.
_PLAIN_SCALARS: tuple[type, ...] = (str, bytes, int, float, complex, bool, type(None))
_PLAIN_OBJECTS: tuple[type, ...] = (torch.Size, torch.dtype, torch.device)
_PLAIN_TENSORS: tuple[type, ...] = (torch.Tensor, torch.nn.Parameter)
_PLAIN_MAPPINGS: tuple[type, ...] = (dict, collections.OrderedDict)
_PLAIN_SEQUENCES: tuple[type, ...] = (list, tuple, set)


class Stateful(Protocol):
    """A scheduler, GradScaler or anything else with the state_dict protocol."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


@dataclass
class TrainingPosition:
    """Where the run stands at a step boundary."""

    step: int  # steps completed
    epoch: int
    batch_in_epoch: int  # batches of `epoch` already consumed
    # The training loader's generator state at the start of `epoch`, before its iterator was
    # created: the iterator draws the sampler order and the worker base seed from it.
    epoch_start_generator: torch.Tensor | None = None


# -- RNG ---------------------------------------------------------------------------------------------
def _cuda_index(device: torch.device | None) -> int | None:
    """The CUDA device whose generator a rank on `device` draws from; None for a rank on the CPU."""
    if device is None or device.type != "cuda":
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


def rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """This process's torch CPU, numpy-global and python RNG states, and the CUDA one of `device` when it is a
    GPU, as plain values.

    Only the rank's own device: one state per visible GPU would tie the checkpoint to how many GPUs the host
    showed (8 on the node that wrote it, 4 on the allocation that resumes, none for a CPU run on a CPU host).
    `cuda_devices` names the index each CUDA state was read from.
    """
    np_state = np.random.get_state()
    if not isinstance(np_state, tuple):
        raise HarnessError(
            "numpy's global RNG is not MT19937, so its state cannot be checkpointed. "
            "Leave np.random's global generator as numpy creates it."
        )
    name, key, pos, has_gauss, cached_gaussian = np_state
    version, internal, gauss_next = random.getstate()
    index = _cuda_index(device)
    return {
        "torch": torch.get_rng_state(),
        "cuda": [] if index is None else [torch.cuda.get_rng_state(index)],
        "cuda_devices": [] if index is None else [index],
        "numpy": {
            "name": str(name),
            # int64, not uint32: the key must come back as the exact same 32-bit words.
            "key": torch.from_numpy(np.asarray(key, dtype=np.int64).copy()),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "python": {
            "version": int(version),
            "internal": [int(x) for x in internal],
            "gauss_next": None if gauss_next is None else float(gauss_next),
        },
    }


def _cuda_state_for(state: Mapping[str, Any], index: int | None) -> torch.Tensor | None:
    """The CUDA RNG state a rank on cuda:`index` resumes with; None for a rank on the CPU, which uses none."""
    if index is None:
        return None  # a CPU rank drew nothing from a GPU: states a GPU host saved for it do not matter
    states = list(state["cuda"])
    devices = state.get("cuda_devices")
    if devices is None:
        # Written before the devices were recorded: one state per GPU the process saw, in index order; the rank
        # drew from the one at its own index.
        if index < len(states):
            return states[index]
        raise HarnessError(
            f"the checkpoint holds CUDA RNG states for {len(states)} device(s), none for cuda:{index}, this rank's "
            f"device. Resume with the GPUs of the checkpointed run visible (at least {index + 1})."
        )
    devices = [int(d) for d in devices]
    if len(states) == 1:
        return states[0]  # the checkpointed rank's own device: the generator follows the rank, not the index
    if index in devices:
        return states[devices.index(index)]
    if not states:
        raise HarnessError(
            f"the checkpoint holds no CUDA RNG state (its rank ran on the cpu) but this rank runs on cuda:{index}. "
            "Resume with device=cpu, as the checkpointed run did."
        )
    raise HarnessError(
        f"the checkpoint holds CUDA RNG states for devices {devices}, none for cuda:{index}, this rank's device. "
        "Resume on the devices of the checkpointed run."
    )


def set_rng_state(state: Mapping[str, Any], device: torch.device | None = None) -> None:
    """Put back what rng_state() captured, in this process, for a rank on `device` (the CUDA state only when it
    is a GPU); refused in one line when a GPU rank would need a state the checkpoint lacks."""
    index = _cuda_index(device)
    try:
        cuda_state = _cuda_state_for(state, index)
        np_state = state["numpy"]
        key = np_state["key"]
        key_array = key.to(torch.int64).numpy() if isinstance(key, torch.Tensor) else np.asarray(key)
        numpy_tuple = (
            str(np_state["name"]),
            key_array.astype(np.uint32),
            int(np_state["pos"]),
            int(np_state["has_gauss"]),
            float(np_state["cached_gaussian"]),
        )
        py = state["python"]
        python_tuple = (int(py["version"]), tuple(int(x) for x in py["internal"]), py["gauss_next"])
        torch_state = state["torch"]
        # Tried on throwaway generators first, so a bad state leaves this process's generators untouched.
        torch.Generator().set_state(torch_state)
        np.random.RandomState().set_state(numpy_tuple)
        random.Random().setstate(python_tuple)
    except (KeyError, TypeError, AttributeError, ValueError, RuntimeError) as exc:
        raise HarnessError(
            f"the checkpoint's RNG state is malformed ({_one_line(exc)}). Resume from another checkpoint."
        ) from exc
    torch.set_rng_state(torch_state)
    if cuda_state is not None and index is not None:
        torch.cuda.set_rng_state(cuda_state, index)
    np.random.set_state(numpy_tuple)
    random.setstate(python_tuple)


def generator_state(generator: torch.Generator) -> torch.Tensor:
    """A copy of `generator`'s state (e.g. a DataLoader's generator)."""
    return generator.get_state().clone()


def set_generator_state(generator: torch.Generator, state: torch.Tensor) -> None:
    generator.set_state(state.clone())


# -- the checkpoint dict -----------------------------------------------------------------------------
def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    # DDP's state_dict prefixes every key with "module."; the unwrapped module gives the same keys
    # and the same fingerprint as the one the context records, wrapped or not.
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    while isinstance(model, (DistributedDataParallel, DataParallel)):
        model = model.module
    return model


def _snapshot(obj: Any, copy: bool = True) -> Any:
    # Copies, not views: a CPU tensor's .to("cpu") is the live parameter, which the next step would
    # overwrite before the dict is saved if the caller keeps it around. copy=False: a CPU tensor is kept as it is.
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True) if copy or obj.device.type != "cpu" else obj.detach()
    if isinstance(obj, dict):
        out: dict[Any, Any] = collections.OrderedDict() if isinstance(obj, collections.OrderedDict) else {}
        out.update((k, _snapshot(v, copy)) for k, v in obj.items())
        # Module state_dicts carry per-module versions here; load_state_dict reads them to upgrade layouts.
        if hasattr(obj, "_metadata"):
            out._metadata = obj._metadata  # type: ignore[attr-defined]
        return out
    if isinstance(obj, list):
        return [_snapshot(v, copy) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_snapshot(v, copy) for v in obj)
    return obj


def _check_plain(obj: Any, where: str) -> None:
    """Raise if `obj` holds anything torch.load(weights_only=True) would refuse."""
    kind = type(obj)
    if kind in _PLAIN_SCALARS or kind in _PLAIN_OBJECTS or kind in _PLAIN_TENSORS:
        return
    if kind in _PLAIN_MAPPINGS:
        for key, value in obj.items():
            _check_plain(key, f"{where} key {key!r}")
            _check_plain(value, f"{where}[{key!r}]")
        return
    if kind in _PLAIN_SEQUENCES:
        for index, value in enumerate(obj):
            _check_plain(value, f"{where}[{index}]")
        return
    raise HarnessError(
        f"{where} is a {kind.__module__}.{kind.__qualname__}, which a weights_only checkpoint cannot hold. "
        "Store tensors, dicts, lists, tuples, str, int, float, bool or None there."
    )


def build(
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Stateful | None = None,
    scaler: Stateful | None = None,
    position: TrainingPosition,
    loader_generators: Mapping[str, torch.Tensor | torch.Generator] | None = None,
    extra: Mapping[str, Any] | None = None,
    device: torch.device | None = None,
    copy: bool = True,
    states: Mapping[str, Stateful] | None = None,
) -> dict[str, Any]:
    """This rank's checkpoint at a step boundary: states on the CPU, RNG (with `device`'s CUDA generator when the
    rank runs on a GPU), position and fingerprint. `copy=False`: CPU tensors are the live ones, not copies - for a
    caller that saves and digests the checkpoint before training goes on (save_with_digests), where a copy of every
    tensor cost as much as the save itself (0.8 s for 400 MB of weights and momentum)."""
    snapshot = functools.partial(_snapshot, copy=copy)
    module = _unwrap(model)
    generators = {
        str(name): generator_state(g) if isinstance(g, torch.Generator) else g.detach().clone()
        for name, g in (loader_generators or {}).items()
    }
    start = position.epoch_start_generator
    ckpt: dict[str, Any] = {
        FORMAT_KEY: FORMAT_VERSION,
        "model": snapshot(module.state_dict()),
        "optimizer": None if optimizer is None else snapshot(optimizer.state_dict()),
        "scheduler": None if scheduler is None else snapshot(scheduler.state_dict()),
        "scaler": None if scaler is None else snapshot(scaler.state_dict()),
        "position": {
            "step": int(position.step),
            "epoch": int(position.epoch),
            "batch_in_epoch": int(position.batch_in_epoch),
            "epoch_start_generator": None if start is None else start.detach().clone(),
        },
        "rng": rng_state(device),
        "loader_generators": generators,
        "extra": snapshot(dict(extra or {})),
        "fingerprint": fingerprint(module),
    }
    if states:  # what ctx.track took by name (an EMA, a loader's position): absent from a checkpoint without them
        ckpt["states"] = {str(name): snapshot(obj.state_dict()) for name, obj in states.items()}
    for part in ("optimizer", "scheduler", "scaler", "extra", *(("states",) if states else ())):
        _check_plain(ckpt[part], part)
    return ckpt


def pack_digests(digests: Mapping[int, str]) -> dict[str, torch.Tensor]:
    """Per-step digests of one length (16 hex digits: the data order; 64: the fingerprints) as a checkpoint holds
    them: the steps (int64) and the digests' bytes end to end (uint8), 8 a step for the data order: 16 MB for a
    million steps, where a dict of strings took 31. Tensors, not bytes: torch pickles empty bytes as a call that a
    weights_only load refuses."""
    steps = sorted(digests)
    raw = b"".join(bytes.fromhex(digests[s]) for s in steps)
    return {"steps": torch.tensor(steps, dtype=torch.int64),
            "digests": torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)}


def unpack_digests(packed: Mapping[str, Any] | None) -> dict[int, str]:
    """What pack_digests packed; {} for a checkpoint without it."""
    if not packed:
        return {}
    steps = packed["steps"].tolist()
    raw = packed["digests"].numpy().tobytes()
    width = len(raw) // len(steps) if steps else 0  # 8 bytes a data order's digest, 32 a fingerprint's
    return {int(step): raw[width * i: width * i + width].hex() for i, step in enumerate(steps)}


# -- per-tensor fingerprints -------------------------------------------------------------------------
def tensor_fingerprints(ckpt: Mapping[str, Any], model: torch.nn.Module,
                        optimizer: torch.optim.Optimizer | None = None) -> dict[str, str]:
    """sha256 per tensor of a built checkpoint: the model's state_dict keys (parameters and buffers) and
    each optimizer state tensor named after its parameter (`fc.weight/momentum_buffer`), by sorted name.

    The digests are of the snapshot that is saved, so they describe the file's bytes, not a later state.
    """
    out = {str(name): tensor_sha256(t) for name, t in ckpt["model"].items() if isinstance(t, torch.Tensor)}
    opt_state = ckpt.get("optimizer")
    if optimizer is not None and opt_state is not None:
        # Optimizer.state_dict numbers the parameters in param_groups order; the numbers say nothing to a reader.
        names = {id(p): n for n, p in _unwrap(model).named_parameters()}
        params = [p for group in optimizer.param_groups for p in group["params"]]
        for index, state in opt_state.get("state", {}).items():
            owner = names.get(id(params[index])) if isinstance(index, int) and index < len(params) else None
            owner = owner or f"optimizer.param{index}"
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    out[f"{owner}/{key}"] = tensor_sha256(value)
    for name, state in (ckpt.get("states") or {}).items():
        # `ema:module.weight`: a colon is in no module's or parameter's name, so no name of the model's can collide.
        for path, value in states_mod.tensors_in(state):
            out[f"{name}:{path}"] = tensor_sha256(value)
    return dict(sorted(out.items()))


def live_tensor_fingerprints(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                             states: Mapping[str, Stateful] | None = None) -> dict[str, str]:
    """tensor_fingerprints of the model, optimizer and tracked states as they are now, without building a checkpoint."""
    state = {"model": _unwrap(model).state_dict(), "optimizer": None if optimizer is None else optimizer.state_dict(),
             "states": {name: obj.state_dict() for name, obj in (states or {}).items()}}
    return tensor_fingerprints(state, model, optimizer)


def replica_sha256(digests: Mapping[str, str], model: torch.nn.Module) -> str:
    """One sha256 over the digests of the parameters and their optimizer state (name and digest, by name).

    What DDP keeps equal on every rank; buffers are left out: BatchNorm statistics are updated by each
    rank's own forward after DDP broadcast rank 0's, so they legitimately differ between ranks.
    """
    params = {name for name, _ in _unwrap(model).named_parameters()}
    digest = hashlib.sha256()
    for name in sorted(digests):
        if name.split("/")[0] in params:
            digest.update(f"{name}\0{digests[name]}\n".encode())
    return digest.hexdigest()


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 300 else text[:297] + "..."


def restore(
    ckpt: Mapping[str, Any],
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Stateful | None = None,
    scaler: Stateful | None = None,
    states: Mapping[str, Stateful] | None = None,
) -> TrainingPosition:
    """Load the model, optimizer, scheduler, scaler and tracked states; RNG is left to set_rng_state()."""
    states_mod.check_names(ckpt.get("states") or {}, states or {})
    given = {"optimizer": optimizer, "scheduler": scheduler, "scaler": scaler}
    for part, target in given.items():
        # A missing optimizer state would restart momentum from zero: silently not the same run.
        if (ckpt.get(part) is None) != (target is None):
            has = "holds" if ckpt.get(part) is not None else "has no"
            was = "was not" if target is None else "was"
            raise HarnessError(
                f"the checkpoint {has} {part} state but restore() {was} given a {part}. "
                "Pass the same objects the checkpointed run used."
            )
    module = _unwrap(model)
    try:
        module.load_state_dict(ckpt["model"])
        for part, target in given.items():
            if target is not None:
                target.load_state_dict(ckpt[part])
        for name, obj in (states or {}).items():
            obj.load_state_dict(ckpt["states"][name])
    except (RuntimeError, ValueError, KeyError, TypeError) as exc:
        raise HarnessError(
            f"the checkpoint does not fit this model or optimizer: {_one_line(exc)}. "
            "Resume with the code and config of the checkpointed run."
        ) from exc
    # load_state_dict casts into the existing parameters' dtypes; the hash proves nothing changed on the way.
    if fingerprint(module) != ckpt["fingerprint"]:
        raise HarnessError(
            "the restored model's fingerprint differs from the checkpoint's (a dtype or device cast changed "
            "the weights). Build the model with the dtypes of the checkpointed run."
        )
    pos = ckpt["position"]
    return TrainingPosition(
        step=int(pos["step"]),
        epoch=int(pos["epoch"]),
        batch_in_epoch=int(pos["batch_in_epoch"]),
        epoch_start_generator=pos["epoch_start_generator"],
    )


# -- files -------------------------------------------------------------------------------------------
def _fsync_dir(directory: Path) -> None:
    # The rename itself lives in the directory entry; without this a power loss can undo it.
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _make_dirs(directory: Path) -> None:
    missing = []
    current = directory
    while not current.exists():
        missing.append(current)
        current = current.parent
    directory.mkdir(parents=True, exist_ok=True)
    for created in reversed(missing):
        _fsync_dir(created.parent)


def _write_atomic(path: Path, write: Callable[[IO[bytes]], object]) -> None:
    path = Path(path)
    tmp: Path | None = None
    try:
        # Inside the try: the step's folder or the file itself may be what the full disk refuses (no block, no inode).
        _make_dirs(path.parent)
        # Same directory, so os.replace is a rename within one filesystem, atomic under POSIX.
        fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        tmp = Path(tmp_name)
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        full = _disk_refused(err, path.parent)  # before the partial file goes: it holds what space there was
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        if full:
            raise ExperimentError(
                f"the disk of {path.parent} {full}: {path.name} could not be written. Free space there (or set "
                "checkpoint_every: 0), then rerun."
            ) from None
        raise
    _fsync_dir(path.parent)


def _disk_refused(err: BaseException, folder: Path) -> str | None:
    """"is full (N KiB free)" / "is read-only" when a write into `folder` failed for want of a writable disk; torch.save
    says so only as `[enforce fail at inline_container.cc:...] ... file write failed`, without an errno."""
    if not isinstance(err, (OSError, RuntimeError)):
        return None
    while not folder.exists() and folder != folder.parent:  # the step's folder itself could not be made
        folder = folder.parent
    try:
        fs = os.statvfs(folder)
    except OSError:
        return None
    if fs.f_flag & os.ST_RDONLY or (isinstance(err, OSError) and err.errno == errno.EROFS):
        return "is read-only"
    free = fs.f_bavail * fs.f_frsize
    if isinstance(err, OSError) and err.errno == errno.ENOSPC and fs.f_files and not fs.f_favail:
        return "is full (no inode left)"
    if (isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT)) or (
            isinstance(err, RuntimeError) and "inline_container" in str(err) and free < 16 << 20):
        return f"is full ({free // 1024} KiB free)"
    return None


def save_atomic(obj: Mapping[str, Any], path: Path) -> None:
    """torch.save `obj` to `path` so that a crash leaves either the old file or the whole new one."""
    _check_plain(obj, "checkpoint")
    _write_atomic(Path(path), lambda fh: torch.save(obj, fh))


def save_with_digests(state: Mapping[str, Any], path: Path, model: torch.nn.Module,
                      optimizer: torch.optim.Optimizer | None = None) -> dict[str, str]:
    """save_atomic(state, path) and its tensor_fingerprints, the digests hashed on a second core while the file is
    written and synced (hashlib and the file writes release the GIL): the checkpoint costs about the save alone."""
    digests = forkgate.beside(tensor_fingerprints, state, model, optimizer)
    try:
        save_atomic(state, path)
    finally:
        tensors = digests.result()
    return tensors


def load(path: Path) -> dict[str, Any]:
    """A checkpoint written by save_atomic, read with weights_only=True (no code runs while loading)."""
    path = Path(path)
    if not path.is_file():
        raise HarnessError(f"no checkpoint at {path}. Check the checkpoint directory and step.")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        reason = _one_line(exc).split(". ")[0]
        raise HarnessError(
            f"{path} holds objects a weights_only load refuses ({reason}). It was not written by harness."
        ) from exc
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise HarnessError(
            f"{path} is truncated or corrupt ({_one_line(exc)}). Resume from an earlier complete step."
        ) from exc
    if not isinstance(obj, dict) or FORMAT_KEY not in obj:
        raise HarnessError(
            f"{path} is not a harness checkpoint (no {FORMAT_KEY!r} key). Point at a file harness saved."
        )
    if obj[FORMAT_KEY] != FORMAT_VERSION:
        raise HarnessError(
            f"{path} has checkpoint format {obj[FORMAT_KEY]!r}; this harness reads {FORMAT_VERSION}. "
            "Resume with the harness version that wrote it."
        )
    return obj


# -- layout: DIR/step-00000120/rank0.pt ... rankN.pt, COMPLETE --------------------------------------
def step_dir(directory: Path, step: int) -> Path:
    return Path(directory) / f"step-{step:08d}"


def path_for(directory: Path, step: int, rank: int) -> Path:
    return step_dir(directory, step) / f"rank{rank}.pt"


def step_of(name: str) -> int | None:
    """The step of a step folder's name (step-00000120 -> 120); None for any other name."""
    match = _STEP_DIR.match(name)
    return int(match.group(1)) if match else None


def mark_complete(directory: Path, step: int, world_size: int | None = None,
                  digests: Mapping[str, Any] | None = None) -> None:
    """Rank 0, after a barrier that every rank reached with its file saved: the step is usable.

    `digests` ({"sha256", "tensors", "ranks"}: what the Checkpoint message tells the launcher) go into the marker,
    in the same atomic write: the message reaches the record later, through a thread, a pipe and the launcher,
    and a rank killed in between left a complete step whose digests no record held (a resume then held its
    proof to no tensors at all). With them in the marker, a marker on disk always comes with its digests."""
    content = f"step={step}\n" + (f"world_size={world_size}\n" if world_size is not None else "")
    if digests is not None:
        content += f"{_DIGESTS_KEY}={json.dumps(dict(digests), sort_keys=True, separators=(',', ':'))}\n"
    _write_atomic(step_dir(directory, step) / COMPLETE_MARKER, lambda fh: fh.write(content.encode()))


_DIGESTS_KEY = "digests"


def _marker_fields(marker: Path) -> dict[str, str]:
    return {key: value for key, _, value in (line.partition("=") for line in marker.read_text().splitlines())}


def _marker_world_size(marker: Path) -> int | None:
    value = _marker_fields(marker).get("world_size", "").strip()
    return int(value) if value.isdigit() else None


def saved_digests(directory: Path, step: int) -> dict[str, Any] | None:
    """The digests the COMPLETE marker of `step` holds ({"sha256", "tensors", "ranks"}); None when it holds none
    (no marker, or one written before markers held them)."""
    marker = step_dir(directory, step) / COMPLETE_MARKER
    try:
        doc = json.loads(_marker_fields(marker)[_DIGESTS_KEY])
    except (OSError, KeyError, ValueError):
        return None
    ok = (isinstance(doc, dict) and isinstance(doc.get("sha256"), str) and isinstance(doc.get("tensors"), dict)
          and isinstance(doc.get("ranks"), list))
    return doc if ok else None


def complete_steps(directory: Path, world_size: int) -> list[int]:
    """Steps whose every rank file and COMPLETE marker exist, ascending."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    steps = []
    for entry in directory.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match is None or not entry.is_dir():
            continue
        marker = entry / COMPLETE_MARKER
        if not marker.is_file():
            continue
        # A marker that names another world size belongs to another topology's run.
        recorded = _marker_world_size(marker)
        if recorded is not None and recorded != world_size:
            continue
        if all((entry / f"rank{rank}.pt").is_file() for rank in range(world_size)):
            steps.append(int(match.group(1)))
    return sorted(steps)


def latest_complete(directory: Path, world_size: int) -> int | None:
    steps = complete_steps(directory, world_size)
    return steps[-1] if steps else None
