"""World-size invariant training: samplers, the canonical tree, and bitwise-equal runs at W = 1, 2 and 4."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader, Dataset

from harness.errors import ConfigError
from harness.runtime import invariant
from harness.runtime.invariant import (
    GATHER_BELOW_BYTES,
    EvalSampler,
    InvariantStep,
    KeyedDataset,
    ShardBatchSampler,
    allgather_reduce,
    broadcast_parameters,
    bytes_per_step,
    canonical_allreduce,
    check_layout,
    tree_sum,
)

SEED = 7
SHARDS = 4
SHARD_SIZE = 4
SAMPLES = 3 * SHARDS * SHARD_SIZE + 5  # three global batches per epoch and a tail that must be dropped
EPOCHS = 2
VECTOR_LEN = 1003  # not divisible by 2 or 4: exercises padding


# -- pieces that run inside the spawned ranks -------------------------------------------------------------


class NoisyPoints(Dataset):
    """Fixed points whose items get fresh torch.randn noise: an augmentation drawn from the global generator."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(SAMPLES, 6, generator=generator)
        self.y = torch.randint(0, 3, (SAMPLES,), generator=generator)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i] + 0.1 * torch.randn(6), self.y[i]


def make_model(rank: int) -> nn.Module:
    # Every rank starts from different weights: broadcast_parameters must make them rank 0's.
    torch.manual_seed(100 + rank)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))


def params_sha(model: nn.Module) -> str:
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def rank_vector(rank: int) -> torch.Tensor:
    """Values over many binades, so that the grouping of a sum shows in its bits."""
    generator = torch.Generator().manual_seed(1000 + rank)
    scale = torch.exp2(torch.randint(-20, 20, (VECTOR_LEN,), generator=generator).float())
    return torch.randn(VECTOR_LEN, generator=generator) * scale


