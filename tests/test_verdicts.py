"""The verdicts' one table (harness/judge/verdicts.py): each verdict's exit code and its place in every named policy,
and the commands that ask a policy instead of listing verdicts."""

from __future__ import annotations

import json

import pytest

from harness.commands import bisect, documents
from harness.errors import EXIT_FAILED, EXIT_OK
from harness.judge import report, verify_report
from harness.judge.verdicts import ROWS, Policy, Verdict, exit_code, listed, meets, verdicts
from harness.record.replays import tally

pytestmark = pytest.mark.unit


def test_every_verdict_has_an_exit_code_words_and_a_place_in_every_policy() -> None:
    assert set(ROWS) == set(Verdict)
    for v in Verdict:
        assert v.name == v.value  # stored as its name (tags, JSON): a dict keyed by either finds the other
        assert v.exit_code in (EXIT_OK, EXIT_FAILED), v
        assert set(v.row.policies) == set(Policy), f"{v}: no answer for {set(Policy) - set(v.row.policies)}"
        assert v.row.words and v.row.colour.startswith("#"), v
        # A pass is exit 0, and exit 0 is a pass: one decision, not two.
        assert (v.exit_code == EXIT_OK) == v.meets(Policy.REPRODUCED), v
    # The policies nest, from the strictest; SETTLED stands apart (what nothing can judge again).
    nested = [set(verdicts(p)) for p in (Policy.SAME_TRAINING, Policy.WITHIN_TOLERANCE, Policy.REPRODUCED)]
    assert nested[0] < nested[1] < nested[2], nested
    assert verdicts(Policy.SETTLED) == (Verdict.BITWISE, Verdict.NOTHING_TO_COMPARE)


def test_the_policies_are_what_the_commands_decided_before_the_table() -> None:
    assert verdicts(Policy.SAME_TRAINING) == ("BITWISE", "WITHIN_ROUNDING")  # a study replay's WITHIN_ROUNDING
    assert bisect.INNOCENT == ("BITWISE", "WITHIN_ROUNDING", "WITHIN_TOLERANCE")  # a probe that keeps its change
    assert verdicts(Policy.REPRODUCED) == ("BITWISE", "WITHIN_ROUNDING", "WITHIN_TOLERANCE", "WITHIN_NOISE")  # exit 0
    assert [exit_code(v) for v in Verdict] == [0, 0, 0, 0, 1, 1, 1]
    # A tag's text that is no verdict (a replay's status, UNVERIFIED, an older harness's name) passes nothing.
    for other in ("FAILED", "UNVERIFIED", "bitwise", "", None):
        assert not any(meets(other, p) for p in Policy) and exit_code(other or "") == EXIT_FAILED
    assert documents.meaning("replay", EXIT_OK) == f"reproduced ({listed(Policy.REPRODUCED)})"
    assert listed(Policy.SETTLED) == "BITWISE or NOTHING_TO_COMPARE"


def test_a_verdict_reads_as_its_name_wherever_it_is_written() -> None:
    v = Verdict.WITHIN_ROUNDING
    assert str(v) == f"{v}" == f"{v:>15}" == "WITHIN_ROUNDING" and v == "WITHIN_ROUNDING"
    assert json.dumps({"verdict": v}) == '{"verdict": "WITHIN_ROUNDING"}'
    assert {"WITHIN_ROUNDING": 1}[v] == 1 and Verdict("DIVERGED") is Verdict.DIVERGED
    # Every table that shows a verdict has it: the replay report's words, the claims page's colours, runs' order.
    for name in Verdict:
        assert report._VERDICT_WORDS[name] == name.row.words
        assert verify_report._COLOURS[name] == name.row.colour
    tallied = tally([_replay("DIVERGED"), _replay("BITWISE"), _replay("WITHIN_ROUNDING"), _replay("BITWISE")])
    assert tallied == {"orig": "BITWISE 2, WITHIN_ROUNDING 1, DIVERGED 1"}


def _replay(verdict: str) -> object:
    from harness.rundata import RunSummary
    from harness.tags import KIND, KIND_REPLAY, REPLAY_OF, VERDICT

    return RunSummary(run_id=verdict, experiment="e", experiment_id="1", run_name="r", status="FINISHED", start_time=0,
                      end_time=0, tags={KIND: KIND_REPLAY, REPLAY_OF: "orig", VERDICT: verdict}, params={},
                      metric_keys=[], artifact_uri="")
