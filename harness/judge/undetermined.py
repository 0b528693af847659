"""Which differing values the training does not determine: proved by the weights, or only suggested by a name.

A script logs values that are no function of what it computed - nanoGPT's `mfu`, the transformers Trainer's
`train_runtime` and `*_samples_per_second` - beside those that are. Two kinds of evidence, used for two things:

- **Proof** (`not_determined`): the registered model's weights came out bit-identical at every fingerprinted step and
  at the end, every other value of the training code's own (one at least: harness's learning rate is no evidence)
  and the data order and checkpoint tensors too, and only metrics named like a clock differ (at the same steps).
  Then what differs is not a function of the training, and a verdict may stay BITWISE, naming them. Both are needed:
  fingerprints are taken every `fingerprint_every` steps, so weights equal there do not prove a loss between them,
  and an evaluation that differs over equal weights is an evaluation that does not reproduce - never waved through.
- **A name** (`looks_like_clock`) alone proves nothing: a key called `time` may be a simulated one. Without the proof
  it only decides which of several divergences a DIVERGED verdict names first (the loss at step 5 rather than `mfu`
  at step 0) and adds a hint where a clock-named metric is all that differs. harness's own wall-clock keys
  (rundata.wall_clock: tags.PERF_PREFIX) never reach a verdict at all: the store keeps them apart.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from harness.judge.dataorder import DataOrderDiff
from harness.judge.fingerprints import FingerprintStats
from harness.judge.metricdiff import MetricStats
from harness.judge.tensordiff import CheckpointDiff
from harness.rundata import own_metric

# The last part of a key ("train/mfu" -> "mfu"), then: a word of its own that names a duration or a utilisation, or
# a rate per unit of time, or a unit of time at its end.
_CLOCK_WORDS = re.compile(r"(^|_)(mfu|runtime|elapsed|duration|throughput|time|dt|walltime|wall)(_|$)")
_PER_TIME = re.compile(r"(_|^)per_(second|sec|s)$|/(s|sec)$|(_|^)(ms|secs?|seconds)$")


def looks_like_clock(key: str) -> bool:
    """Whether the name reads like a wall-clock value (a duration, a throughput, a utilisation): a hint, not proof."""
    low = key.lower().strip()
    return bool(_CLOCK_WORDS.search(re.split(r"[./]", low)[-1]) or _PER_TIME.search(low))


def not_determined(metrics: Sequence[MetricStats], fingerprints: FingerprintStats, *, failed: bool,
                   weights_unchanged: bool, checkpoints: CheckpointDiff | None,
                   data_order: DataOrderDiff | None) -> list[str]:
    """The metrics that differ while everything the training determines is bit-identical, or [] when that is not
    shown. Shown only where the weights were held and equal (every fingerprint, the last weights among them), the
    model trained at all (weights that never moved would be equal whatever happened), the replay did not fail, no
    checkpoint tensor or drawn sample differs, and every other metric - one of the training code's own at least - is
    bit-identical. Each such metric is named like a clock (looks_like_clock: a loss or an evaluation over equal
    weights that differs is not waved through), was logged by both runs at the same steps (a step logged by one run
    only is the code taking another path) and is the training code's (harness's own learning rate is set by the
    training)."""
    if failed or weights_unchanged or not fingerprints.all_equal or fingerprints.final_equal is not True:
        return []
    if checkpoints is not None and (checkpoints.first_diff_step is not None or checkpoints.desynced_ranks):
        return []
    if data_order is not None and data_order.first_diff_step is not None:
        return []
    differing = [m for m in metrics if not m.bitwise_equal]
    if not any(m.bitwise_equal and not own_metric(m.name) for m in metrics):
        return []  # no value of the training code's own came out the same: nothing beside the weights vouches
    if any(own_metric(m.name) or not looks_like_clock(m.name) or m.missing_steps or m.extra_steps
           or not (m.in_original and m.in_replay) or m.steps_compared == 0 for m in differing):
        return []
    return [m.name for m in differing]
