"""World-size invariant data parallelism: fixed shards, keyed randomness and one canonical reduction tree."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import Dataset, Sampler

from harness.config import check_layout, is_power_of_two
from harness.errors import ConfigError, ExperimentError

__all__ = [
    "EvalSampler",
    "InvariantModule",
    "InvariantStep",
    "KeyedDataset",
    "ShardBatchSampler",
    "allgather_reduce",
    "broadcast_parameters",
    "bytes_per_step",
    "canonical_allreduce",
    "check_layout",
    "tree_sum",
]

# Domain tags: the sample, shard and epoch seed streams stay apart even for equal numbers.
_TAG_SAMPLE = 0
_TAG_SHARD = 1
_TAG_EPOCH = 2
_FP32_BYTES = 4
# Below this size canonical_allreduce all-gathers. Measured on gloo over loopback: at 150 KiB one all-gather
# is 2-7x faster than the 2*log2(W) point-to-point rounds (latency-bound); at 4 MiB and W=4 it is 2x slower.
GATHER_BELOW_BYTES = 1 << 20


def _derive(*words: int) -> int:
    """A 64-bit seed from integers, stable across processes, platforms and Python versions (unlike hash())."""
    # SeedSequence wants non-negative entropy; a negative base seed maps to its 64-bit two's complement.
    hi, lo = np.random.SeedSequence([int(w) % 2**64 for w in words]).generate_state(2)
    return (int(hi) << 32) | int(lo)


def _seed_globals(seed: int, device: torch.device | None = None) -> None:
    """Seed the global generators user code draws from: torch's CPU one (and `device`'s), numpy and random."""
    # Not torch.manual_seed: it also queues a lazy seed for every CUDA device, recording a stack trace
    # each time (~0.15 ms), which is paid once per shard per step here.
    torch.default_generator.manual_seed(seed)
    if device is not None and device.type == "cuda":
        torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()].manual_seed(seed)
    np.random.seed(seed >> 32)  # numpy's legacy seeding accepts 32 bits only
    random.seed(seed)


@contextlib.contextmanager
def _preserved_global_rng(device: torch.device) -> Iterator[None]:
    """Restore every global generator afterwards, so the per-shard reseeding leaves no trace."""
    np_state = np.random.get_state()
    py_state = random.getstate()
    devices = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        np.random.set_state(np_state)
        random.setstate(py_state)


# -- data ---------------------------------------------------------------------------------------------


class ShardBatchSampler(Sampler[list]):
    """Batch sampler: every global batch is K shards of s samples; this rank yields its K/W shards, concatenated.

    The permutation depends on (seed, epoch) only, so global batch t holds the same samples in the same
    shard positions for every world size. Items are `(epoch, index)` keys for `KeyedDataset`.
    """

    def __init__(
        self,
        dataset_len: int,
        shard_size: int,
        shards: int,
        world_size: int,
        rank: int,
        seed: int,
        drop_last: bool = True,
        *,
        shuffle: bool = True,
    ) -> None:
        check_layout(shards, world_size)
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is outside world_size {world_size}. Pass 0 <= rank < world_size.")
        if shard_size < 1:
            raise ConfigError(f"invariant shard size (batch_size) must be >= 1, got {shard_size}. Pass a positive batch_size.")
        if not drop_last:
            # A partial global batch would change shard shapes, and with them the arithmetic, with W.
            raise ConfigError("invariant mode always drops the incomplete last global batch. Pass drop_last=True.")
        if dataset_len < shard_size * shards:
            raise ConfigError(
                f"{dataset_len} samples do not fill one global batch of shards*batch_size = {shards}*{shard_size}. "
                "Lower batch_size or shards."
            )
        self.dataset_len = dataset_len
        self.shard_size = shard_size
        self.shards = shards
        self.world_size = world_size
        self.rank = rank
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self._global = shard_size * shards
        self._local = self._global // world_size
        self._offset = rank * self._local

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def global_view(self) -> ShardBatchSampler:
        """The same epoch's whole global batches (as one rank of one would draw them): what every world size shares."""
        view = ShardBatchSampler(self.dataset_len, self.shard_size, self.shards, 1, 0, self.seed, shuffle=self.shuffle)
        view.set_epoch(self.epoch)
        return view

    def __len__(self) -> int:
        return self.dataset_len // self._global

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        epoch = self.epoch
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(_derive(self.seed, _TAG_EPOCH, epoch))
            order = torch.randperm(self.dataset_len, generator=generator)
        else:
            order = torch.arange(self.dataset_len)
        steps = len(self)
        mine = order[: steps * self._global].view(steps, self._global)[:, self._offset : self._offset + self._local]
        for batch in mine.tolist():
            yield [(epoch, index) for index in batch]


