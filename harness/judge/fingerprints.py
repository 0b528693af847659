"""A replay's parameter fingerprints held to its original's, step by step and at the end."""

from __future__ import annotations

from dataclasses import dataclass

from harness.judge.metricdiff import up_to
from harness.rundata import RunRecord


@dataclass
class FingerprintStats:
    """Parameter fingerprints over the union of fingerprinted steps, plus the final one."""

    compared: int = 0
    equal: int = 0
    first_mismatch_step: int | None = None
    final_equal: bool | None = None  # None when neither run has a final fingerprint

    @property
    def all_equal(self) -> bool:
        return self.compared == self.equal


def compare_fingerprints(original: RunRecord, replay: RunRecord, incomplete: bool = False,
                          first: int | None = None) -> FingerprintStats:
    """`first` (replay --steps K): only the fingerprints of steps < K, and the replay's last weights (after K steps)
    held to the original's checkpoint of step K where one is recorded - the original's final weights are not K's."""
    fa, fb = original.fingerprints, replay.fingerprints
    if incomplete:
        # Only the steps the original reached; it has no final fingerprint to hold the replay to.
        last = max(fa, default=-1)
        fb = {k: v for k, v in fb.items() if k <= last}
    elif first is not None:
        fa, fb = up_to(fa, first - 1), up_to(fb, first - 1)
    stats = FingerprintStats()
    for step in sorted(fa.keys() | fb.keys()):
        stats.compared += 1
        # A step fingerprinted by one run only is a mismatch: it cannot be shown equal.
        if fa.get(step) is not None and fa.get(step) == fb.get(step):
            stats.equal += 1
        elif stats.first_mismatch_step is None:
            stats.first_mismatch_step = int(step)
    if first is not None:
        held = original.checkpoints.get(first)
        if held is not None:
            stats.compared += 1
            stats.final_equal = held == replay.final_fingerprint
            stats.equal += int(stats.final_equal)
    elif not incomplete and (original.final_fingerprint is not None or replay.final_fingerprint is not None):
        stats.compared += 1
        stats.final_equal = original.final_fingerprint == replay.final_fingerprint
        stats.equal += int(stats.final_equal)
    return stats
