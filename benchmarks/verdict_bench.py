"""Calibration of the noise verdict: how often an honest replay is called DIVERGED, and how often a planted change is.

    python benchmarks/verdict_bench.py            # the table in docs/verdicts.md (about 15 min on 2 cores)
    python benchmarks/verdict_bench.py --small    # the version tests/test_verdict_bench.py runs in CI (~1 min)
    python benchmarks/verdict_bench.py --power    # the INCONCLUSIVE rule: small studies against real lr x2, x10

Each model is trained in this process, many times, with the seed deciding the initial weights, the data order and
the augmentation noise (the dataset itself is fixed, as a paper's is). A trial is what `harness replay` of a study
member judges: a study of N seeds (disjoint from every other trial's), its first member as the original, and a
replay of that member under one change. The replay's curves go through harness's own rules (harness/judge/noise.py:
`judge` on the final values; `judge_curves`, CURVE_POINTS segment means and the last value of each curve, which is
the rule `harness replay` applies; `judge_curves(before=K)`, the same on steps < K, as `replay --steps K` judges),
so what is measured is the code that decides verdicts.

Honest changes alter bits, not the algorithm: another thread count, the loss reduced in two halves, the gradient
summed over 4 shards (what invariant mode does for another world size), the oneDNN path off; and, the worst case,
a replay that decorrelated completely (another seed), which is what long training on other hardware approaches.
Planted changes are graded: lr x1.1 / x1.5 / x2, 1% label noise, one of 4 data shards dropped, weight decay off,
zero_grad skipped once mid-run, another augmentation seed (by design indistinguishable from seed noise: a rule
that caught it would also flag honest replays).

The rates are per trial with Clopper-Pearson 95% intervals. Training runs happen in-process, not through
`harness run`: the end-to-end path (a real study, a replay with another thread count) is tests/test_study_noise.py.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from scipy.stats import binomtest
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness.judge import noise, rounding
from harness.judge.weightdistance import Sketch, distance
from harness.runtime.perturb import NUDGE, NUDGE_ULPS, kernels_of, nudge, other_threads
from harness.runtime.sketch import sketch

Curves = dict[str, tuple[np.ndarray, np.ndarray]]


# --- what one training run is ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Change:
    """One way a replay differs from its original; the defaults are the original's own settings."""

    name: str
    honest: bool
    lr_scale: float = 1.0
    label_noise: float = 0.0
    drop_shard: bool = False
    weight_decay: bool = True
    skip_zero_grad: bool = False
    aug_seed: int = 1
    threads: int = 1
    halves: bool = False  # the batch loss as the mean of its two halves' means
    shards: int = 1  # the gradient accumulated over this many equal shards (invariant mode's world size)
    onednn: bool = True
    new_seed: bool = False
    perturb: int | None = None  # a calibration member: the weights start nudged (harness/runtime/perturb.py)
    nudge: float = NUDGE  # the member's nudge, relative (--nudge-sweep tries others)
    dropout: float = 0.0  # dropout on the model's input, added to the model's own (Model.dropout)
    momentum: float | None = None  # the SGD momentum instead of the model's
    weight_decay_add: float = 0.0  # added to the model's weight decay
    flip_label_at: int | None = None  # at this step, the batch's first sample's label is another class's


HONEST = [
    Change("threads 1 -> 2", True, threads=2),
    Change("loss reduced in two halves", True, halves=True),
    Change("gradient over 4 shards (invariant world size)", True, shards=4),
    Change("oneDNN path off", True, onednn=False),
    Change("another seed (decorrelated, worst case)", True, new_seed=True),
]
PLANTED = [
    Change("lr x1.1", False, lr_scale=1.1),
    Change("lr x1.5", False, lr_scale=1.5),
    Change("lr x2", False, lr_scale=2.0),
    Change("1% label noise", False, label_noise=0.01),
    Change("one of 4 data shards dropped", False, drop_shard=True),
    Change("weight decay off", False, weight_decay=False),
    Change("zero_grad skipped once", False, skip_zero_grad=True),
    Change("another augmentation seed", False, aug_seed=2),
]
ORIGINAL = Change("original", True)


@dataclass(frozen=True)
class Model:
    name: str
    build: Callable[[], nn.Module]
    data: Callable[[], tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]
    classify: bool
    steps: int
    batch: int
    lr: float
    momentum: float = 0.9
    weight_decay: float = 5e-3
    eval_every: int = 4
    dropout: float = 0.0  # dropout on the input
    accumulate: int = 1  # each step's gradient accumulated over this many micro-batches
    warmup: int = 0  # the learning rate ramps up linearly over this many steps


