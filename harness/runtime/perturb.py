"""A calibration member's start: every floating-point parameter one ulp away from where the run started, and the
member's share of the machine's other CPU kernels.

`harness calibrate` measures how far rounding alone carries a run: another machine's kernels round the same
arithmetic differently by about one unit in the last place, and training carries that on. A member replays the run
with the same seed, config and data, its weights nudged before the first step by exactly that much, up or down per
element as a generator of the member's seed draws it. Everything else is the run's own: the nudge draws from its own
generator, never the global RNG that the data order, dropout and initialisation draw from.

A one-ulp nudge at the start is not all another machine does: its kernels round differently at every step, and a
convolution library reduces in another order throughout. Measured (benchmarks/verdict_bench.py, a CNN, 300 seeds),
replays with oneDNN off left an envelope of nudged members 13% of the time: they stay within 1e-7 for tens of
steps, then part abruptly (one seed: 1e-7 at step 22, 3.5e-6 at 24, 2.6e-4 by 38) while every nudged member stayed
at 1e-7. So members also run on the machine's other kernels (`KERNELS`, member i takes KERNELS[(i - 1) % 4]): the
convolution library off, the intra-op thread count changed (another reduction split), both. The envelope then holds
what the kernels this machine can run do to the run; docs/verdicts.md measures both that and kernels held out.

Every rank draws the same nudges (same seed, same parameter order), so the replicas stay equal whether the nudge
comes before DDP's broadcast (ctx.ddp) or after a framework's wrap (ctx.register).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

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


def use_kernels(seed: int) -> Kernels:
    """Switch this process to member `seed`'s kernels (in the rank, before the first step). Returns them."""
    import torch

    chosen = kernels_of(seed)
    if chosen.onednn_off:
        torch.backends.mkldnn.enabled = False  # type: ignore[assignment]  # a module property (ContextProp)
    if chosen.other_threads:
        torch.set_num_threads(other_threads(torch.get_num_threads()))
    return chosen


def nudge(model: torch.nn.Module, seed: int) -> int:
    """Move every floating-point parameter of `model` by one ulp towards +inf or -inf, drawn per element. Returns how
    many elements moved."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    moved = 0
    with torch.no_grad():
        for _, param in sorted(model.named_parameters(), key=lambda item: item[0]):
            if not param.is_floating_point() or param.numel() == 0:
                continue
            up = torch.rand(param.shape, generator=generator) < 0.5  # drawn on the CPU: the same on every device
            towards = torch.where(up, torch.tensor(float("inf")), torch.tensor(float("-inf"))).to(param.device, param.dtype)
            param.copy_(torch.nextafter(param, towards))
            moved += param.numel()
    return moved
