"""Whether a run's record holds every step that ran: a step none of its series holds is a hole in the record.

The witness is harness.lr (tags.METRIC_LR), which rank 0 logs at every step of the counted optimizer, whatever the
training code logs; the training code's own series fill in a step the optimizer skipped. A record is a prefix of what
rank 0 sent (one pipe, written in order), so a launcher killed while its ranks ran on leaves a record that ends early:
a resume may continue only from a checkpoint at or before the first step the record lacks, and a run whose steps have
a hole that nothing explains is not closed FINISHED.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from harness import tags as T
from harness.rundata import wall_clock

Series = Mapping[str, Mapping[int, float]]  # key -> {step: value} (rundata.series)


def evaluation_keys(facts: Mapping[str, str]) -> dict[str, str]:
    """The keys an evaluation logged, and what their steps count (tags.EVALUATION_METRICS), from a run's tags."""
    try:
        keys = json.loads(facts.get(T.EVALUATION_METRICS) or "{}")
    except ValueError:
        return {}
    return keys if isinstance(keys, dict) else {}


def _covered(series: Series, evaluation: Mapping[str, str]) -> set[int]:
    """The training steps at which any series holds a value (a key counted in an index of its own is no step)."""
    steps: set[int] = set()
    for key, values in series.items():
        if evaluation.get(key, T.EVAL_AT_STEP) == T.EVAL_AT_STEP and not wall_clock(key):
            steps.update(values)
    return steps


def first_missing(series: Series, evaluation: Mapping[str, str]) -> int:
    """The first step the record does not hold: the first hole in its steps (`holes`: where harness.lr witnesses every
    step), else the step after the last one logged (without a witness, sparse logging cannot be told from a loss);
    0 when nothing was logged (a launcher killed before its first write)."""
    covered = _covered(series, evaluation)
    if not covered:
        return 0
    found = holes(series, evaluation)
    return found[0][0] if found else max(covered) + 1


def holes(series: Series, evaluation: Mapping[str, str]) -> list[tuple[int, int]]:
    """The steps (first, last) between the first logged and the last witnessed one at which no series holds a value,
    less those a GradScaler explains (it skipped the optimizer step: its scale backed off across the hole). [] without
    a witness."""
    witness = series.get(T.METRIC_LR)
    if not witness:
        return []
    covered = _covered(series, evaluation)
    scale = series.get(T.METRIC_GRAD_SCALE, {})
    found: list[tuple[int, int]] = []
    step, last = min(covered), max(witness)
    while step <= last:
        if step in covered:
            step += 1
            continue
        first = step
        while step <= last and step not in covered:
            step += 1
        before, after = scale.get(first - 1), scale.get(step)
        if not (before is not None and after is not None and after < before):
            found.append((first, step - 1))
    return found


def shown(hole: tuple[int, int]) -> str:
    first, last = hole
    return f"step {first}" if first == last else f"steps {first}-{last}"