def _digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    y = torch.tensor(d.target, dtype=torch.int64)
    g = torch.Generator().manual_seed(1234)  # the dataset's split is fixed, as a paper's is
    order = torch.randperm(len(y), generator=g)
    return x[order[:1400]], y[order[:1400]], x[order[1400:]], y[order[1400:]]


def _regression() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    w = torch.randn(16, 1, generator=g)
    x = torch.randn(1280, 16, generator=g)
    y = x @ w + 0.3 * torch.randn(1280, 1, generator=g)
    return x[:1024], y[:1024], x[1024:], y[1024:]


def _blobs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    centers = 0.35 * torch.randn(4, 20, generator=g)  # overlapping classes: accuracy near 0.8, not 1
    y = torch.randint(0, 4, (2000,), generator=g)
    x = centers[y] + torch.randn(2000, 20, generator=g)
    return x[:1600], y[:1600], x[1600:], y[1600:]


MODELS = {
    # linear_ddp's shape: linear regression, one metric.
    "linear": Model("linear", lambda: nn.Linear(16, 1), _regression, False, steps=48, batch=32, lr=0.02),
    # digits_cnn's shape: a small CNN on the 8x8 digits.
    "cnn": Model("cnn", lambda: nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                              nn.Flatten(), nn.Linear(128, 10)),
                 _digits, True, steps=48, batch=32, lr=0.05),
    # A model with several metrics (train loss, val loss, val accuracy, weight norm, gradient norm).
    "mlp": Model("mlp", lambda: nn.Sequential(nn.Linear(20, 32), nn.Tanh(), nn.Linear(32, 4)),
                 _blobs, True, steps=48, batch=32, lr=0.05),
}


@contextmanager
def _settings(change: Change) -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(change.threads)
    try:
        with torch.backends.mkldnn.flags(enabled=change.onednn):
            yield
    finally:
        torch.set_num_threads(threads)


def train(model: Model, seed: int, change: Change, data: Any) -> Curves:
    """One run: every metric's curve (steps, values). Seeded like a harness run: one seed for weights and order."""
    return train_sketched(model, seed, change, data)[0]


