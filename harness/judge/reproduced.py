"""Did a re-execution reproduce the record: values it logged again, held to the values the run recorded.

One rule for every re-execution (an audit's segments, a trace's steps, a resume's proof): a value is the
same when its bits are (rundata.same_value: a NaN of the same bits is the same, -0.0 is not 0.0). A value
the record lacks counts against the re-execution only where the record is complete - a FINISHED run
recorded every value it logged - and is otherwise no evidence either way (a run that died may not have
written its last values); so is a metric of harness's own that the record lacks altogether (a run recorded before
harness logged it). A value named like a clock (judge/undetermined.py looks_like_clock: nanoGPT's `mfu`, a
`*_runtime`, a `*_per_second`) that differs is not held - two executions of the same step never time alike - and is
named apart (`unheld`), so that a re-execution is never refused for its own speed. Pure: values in, a verdict out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from harness.judge.undetermined import looks_like_clock
from harness.rundata import own_metric, same_value, series

__all__ = ["Reproduction", "same_value", "series", "values"]


@dataclass(frozen=True)
class Reproduction:
    checked: int  # values held to the record
    mismatch: str = ""  # the first that differed (in step order, then key), as a line; "" when none did
    unheld: tuple[str, ...] = ()  # keys named like a clock whose values differed: not held, said apart

    @property
    def unheld_line(self) -> str:
        """What the re-execution did not hold, as a sentence for a notice; "" when nothing."""
        if not self.unheld:
            return ""
        names = ", ".join(self.unheld)
        return (f"{names} differed as re-executed and {'is' if len(self.unheld) == 1 else 'are'} not held: named like a "
                "clock (a duration, a throughput), not determined by the training")

    @property
    def reproduced(self) -> bool | None:
        """True: every checked value the same; False: one differed; None: nothing recorded to hold it to."""
        if self.mismatch:
            return False
        return True if self.checked else None


def values(
    recorded: Mapping[str, Mapping[int, float]],
    logged: Mapping[tuple[str, int], float],
    *,
    complete: bool,
    first: int | None = None,
    end: int | None = None,
) -> Reproduction:
    """`logged` ({(key, step): value}, steps in [first, end) when given) held to `recorded` ({key: {step: value}}).

    `complete`: the record holds every value its run logged at those steps (a FINISHED run), so a value it lacks
    differs; otherwise such a value is skipped and not counted.
    """
    checked, unheld = 0, set()
    for (key, step), value in sorted(logged.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        if (first is not None and step < first) or (end is not None and step >= end):
            continue
        if key not in recorded and own_metric(key):
            continue  # harness's own metric, which a run recorded before harness logged it lacks: no evidence
        original = recorded.get(key, {}).get(step)
        if original is None and not complete:
            continue
        if original is not None and not same_value(original, value) and looks_like_clock(key):
            unheld.add(key)
            continue
        checked += 1
        if original is None or not same_value(original, value):
            return Reproduction(checked, f"{key} at step {step}: {value!r}, the run recorded {original!r}",
                                tuple(sorted(unheld)))
    return Reproduction(checked, unheld=tuple(sorted(unheld)))
