"""Where two runs' weights parted: the first checkpoint whose per-tensor fingerprints differ, and which tensors.

Reads only the records (`RunRecord.checkpoint_tensors`, written from the Checkpoint messages): no
checkpoint file is opened, so it works on a bundle imported without its checkpoints too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# How many differing tensor names a one-line summary spells out before it counts the rest.
_NAMES_IN_LINE = 6


@dataclass
class CheckpointDiff:
    """The checkpoint steps of two runs compared tensor by tensor."""

    common_steps: int = 0  # checkpoint steps both runs recorded per-tensor fingerprints for
    last_equal_step: int | None = None  # the last common step before first_diff_step with every tensor equal
    first_diff_step: int | None = None  # the first common step where some tensor differs
    differing: list[str] = field(default_factory=list)  # the tensors that differ there, by name
    only_in_a: list[str] = field(default_factory=list)  # tensors at first_diff_step recorded by one run only
    only_in_b: list[str] = field(default_factory=list)
    tensors_at_step: int = 0  # how many tensors the first differing step holds (either run)
    missing_in: list[str] = field(default_factory=list)  # labels of runs with checkpoints but no per-tensor record
    desynced_ranks: dict[str, dict[int, list[int]]] = field(default_factory=dict)  # label -> step -> ranks != rank 0

    def describe(self, labels: tuple[str, str] = ("original", "replay")) -> str:
        """One line for the verdict output and the report; never claims equality it has not seen."""
        a, b = labels
        if self.missing_in:
            who = " and ".join(self.missing_in)
            return (f"checkpoint tensors: {who} recorded no per-tensor fingerprints (a run from before they were "
                    "recorded): which tensors differ cannot be said")
        if self.common_steps == 0:
            return "checkpoint tensors: the runs share no checkpoint step to compare"
        last = "none (they differ from the first common checkpoint)" if self.last_equal_step is None \
            else f"step {self.last_equal_step}"
        if self.first_diff_step is None:
            return f"checkpoint tensors: all equal at the {self.common_steps} common checkpoint steps (last: {last})"
        return (f"checkpoint tensors: first differ at step {self.first_diff_step}: {self.what_differs(labels)}; "
                f"last checkpoint with all equal: {last}")

    def what_differs(self, labels: tuple[str, str] = ("original", "replay")) -> str:
        names = self.differing
        shown = ", ".join(names[:_NAMES_IN_LINE]) + (f" and {len(names) - _NAMES_IN_LINE} more"
                                                      if len(names) > _NAMES_IN_LINE else "")
        text = (f"only {shown} differ" if len(names) < self.tensors_at_step else f"all {len(names)} tensors differ") \
            if names else "no common tensor differs"
        for label, only in zip(labels, (self.only_in_a, self.only_in_b)):
            if only:
                text += f"; only in {label}: {', '.join(only[:_NAMES_IN_LINE])}"
        text += f" (of {self.tensors_at_step})"
        return text


def _tensors(entry: Mapping[str, Any]) -> dict[str, str]:
    return dict(entry.get("tensors", {}))


def _desynced(steps: Mapping[int, Mapping[str, Any]]) -> dict[int, list[int]]:
    """Steps at which some rank's set of digests differs from rank 0's, and those ranks."""
    out = {}
    for step, entry in sorted(steps.items()):
        ranks = list(entry.get("ranks", []))
        odd = [r for r, sha in enumerate(ranks) if ranks and sha != ranks[0]]
        if odd:
            out[int(step)] = odd
    return out


def diff_checkpoints(a: Any, b: Any, labels: tuple[str, str] = ("original", "replay"),
                     last_step: int | None = None) -> CheckpointDiff | None:
    """Compare two RunRecords' checkpoint tensors; None when neither run saved checkpoints.

    `last_step`: ignore checkpoints after it (an incomplete original is judged up to where it stopped).
    """
    if not a.checkpoints and not b.checkpoints:
        return None
    result = CheckpointDiff()
    missing = [label for label, rec in zip(labels, (a, b)) if rec.checkpoints and rec.checkpoint_tensors is None]
    if missing:
        result.missing_in = missing
        return result
    ta, tb = a.checkpoint_tensors or {}, b.checkpoint_tensors or {}
    for label, steps in zip(labels, (ta, tb)):
        odd = _desynced(steps)
        if odd:
            result.desynced_ranks[label] = odd
    common = sorted(s for s in ta.keys() & tb.keys() if last_step is None or s <= last_step)
    result.common_steps = len(common)
    for step in common:
        da, db = _tensors(ta[step]), _tensors(tb[step])
        if da == db:
            result.last_equal_step = int(step)
            continue
        result.first_diff_step = int(step)
        result.differing = sorted(n for n in da.keys() & db.keys() if da[n] != db[n])
        result.only_in_a = sorted(da.keys() - db.keys())
        result.only_in_b = sorted(db.keys() - da.keys())
        result.tensors_at_step = len(da.keys() | db.keys())
        break
    return result


def first_differing_checkpoint(record_a: Any, record_b: Any) -> tuple[int | None, int | None, list[str]]:
    """(last step with all checkpoint tensors equal, first step where some differ, the names differing there).

    For choosing the step to trace. Every element is None / [] when it cannot be said: no common checkpoint,
    or a run without per-tensor fingerprints (never read as "equal"). Names include tensors present in one
    run only at that step.
    """
    diff = diff_checkpoints(record_a, record_b)
    if diff is None or diff.missing_in:
        return None, None, []
    names = sorted({*diff.differing, *diff.only_in_a, *diff.only_in_b})
    return diff.last_equal_step, diff.first_diff_step, names
