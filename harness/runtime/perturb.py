"""A calibration member's start: every floating-point parameter a few hundred float32 ulps (NUDGE, relative) away
from where the run started, and the member's share of the machine's other CPU kernels.

`harness calibrate` measures how far rounding alone carries a run: another machine's kernels round the same
arithmetic differently, and training carries that on. A member replays the run with the same seed, config and data,
its weights nudged before the first step, each element up or down by a whole number of its own ulps as a generator
of the member's seed draws it. Everything else is the run's own: the nudge draws from its own generator, never the
global RNG that the data order, dropout and initialisation draw from.

How large a nudge. One rounding is half an ulp, but another machine's kernels round every sum of every step in
another order, and by the end of the first forward pass the activations differ by far more than one ulp of the
weights makes them differ. Measured (benchmarks/verdict_bench.py's CNN): after one forward pass, oneDNN off moved
the max-pool's inputs by 2e-5 (99th percentile, relative), a one-ulp nudge by 2e-6. What that misses is a discrete
choice: a max-pool window or an argmax whose two largest inputs lie closer than the other kernels' difference flips
in the replay and not in one-ulp members, and the replay leaves their envelope though it computed the same training.
Over 300 calibrated CNN runs judged over 20 steps (`verdict_bench.py --nudge-sweep`), a replay with oneDNN off left
the envelope of 8 members nudged by up to U ulps: U = 1: 2 times (13 when no member ran oneDNN off), 64: 3 (3),
256: 1 (1), 1024: 0 (0); the cost is later detection (weight decay off caught by step 2, 3, 6 for U = 64, 256,
1024), and at 4096 a planted change was missed. NUDGE is 256 float32 ulps (2^-15, 3e-5 relative): a weight moved by
as much as another convolution library moves an activation, with power left at every planted change.

A 16-bit parameter's own ulp is already larger than NUDGE (bfloat16's is 2^-7): it moves by one of its ulps, as its
rounding does; a float64 one by NUDGE relative, as a float32 one.

A nudge at the start is not all another machine does: its kernels round differently at every step. So members also
run on the machine's other kernels (`KERNELS`, member i takes KERNELS[(i - 1) % 4]): the convolution library off,
the intra-op thread count changed (another reduction split), both. The envelope then holds what the kernels this
machine can run do to the run; docs/verdicts.md measures both that and kernels held out.

Every rank draws the same nudges (same seed, same parameter order), so the replicas stay equal whether the nudge
comes before DDP's broadcast (ctx.ddp) or after a framework's wrap (ctx.register).

Which parameters: the trained ones, as soon as harness sees them (`MemberNudge`) - the model given to ctx.ddp or
ctx.register, and the parameters of every optimizer as it is made: a script that wraps its own DDP and registers
nothing is nudged there, before its first forward, as a registered model is.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Kernels:
    """The CPU kernels a member runs on besides its nudge: oneDNN (torch.backends.mkldnn) off, the thread count
    changed. Neither changes what is computed, only the order its sums are rounded in."""

    onednn_off: bool = False
    other_threads: bool = False

    def describe(self) -> str:
        parts = (["oneDNN off"] if self.onednn_off else []) + (["other thread count"] if self.other_threads else [])
        return " + ".join(parts) or "the run's own kernels"


KERNELS = (Kernels(), Kernels(onednn_off=True), Kernels(other_threads=True), Kernels(onednn_off=True, other_threads=True))
# Member 0 is the run itself, re-executed: not nudged, on the run's own kernels. Its weights after the M steps are
# what the other members' distance is measured from, and its values show whether the run re-executes bit for bit here.
REFERENCE = 0


def kernels_of(seed: int) -> Kernels:
    """The kernels of calibration member `seed` (1, 2, ...): the first of every four runs the run's own, as the
    reference (0) does."""
    return KERNELS[0] if seed == REFERENCE else KERNELS[(seed - 1) % len(KERNELS)]


def other_threads(threads: int) -> int:
    """Another intra-op thread count for a run that used `threads`: half as many (a run on one thread: two), so the
    member splits every parallel reduction differently without oversubscribing the cores a many-thread run used."""
    return threads // 2 if threads > 1 else 2


def threads_vary(ranks_here: int, threads: int, cores: int) -> bool:
    """Whether a member may run on another thread count: its `ranks_here` ranks on this machine, each on
    other_threads(threads), fit its `cores`. Past them, every thread of a parallel region waits on threads the
    cores cannot run (OpenMP spins at its barriers): measured 5-17x slower a step on 2 ranks x 2 threads over 2 cores,
    where the same members on their own thread count were not - most of a calibration's cost, for kernels the
    nudge's spread covers already."""
    return ranks_here * other_threads(threads) <= cores


def member_seeds(count: int, vary_threads: bool = True) -> list[int]:
    """The perturb seeds of a calibration's `count` members: 1..count, each on its kernels (kernels_of), or where
    the thread count may not vary (threads_vary), the first `count` seeds whose kernels keep it. The seed alone
    tells a rank its kernels, so the ranks and the members' records agree on them by construction."""
    seeds = itertools.count(1)
    return list(itertools.islice((s for s in seeds if vary_threads or not kernels_of(s).other_threads), count))


