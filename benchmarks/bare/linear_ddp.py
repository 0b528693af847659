"""experiments/linear_ddp written as a bare mp.spawn script: the baseline of benchmarks/startup_bench.py
(2 ranks, as the experiment's world_size) and of benchmarks/scale_ranks_data_bench.py (any world size).

Usage: python benchmarks/bare/linear_ddp.py [EPOCHS [WORLD_SIZE]]
"""

import datetime
import gc
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

WORLD_SIZE, SEED, LR, BATCH, SAMPLES = 2, 0, 0.01, 10, 100


def train(rank, world_size, port, epochs):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)  # as harness's determinism level strict
    torch.manual_seed(SEED + rank)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=600))
    fit(rank, world_size, epochs)
    # The DDP model is gone (fit's frame, and any cycle it left) while the group is still registered: freed after
    # destroy_process_group(), DDP's Reducer would be the group's last owner and destroy it holding the GIL while
    # joining gloo's workers, one of which may need the GIL to free the last all-reduce - a deadlock in torch 2.13
    # that hung this script now and then (harness/runtime/groupkeep.py describes the same).
    gc.collect()
    # Rank 0 hosts the rendezvous store: it must not exit while a peer still needs it.
    dist.barrier()
    dist.destroy_process_group()


def fit(rank, world_size, epochs):
    data = torch.randn(SAMPLES, 10, generator=torch.Generator().manual_seed(SEED))
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, seed=SEED)
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler)
    model = DDP(nn.Linear(10, 5))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    loss_fn = nn.MSELoss()
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for batch in loader:
            optimizer.zero_grad()
            output = model(batch)
            loss = loss_fn(output, torch.randn_like(output))
            loss.backward()
            optimizer.step()
        if rank == 0:
            print(f"epoch {epoch + 1}/{epochs} loss {loss.item():.4f}", flush=True)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    epochs = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    world_size = int(sys.argv[2]) if len(sys.argv) > 2 else WORLD_SIZE
    mp.spawn(train, args=(world_size, free_port(), epochs), nprocs=world_size)
