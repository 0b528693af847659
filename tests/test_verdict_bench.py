"""The calibration benchmark's small version (benchmarks/verdict_bench.py --small): the noise rule harness applies
keeps its false-alarm bound on real training, and the rule it replaced did not.

Fixed seeds: every number below is the same on every run on one machine; the bound is asserted on the measured
rate, the full table (more trials, a CNN, 10-seed studies) is in docs/verdicts.md.
"""

from __future__ import annotations

import sys

import pytest
from conftest import ROOT

from harness.judge import noise

sys.path.insert(0, str(ROOT / "benchmarks"))
import verdict_bench as bench

# In-process, but it trains hundreds of small models (a minute and a half of CPU): not for the quick unit tier,
# which must stay under a minute (docs/development.md).
pytestmark = pytest.mark.cli


@pytest.fixture(scope="module")
def tables() -> dict:
    return bench.calibrate(**bench.SMALL)


def test_honest_replays_stay_under_the_false_alarm_bound(tables: dict) -> None:
    for (model, seeds), table in tables.items():
        for change in bench.HONEST:
            tally = table[change.name, bench.RULE]
            assert tally.trials >= bench.SMALL["trials"], (model, change.name)
            assert tally.alarms / tally.trials <= noise.FALSE_ALARM, (model, seeds, change.name, tally.rate())


def test_the_old_per_metric_rule_breaks_the_bound_with_several_metrics(tables: dict) -> None:
    """What the correction is for: 95% per metric, 5 metrics, flags an honest new seed far more than 1% of the time."""
    old = tables["mlp", 5]["another seed (decorrelated, worst case)", "final, 95% per metric (before)"]
    assert old.alarms / old.trials > 5 * noise.FALSE_ALARM, old.rate()


def test_the_rule_is_not_vacuous(tables: dict) -> None:
    """A rule that never says DIVERGED would keep any bound: on 5 seeds it still catches a doubled learning rate
    often (8 of 20 measured; the full table in docs/verdicts.md gives the power per change)."""
    caught = tables["mlp", 5]["lr x2", bench.RULE]
    assert caught.alarms / caught.trials >= 0.25, caught.rate()
