"""What the data did: whether two runs' ctx.loader steps drew the same samples, step by step.

Reads `RunRecord.data_order` (per step, a digest of the sample indices every rank's batches held: recorded by
the ranks, harness/runtime/dataorder.py). Identical digests with other numbers point at the arithmetic; a first
differing step points at the data pipeline (the sampler, its seed, the dataset's length), not the arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from harness.fmt import the


@dataclass
class DataOrderDiff:
    """The data-order digests of two runs compared at the steps both recorded."""

    common_steps: int = 0
    first_diff_step: int | None = None
    missing_in: list[str] = field(default_factory=list)  # labels of runs that recorded no data order

    def describe(self, labels: tuple[str, str] = ("original", "replay")) -> str:
        """One line for the comparison output; never says "identical" of steps it has not seen."""
        if self.missing_in:
            return (f"data order: not recorded by {' and '.join(the(m) for m in self.missing_in)} (steps fed by ctx.loader "
                    "record it): cannot be compared")
        if self.common_steps == 0:
            return "data order: the runs share no step to compare"
        if self.first_diff_step is None:
            return f"data order: identical at the {self.common_steps} common steps (every rank drew the same samples)"
        return (f"data order: first differs at step {self.first_diff_step}: the ranks' batches held other samples "
                "there (a change of the data pipeline - sampler, seed, data set - not of the arithmetic)")


def diff_data_order(a: Any, b: Any, labels: tuple[str, str] = ("original", "replay"),
                    last_step: int | None = None) -> DataOrderDiff | None:
    """Compare two RunRecords' data order; None when neither recorded one. `last_step`: ignore later steps (an
    incomplete original is judged up to where it stopped)."""
    oa, ob = a.data_order, b.data_order
    if not oa and not ob:
        return None
    result = DataOrderDiff(missing_in=[label for label, order in zip(labels, (oa, ob)) if not order])
    if result.missing_in:
        return result
    common = sorted(s for s in oa.keys() & ob.keys() if last_step is None or s <= last_step)
    result.common_steps = len(common)
    result.first_diff_step = next((s for s in common if oa[s] != ob[s]), None)
    return result
