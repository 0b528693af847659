"""The rounding envelope's margins: how far planted changes that show only in the training land outside it, at the
first step they can show, and how close honest replays on other CPU kernels come to its edge.

    python benchmarks/margin_bench.py [--seeds 5] [--members 8] [--models linear cnn mlp gru mlp_relu]

Each model (benchmarks/verdict_bench.py's, and two more: `gru`, a GRU classifier with its own batch size, gradient
accumulation over 2 micro-batches and a learning-rate warm-up, and `mlp_relu`, a ReLU MLP with input dropout 0.1
and no weight decay) is trained once per seed as the original; its calibration is `--members` members built as
`harness calibrate` builds them (verdict_bench.member: nudged by perturb.NUDGE, on the machine's other kernels in
turn), and the envelope is harness's own (rounding.measure; the weights' after the last step from their sketches).

Planted changes show only in the training, never in a value harness records itself:

- lr x1.02, judged without `harness.lr` (the learning rate as a step used it; with it, the decisive values decide
  `DIVERGED at step 0`: harness/judge/decisive.py, the "with harness's values" column);
- momentum 0.9 -> 0.91; weight decay +0.01 (0 -> 0.01 on gru and mlp_relu, which have none);
- one flipped label: at step FLIP_AT, the batch's first sample's label moved to the next class (the data order, which
  harness records, is unchanged);
- dropout p +0.01 (mlp_relu: 0.1 -> 0.11; the others have none, so it is not planted there).

**Margin.** The first step a change can show is the first step at which any judged value of the replay differs
from the original's (before it, the replay re-executes the original bit for bit in this process: the change has not
acted yet). The margin is the replay's largest distance / half-width over the metrics judged at that step
(`rounding.judge(..., before=step + 1).widest`: the judge's own ratio). The table also gives the first step outside
(`rounding.judge(...).first()`) and its ratio there. A margin below 1 at the first step is a change that rounding
could still explain there; the goal is >= 5 on every seed.

**Honest replays** train the originals again in a child process started with one held-out kernel setting (ATen,
MKL and oneDNN read these variables when they load, so they cannot change in this process): no member runs them.
Their ratio is the judge's widest distance / half-width over every step and the weights after the last step; a
ratio above 1 is a false alarm (bitwise replays count as trials at ratio 0). Rates come with Clopper-Pearson 95%
upper bounds (scipy.stats.binomtest).
"""

from __future__ import annotations

import argparse
import os
import pickle
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from scipy.stats import binomtest
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import verdict_bench as vb  # benchmarks/, the models and the training loop

from harness.judge import rounding
from harness.judge.decisive import first_decisive
from harness.judge.metricdiff import KIND_VALUE, Divergence
from harness.judge.weightdistance import distance

FLIP_AT = 10
OLD_SAFETY = 8.0  # the constant the evidence-based factor replaced


class _GRUNet(nn.Module):
    """A GRU over the sequence, a linear head on its last output."""

    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(3, 16, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gru(x)[0][:, -1])


def _sequences() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(1200, 10, 3, generator=g)
    y = (x[:, :, 0].mean(1) > 0).long() * 2 + (x[:, -3:, 1].mean(1) > 0).long()
    return x[:1000], y[:1000], x[1000:], y[1000:]


MODELS = {
    **vb.MODELS,
    "gru": vb.Model("gru", _GRUNet, _sequences, True, steps=48, batch=24, lr=0.1, weight_decay=0.0, accumulate=2,
                    warmup=8),
    "mlp_relu": vb.Model("mlp_relu", lambda: nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4)),
                         vb._blobs, True, steps=48, batch=32, lr=0.05, weight_decay=0.0, dropout=0.1),
}

