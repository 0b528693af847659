"""How the cost of fingerprints and checkpoints grows with the model: 1 MB / 100 MB / 1 GB of fp32 parameters.

Two rows per size, each against its baseline, interleaved rounds, medians (benchmarks/scaling.py prints the table):
- fingerprint: `harness.runtime.fingerprint.fingerprint(model)` (what ctx.ddp logs every `fingerprint_every` steps)
  against one `hashlib.sha256` over the same bytes in one buffer - the least any exact digest of the weights costs
  on one core. Throughput in GB/s is printed beside it.
- checkpoint: what a rank does at a checkpoint (runtime/checkpoint_steps.py `CheckpointSteps.save` without the collective: the
  state built, saved atomically with fsync, its per-tensor digests) against a plain `torch.save(model.state_dict())`
  to the same folder, without fsync (what a training script usually does).

The model is a stack of Linear layers with an SGD optimizer that holds momentum (its state is saved too, and the
baseline saves it as well). Files go to a temporary folder on the same disk and are removed after each round.

Usage: python benchmarks/scale_model_bench.py [--rounds N] [--quick]
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from scaling import Axis, interleaved, table

from harness.runtime import checkpoint as ckpt
from harness.runtime.fingerprint import fingerprint, raw_bytes

MB = 1_000_000


def model_of(size_bytes: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Linear layers of 4 MB (1000x1000 fp32) or one smaller one, `size_bytes` of parameters in all."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    left = size_bytes // 4
    while left > 0:
        n = min(1000, max(1, int(left ** 0.5)))
        layers.append(torch.nn.Linear(n, n, bias=False))
        left -= n * n
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for p in model.parameters():  # one step, so the optimizer holds a momentum buffer per parameter
        p.grad = torch.ones_like(p)
    opt.step()
    return model, opt


def harness_checkpoint(model: torch.nn.Module, opt: torch.optim.Optimizer, folder: Path) -> None:
    position = ckpt.TrainingPosition(step=1, epoch=0, batch_in_epoch=1)
    state = ckpt.build(model=model, optimizer=opt, position=position, copy=False)
    ckpt.save_with_digests(state, ckpt.path_for(folder, 1, 0), model, opt)


def plain_save(model: torch.nn.Module, opt: torch.optim.Optimizer, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, folder / "plain.pt")


def measure(size: int, rounds: int, scratch: Path, fp: Axis, cp: Axis, notes: list[str]) -> None:
    """One size: the fingerprint against one sha256, then a checkpoint against torch.save (interleaved rounds)."""
    model, opt = model_of(size)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    flat = b"".join(bytes(raw_bytes(p)) for p in model.parameters())  # one buffer: the baseline's input
    times = interleaved({"harness": lambda: fingerprint(model) and None,
                         "sha": lambda: hashlib.sha256(flat).hexdigest() and None}, rounds)
    h, b = statistics.median(times["harness"]), statistics.median(times["sha"])
    fp.add(nbytes, f"{nbytes / MB:,.0f} MB", h, b)
    notes.append(f"{nbytes / MB:,.0f} MB: fingerprint {nbytes / h / 1e9:.2f} GB/s, one sha256 {nbytes / b / 1e9:.2f} GB/s")

    def saving(save, folder: Path):
        def timed() -> float:
            t0 = time.perf_counter()
            save(model, opt, folder)
            took = time.perf_counter() - t0
            shutil.rmtree(folder)  # the next round writes a new file, as the next checkpoint does
            return took
        return timed

    times = interleaved({"harness": saving(harness_checkpoint, scratch / "h"),
                         "plain": saving(plain_save, scratch / "p")}, rounds)
    cp.add(nbytes, f"{nbytes / MB:,.0f} MB", statistics.median(times["harness"]), statistics.median(times["plain"]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="1 MB and 10 MB, one round")
    args = ap.parse_args()
    sizes = [1 * MB, 10 * MB] if args.quick else [1 * MB, 100 * MB, 1000 * MB]
    rounds = 1 if args.quick else args.rounds
    fp = Axis("model size", "fingerprint(model), s (GB/s in notes)", "one hashlib.sha256 over the same bytes")
    cp = Axis("model size", "checkpoint: build + save_atomic + per-tensor digests, s", "plain torch.save, no fsync")
    notes = []
    scratch = Path(tempfile.mkdtemp(prefix="harness-model-bench-", dir=Path.cwd()))
    try:
        for size in sizes:
            measure(size, rounds, scratch, fp, cp, notes)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(table([fp, cp], f"## Model size ({rounds} interleaved rounds, medians, torch threads {torch.get_num_threads()})"))
    print("\n" + "\n".join(notes))


if __name__ == "__main__":
    main()
