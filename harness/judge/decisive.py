"""The values that decide a verdict on their own: those neither rounding nor a seed moves, so that no calibration's
envelope and no study's noise judges them again.

harness's own per-step values (tags.OWN_METRIC_PREFIX: the learning rate each step used, the AMP loss scale the
step's loss was multiplied by) follow the recorded config and schedule, and the data order (which samples each step
drew) follows the sampler and the recorded seed. A replay keeps its original's seed, so no seed moves them (two runs
of other seeds compared: the learning rate alone, as the data order and where a gradient overflows follow the seed);
and rounding does not either: a schedule is arithmetic on the config's numbers, sample indices are integers, and a
loss scale changes only where a gradient overflows float16, which a last bit tips only at the very edge of its
range. Where one of them differs beyond its tolerance, something else changed (the config, the code, the data
pipeline), and the replay is DIVERGED at that step, naming it: compare_runs applies the rule for every verdict, and
the handoffs (harness/judge/handoff.py) judge no divergence it marked.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from harness import tags
from harness.judge.dataorder import DataOrderDiff
from harness.judge.metricdiff import KIND_DATA_ORDER, KIND_VALUE, Divergence
from harness.rundata import own_metric

# What the note beside such a verdict calls the data order (a divergence of it names no metric).
DATA_ORDER = "the data order"


def first_decisive(firsts: Sequence[Divergence], data_order: DataOrderDiff | None,
                   same_seed: bool = True) -> Divergence | None:
    """The earliest divergence of a value neither rounding nor a seed moves, marked decisive; None when there is none.
    `firsts`: each metric's first divergence outside its tolerance (a copy is marked, not the one given); `same_seed`:
    whether both runs had the same seed (else the data order and the loss scale may differ by the seed alone)."""
    found = [dataclasses.replace(d, decisive=True) for d in firsts
             if d.kind == KIND_VALUE and d.counts is None and d.step is not None and own_metric(d.metric or "")
             and (same_seed or d.metric != tags.METRIC_GRAD_SCALE)]
    if same_seed and data_order is not None and data_order.first_diff_step is not None:
        found.append(Divergence(KIND_DATA_ORDER, data_order.first_diff_step, decisive=True, detail=(
            "the data order differs: the ranks' batches held other samples (a change of the data pipeline - sampler, "
            "seed, data set - not of the arithmetic)")))
    # At one step, a value with numbers to show before the data order.
    return min(found, key=lambda d: (d.step, d.kind != KIND_VALUE, d.metric or "")) if found else None


def named(divergence: Divergence) -> str:
    """What a decisive divergence is of: the metric, or the data order."""
    return divergence.metric or DATA_ORDER