PLANTED = [
    vb.Change("lr x1.02 (without harness.lr)", False, lr_scale=1.02),
    vb.Change("momentum 0.9 -> 0.91", False, momentum=0.91),
    vb.Change("weight decay +0.01", False, weight_decay_add=0.01),
    vb.Change(f"one flipped label at step {FLIP_AT}", False, flip_label_at=FLIP_AT),
    vb.Change("dropout p +0.01", False, dropout=0.01),
]

_ALL = {"MKL_CBWR": "COMPATIBLE", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "DNNL_MAX_CPU_ISA": "SSE41",
        "ATEN_CPU_CAPABILITY": "default"}
HONEST: dict[str, dict[str, str]] = {
    **{f"{k}={v}": {k: v} for k, v in [("MKL_CBWR", "COMPATIBLE"), ("MKL_CBWR", "AVX2"),
                                       ("MKL_ENABLE_INSTRUCTIONS", "AVX2"), ("DNNL_MAX_CPU_ISA", "AVX2"),
                                       ("DNNL_MAX_CPU_ISA", "SSE41"), ("ATEN_CPU_CAPABILITY", "default"),
                                       ("ATEN_CPU_CAPABILITY", "avx2")]},
    "all at once (" + " ".join(f"{k}={v}" for k, v in _ALL.items()) + ")": _ALL,
}


def planted_for(model: vb.Model) -> list[vb.Change]:
    return [c for c in PLANTED if not (c.dropout and not model.dropout) and not (c.momentum and not model.momentum)]


@dataclass
class Trial:
    """One calibrated run (model, seed): the original, its members, and each replay's curves and weights."""

    model: str
    seed: int
    original: vb.Curves
    members: list[vb.Curves]
    spread: list[float]  # each member's weights' relative distance from the run's after the last step
    replays: dict[str, tuple[vb.Curves, float, str]] = field(default_factory=dict)  # row -> curves, moved, tensor
    honest: dict[str, bool] = field(default_factory=dict)
    lr: dict[str, float] = field(default_factory=dict)  # row -> the learning rate harness would record (step 0)


def envelope(t: Trial, steps: int) -> rounding.Envelope:
    weights = rounding.WeightsEnvelope(steps, "ref", t.spread, "")
    return rounding.measure("run", "cal", t.original, t.members, steps, len(t.members), weights)


def _bitwise(a: vb.Curves, b: vb.Curves) -> bool:
    return all(np.array_equal(a[k][1], b[k][1]) for k in a)


def first_shown(original: vb.Curves, replay: vb.Curves) -> int | None:
    """The first step at which any value of `replay` differs from `original`'s (None: bit for bit)."""
    found = [int(s[np.argmax(v != replay[k][1])]) for k, (s, v) in original.items() if not np.array_equal(v, replay[k][1])]
    return min(found) if found else None


@dataclass
class Margin:
    shown: int | None  # the first step the change shows (None: never, bit for bit)
    at_shown: float  # distance / half-width there
    outside: int | None  # the first step outside (None: inside throughout, weights included)
    at_outside: float
    decisive: int | None  # with harness's own values: the step they decide DIVERGED at (None: they do not)


def margin(env: rounding.Envelope, t: Trial, row: str, safety: float | None = None) -> Margin:
    """`safety`: another factor than rounding.SAFETY (the rule it replaced: 8)."""
    replay, moved, tensor = t.replays[row]
    shown = first_shown(t.original, replay)
    at_shown = 0.0 if shown is None else rounding.judge(env, t.original, replay, before=shown + 1, safety=safety).widest
    judged = rounding.judge(env, t.original, replay, safety=safety)
    judged.weights = rounding.judge_weights(env, moved, tensor)
    first = judged.first()
    if first is not None:
        outside, at_outside = first.step, first.distance / first.half_width
    elif judged.weights is not None and not judged.weights.inside:
        outside, at_outside = env.steps, judged.weights.distance / judged.weights.half_width
    else:
        outside, at_outside = None, judged.widest
    base = t.lr["original"]
    lr = [Divergence(KIND_VALUE, 0, "harness.lr", base, t.lr[row], abs(t.lr[row] - base))] if t.lr[row] != base else []
    found = first_decisive(lr, None)  # the data order is the original's in every planted change here
    return Margin(shown, at_shown, outside, at_outside, None if found is None else found.step)