def use_kernels(seed: int) -> Kernels:
    """Switch this process to member `seed`'s kernels (in the rank, before the first step). Returns them."""
    import torch

    chosen = kernels_of(seed)
    if chosen.onednn_off:
        torch.backends.mkldnn.enabled = False  # type: ignore[assignment]  # a module property (ContextProp)
    if chosen.other_threads:
        torch.set_num_threads(other_threads(torch.get_num_threads()))
    return chosen


# The nudge's size: up to 256 float32 ulps, relative to each element (the docstring measures the choice).
NUDGE_ULPS = 256
NUDGE = NUDGE_ULPS * 2.0**-23


def nudge_ulps(dtype: torch.dtype, size: float = NUDGE) -> int:
    """How many of its own ulps an element of `dtype` may move: `size` (relative) worth, one at the least (a 16-bit
    type's ulp is larger than NUDGE)."""
    import torch

    return max(1, round(size / torch.finfo(dtype).eps))


def nudge(model: torch.nn.Module, seed: int, size: float = NUDGE, *, skip: Container[int] = (),
          generator: torch.Generator | None = None) -> int:
    """Move every floating-point parameter of `model` by a whole number of its own ulps, drawn per element from
    -nudge_ulps to +nudge_ulps (`size`: another relative size than NUDGE, benchmarks/verdict_bench.py's sweep).
    `skip`: ids of parameters left as they are (nudged already); `generator`: draw from it instead of a new one of
    `seed` (one member's successive nudges). Returns how many elements moved."""
    import torch

    generator = generator or torch.Generator().manual_seed(seed)
    moved = 0
    with torch.no_grad():
        for _, param in sorted(model.named_parameters(), key=lambda item: item[0]):
            if not param.is_floating_point() or param.numel() == 0 or id(param) in skip:
                continue
            most = nudge_ulps(param.dtype, size)
            # Drawn on the CPU for the whole tensor: the same on every device and every rank. The ulp is the
            # element's own (towards +inf), so the move is exact in its dtype wherever it stays within its binade.
            steps = torch.randint(-most, most + 1, param.shape, generator=generator)
            moved += int(steps.count_nonzero())
            local, local_steps = _shard_of(param, steps)
            ulp = torch.nextafter(local, torch.full_like(local, float("inf"))) - local
            moved_to = local + local_steps.to(local.device, local.dtype) * ulp
            # An infinite or NaN element (a mask kept as a parameter) stays as it is, and none is pushed past the
            # largest finite value: a nudge is rounding, never a new inf or NaN.
            local.copy_(torch.where(torch.isfinite(moved_to), moved_to, local))
    return moved


@dataclass
class MemberNudge:
    """One calibration member's nudge of its trained parameters, each once, wherever harness first sees them: the
    registered model (`apply`) and every optimizer's parameters as it is made (`install` wraps torch's Optimizer
    constructor until `uninstall`). The draws continue one generator of the member's seed, in the order the training
    code makes its model and optimizers - the same on every rank."""

    seed: int
    _done: set[int] = field(default_factory=set)  # ids of the parameters nudged
    _generator: Any = None

    def apply(self, module: torch.nn.Module) -> int:
        import torch

        if self._generator is None:
            self._generator = torch.Generator().manual_seed(self.seed)
        moved = nudge(module, self.seed, skip=self._done, generator=self._generator)
        self._done.update(id(p) for p in module.parameters())
        return moved

    def install(self) -> None:
        """From now on every optimizer made has its parameters nudged. The constructor's wrapper is installed once
        for every member alive in the process and put back when the last one is uninstalled, in whatever order."""
        if not _MEMBERS:
            _wrap_optimizer_init()
        _MEMBERS.append(self)

    def uninstall(self) -> None:
        if self in _MEMBERS:
            _MEMBERS.remove(self)
            if not _MEMBERS:
                _unwrap_optimizer_init()


_MEMBERS: list[MemberNudge] = []  # installed and not uninstalled
_ORIGINAL_INIT: list[Callable[..., None]] = []  # torch's Optimizer.__init__ while it is wrapped


def _wrap_optimizer_init() -> None:
    import torch

    from harness.runtime.steps import optimizer_parameters

    original = torch.optim.Optimizer.__init__

    @functools.wraps(original)
    def made(optimizer: Any, *args: Any, **kwargs: Any) -> None:
        original(optimizer, *args, **kwargs)
        for member in _MEMBERS:
            member.apply(optimizer_parameters(optimizer))

    _ORIGINAL_INIT.append(original)
    torch.optim.Optimizer.__init__ = made  # type: ignore[assignment, method-assign]


def _unwrap_optimizer_init() -> None:
    import torch

    torch.optim.Optimizer.__init__ = _ORIGINAL_INIT.pop()  # type: ignore[method-assign]


def _shard_of(param: torch.Tensor, steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The tensor to nudge in place and its steps: a sharded parameter (a DTensor: FSDP2's fully_shard, tensor
    parallelism) is nudged in this rank's shard, by that shard of the steps drawn for the whole tensor, so a sharded
    member starts exactly where an unsharded one would (no communication: every rank drew the whole)."""
    import torch.distributed

    if torch.distributed.is_available():
        from torch.distributed.tensor import DTensor, distribute_tensor

        if isinstance(param, DTensor):
            shard = distribute_tensor(steps, param.device_mesh, param.placements, src_data_rank=None)
            return param.to_local(), shard.to_local()
    return param, steps
