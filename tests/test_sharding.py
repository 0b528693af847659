"""Sharded models in one process (a 1-rank gloo group, FSDP2 on the CPU): DTensor digests, the whole's fingerprint
from the replica check, and the DCP round trip of model and AdamW state, a step-0 save leaving the optimizer as it is."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from harness.errors import ExperimentError
from harness.runtime import replicas, sharding
from harness.runtime.fingerprint import fingerprint


@pytest.fixture
def group(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group("gloo", init_method=(tmp_path / "store").as_uri(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _sharded(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _steps(model: nn.Module, optimizer: torch.optim.Optimizer, n: int) -> None:
    for i in range(n):
        optimizer.zero_grad()
        model(torch.randn(4, 6, generator=torch.Generator().manual_seed(i))).square().mean().backward()
        optimizer.step()


def test_sharded_model_is_fingerprinted_and_round_trips_through_dcp(group: None, tmp_path: Path) -> None:
    model, optimizer = _sharded(0)
    assert sharding.holds_sharded(model) and not sharding.holds_sharded(nn.Linear(2, 2))
    with pytest.raises(ExperimentError, match="which DDP cannot wrap. Call ctx.register"):
        sharding.refuse_ddp(model)
    with pytest.raises(ExperimentError, match="world-size-invariant mode cannot train a sharded"):
        sharding.refuse_invariant(model)
    before = fingerprint(model)  # a DTensor is hashed as this rank holds it, no .numpy() of the subclass
    assert replicas.check_equal(model, 1, registered=True) == sharding.combine([before])
    sharding.save(model, optimizer, tmp_path / "step0")
    assert not optimizer.state  # saving at step 0 did not initialise the optimizer by a step of its own
    _steps(model, optimizer, 2)
    saved = sharding.save(model, optimizer, tmp_path / "step2")
    assert "2.weight/exp_avg" in saved and fingerprint(model) != before
    fresh, fresh_optimizer = _sharded(1)
    sharding.load(fresh, fresh_optimizer, tmp_path / "step2", sharding.param_groups(optimizer))
    assert sharding.digests(fresh, fresh_optimizer) == saved and fingerprint(fresh) == fingerprint(model)
    _steps(model, optimizer, 1)
    _steps(fresh, fresh_optimizer, 1)
    assert fingerprint(fresh) == fingerprint(model)  # the step after the load is the same step