def honest_ratio(env: rounding.Envelope, t: Trial, row: str, safety: float | None = None) -> float:
    """The judge's widest distance / half-width, values and weights (`safety`: the values' factor)."""
    replay, moved, tensor = t.replays[row]
    if _bitwise(t.original, replay):
        return 0.0
    judged = rounding.judge(env, t.original, replay, safety=safety)
    w = rounding.judge_weights(env, moved, tensor)
    return max(judged.widest, 0.0 if w is None else w.distance / w.half_width)


# --- training ---------------------------------------------------------------------------------------------------
def _originals_in_child(names: list[str], seeds: list[int], env: dict[str, str]
                        ) -> dict[str, list[tuple[vb.Curves, object]]]:
    """Each model's originals of `seeds`, trained in a child process started with `env` (one per kernel setting)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "runs.pkl"
        steps = ["--steps", str(MODELS[names[0]].steps)]
        subprocess.run([sys.executable, __file__, "--child", ",".join(names), ",".join(map(str, seeds)), str(out),
                        *steps], check=True, env={**os.environ, **env}, timeout=3600)
        return pickle.loads(out.read_bytes())


def trials(names: list[str], seeds: list[int], members: int) -> list[Trial]:
    torch.set_num_threads(1)
    out = []
    children = {row: _originals_in_child(names, seeds, env) for row, env in HONEST.items()}
    for name in names:
        model = MODELS[name]
        data = model.data()
        kernels = {row: found[name] for row, found in children.items()}
        for i, seed in enumerate(seeds):
            original, reference = vb.train_sketched(model, seed, vb.ORIGINAL, data)
            runs = [vb.train_sketched(model, seed, vb.member(k), data) for k in range(1, members + 1)]
            t = Trial(name, seed, original, [c for c, _ in runs], [distance(s, reference).relative for _, s in runs])
            t.lr["original"] = model.lr
            for change in planted_for(model):
                curves, sk = vb.train_sketched(model, seed, change, data)
                moved = distance(sk, reference)
                t.replays[change.name] = (curves, moved.relative, moved.widest)
                t.honest[change.name] = False
                t.lr[change.name] = model.lr * change.lr_scale
            for row, runs_ in kernels.items():
                curves, sk = runs_[i]
                moved = distance(sk, reference)
                t.replays[row] = (curves, moved.relative, moved.widest)
                t.honest[row] = True
            out.append(t)
            print(f"  done: {name} seed {seed}", file=sys.stderr, flush=True)
    return out


# --- the table ----------------------------------------------------------------------------------------------------
def _upper(alarms: int, n: int) -> float:
    return float(binomtest(alarms, n).proportion_ci(0.95, method="exact").high) if n else 1.0


def report(ts: list[Trial], steps: int) -> list[str]:
    names = sorted({t.model for t in ts}, key=list(MODELS).index)
    seeds = sorted({t.seed for t in ts})
    envs = {(t.model, t.seed): envelope(t, steps) for t in ts}
    out = [f"planted (training only): distance / half-width; {len(seeds)} seeds per model ({seeds[0]}-{seeds[-1]}), "
           f"{len(ts[0].members)} members, SAFETY {rounding.SAFETY:g} (before: {OLD_SAFETY:g})", "",
           "| model | change | first shown (step) | margin there, min over seeds | seeds >= 5x | before: min, seeds >= 5x "
           "| first outside (step per seed) | ratio there, min | judged on the training's values: caught "
           "| with harness's values: caught |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name in names:
        for change in [c for c in PLANTED if any(c.name in t.replays for t in ts if t.model == name)]:
            ms = [margin(envs[t.model, t.seed], t, change.name) for t in ts if t.model == name]
            old = [margin(envs[t.model, t.seed], t, change.name, OLD_SAFETY).at_shown for t in ts if t.model == name]
            shown = sorted({m.shown for m in ms if m.shown is not None})
            outs = [m.outside for m in ms]
            caught = sum(o is not None for o in outs)
            with_own = sum(o is not None or m.decisive is not None for o, m in zip(outs, ms))
            out.append(f"| {name} | {change.name} | {','.join(map(str, shown)) or '-'} | "
                       f"{min(m.at_shown for m in ms):.3g} | {sum(m.at_shown >= 5 for m in ms)}/{len(ms)} | "
                       f"{min(old):.3g}, {sum(o >= 5 for o in old)}/{len(old)} | "
                       f"{','.join('-' if o is None else str(o) for o in outs)} | "
                       f"{min(m.at_outside for m in ms):.3g} | {caught}/{len(ms)} | {with_own}/{len(ms)}"
                       + (f" (step {ms[0].decisive}, harness.lr)" if ms[0].decisive is not None else "") + " |")
    out += ["", "honest (held-out kernels, child process): widest distance / half-width", "",
            "| change | " + " | ".join(f"{n}: max ratio" for n in names) + " | alarms / trials | 95% upper bound |",
            "| --- |" + " --- |" * (len(names) + 2)]
    total = [0, 0]
    for row in HONEST:
        ratios = {n: [honest_ratio(envs[t.model, t.seed], t, row) for t in ts if t.model == n] for n in names}
        alarms = sum(r > 1 for rs in ratios.values() for r in rs)
        n = sum(len(rs) for rs in ratios.values())
        total[0] += alarms
        total[1] += n
        bitwise = {k: sum(r == 0 for r in rs) for k, rs in ratios.items()}
        out.append(f"| {row} | " + " | ".join(f"{max(ratios[k]):.3g}" + (f" ({bitwise[k]} bitwise)" if bitwise[k] else "")
                                              for k in names) + f" | {alarms}/{n} | {_upper(alarms, n):.1%} |")
    out.append("| all honest rows | | " + " | " * (len(names) - 1) + f"{total[0]}/{total[1]} | "
               f"{_upper(total[0], total[1]):.1%} |")
    # The evidence SAFETY is set from (rounding.HONEST_WIDEST): honest distances in units of the widest member.
    unit = max(honest_ratio(envs[t.model, t.seed], t, row, 1.0) for t in ts for row in HONEST)
    return out + ["", f"largest honest distance in units of the widest member (values; weights at WIDE_SAFETY "
                  f"{rounding.WIDE_SAFETY:g}): {unit:.3g}"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=5, help="calibrated runs per model (default 5)")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--members", type=int, default=8, help="calibration members (default 8)")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default: each model's 48)")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--dump", type=Path, help="keep the trials in this file (pickle)")
    parser.add_argument("--load", type=Path, nargs="+", help="report the trials of these --dump files (pooled) instead of "
                        "training")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps:
        for name in list(MODELS):
            MODELS[name] = replace(MODELS[name], steps=args.steps)
    if args.child:  # the originals under this process's kernels (HONEST's variables)
        names, seeds, path = args.child
        torch.set_num_threads(1)
        runs = {name: [vb.train_sketched(MODELS[name], int(s), vb.ORIGINAL, MODELS[name].data())
                       for s in seeds.split(",")] for name in names.split(",")}
        Path(path).write_bytes(pickle.dumps(runs))
        return 0
    start = time.monotonic()
    if args.load:
        ts = [t for path in args.load for t in pickle.loads(path.read_bytes())]
    else:
        ts = trials(args.models, list(range(args.first_seed, args.first_seed + args.seeds)), args.members)
        if args.dump:
            args.dump.write_bytes(pickle.dumps(ts))
    steps = max(MODELS[t.model].steps for t in ts)
    print("\n".join(report(ts, steps)))
    print(f"({time.monotonic() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