def train_sketched(model: Model, seed: int, change: Change, data: Any) -> tuple[Curves, Sketch]:
    """train(), and the sketch of the model's weights after its last step (harness/runtime/sketch.py), as a
    calibration member or a replay of a calibrated run records it."""
    xs, ys, xv, yv = data
    if change.label_noise:
        g = torch.Generator().manual_seed(99)  # the same corrupted labels for every seed: a data bug, not noise
        flip = torch.rand(len(ys), generator=g) < change.label_noise
        ys = ys.clone()
        ys[flip] = (ys[flip] + 1) % (int(ys.max()) + 1) if model.classify else ys[flip] + 3.0
    if change.drop_shard:
        xs, ys = xs[: 3 * len(xs) // 4], ys[: 3 * len(ys) // 4]
    torch.manual_seed(seed)
    net = model.build()
    inner = net  # what is sketched: the model's own weights, with or without a dropout in front
    if change.dropout or model.dropout:
        net = nn.Sequential(nn.Dropout(model.dropout + change.dropout), net)
    if change.perturb is not None:
        nudge(net, change.perturb, change.nudge)
    lr = model.lr * change.lr_scale
    opt = torch.optim.SGD(net.parameters(), lr=lr,
                          momentum=model.momentum if change.momentum is None else change.momentum,
                          weight_decay=(model.weight_decay if change.weight_decay else 0.0) + change.weight_decay_add)
    order = torch.Generator().manual_seed(seed)
    aug = torch.Generator().manual_seed(1000 * change.aug_seed + seed)
    loss_fn = nn.functional.cross_entropy if model.classify else nn.functional.mse_loss
    names = ["train_loss", "val_loss"] + (["val_acc"] if model.classify else [])
    if model.name == "mlp":
        names += ["weight_norm", "grad_norm"]
    curves: dict[str, list[float]] = {k: [] for k in names}
    steps: dict[str, list[int]] = {k: [] for k in names}

    def log(key: str, step: int, value: float) -> None:
        if key in curves:
            steps[key].append(step)
            curves[key].append(value)

    perm = torch.randperm(len(ys), generator=order)
    at = 0
    with _settings(change):
        for step in range(model.steps):
            if at + model.batch > len(perm):
                perm, at = torch.randperm(len(ys), generator=order), 0
            idx = perm[at: at + model.batch]
            at += model.batch
            x = xs[idx] + 0.05 * torch.randn(xs[idx].shape, generator=aug)  # augmentation: input jitter
            y = ys[idx]
            if step == change.flip_label_at:
                y = y.clone()
                y[0] = (y[0] + 1) % (int(ys.max()) + 1) if model.classify else y[0] + 3.0
            if model.warmup:
                opt.param_groups[0]["lr"] = lr * min(1.0, (step + 1) / model.warmup)
            if not (change.skip_zero_grad and step == model.steps // 2):
                opt.zero_grad()
            total = 0.0
            parts = change.shards if change.shards > 1 else (2 if change.halves else model.accumulate)
            for xp, yp in zip(x.chunk(parts), y.chunk(parts)):
                loss = loss_fn(net(xp), yp) / parts
                loss.backward()
                total += float(loss.detach())
            grad = math.sqrt(sum(float((p.grad ** 2).sum()) for p in net.parameters() if p.grad is not None))
            opt.step()
            log("train_loss", step, total)
            log("grad_norm", step, grad)
            if (step + 1) % model.eval_every == 0:
                with torch.no_grad():
                    out = net(xv)
                    log("val_loss", step, float(loss_fn(out, yv)))
                    if model.classify:
                        log("val_acc", step, float((out.argmax(1) == yv).float().mean()))
                    log("weight_norm", step, math.sqrt(sum(float((p ** 2).sum()) for p in net.parameters())))
    return ({k: (np.asarray(steps[k]), np.asarray(curves[k])) for k in names},
            Sketch.of(sketch(inner, model.steps)))


# --- the rules under test ----------------------------------------------------------------------------------------
def _old_rule(replay: Curves, original: Curves, members: list[Curves]) -> bool:
    """Before calibration: each metric's final value inside its own 95% prediction interval."""
    fin = noise.final_values
    return all(noise.check(m, fin(replay)[m], None, [fin(x)[m] for x in members], 0.95).inside for m in original)


def _final_rule(replay: Curves, original: Curves, members: list[Curves]) -> bool:
    fin = noise.final_values
    return noise.judge("bench", fin(replay), fin(original), [fin(x) for x in members]).within


def _curve_rule(replay: Curves, original: Curves, members: list[Curves]) -> bool:
    return noise.judge_curves("bench", replay, original, members).within


def _early_rule(steps: int) -> Callable[[Curves, Curves, list[Curves]], bool]:
    def rule(replay: Curves, original: Curves, members: list[Curves]) -> bool:
        return noise.judge_curves("bench", replay, original, members, before=steps).within  # as replay --steps K
    return rule


RULE = f"curve: {noise.CURVE_POINTS} segment means + final, 1% (the rule)"  # the one `harness replay` applies


def rules(model: Model) -> dict[str, Callable[[Curves, Curves, list[Curves]], bool]]:
    k = model.steps // 4
    return {"final, 95% per metric (before)": _old_rule, "final only, 1% per replay": _final_rule,
            RULE: _curve_rule,
            f"first {k} steps (--steps {k}), 1%": _early_rule(k)}


# --- trials ------------------------------------------------------------------------------------------------------
@dataclass
class Tally:
    alarms: int = 0
    trials: int = 0

    def rate(self) -> str:
        if not self.trials:
            return "-"
        ci = binomtest(self.alarms, self.trials).proportion_ci(0.95, method="exact")
        return f"{self.alarms}/{self.trials} = {self.alarms / self.trials:.1%} [{ci.low:.1%}, {ci.high:.1%}]"


def measure(model: Model, seeds: int, trials: int, changes: list[Change], null_trials: int
            ) -> dict[tuple[str, str], Tally]:
    """Per (change, rule): how many of `trials` disjoint studies of `seeds` seeds called the replay DIVERGED.

    The worst honest case (another seed) needs no training per trial, so it gets `null_trials` studies, drawn at
    random from the same pool of runs (they overlap, so its interval is somewhat narrower than it should be)."""
    data = model.data()
    table: dict[tuple[str, str], Tally] = {}
    judges = rules(model)
    pool = seeds * trials
    base = {s: train(model, s, ORIGINAL, data) for s in range(pool)}
    draw = np.random.default_rng(seeds)
    for change in changes:
        if change.new_seed:
            studies = [[int(x) for x in draw.choice(pool, seeds + 1, replace=False)] for _ in range(null_trials)]
        else:
            studies = [list(range(t * seeds, (t + 1) * seeds)) for t in range(trials)]
        for study in studies:
            members = [base[s] for s in study[:seeds]]
            if change.new_seed:
                replay = base[study[seeds]]  # a seed outside this study
            else:
                replay = train(model, study[0], change, data)
            for name, rule in judges.items():
                tally = table.setdefault((change.name, name), Tally())
                tally.trials += 1
                tally.alarms += not rule(replay, members[0], members)
    return table


# The CI version: the honest changes and one planted one, on two models (about 30 s on a quiet 2-core machine).
SMALL = {"models": ["linear", "mlp"], "sizes": [5], "trials": 20, "null_trials": 300, "planted": ["lr x2"]}


def calibrate(models: list[str], sizes: list[int], trials: int, null_trials: int, planted: list[str] | None = None
              ) -> dict[tuple[str, int], dict[tuple[str, str], Tally]]:
    """(model, study size) -> its table: the whole measurement, as the CI test and main() take it (`planted`: only
    the planted changes of these names)."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="TF32 acceleration on top of oneDNN")
    changes = HONEST + [c for c in PLANTED if planted is None or c.name in planted]
    return {(name, seeds): measure(MODELS[name], seeds, trials, changes, null_trials)
            for name in models for seeds in sizes}


def report(model: Model, seeds: int, table: dict[tuple[str, str], Tally], changes: list[Change]) -> list[str]:
    names = list(rules(model))
    metrics = len(train(model, 0, ORIGINAL, model.data()))
    out = [f"### {model.name}: {metrics} metric{'s' if metrics != 1 else ''}, {model.steps} steps, studies of {seeds} "
           "seeds", "", "| change | kind | " + " | ".join(names) + " |", "| --- | --- |" + " --- |" * len(names)]
    for change in changes:
        kind = "honest: false alarm" if change.honest else "planted: power"
        out.append(f"| {change.name} | {kind} | " + " | ".join(table[change.name, n].rate() for n in names) + " |")
    return out + [""]


# --- the rounding envelope (harness calibrate, WITHIN_ROUNDING) ----------------------------------------------------
# Honest: what another machine changes while the training stays the same. Planted: real changes, down to 2%.
ROUNDING_HONEST = [
    Change("threads 1 -> 2", True, threads=2),
    Change("threads 1 -> 4", True, threads=4),
    Change("loss reduced in two halves", True, halves=True),
    Change("gradient over 4 shards (invariant world size)", True, shards=4),
    Change("oneDNN path off", True, onednn=False),
]
ROUNDING_PLANTED = [
    Change("lr x1.02", False, lr_scale=1.02),
    Change("lr x1.1", False, lr_scale=1.1),
    Change("1% label noise", False, label_noise=0.01),
    Change("weight decay off", False, weight_decay=False),
    Change("zero_grad skipped once", False, skip_zero_grad=True),
    Change("one of 4 data shards dropped", False, drop_shard=True),
    Change("another augmentation seed", False, aug_seed=2),
    Change("dropout p 0 -> 0.01", False, dropout=0.01),
]


# Another CPU's kernels: ATen reads ATEN_CPU_CAPABILITY once per process, so those replays train in a child process.
KERNELS = ("default", "avx2")


def _replays_in_child(model: Model, seeds: range, capability: str) -> list[tuple[Curves, Sketch]]:
    import pickle
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "curves.pkl"
        subprocess.run([sys.executable, __file__, "--dump-originals", model.name, f"{seeds.start}:{seeds.stop}", str(out)],
                       check=True,
                       env={**__import__("os").environ, "ATEN_CPU_CAPABILITY": capability}, timeout=3600)
        return pickle.loads(out.read_bytes())


def member(seed: int) -> Change:
    """Calibration member `seed` as `harness calibrate` runs it: nudged (perturb.NUDGE), on its share of the machine's
    other kernels (harness/runtime/perturb.py's KERNELS; the original runs one thread, oneDNN on)."""
    kernels = kernels_of(seed)
    return Change(f"member {seed}", True, perturb=seed, onednn=not kernels.onednn_off,
                  threads=other_threads(1) if kernels.other_threads else 1)


# Which member kernels an honest change shares with the calibration: its "held out" row judges it against the
# members that do not run those kernels (half of them), as a replay on kernels no member ran would be judged.
_FAMILY = {"oneDNN path off": lambda c: not c.onednn, "threads 1 -> 2": lambda c: c.threads != 1,
           "threads 1 -> 4": lambda c: c.threads != 1}


def held_out(name: str) -> str:
    return f"{name} (held out of the members)"


# The envelope's factor (rounding.SAFETY) is a choice between false alarms and power: every replay is also judged at
# these factors, so one run of trials shows both sides of each choice (--sweep prints the table).
SWEEP = (8.0, 16.0, 32.0, 64.0, 128.0)


def rounding_trials(model: Model, seeds: range, members: int, changes: list[Change], dump: list | None = None
                    ) -> tuple[dict[str, Tally], dict[str, dict[float, Tally]]]:
    """Per change: of `trials` calibrated runs (seeds 0..trials-1, each with `members` members over all its steps,
    built as `harness calibrate` builds them), how many replays under the change left the envelope (rounding.judge,
    as `harness replay` judges), at rounding.SAFETY and at each factor of SWEEP. A change whose kernels some members
    run gets a second row, judged against the other members only. `dump`: every trial's curves and weights' distances
    are appended to it, for other rules to be judged on the same trials (--grid)."""
    data = model.data()
    table = {c.name: Tally() for c in changes}
    table.update({held_out(c.name): Tally() for c in changes if c.name in _FAMILY})
    kernels = {cap: dict(zip(seeds, _replays_in_child(model, seeds, cap))) for cap in KERNELS}
    for cap in KERNELS:
        table[f"ATEN_CPU_CAPABILITY={cap}"] = Tally()
    sweep = {row: {factor: Tally() for factor in SWEEP} for row in table}
    for seed in seeds:
        original, reference = train_sketched(model, seed, ORIGINAL, data)
        specs = [member(i) for i in range(1, members + 1)]
        runs = [train_sketched(model, seed, spec, data) for spec in specs]
        calibration = [curves for curves, _ in runs]
        # The weights after all the steps: each member's distance from the run's (in process, the run re-executes
        # bit for bit: the original's own sketch is the reference member's).
        spread = [distance(s, reference) for _, s in runs]
        weights = rounding.WeightsEnvelope(model.steps, "ref", [d.relative for d in spread], "")
        envelope = rounding.measure("run", "cal", original, calibration, model.steps, members, weights)
        replays = [(change.name, change, *train_sketched(model, seed, change, data)) for change in changes]
        replays += [(f"ATEN_CPU_CAPABILITY={cap}", None, *kernels[cap][seed]) for cap in KERNELS]
        for name, change, replay, replay_sketch in replays:
            judged_by = [(name, envelope)]
            if change is not None and name in _FAMILY:
                kept = [i for i, spec in enumerate(specs) if not _FAMILY[name](spec)]
                held = rounding.WeightsEnvelope(model.steps, "ref", [spread[i].relative for i in kept], "")
                judged_by.append((held_out(name), rounding.measure("run", "cal", original, [calibration[i] for i in kept],
                                                                   model.steps, len(kept), held)))
            bitwise = all(np.array_equal(replay[k][1], original[k][1]) for k in original)
            moved = distance(replay_sketch, reference)
            if dump is not None:
                dump.append({"model": model.name, "seed": seed, "row": name, "original": original,
                             "members": calibration, "spread": [d.relative for d in spread], "replay": replay,
                             "moved": (moved.relative, moved.widest), "bitwise": bitwise,
                             "family": [i for i, spec in enumerate(specs) if change is not None and name in _FAMILY
                                        and _FAMILY[name](spec)]})
            for row, env in judged_by:
                judged = _judged(env, original, replay, moved)
                table[row].trials += 1
                table[row].alarms += not (bitwise or judged.within)
                for factor in SWEEP:
                    sweep[row][factor].trials += 1
                    sweep[row][factor].alarms += not (bitwise or _judged(env, original, replay, moved, factor).within)
                if not (bitwise or judged.within):  # what an alarm saw, so a rare one can be explained
                    print(f"  alarm: {model.name} seed {seed} {row}: {judged.headline()}", file=sys.stderr, flush=True)
        print(f"  done: {model.name} seed {seed}", file=sys.stderr, flush=True)  # a long run's progress, to pool
    return table, sweep


def _judged(envelope: rounding.Envelope, original: Curves, replay: Curves, moved: Any,
            factor: float | None = None) -> rounding.RoundingJudgement:
    """As `harness replay` judges a calibrated run's replay: its values over the M steps, then its weights after
    them (`moved`: their distance from the run's), both at the envelope's factor `factor` (None: rounding.SAFETY)."""
    judged = rounding.judge(envelope, original, replay, safety=factor)
    judged.weights = rounding.judge_weights(envelope, moved.relative, moved.widest, safety=factor)
    return judged


def rounding_report(trials: int, members: int, models: list[str], honest_only: bool = False,
                    first_seed: int = 0, dump: Path | None = None) -> list[str]:
    torch.set_num_threads(1)
    changes = ROUNDING_HONEST + ([] if honest_only else ROUNDING_PLANTED)
    out = [f"### rounding envelope: {members} members (nudged by up to {NUDGE_ULPS} ulps, on the machine's kernels) over all steps, "
           f"{trials} calibrated runs per model (SAFETY {rounding.SAFETY:g}, FLOOR_ULPS {rounding.FLOOR_ULPS})", "",
           f"| change | kind | {' | '.join(models)} |", "| --- | --- |" + " --- |" * len(models)]
    seeds = range(first_seed, first_seed + trials)
    raw: list | None = [] if dump is not None else None
    measured = {name: rounding_trials(MODELS[name], seeds, members, changes, raw) for name in models}
    if dump is not None:
        import pickle

        dump.write_bytes(pickle.dumps(raw))
    rows = [(f"ATEN_CPU_CAPABILITY={cap}", True) for cap in KERNELS]
    for c in changes:
        rows += [(c.name, c.honest)] + ([(held_out(c.name), c.honest)] if c.name in _FAMILY else [])
    # --honest-only: the false-alarm rows alone, for the hundreds of trials a 1% bound needs.
    for name, honest in rows:
        kind = "honest: false alarm" if honest else "planted: power"
        out.append(f"| {name} | {kind} | " + " | ".join(measured[n][0][name].rate() for n in models) + " |")
    for model in models:  # the same trials at other factors: what each choice of SAFETY costs and buys
        out += ["", f"#### {model}: alarms at each factor (SAFETY) of the envelope, the same {trials} runs", "",
                "| change | kind | " + " | ".join(f"x{f:g}" for f in SWEEP) + " |", "| --- | --- |" + " --- |" * len(SWEEP)]
        for name, honest in rows:
            kind = "honest: false alarm" if honest else "planted: power"
            out.append(f"| {name} | {kind} | " + " | ".join(measured[model][1][name][f].rate() for f in SWEEP) + " |")
    return out + [""]


GRID_SAFETY = (8.0, 16.0, 32.0, 64.0)
GRID_FLOOR = (4.0, 16.0, 64.0, 256.0)


def grid_report(files: list[Path], steps: int | None) -> list[str]:
    """Every trial of `--dump` files judged again under each (SAFETY, FLOOR_ULPS) of the grid, over the first `steps`
    steps (None: all, as `harness calibrate`'s default 50 judges a run of 48) and the weights after the last: alarms
    per row, for the honest rows, catches for the planted ones. Pure arithmetic on recorded curves: seconds."""
    import pickle

    trials = [t for f in files for t in pickle.loads(f.read_bytes())]
    combos = [(s, f) for s in GRID_SAFETY for f in GRID_FLOOR]
    counts: dict[tuple[str, str], dict[tuple[float, float], Tally]] = {}
    for t in trials:
        last = max(int(s[-1]) for s, _ in t["original"].values()) + 1
        m = last if steps is None else min(steps, last)
        rows = [(t["row"], list(range(len(t["members"]))))]
        if t["family"]:
            rows.append((held_out(t["row"]), [i for i in range(len(t["members"])) if i not in t["family"]]))
        for row, kept in rows:
            weights = (rounding.WeightsEnvelope(last, "ref", [t["spread"][i] for i in kept], "")
                       if m == last else None)  # the weights are sketched after step M: only where M is the last
            env = rounding.measure("run", "cal", t["original"], [t["members"][i] for i in kept], m, len(kept), weights)
            for s, f in combos:
                judged = rounding.judge(env, t["original"], t["replay"], safety=s, floor_ulps=f)
                judged.weights = rounding.judge_weights(env, t["moved"][0], t["moved"][1], safety=s)
                tally = counts.setdefault((t["model"], row), {}).setdefault((s, f), Tally())
                tally.trials += 1
                tally.alarms += not (t["bitwise"] or judged.within)
    out = [f"### the rule's constants on {len({(t['model'], t['seed']) for t in trials})} calibrated runs, judged "
           f"over {'all steps' if steps is None else f'the first {steps} steps'}: alarms (honest) or catches (planted) "
           "per (SAFETY, FLOOR_ULPS)", "", "| model | change | " + " | ".join(f"x{s:g}, {f:g} ulps" for s, f in combos)
           + " |", "| --- | --- |" + " --- |" * len(combos)]
    for (model, row), by in sorted(counts.items()):
        out.append(f"| {model} | {row} | " + " | ".join(f"{by[c].alarms}/{by[c].trials}" for c in combos) + " |")
    return out


# --- the nudge's size (perturb.NUDGE): members nudged by up to U float32 ulps, judged over the first steps ----------
def nudge_sweep(models: list[str], seeds: range, ulps: list[int], steps: int, members: int) -> list[str]:
    """Per model and change: of the calibrated runs `seeds`, how many replays left an envelope of `members` members
    nudged by up to U ulps, for each U of `ulps`, judged over the first `steps` steps (only those are trained); for a
    planted change, also the step by which 95% of the caught ones were caught (wider nudges catch later). A change
    some members run is also judged against the others only (held out)."""
    torch.set_num_threads(1)
    changes = ROUNDING_HONEST + ROUNDING_PLANTED
    out = [f"### the nudge's size: {members} members nudged by up to U float32 ulps, {len(seeds)} calibrated runs "
           f"per model, the first {steps} steps judged (SAFETY {rounding.SAFETY:g}, FLOOR_ULPS {rounding.FLOOR_ULPS}); "
           "planted: caught, (95% by step k)", "", "| model | change | kind | " + " | ".join(f"U = {u}" for u in ulps)
           + " |", "| --- | --- | --- |" + " --- |" * len(ulps)]
    for name in models:
        model = replace(MODELS[name], steps=steps)
        data = model.data()
        caught: dict[str, dict[int, list[int | None]]] = {}
        for seed in seeds:
            original = train(model, seed, ORIGINAL, data)
            replays = [(c, train(model, seed, c, data)) for c in changes]
            for u in ulps:
                specs = [replace(member(i), nudge=u * 2.0**-23) for i in range(1, members + 1)]
                runs = [train(model, seed, spec, data) for spec in specs]
                for change, replay in replays:
                    rows = [(change.name, runs)]
                    if change.name in _FAMILY:
                        rows.append((held_out(change.name), [r for r, sp in zip(runs, specs) if not _FAMILY[change.name](sp)]))
                    for row, kept in rows:
                        judged = rounding.judge(rounding.measure("run", "cal", original, kept, steps, len(kept)), original, replay)
                        bitwise = all(np.array_equal(replay[k][1], original[k][1]) for k in original)
                        first = judged.first()
                        caught.setdefault(row, {}).setdefault(u, []).append(
                            None if bitwise or judged.within else (first.step if first else steps))
            print(f"  done: {name} seed {seed}", file=sys.stderr, flush=True)
        for change in changes:
            for row in [change.name] + ([held_out(change.name)] if change.name in _FAMILY else []):
                cells = []
                for u in ulps:
                    hits = [s for s in caught[row][u] if s is not None]
                    by = f" (by step {int(np.percentile(hits, 95))})" if hits and not change.honest else ""
                    cells.append(f"{len(hits)}/{len(caught[row][u])}{by}")
                kind = "honest: false alarm" if change.honest else "planted: power"
                out.append(f"| {name} | {row} | {kind} | " + " | ".join(cells) + " |")
    return out + [""]


# --- the INCONCLUSIVE rule (noise.Power): what a small study says of a real doubled learning rate ------------------
POWER_CHANGES = [next(c for c in PLANTED if c.name == "lr x2"), Change("lr x10", False, lr_scale=10.0),
                 Change("another seed (honest)", True, new_seed=True)]
OUTCOMES = ("WITHIN_NOISE", "INCONCLUSIVE", "DIVERGED")


def _outcome(replay: Curves, original: Curves, members: list[Curves]) -> str:
    judgement = noise.judge_curves("bench", replay, original, members)
    if judgement.vacuous:
        return "INCONCLUSIVE"
    return "WITHIN_NOISE" if judgement.within else "DIVERGED"


def power_trials(model: Model, seeds: int, trials: int) -> dict[str, dict[str, int]]:
    """Per change, how many of `trials` disjoint studies of `seeds` seeds said each outcome of `harness replay`'s
    seed rule (the curve rule, then the doubled-learning-rate test) of a replay of their first member."""
    data = model.data()
    base = {s: train(model, s, ORIGINAL, data) for s in range(seeds * trials + trials)}  # the last `trials`: outsiders
    counts: dict[str, dict[str, int]] = {c.name: dict.fromkeys(OUTCOMES, 0) for c in POWER_CHANGES}
    for t in range(trials):
        members = [base[s] for s in range(t * seeds, (t + 1) * seeds)]
        for change in POWER_CHANGES:
            replay = base[seeds * trials + t] if change.new_seed else train(model, t * seeds, change, data)
            counts[change.name][_outcome(replay, members[0], members)] += 1
    return counts


def power_report(trials: int, sizes: list[int], models: list[str]) -> list[str]:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="TF32 acceleration on top of oneDNN")
    out = [f"### the seed rule on small studies: {trials} disjoint studies per row, a replay of the first member", "",
           "| model | seeds | replay | " + " | ".join(OUTCOMES) + " |", "| --- | --- | --- |" + " --- |" * len(OUTCOMES)]
    for name in models:
        for seeds in sizes:
            counts = power_trials(MODELS[name], seeds, trials)
            for change in POWER_CHANGES:
                cells = [Tally(counts[change.name][o], trials).rate() for o in OUTCOMES]
                out.append(f"| {name} | {seeds} | {change.name} | " + " | ".join(cells) + " |")
            print(out[-1], file=sys.stderr, flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="the CI version: fewer trials, two models")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="study sizes (default 5 10; --small 5)")
    parser.add_argument("--trials", type=int, default=None, help="studies per change (default 100; --small 30)")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=None,
                        help="which models (default: all; --small: linear mlp)")
    parser.add_argument("--null-trials", type=int, default=None,
                        help="studies for the another-seed case (default 2000; --small 300)")
    parser.add_argument("--rounding", action="store_true",
                        help="the rounding envelope's table instead (harness calibrate): false alarms and power")
    parser.add_argument("--honest-only", action="store_true",
                        help="--rounding: only the honest changes (false alarms), for many trials")
    parser.add_argument("--members", type=int, default=8, help="--rounding: calibration members (default 8)")
    parser.add_argument("--first-seed", type=int, default=0,
                        help="--rounding: the first calibrated run's seed (runs of disjoint seeds pool into one table)")
    parser.add_argument("--dump", type=Path, help="--rounding: keep every trial's curves in this file (for --grid)")
    parser.add_argument("--grid", type=Path, nargs="+", help="judge the trials of these --dump files under each "
                        "(SAFETY, FLOOR_ULPS) of the grid instead of training anything")
    parser.add_argument("--grid-steps", type=int, default=None, help="--grid: judge only the first K steps")
    parser.add_argument("--nudge-sweep", type=int, nargs="+", metavar="U", help="members nudged by up to U float32 "
                        "ulps, for each U: false alarms and power over the first --grid-steps steps (default 20)")
    parser.add_argument("--power", action="store_true",
                        help="the INCONCLUSIVE rule's table instead: small studies against real lr x2 and x10")
    parser.add_argument("--dump-originals", nargs=3, metavar=("MODEL", "FIRST:STOP", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.dump_originals:  # the child of _replays_in_child: the originals under this process's kernels
        import pickle

        name, span, out = args.dump_originals
        torch.set_num_threads(1)
        data = MODELS[name].data()
        first, stop = (int(x) for x in span.split(":"))
        Path(out).write_bytes(pickle.dumps([train_sketched(MODELS[name], s, ORIGINAL, data)
                                            for s in range(first, stop)]))
        return 0
    if args.grid:
        print("\n".join(grid_report(args.grid, args.grid_steps)))
        return 0
    if args.nudge_sweep:
        start = time.monotonic()
        seeds = range(args.first_seed, args.first_seed + (args.trials or 100))
        print("\n".join(nudge_sweep(args.models or list(MODELS), seeds, args.nudge_sweep, args.grid_steps or 20,
                                     args.members)))
        print(f"({time.monotonic() - start:.0f} s)")
        return 0
    if args.power:
        start = time.monotonic()
        print("\n".join(power_report(args.trials or 30, args.seeds or [3, 5], args.models or ["linear", "mlp"])))
        print(f"({time.monotonic() - start:.0f} s)")
        return 0
    if args.rounding:
        start = time.monotonic()
        print("\n".join(rounding_report(args.trials or 50, args.members, args.models or list(MODELS),
                                         args.honest_only, args.first_seed, args.dump)))
        print(f"({time.monotonic() - start:.0f} s)")
        return 0
    sizes = args.seeds or (SMALL["sizes"] if args.small else [5, 10])
    trials = args.trials or (SMALL["trials"] if args.small else 100)
    null_trials = args.null_trials or (SMALL["null_trials"] if args.small else 2000)
    models = args.models or (SMALL["models"] if args.small else list(MODELS))
    planted = SMALL["planted"] if args.small else None
    changes = HONEST + [c for c in PLANTED if planted is None or c.name in planted]
    start = time.monotonic()
    bound = noise.percent(noise.FALSE_ALARM)
    print(f"# verdict calibration: {trials} trials per change ({null_trials} for another seed), false-alarm bound "
          f"{bound} per replay (Bonferroni over metrics x checks), torch {torch.__version__}\n")
    for name in models:  # one model at a time, printed as it is measured
        for seeds in sizes:
            table = calibrate([name], [seeds], trials, null_trials, planted)[name, seeds]
            print("\n".join(report(MODELS[name], seeds, table, changes)), flush=True)
    print(f"({time.monotonic() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
