"""experiments/digits_cnn written as a bare mp.spawn script: the baseline of benchmarks/startup_bench.py.

The same model, data, split, augmentation, loaders and epochs as experiments/digits_cnn/train.py with
its experiment.yaml; seeding is plain torch.manual_seed. Usage: python benchmarks/bare/digits_cnn.py [EPOCHS]
"""

import datetime
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from sklearn.datasets import load_digits
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

WORLD_SIZE, SEED = 2, 1234
BATCH, LR, MOMENTUM, DROPOUT, VAL_FRACTION, NUM_WORKERS, MAX_SHIFT, NOISE = 32, 0.05, 0.9, 0.25, 0.2, 1, 1, 0.05


class Digits(Dataset):
    def __init__(self, images, labels, augment=False):
        self.images, self.labels, self.augment = images, labels, augment

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        x = self.images[i]
        if self.augment:
            dy, dx = torch.randint(-MAX_SHIFT, MAX_SHIFT + 1, (2,)).tolist()
            x = torch.roll(x, shifts=(dy, dx), dims=(1, 2))
            x = (x + NOISE * torch.randn_like(x)).clamp(0, 1)
        return x, self.labels[i]


def make_model():
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(), nn.Dropout(DROPOUT),
        nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Dropout(DROPOUT),
        nn.Linear(64, 10),
    )


def train(rank, world_size, port, epochs):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(SEED + rank)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=600))
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(SEED))
    n_val = int(len(labels) * VAL_FRACTION)
    val, tr = order[:n_val], order[n_val:]
    train_set, val_set = Digits(images[tr], labels[tr], augment=True), Digits(images[val], labels[val])
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, seed=SEED)
    # BARE_FORK_WORKERS=1: the loader workers fork (as ctx.loader's do) instead of inheriting the ranks' spawn, which
    # re-imports torch in a new worker every epoch.
    fork = {"multiprocessing_context": "fork"} if os.environ.get("BARE_FORK_WORKERS") == "1" else {}
    loader = DataLoader(train_set, batch_size=BATCH, sampler=sampler, num_workers=NUM_WORKERS, **fork)
    val_loader = DataLoader(val_set, batch_size=256,
                            sampler=DistributedSampler(val_set, num_replicas=world_size, rank=rank, shuffle=False))
    model = DDP(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    loss_fn = nn.CrossEntropyLoss()
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
        model.eval()
        counts = torch.zeros(2, dtype=torch.int64)
        with torch.no_grad():
            for x, y in val_loader:
                counts[0] += (model(x).argmax(dim=1) == y).sum()
                counts[1] += len(y)
        dist.all_reduce(counts)
        model.train()
        if rank == 0:
            print(f"epoch {epoch + 1}/{epochs}  train_loss {loss.item():.4f}  val_acc {(counts[0] / counts[1]).item():.4f}",
                  flush=True)
    # Rank 0 hosts the rendezvous store: it must not exit while a peer still needs it.
    dist.barrier()
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    epochs = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    mp.spawn(train, args=(WORLD_SIZE, free_port(), epochs), nprocs=WORLD_SIZE)
