"""Sharded models (FSDP2's fully_shard, DTensor parameters): which tensors are sharded, the digests of the whole
combined from every rank's in rank order, and their checkpoints through torch.distributed.checkpoint (DCP).

Each rank hashes what it holds (harness/runtime/fingerprint.py); the whole's digest is sha256 over the ranks'
digests in rank order, gathered only where every rank is at the same point (a checkpoint, an audit's stop, the
end), so no rank waits in a collective that another never enters. It is a digest of this sharding: another world
size shards the tensors otherwise and reduces the gradients in another order, so its digests differ by design.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from harness.errors import ExperimentError, HarnessError
from harness.runtime.fingerprint import is_dtensor, tensor_sha256

# What the rank file of a sharded checkpoint says about the model and optimizer state DCP holds beside it.
SHARDED_KEY = "sharded"
DCP_FORMAT = "torch.distributed.checkpoint, get_state_dict; v1"

INVARIANT_REFUSAL = (
    "world-size-invariant mode cannot train a sharded (FSDP/DTensor) model: its gradients are reduce-scattered over "
    "the ranks, in an order the world size decides. Set determinism.world_size_invariant=false, or train with "
    "model = ctx.ddp(model)."
)


def is_sharded(tensor: object) -> bool:
    """A DTensor whose placements are not all Replicate: each rank holds another part."""
    return is_dtensor(tensor) and any(not p.is_replicate() for p in tensor.placements)  # type: ignore[attr-defined]


def holds_sharded(module: torch.nn.Module | None) -> bool:
    """`module` has a sharded parameter or buffer (FSDP2's fully_shard, a DTensor-parallel plan)."""
    if module is None:
        return False
    return any(is_sharded(t) for t in itertools.chain(module.parameters(), module.buffers()))


def sharded_parameters(module: torch.nn.Module) -> set[str]:
    return {name for name, p in module.named_parameters() if is_sharded(p)}


def combine(digests: list[str]) -> str:
    """The whole's digest: sha256 over every rank's digest, in rank order."""
    return hashlib.sha256(f"sharded over {len(digests)} ranks\n{chr(10).join(digests)}".encode()).hexdigest()


def _gather(value: Any, world_size: int) -> list[Any]:
    if world_size == 1 or not dist.is_initialized():
        return [value]
    every: list[Any] = [None] * world_size
    dist.all_gather_object(every, value)
    return every


def whole(tensors: Mapping[str, str], sha: str, replica: str, world_size: int
          ) -> tuple[dict[str, str], str, list[str]]:
    """Every rank's per-tensor digests, fingerprint and replica digest gathered (a collective every rank enters): the
    per-tensor digests and the fingerprint of the whole, each combined over the ranks, and the ranks' replica digests."""
    every = _gather((dict(tensors), sha, replica), world_size)
    names = sorted(set().union(*(e[0] for e in every)))
    combined = {name: combine([e[0].get(name, "-") for e in every]) for name in names}
    return combined, combine([e[1] for e in every]), [str(e[2]) for e in every]


def replicated(tensors: Mapping[str, str], module: torch.nn.Module) -> dict[str, str]:
    """The digests of what every rank must hold alike: all but the sharded parameters and their optimizer state."""
    sharded = sharded_parameters(module)
    return {name: d for name, d in tensors.items() if name.split("/")[0] not in sharded}


# -- DCP ----------------------------------------------------------------------------------------------------------
# The optimizer's own state_dict, keyed by parameter name, not get_state_dict's: that one initialises an optimizer
# without state by a step at lr 0 (AdamW's step count then starts at 1), so a checkpoint at step 0 would change the
# run it saves, and a resume would count a step that never was.
def _flat(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """`model/<name>` for the model's state, `optimizer/<parameter>/<key>` for each optimizer state tensor."""
    out: dict[str, Any] = {f"model/{name}": t for name, t in model.state_dict().items() if isinstance(t, torch.Tensor)}
    if optimizer is not None:
        names = {id(p): n for n, p in model.named_parameters()}
        for param, entries in optimizer.state.items():
            owner = names.get(id(param))
            if owner is None:
                raise HarnessError("the tracked optimizer steps a parameter the sharded model does not hold. "
                                   "Make the optimizer from model.parameters() after fully_shard.")
            out.update((f"optimizer/{owner}/{key}", v) for key, v in entries.items() if isinstance(v, torch.Tensor))
    return out


def digests(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, str]:
    """sha256 of every tensor this rank holds of the model's state (`fc.weight`) and the optimizer's, named after its
    parameter (`fc.weight/exp_avg`): the names a plain checkpoint's digests have."""
    return {name.partition("/")[2]: tensor_sha256(t) for name, t in _flat(model, optimizer).items()}


def save(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, directory: Path) -> dict[str, str]:
    """Save the model's and optimizer's sharded state into `directory` with DCP (a collective: every rank writes its
    shards, rank 0 the metadata); this rank's digests of it."""
    import torch.distributed.checkpoint as dcp

    directory.mkdir(parents=True, exist_ok=True)
    dcp.save(_flat(model, optimizer), checkpoint_id=str(directory))
    return digests(model, optimizer)


def param_groups(optimizer: torch.optim.Optimizer | None) -> list[dict[str, Any]] | None:
    """The optimizer's hyperparameters (plain values, for the rank file): load() puts them back with the state."""
    return None if optimizer is None else optimizer.state_dict()["param_groups"]


def load(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, directory: Path,
         groups: list[dict[str, Any]] | None) -> None:
    """Load what save() wrote into `model` and `optimizer`, each rank its own shards (a collective)."""
    import torch.distributed.checkpoint as dcp

    try:
        stored = dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata
        target = _flat(model, None)
        params = dict(model.named_parameters())
        for key, meta in stored.items():
            if key.startswith("optimizer/"):
                owner, _, name = key[len("optimizer/"):].rpartition("/")
                param, size = params[owner], tuple(meta.size)  # type: ignore[union-attr]
                like = param.detach() if size == tuple(param.shape) else torch.zeros(size)
                target[key] = torch.zeros_like(like, dtype=meta.properties.dtype)  # type: ignore[union-attr]
        dcp.load(target, checkpoint_id=str(directory))
        model.load_state_dict({k[len("model/"):]: v for k, v in target.items() if k.startswith("model/")})
        if optimizer is not None and groups is not None:
            index = {n: i for i, n in enumerate(_names(model, optimizer))}
            state: dict[int, dict[str, Any]] = {}
            for key, value in target.items():
                if key.startswith("optimizer/"):
                    owner, _, name = key[len("optimizer/"):].rpartition("/")
                    state.setdefault(index[owner], {})[name] = value
            optimizer.load_state_dict({"state": state, "param_groups": groups})
    except (RuntimeError, ValueError, KeyError, OSError, AttributeError) as exc:
        text = " ".join(str(exc).split())[:300]
        raise HarnessError(
            f"the sharded checkpoint in {directory} does not fit this model or optimizer: {text}. Resume with the "
            "code, config and world size of the checkpointed run."
        ) from exc


def _names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The optimizer's parameters' names, in the order its state_dict numbers them."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names.get(id(p), f"param{i}") for i, p in
            enumerate(p for group in optimizer.param_groups for p in group["params"])]


def refuse_invariant(model: torch.nn.Module) -> None:
    """World-size-invariant mode reduces gradients itself, over whole parameters: a sharded model is refused."""
    if holds_sharded(model):
        raise ExperimentError(INVARIANT_REFUSAL)


def refuse_ddp(model: torch.nn.Module) -> None:
    """ctx.ddp of a sharded model: DDP would all-reduce gradients FSDP already reduce-scatters."""
    if holds_sharded(model):
        raise ExperimentError(
            "ctx.ddp: the model is sharded (FSDP2's fully_shard or DTensor parameters), which DDP cannot wrap. Call "
            "ctx.register(model) after the last fully_shard instead of ctx.ddp."
        )