def train_invariant(rank: int, world: int, num_workers: int) -> dict[str, Any]:
    model = make_model(rank)
    broadcast_parameters(model)
    initial = params_sha(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sampler = ShardBatchSampler(SAMPLES, SHARD_SIZE, SHARDS, world, rank, SEED)
    loader = DataLoader(
        KeyedDataset(NoisyPoints(), SEED), batch_sampler=sampler, num_workers=num_workers,
        multiprocessing_context="fork" if num_workers else None,
    )
    stepper = InvariantStep(SHARDS, world, rank, SEED)
    loss_fn = nn.CrossEntropyLoss()
    losses, step = [], 0
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            loss = stepper.backward(model, (x, y), lambda a, b: loss_fn(model(a), b), step)
            optimizer.step()
            losses.append(float(loss).hex())
            step += 1
    return {"initial": initial, "sha": params_sha(model), "losses": losses}


def make_wide_model(rank: int) -> nn.Module:
    """267,779 parameters: a gradient vector over 1 MiB, so canonical_allreduce takes the point-to-point path."""
    torch.manual_seed(200 + rank)
    return nn.Sequential(nn.Linear(6, 512), nn.ReLU(), nn.Dropout(0.3), nn.Linear(512, 512), nn.ReLU(),
                         nn.Linear(512, 3))


WIDE_STEPS = 2


def train_wide(rank: int, world: int) -> dict[str, Any]:
    """A few invariant steps of the wide model, counting how the exchanges were posted."""
    counts = {"batches": 0, "not_one_pair": 0}
    batch_isend_irecv = dist.batch_isend_irecv

    def counted_batch(ops: list) -> list:
        counts["batches"] += 1
        pair = [(op.op, op.peer) for op in ops]
        counts["not_one_pair"] += len(pair) != 2 or {op for op, _ in pair} != {dist.isend, dist.irecv} or len(
            {peer for _, peer in pair}) != 1
        return batch_isend_irecv(ops)

    # A spy that calls the real function (this is a spawned rank: nothing outlives it).
    dist.batch_isend_irecv = counted_batch
    try:
        model = make_wide_model(rank)
        broadcast_parameters(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        sampler = ShardBatchSampler(SAMPLES, SHARD_SIZE, SHARDS, world, rank, SEED)
        loader = DataLoader(KeyedDataset(NoisyPoints(), SEED), batch_sampler=sampler)
        stepper = InvariantStep(SHARDS, world, rank, SEED)
        loss_fn = nn.CrossEntropyLoss()
        losses = []
        for step, (x, y) in zip(range(WIDE_STEPS), loader):
            optimizer.zero_grad()
            loss = stepper.backward(model, (x, y), lambda a, b: loss_fn(model(a), b), step)
            optimizer.step()
            losses.append(float(loss).hex())
    finally:
        dist.batch_isend_irecv = batch_isend_irecv
    numel = sum(p.numel() for p in model.parameters())
    return {"sha": params_sha(model), "losses": losses, "numel": numel, **counts}


def train_standard(rank: int, world: int) -> dict[str, Any]:
    """The usual recipe: the rank's whole batch in one pass, grads summed by all_reduce, divided by W."""
    model = make_model(rank)
    broadcast_parameters(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sampler = ShardBatchSampler(SAMPLES, SHARD_SIZE, SHARDS, world, rank, SEED)
    loader = DataLoader(KeyedDataset(NoisyPoints(), SEED), batch_sampler=sampler)
    loss_fn = nn.CrossEntropyLoss()
    losses, step = [], 0
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for x, y in loader:
            torch.manual_seed(SEED * 1000 + step)  # the same dropout seed on every rank and every W
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
            optimizer.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(float(mean / world).hex())
            step += 1
    return {"sha": params_sha(model), "losses": losses}


def rank_main(rank: int, world: int, port: int, out: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    try:
        result: dict[str, Any] = {}
        vector = rank_vector(rank)
        record = {
            "input": vector,
            "halving": canonical_allreduce(vector, gather_below_bytes=0),  # forces the point-to-point path
            "default": canonical_allreduce(vector),  # small: takes the all-gather path
            "allgather": allgather_reduce(vector),
        }
        torch.save(record, Path(out) / f"reduce_w{world}_r{rank}.pt")
        # The DataLoader runs in a worker process at W=2 only: keys, not workers, decide the noise.
        result["invariant"] = train_invariant(rank, world, num_workers=1 if world == 2 else 0)
        result["wide"] = train_wide(rank, world)
        if world <= 2:
            result["standard"] = train_standard(rank, world)
        (Path(out) / f"train_w{world}_r{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One spawned job per world size; every rank writes its reduction results and training record."""
    out = tmp_path_factory.mktemp("invariant")
    for world in (1, 2, 4):
        mp.spawn(rank_main, args=(world, free_port(), str(out)), nprocs=world, join=True)
    return out


def load_train(out: Path, world: int, rank: int = 0) -> dict[str, Any]:
    return json.loads((out / f"train_w{world}_r{rank}.json").read_text())


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


# -- tests -------------------------------------------------------------------------------------------------


def test_tree_sum_groups_pairwise_and_the_grouping_shows() -> None:
    a, b, c, d = (torch.tensor([v], dtype=torch.float32) for v in (1e8, 1.0, -1e8, 1.0))
    tree = tree_sum([a, b, c, d])
    assert torch.equal(bits(tree), bits((a + b) + (c + d)))
    left_fold = ((a + b) + c) + d
    assert not torch.equal(bits(tree), bits(left_fold)), "values too tame: grouping would not be detected"
    parts = [rank_vector(r) for r in range(8)]
    expected = ((parts[0] + parts[1]) + (parts[2] + parts[3])) + ((parts[4] + parts[5]) + (parts[6] + parts[7]))
    assert torch.equal(bits(tree_sum(parts)), bits(expected))
    with pytest.raises(ValueError):
        tree_sum(parts[:3])


@pytest.mark.parametrize("world", [2, 4])
def test_canonical_allreduce_is_the_tree_on_every_rank(runs: Path, world: int) -> None:
    records = [torch.load(runs / f"reduce_w{world}_r{r}.pt") for r in range(world)]
    inputs = [rank_vector(r) for r in range(world)]
    for r, rec in enumerate(records):
        assert torch.equal(rec["input"], inputs[r])
    expected = tree_sum(inputs)
    for r, rec in enumerate(records):
        for path in ("halving", "default", "allgather"):
            assert rec[path].shape == (VECTOR_LEN,)
            assert torch.equal(bits(rec[path]), bits(expected)), f"rank {r}, {path}: not the canonical tree"
    if world == 4:
        left_fold = ((inputs[0] + inputs[1]) + inputs[2]) + inputs[3]
        assert not torch.equal(bits(expected), bits(left_fold)), "inputs too tame: grouping would not be detected"


def test_training_is_bitwise_identical_for_world_sizes_1_2_4(runs: Path) -> None:
    results = {world: [load_train(runs, world, r)["invariant"] for r in range(world)] for world in (1, 2, 4)}
    for world, ranks in results.items():
        assert len({r["sha"] for r in ranks}) == 1, f"ranks disagree at W={world}"
        assert len({tuple(r["losses"]) for r in ranks}) == 1, f"rank losses disagree at W={world}"
    reference = results[1][0]
    assert reference["sha"] != reference["initial"], "training left the weights unchanged: nothing was compared"
    assert len(reference["losses"]) == EPOCHS * (SAMPLES // (SHARDS * SHARD_SIZE))
    for world in (2, 4):
        assert results[world][0]["losses"] == reference["losses"], f"losses at W={world} differ from W=1"
        assert results[world][0]["sha"] == reference["sha"], f"parameters at W={world} differ from W=1"


def test_gradients_over_1_mib_go_point_to_point_in_one_batch_per_round_and_stay_invariant(runs: Path) -> None:
    """The wide model's gradient takes canonical_allreduce's halving/doubling path on real gloo ranks, each round
    posted as one batch_isend_irecv of one send and one receive to the same peer, and W = 1, 2, 4 agree bit for bit.

    What this cannot show on CPU: that ungrouped isend/irecv would hang under NCCL (gloo buffers them). That
    the ops are posted as one group is what is asserted, here and in test_exchange_ops_are_one_send_and_one_receive.
    """
    results = {world: [load_train(runs, world, r)["wide"] for r in range(world)] for world in (1, 2, 4)}
    reference = results[1][0]
    assert (reference["numel"] + SHARDS) * 4 >= GATHER_BELOW_BYTES, "the model is too small to take the p2p path"
    assert len(reference["losses"]) == WIDE_STEPS
    for world, ranks in results.items():
        rounds = 2 * (world.bit_length() - 1)  # log2(W) halving rounds, then as many doubling rounds
        for rank, result in enumerate(ranks):
            assert result["batches"] == WIDE_STEPS * rounds, f"W={world} rank {rank}: {result['batches']} batches"
            assert result["not_one_pair"] == 0, f"W={world} rank {rank} posted a batch that is not one send + one receive"
            assert (result["losses"], result["sha"]) == (reference["losses"], reference["sha"]), f"W={world} rank {rank}"


def test_exchange_ops_are_one_send_and_one_receive_to_the_same_peer() -> None:
    """The ops one round posts together, built in a one-rank gloo group (P2POp needs one; nothing is sent)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        send, recv = torch.zeros(3), torch.zeros(3)
        ops = invariant._exchange_ops(send, recv, 0, None)
        assert [(op.op, op.peer) for op in ops] == [(dist.isend, 0), (dist.irecv, 0)]
        assert ops[0].tensor is send and ops[1].tensor is recv and ops[0].group is ops[1].group
    finally:
        dist.destroy_process_group()


def test_standard_data_parallel_is_not_invariant(runs: Path) -> None:
    # The control: the same data, model and seeds through the usual recipe must differ, or the test above
    # could not tell invariant training from any other.
    one, two = load_train(runs, 1)["standard"], load_train(runs, 2)["standard"]
    assert one["sha"] != two["sha"]
    assert one["losses"] != two["losses"]


@pytest.mark.parametrize("shards, world", [(6, 2), (8, 3), (4, 8), (0, 1)])
def test_check_layout_refuses(shards: int, world: int) -> None:
    with pytest.raises(ConfigError) as err:
        check_layout(shards, world)
    assert "\n" not in str(err.value)


def test_check_layout_accepts() -> None:
    for shards, world in [(1, 1), (8, 1), (8, 2), (8, 8)]:
        check_layout(shards, world)


def test_shard_batch_sampler_partitions_the_world_size_1_batches() -> None:
    n, shard, shards = 50, 3, 4
    for epoch in (0, 1):
        single = ShardBatchSampler(n, shard, shards, 1, 0, SEED)
        single.set_epoch(epoch)
        reference = list(single)
        assert len(reference) == len(single) == n // (shard * shards)
        flat = [key for batch in reference for key in batch]
        assert all(e == epoch for e, _ in flat)
        assert len({i for _, i in flat}) == len(flat), "an index repeats within an epoch"
        for world in (2, 4):
            samplers = [ShardBatchSampler(n, shard, shards, world, r, SEED) for r in range(world)]
            for s in samplers:
                s.set_epoch(epoch)
            per_rank = [list(s) for s in samplers]
            for t, batch in enumerate(reference):
                joined = [key for r in range(world) for key in per_rank[r][t]]
                assert joined == batch, f"W={world} step {t} is not W=1's batch in order"
    first, second = ShardBatchSampler(n, shard, shards, 1, 0, SEED), ShardBatchSampler(n, shard, shards, 1, 0, SEED)
    second.set_epoch(1)
    assert [i for _, i in next(iter(first))] != [i for _, i in next(iter(second))], "epochs do not reshuffle"


def test_shard_batch_sampler_refuses_bad_input() -> None:
    with pytest.raises(ConfigError):
        ShardBatchSampler(10, 4, 4, 1, 0, SEED)  # no full global batch
    with pytest.raises(ConfigError):
        ShardBatchSampler(100, 4, 4, 2, 0, SEED, drop_last=False)
    with pytest.raises(ConfigError):
        ShardBatchSampler(100, 4, 4, 2, 2, SEED)


def test_eval_sampler_splits_without_padding() -> None:
    for n in (0, 1, 10, 13):
        for world in (1, 2, 3, 4):
            blocks = [list(EvalSampler(n, world, r)) for r in range(world)]
            assert [i for b in blocks for _, i in b] == list(range(n))
            sizes = [len(b) for b in blocks]
            assert max(sizes) - min(sizes) <= 1
            assert sizes == [len(EvalSampler(n, world, r)) for r in range(world)]
    sampler = EvalSampler(5, 2, 1)
    sampler.set_epoch(3)
    assert list(sampler) == [(3, 2), (3, 3), (3, 4)]


def test_eval_sampler_chunks_form_the_same_batches_for_every_world_size() -> None:
    n, chunk = 23, 4

    def batches(world: int) -> list[list[int]]:
        out = []
        for r in range(world):
            keys = list(EvalSampler(n, world, r, chunk=chunk))
            out += [[i for _, i in keys[k : k + chunk]] for k in range(0, len(keys), chunk)]
        return out

    reference = batches(1)
    assert [i for b in reference for i in b] == list(range(n))
    for world in (2, 3, 4):
        assert batches(world) == reference, f"W={world} forms other evaluation batches"


def test_keyed_dataset_draws_by_key_and_pickles() -> None:
    keyed = KeyedDataset(NoisyPoints(), SEED)
    torch.manual_seed(1)
    first = keyed[(0, 5)][0]
    torch.manual_seed(2)  # the global state before the call must not matter
    assert torch.equal(first, keyed[(0, 5)][0])
    assert not torch.equal(first, keyed[(1, 5)][0])
    assert not torch.equal(first, KeyedDataset(NoisyPoints(), SEED + 1)[(0, 5)][0])
    assert torch.equal(first, pickle.loads(pickle.dumps(keyed))[(0, 5)][0])


def test_invariant_step_single_process_matches_the_definition() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2))
    x, y = torch.randn(8 * 2, 5), torch.randn(8 * 2, 2)
    stepper = InvariantStep(8, 1, 0, SEED)
    loss_fn = nn.MSELoss()
    rng_before = torch.get_rng_state()
    loss = stepper.backward(model, [x, y], lambda a, b: loss_fn(model(a), b), step=0)
    assert torch.equal(rng_before, torch.get_rng_state()), "backward left the global generator reseeded"
    shard_losses, shard_grads = [], []
    for j in range(8):
        # Fresh copies, as InvariantStep makes: a view at an offset into x can round differently.
        out = loss_fn(model(x[2 * j : 2 * j + 2].clone()), y[2 * j : 2 * j + 2].clone())
        shard_losses.append(out.detach().double())
        shard_grads.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(out, list(model.parameters()))]))
    assert torch.equal(loss, tree_sum(shard_losses) / 8)
    grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    assert torch.equal(bits(grad), bits(tree_sum(shard_grads) / 8))
    with pytest.raises(ValueError):
        stepper.backward(model, x[:12], lambda a: model(a).sum(), step=1)  # 12 rows are not 8 shards


def test_invariant_step_refuses_batchnorm_running_stats() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    with pytest.raises(ConfigError):
        InvariantStep(2, 1, 0, SEED).backward(model, torch.randn(4, 3), lambda a: model(a).sum(), step=0)


def test_bytes_per_step() -> None:
    assert bytes_per_step(1000, 1) == {"ddp_ring": 0, "canonical": 0, "allgather": 0}
    assert bytes_per_step(1000, 4) == {"ddp_ring": 6000, "canonical": 6000, "allgather": 12000}
    assert bytes_per_step(1003, 2)["canonical"] == 2 * 1 * 502 * 4