class EvalSampler(Sampler[tuple]):
    """Contiguous split of range(n) over W ranks without padding or duplicates: exact counts for any W.

    Rank r gets [r*n//W, (r+1)*n//W); block sizes differ by at most one. With `chunk=c` the blocks are made
    of whole chunks of c samples instead (sizes then differ by at most c): a DataLoader with batch_size=c
    then forms the same batches for every W, so per-sample outputs, not just counts, are W-independent.
    Items are `(epoch, index)` keys.
    """

    def __init__(self, dataset_len: int, world_size: int, rank: int, epoch: int = 0, *, chunk: int = 1) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is outside world_size {world_size}. Pass 0 <= rank < world_size.")
        if chunk < 1:
            raise ConfigError(f"EvalSampler chunk must be >= 1, got {chunk}. Pass the evaluation batch size.")
        self.dataset_len = dataset_len
        self.world_size = world_size
        self.rank = rank
        self.epoch = epoch
        chunks = -(-dataset_len // chunk)
        self.start = min(rank * chunks // world_size * chunk, dataset_len)
        self.stop = min((rank + 1) * chunks // world_size * chunk, dataset_len)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.stop - self.start

    def __iter__(self) -> Iterator[tuple[int, int]]:
        epoch = self.epoch
        return iter([(epoch, index) for index in range(self.start, self.stop)])


class KeyedDataset(Dataset):
    """Wraps a dataset; item `(epoch, index)` reseeds torch (CPU), numpy and random from (seed, epoch, index) first.

    Augmentation drawn from the global generators then depends on the sample and epoch only, never on the
    DataLoader worker, the rank or the world size. With num_workers=0 this reseeds the main process's
    generators on every item.
    """

    def __init__(self, dataset: Dataset, seed: int) -> None:
        self.dataset = dataset
        self.seed = seed

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, int]) -> Any:
        epoch, index = key
        _seed_globals(_derive(self.seed, _TAG_SAMPLE, epoch, index))
        return self.dataset[index]


# -- reductions -----------------------------------------------------------------------------------------


def tree_sum(parts: Sequence[Tensor]) -> Tensor:
    """Canonical pairwise tree: level by level, (0+1), (2+3), ... until one remains. len must be a power of two."""
    if not is_power_of_two(len(parts)):
        raise ValueError(f"tree_sum needs a power-of-two number of parts, got {len(parts)}")
    level = list(parts)
    if len(level) == 1:
        return level[0].clone()
    while len(level) > 1:
        level = [level[i] + level[i + 1] for i in range(0, len(level), 2)]
    return level[0]


def _tree_sum_rows_(rows: Tensor) -> Tensor:
    """tree_sum over dim 0, in place and one vectorised add per level; the total lands in rows[0]."""
    n = rows.shape[0]
    stride = 1
    while stride < n:
        # rows[0::2s] += rows[s::2s] is exactly the pairs (0+1, 2+3, ...) of this level, element by element.
        rows[0 :: 2 * stride] += rows[stride :: 2 * stride]
        stride *= 2
    return rows[0]


def _group_size_rank(group: Any) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _global_rank(group: Any, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def _exchange_ops(send: Tensor, recv: Tensor, peer: int, group: Any) -> list[dist.P2POp]:
    """The send and the receive of one round with `peer`, to be posted together as one batch."""
    return [dist.P2POp(dist.isend, send, peer, group), dist.P2POp(dist.irecv, recv, peer, group)]


def _exchange(send: Tensor, recv: Tensor, peer: int, group: Any) -> None:
    # One fused group (ncclGroupStart/End under NCCL): two ranks that each post isend then irecv to the
    # other, ungrouped, deadlock on NCCL (NVIDIA/nccl#479); gloo buffers and takes the same call. torch
    # documents that a batch_isend_irecv which is a group's first collective must involve every rank of it:
    # each halving/doubling round pairs every rank with one peer, so every rank takes part in every call.
    for request in dist.batch_isend_irecv(_exchange_ops(send, recv, peer, group)):
        request.wait()


def canonical_allreduce(flat: Tensor, group: Any = None, *, gather_below_bytes: int = GATHER_BELOW_BYTES) -> Tensor:
    """Sum a 1-D tensor over ranks as the canonical tree does above the rank subtrees: ((r0+r1)+(r2+r3))+...

    Recursive halving (partner rank^1, then ^2, ^4, ...) reduce-scatters, recursive doubling all-gathers:
    each rank sends 2*(W-1)/W of the vector, as a ring all-reduce does, and every element is added in the
    same grouping on every rank and for every W. Vectors under `gather_below_bytes` go through
    `allgather_reduce` instead: the same bits, one collective instead of 2*log2(W) point-to-point rounds,
    which is what decides the time when latency, not bandwidth, dominates. Returns a new tensor (`flat`
    itself when W == 1).
    """
    world, rank = _group_size_rank(group)
    if world == 1:
        return flat
    if not is_power_of_two(world):
        raise ValueError(f"canonical_allreduce needs a power-of-two world size, got {world}")
    if flat.dim() != 1:
        raise ValueError(f"canonical_allreduce takes a 1-D tensor, got shape {tuple(flat.shape)}")
    if flat.numel() * flat.element_size() < gather_below_bytes:
        return allgather_reduce(flat, group)
    n = flat.numel()
    padded = -(-n // world) * world  # every halving then splits evenly
    work = flat.new_zeros(padded)
    work[:n].copy_(flat)
    incoming = flat.new_empty(padded // 2)

    lo, hi = 0, padded
    parents: list[tuple[int, int, int]] = []
    distance = 1
    while distance < world:
        mid = (lo + hi) // 2
        peer = _global_rank(group, rank ^ distance)
        keep, give = ((mid, hi), (lo, mid)) if rank & distance else ((lo, mid), (mid, hi))
        buf = incoming[: mid - lo]
        _exchange(work[give[0] : give[1]], buf, peer, group)
        work[keep[0] : keep[1]] += buf
        parents.append((lo, hi, distance))
        lo, hi = keep
        distance *= 2

    # Each rank now holds the finished sum of one 1/W segment; hand segments back down the same pairs.
    for lo, hi, distance in reversed(parents):
        mid = (lo + hi) // 2
        peer = _global_rank(group, rank ^ distance)
        mine, theirs = ((mid, hi), (lo, mid)) if rank & distance else ((lo, mid), (mid, hi))
        _exchange(work[mine[0] : mine[1]], work[theirs[0] : theirs[1]], peer, group)
    return work[:n]


def allgather_reduce(flat: Tensor, group: Any = None) -> Tensor:
    """The same canonical sum by gathering every rank's vector and tree-summing locally (W/2 times the traffic)."""
    world, _ = _group_size_rank(group)
    if world == 1:
        return flat
    parts = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(parts, flat.contiguous(), group=group)
    return tree_sum(parts)


def bytes_per_step(numel: int, world_size: int) -> dict[str, int]:
    """fp32 bytes each rank sends per step to all-reduce `numel` values: ring (DDP), canonical, all-gather."""
    if world_size <= 1:
        return {"ddp_ring": 0, "canonical": 0, "allgather": 0}
    chunk = -(-numel // world_size)  # ring and halving/doubling both move (W-1) chunks of n/W, twice
    return {
        "ddp_ring": 2 * (world_size - 1) * chunk * _FP32_BYTES,
        "canonical": 2 * (world_size - 1) * chunk * _FP32_BYTES,
        "allgather": (world_size - 1) * numel * _FP32_BYTES,
    }


# -- the training step ----------------------------------------------------------------------------------


def _split(batch: Any, parts: int) -> list[tuple[Tensor, ...]]:
    """K/W equal chunks along dim 0 of a tensor or of each tensor in a tuple/list, as fresh tensors."""
    tensors = (batch,) if isinstance(batch, Tensor) else tuple(batch)
    sizes = set()
    for t in tensors:
        if not isinstance(t, Tensor):
            raise TypeError(f"invariant batches hold tensors only, got {type(t).__name__}")
        sizes.add(t.shape[0])
    if len(sizes) != 1 or next(iter(sizes)) % parts:
        raise ValueError(
            f"batch dim-0 sizes {sorted(sizes)} do not split into {parts} equal shards; "
            "build the loader with ShardBatchSampler"
        )
    size = next(iter(sizes)) // parts
    # Fresh, allocator-aligned copies: a shard must not compute differently for sitting at another offset
    # of a larger batch (BLAS kernels may pick their path by alignment).
    return [tuple(t[j * size : (j + 1) * size].clone() for t in tensors) for j in range(parts)]


def _refuse_running_stats(model: nn.Module) -> None:
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.training and module.track_running_stats:
            # Running statistics are updated shard after shard on each rank, so rank 0 sees K/W of them.
            raise ConfigError(
                f"module {name or type(module).__name__} updates BatchNorm running statistics, which invariant mode "
                "cannot keep independent of world_size. Use GroupNorm/LayerNorm or track_running_stats=False."
            )


# DDP's two ways to skip the all-reduce for gradient accumulation. Invariant mode has nothing to skip: each
# ctx.backward reduces in the canonical order and overwrites param.grad, so micro-batches accumulated around
# it would silently train on the last one only. Its shards are the micro-batches.
_NO_ACCUMULATION = (
    "in world-size-invariant mode, where ctx.backward reduces the gradients of its whole batch across ranks in one "
    "canonical order and overwrites param.grad, so gradients cannot be accumulated outside it. Accumulate through "
    "ctx.backward: give it the whole global batch, whose determinism.shards shards it sums as micro-batches (see "
    "docs/world-size-invariant.md)."
)


class InvariantModule(nn.Module):
    """What ctx.ddp returns in invariant mode: the model under `.module`, as DDP holds it.

    Code written for DDP (model.module.state_dict(), model(x)) keeps working; no gradient hook, no
    all-reduce - ctx.backward does the reduction. DDP's gradient-accumulation switches (no_sync(),
    require_backward_grad_sync = False) are refused where they are used.
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Refused (ExperimentError) at the call: see _NO_ACCUMULATION."""
        raise ExperimentError(f"model.no_sync() does not apply {_NO_ACCUMULATION}")

    @property
    def require_backward_grad_sync(self) -> bool:
        return True  # every ctx.backward synchronises

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        if not value:  # True (the last micro-step in nanoGPT's loop) is what invariant mode always does
            raise ExperimentError(f"model.require_backward_grad_sync = False does not apply {_NO_ACCUMULATION}")


class InvariantStep:
    """Gradients and loss of one global step, bitwise identical for every world size W that divides K.

    Each local shard is forwarded and differentiated on its own with torch/numpy/random seeded from
    (seed, step, global shard), the K/W shard gradients are tree-summed locally, the rank subtrees are
    combined by `reduce` (canonical_allreduce or allgather_reduce), and the total is divided by K once.
    """

    def __init__(
        self,
        shards: int,
        world_size: int,
        rank: int,
        seed: int,
        *,
        reduce: Callable[..., Tensor] = canonical_allreduce,
        group: Any = None,
    ) -> None:
        check_layout(shards, world_size)
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is outside world_size {world_size}. Pass 0 <= rank < world_size.")
        self.shards = shards
        self.world_size = world_size
        self.rank = rank
        self.seed = seed
        self.local_shards = shards // world_size
        self.first_shard = rank * self.local_shards
        self._reduce = reduce
        self._group = group
        self._key: tuple | None = None
        self._params: list[nn.Parameter] = []
        self._numel = 0
        self._rows = torch.empty(0)
        self._views: list[list[Tensor]] = []
        self._grad = torch.empty(0)
        self._grad_views: list[Tensor] = []

    def _prepare(self, model: nn.Module) -> list[nn.Parameter]:
        params = [p for p in model.parameters() if p.requires_grad]
        key = tuple((id(p), p.shape, p.dtype, p.device) for p in params)
        if key != self._key:
            if not params:
                raise ValueError("the model has no parameter that requires grad")
            _refuse_running_stats(model)
            self._key = key
            self._params = params
            self._numel = sum(p.numel() for p in params)
            # One row per local shard: its flat gradient, then K loss slots (zero except its own), so one
            # reduction carries gradients and losses together; adding zeros is exact.
            # fp32, or fp64 when a parameter is fp64, so no gradient loses precision in the sum.
            dtype = torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32
            device = params[0].device
            self._rows = torch.zeros(self.local_shards, self._numel + self.shards, dtype=dtype, device=device)
            self._grad = torch.empty(self._numel, dtype=dtype, device=device)
            self._grad_views = []
            offset = 0
            for p in params:
                self._grad_views.append(self._grad[offset : offset + p.numel()].view(p.shape))
                offset += p.numel()
            self._views = []
            for j in range(self.local_shards):
                views, offset = [], 0
                for p in params:
                    views.append(self._rows[j, offset : offset + p.numel()].view(p.shape))
                    offset += p.numel()
                self._views.append(views)
        return self._params

    def backward(self, model: nn.Module, batch: Any, loss_fn: Callable[..., Tensor], step: int) -> Tensor:
        """Write the global mean gradient into every `param.grad` (overwriting it) and return the global mean loss.

        `batch` is this rank's K/W shards concatenated along dim 0 (a tensor or a tuple/list of tensors);
        `loss_fn(*shard)` returns the mean loss over one shard. The returned loss is a float64 scalar,
        identical on every rank and for every W.
        """
        params = self._prepare(model)
        numel, rows = self._numel, self._rows
        rows[:, numel:].zero_()
        with _preserved_global_rng(rows.device):
            for j, shard in enumerate(_split(batch, self.local_shards)):
                g = self.first_shard + j
                _seed_globals(_derive(self.seed, _TAG_SHARD, step, g), rows.device)
                loss = loss_fn(*shard)
                grads = torch.autograd.grad(loss, params, allow_unused=True)
                for view, grad in zip(self._views[j], grads):
                    if grad is None:
                        view.zero_()  # unused in this shard's graph: contributes zero, as DDP's find_unused does
                    else:
                        view.copy_(grad)
                # + 0.0 turns a -0.0 into +0.0, which summing with the zero slots of other ranks would do anyway.
                rows[j, numel + g] = loss.detach().to(rows.dtype) + 0.0
        local = _tree_sum_rows_(rows)
        total = self._reduce(local, group=self._group)

        torch.div(total[:numel], self.shards, out=self._grad)  # K is a power of two: exact, the same for every W
        for p, view in zip(params, self._grad_views):
            if view.dtype != p.dtype:  # e.g. bf16 parameters: summed in fp32, cast back
                if p.grad is None:
                    p.grad = view.to(p.dtype)
                else:
                    p.grad.copy_(view)
            elif p.grad is None or p.grad.data_ptr() != view.data_ptr():
                # .grad is a view of one persistent buffer (as DDP's gradient_as_bucket_view): no copy per step.
                p.grad = view

        losses = total[numel:].to(torch.float64)
        while losses.numel() > 1:
            losses = losses[0::2] + losses[1::2]  # tree_sum over the K shard losses, in shard order
        return (losses[0] / self.shards).detach()


def broadcast_parameters(model: nn.Module, src: int = 0, group: Any = None) -> None:
    """Copy rank `src`'s parameters and buffers to every rank (DDP does this in its constructor)."""
    world, _ = _group_size_rank(group)
    if world == 1:
        return
    tensors = [*model.parameters(), *model.buffers()]
    # One broadcast per (device, dtype) instead of one per tensor.
    buckets: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for t in tensors:
        buckets.setdefault((t.device, t.dtype), []).append(t)
    with torch.no_grad():
        for bucket in buckets.values():
            flat = torch.cat([t.reshape(-1) for t in bucket])
            dist.broadcast(flat, src, group=group)
            offset = 0
            for t in bucket:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
