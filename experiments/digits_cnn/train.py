"""A small CNN on scikit-learn's handwritten digits: dropout, worker-side augmentation, DDP."""

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import Dataset


class Digits(Dataset):
    """8x8 digit images in [0, 1]; training items get a random shift and pixel noise.

    The augmentation draws from torch's global generator inside the DataLoader worker, which
    harness seeds per worker, so it is random and still reproducible.
    """

    def __init__(self, images, labels, augment=False, max_shift=1, noise=0.0):
        self.images, self.labels = images, labels
        self.augment, self.max_shift, self.noise = augment, max_shift, noise

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        x = self.images[i]
        if self.augment:
            dy, dx = torch.randint(-self.max_shift, self.max_shift + 1, (2,)).tolist()
            x = torch.roll(x, shifts=(dy, dx), dims=(1, 2))
            x = (x + self.noise * torch.randn_like(x)).clamp(0, 1)
        return x, self.labels[i]


def make_model(dropout):
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(), nn.Dropout(dropout),
        nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Dropout(dropout),
        nn.Linear(64, 10),
    )


def split(ctx, val_fraction):
    digits = load_digits()  # bundled with scikit-learn: no download
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(ctx.seed))
    n_val = int(len(labels) * val_fraction)
    val, tr = order[:n_val], order[n_val:]
    return (images[tr], labels[tr]), (images[val], labels[val])


def evaluate(ctx, model, loader):
    model.eval()
    counts = torch.zeros(2, dtype=torch.int64, device=ctx.device)
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(ctx.device), y.to(ctx.device)
            counts[0] += (model(x).argmax(dim=1) == y).sum()
            counts[1] += len(y)
    dist.all_reduce(counts)  # integer sums: exact in any order
    model.train()
    return (counts[0] / counts[1]).item()


def train(ctx):
    cfg = ctx.cfg
    (x_tr, y_tr), (x_val, y_val) = split(ctx, cfg.val_fraction)
    train_set = Digits(x_tr, y_tr, augment=True, max_shift=cfg.max_shift, noise=cfg.noise)
    train_loader = ctx.loader(train_set, cfg.batch_size, shuffle=True, num_workers=cfg.num_workers)
    val_loader = ctx.loader(Digits(x_val, y_val), 256, shuffle=False)

    model = ctx.ddp(make_model(cfg.dropout))
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    ctx.track(optimizer)  # part of every checkpoint (momentum buffers included)
    loss_fn = nn.CrossEntropyLoss()

    for epoch in ctx.epochs(cfg.epochs):
        for x, y in train_loader:
            optimizer.zero_grad()
            # loss.backward() in standard DDP; per-shard gradients summed in a fixed order in
            # world-size-invariant mode. The same line works in both.
            loss = ctx.backward((x.to(ctx.device), y.to(ctx.device)), lambda x, y: loss_fn(model(x), y))
            optimizer.step()
            ctx.log({"train_loss": loss}, ctx.step)
        acc = evaluate(ctx, model, val_loader)
        ctx.log({"val_acc": acc, "epoch": epoch}, ctx.step)  # at the epoch's last step
        ctx.print(f"epoch {epoch + 1}/{cfg.epochs}  train_loss {loss.item():.4f}  val_acc {acc:.4f}")
