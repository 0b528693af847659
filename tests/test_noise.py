"""The run-to-run noise statistics and the WITHIN_NOISE verdict, on synthetic run records.

The end-to-end checks (a real study, a replay with another thread count, a planted learning-rate
change) are in tests/test_study_noise.py; these pin the arithmetic and every branch of the rule.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from conftest import OTHER_HARDWARE
from records import clone, make_record
from scipy import stats

from harness import tags
from harness.judge import noise
from harness.judge.compare import compare_runs
from harness.judge.handoff import judge_noise
from harness.judge.report import render_markdown
from harness.judge.verdicts import Verdict

SEEDS = [0.91, 0.87, 0.95, 0.89, 0.93]


def test_spread_is_the_t_prediction_interval() -> None:
    s = noise.spread(SEEDS)
    n, m, sd = 5, float(np.mean(SEEDS)), float(np.std(SEEDS, ddof=1))
    t = stats.t.ppf(0.975, n - 1)
    assert (s.n, s.mean, s.std, s.min, s.max) == (n, m, sd, 0.87, 0.95)
    assert s.pi95 == pytest.approx((m - t * sd * math.sqrt(1 + 1 / n), m + t * sd * math.sqrt(1 + 1 / n)), rel=1e-15)
    assert s.ci95 == pytest.approx((m - t * sd / math.sqrt(n), m + t * sd / math.sqrt(n)), rel=1e-15)
    one = noise.spread([1.0])
    assert one.n == 1 and math.isnan(one.std) and all(math.isnan(x) for x in one.pi95)
    with pytest.raises(ValueError):
        noise.spread([])


def test_check_places_the_replay_among_the_seeds() -> None:
    inside = noise.check("acc", 0.90, 0.91, SEEDS)
    assert inside.inside and inside.below == 2 and not inside.reason
    # One check alone: the whole nominal level (a third of the 1% bound), on a log scale: every seed is positive.
    assert "inside the 99.67% prediction interval (log scale)" in inside.describe() and inside.log
    lo, hi = noise.prediction_interval(noise.spread(np.log(SEEDS)), 1 - 0.01 / 3)
    assert inside.interval == pytest.approx((math.exp(lo), math.exp(hi)), rel=1e-12)
    signed = noise.check("delta", 0.0, 0.01, [0.02, -0.01, 0.0, 0.01, -0.02])  # not all positive: the values' scale
    assert not signed.log and signed.inside and "log" not in signed.describe()
    assert noise.check("acc", 0.90, 0.91, SEEDS, 0.95).describe().count("95% prediction interval") == 1
    outside = noise.check("acc", 1.2, 0.91, SEEDS)
    assert not outside.inside and outside.below == 5 and "OUTSIDE" in outside.describe()
    few = noise.check("acc", 0.90, 0.91, SEEDS[:2])
    assert not few.inside and "too few seeds to judge (2 < 3)" in few.reason
    nan = noise.check("acc", math.nan, 0.91, SEEDS)
    assert not nan.inside and "not finite" in nan.reason


def test_equivalence_is_two_one_sided_tests_with_one_seed_sd_as_margin() -> None:
    originals = [0.91, 0.87, 0.95]
    close = noise.equivalence("acc", originals, [x + 1e-4 * (-1) ** i for i, x in enumerate(originals)], SEEDS)
    assert close.equivalent and close.margin == pytest.approx(np.std(SEEDS, ddof=1))
    shifted = noise.equivalence("acc", originals, [x + 0.1 for x in originals], SEEDS)
    assert not shifted.equivalent and shifted.mean_diff == pytest.approx(0.1)
    assert "NOT equivalent" in shifted.describe()
    one = noise.equivalence("acc", originals[:1], originals[:1], SEEDS)
    assert not one.equivalent and "fewer than 2" in one.reason
    few = noise.equivalence("acc", originals, originals, SEEDS[:2])
    assert not few.equivalent and "too few seeds" in few.reason


def _member(run_id: str, final_loss: float, facts: dict | None = None):
    """A study member whose loss ends at `final_loss` (its other metric ends alike in every member)."""
    steps = np.arange(10, dtype=np.int64)
    loss = np.linspace(2.0, final_loss, 10)
    rec = make_record(run_id, metrics={"loss": (steps, loss), "acc": (steps.copy(), np.full(10, 0.5))})
    rec.facts[tags.STUDY] = "study0"
    rec.facts.update(facts or {})
    return rec


def _replay_of(original, final_loss: float, threads: str = "2"):
    rep = clone(original)
    rep.facts[tags.KIND] = tags.KIND_REPLAY
    rep.facts[tags.REPLAY_OF] = original.run_id
    rep.facts[tags.THREADS_PER_RANK] = threads  # another thread count: another reduction order, as on other hardware
    steps, loss = rep.metrics["loss"]
    loss = loss.copy()
    loss[-1] = final_loss
    rep.metrics["loss"] = (steps, loss)
    rep.final_fingerprint = "e" * 64  # the weights parted too, as they do on other hardware
    return rep


MEMBERS = [_member(f"m{i}", v) for i, v in enumerate(SEEDS)]


def test_a_cross_hardware_difference_inside_the_seeds_spread_is_within_noise() -> None:
    original = MEMBERS[0]
    replay = _replay_of(original, 0.9100001)
    cmp = compare_runs(original, replay)
    assert cmp.verdict == Verdict.DIVERGED and not cmp.bitwise_possible
    cmp = judge_noise(cmp, original, replay, "study0", MEMBERS)
    assert cmp.verdict == Verdict.WITHIN_NOISE and cmp.exit_code == 0
    # Each metric's curve (10 steps) in 4 segments by their means, and its last value: 10 checks sharing the bound.
    parts = [(0, 2), (3, 5), (6, 7), (8, 9), (9, 9)]
    assert [(c.metric, c.steps) for c in cmp.noise.checks] == [(m, k) for m in ("acc", "loss") for k in parts]
    assert all(c.inside for c in cmp.noise.checks) and {c.level for c in cmp.noise.checks} == {1 - 0.01 / 3 / 10}
    assert cmp.noise.checks[5].value == pytest.approx(np.mean(np.linspace(2.0, 0.91, 10)[:3]))
    assert cmp.summary().startswith("WITHIN_NOISE: every segment mean and final value inside its 99.97% prediction "
                                    "interval of 5 seeds (acc at step 9 0.5 in [0.5, 0.5], loss at step 9 0.91 in [")
    assert "false-alarm bound 1% for the replay: 10 checks at 0.033% each" in cmp.summary()
    assert "threads" not in cmp.summary() and "bitwise impossible (1 environment change)" in cmp.summary()
    doc = json.loads(json.dumps(cmp.to_dict()))
    assert doc["verdict"] == Verdict.WITHIN_NOISE and doc["noise"]["within"] is True
    assert doc["noise"]["checks"][-1]["spread"]["n"] == 5 and doc["noise"]["checks"][-1]["steps"] == [9, 9]
    report = render_markdown(cmp)
    assert "## Run-to-run noise" in report and "**inside**" in report and "3 of 5" in report
    assert "loss mean over steps 3-5" in report and "(99.97%, log scale)" in report


def test_a_difference_outside_the_seeds_spread_stays_diverged_with_the_numbers() -> None:
    original = MEMBERS[0]
    replay = _replay_of(original, 2.0)  # a change that matters: far from every seed (sd 0.03)
    cmp = judge_noise(compare_runs(original, replay), original, replay, "study0", MEMBERS)
    assert cmp.verdict == Verdict.DIVERGED and cmp.exit_code == 1
    # Both the last segment's mean and the last value are outside; each is named with its numbers.
    assert "outside the seeds' noise: loss mean over steps 8-9: replay 1." in cmp.summary()
    assert "; loss at step 9: replay 2 OUTSIDE the 99.97% prediction interval (log scale)" in cmp.summary()
    assert "**OUTSIDE**" in render_markdown(cmp)


def test_too_few_seeds_is_said_not_passed() -> None:
    original = MEMBERS[0]
    replay = _replay_of(original, 0.9100001)
    cmp = judge_noise(compare_runs(original, replay), original, replay, "study0", MEMBERS[:2])
    assert cmp.verdict == Verdict.DIVERGED
    assert "not judged against the seeds' noise: too few seeds to judge (2 < 3)" in cmp.summary()


def test_same_environment_difference_is_never_noise() -> None:
    original = MEMBERS[0]
    replay = _replay_of(original, 0.9100001, threads=original.facts[tags.THREADS_PER_RANK])
    cmp = judge_noise(compare_runs(original, replay), original, replay, "study0", MEMBERS)
    assert cmp.verdict == Verdict.DIVERGED and cmp.noise is None
    assert any("same environment with the same config" in n for n in cmp.notes)


def test_a_failed_or_shorter_replay_is_never_noise() -> None:
    original = MEMBERS[0]
    replay = _replay_of(original, 0.9100001)
    steps, loss = replay.metrics["loss"]
    replay.metrics["loss"] = (steps[:-1], loss[:-1])
    cmp = judge_noise(compare_runs(original, replay), original, replay, "study0", MEMBERS)
    assert cmp.verdict == Verdict.DIVERGED and cmp.noise is None
    failed = _replay_of(original, 0.9100001)
    cmp = judge_noise(compare_runs(original, failed, replay_failed="rank 1 raised"), original, failed, "study0", MEMBERS)
    assert cmp.verdict == Verdict.DIVERGED and cmp.noise is None


# ---------------------------------------------------------------------------------------------
# End to end: a real 3-seed study (conftest.wide_study), replays on "other hardware"
# (conftest.OTHER_HARDWARE: another thread count, which says why it is an honest stand-in).

def _verdict(result) -> str:
    return result.stdout.strip().splitlines()[-2]


def test_a_cross_hardware_replay_of_a_member_is_within_noise(project, wide_study, tmp_path) -> None:
    _, members = wide_study
    result = project.harness("replay", members[0], *OTHER_HARDWARE)
    assert result.returncode == 0, result.stdout + result.stderr
    assert _verdict(result).startswith("verdict: WITHIN_NOISE: every segment mean and final value inside its ")
    assert "prediction interval of 3 seeds" in _verdict(result)
    replay = project.client().get_run(result.last_line)
    assert replay.data.tags[tags.VERDICT] == Verdict.WITHIN_NOISE
    local = project.client().download_artifacts(result.last_line, tags.ARTIFACT_COMPARISON, str(tmp_path))
    doc = json.loads(Path(local).read_text())
    # The difference is real (not bit-identical), and tiny against the seeds' spread.
    check = doc["noise"]["checks"][-1]  # the final point of the loss curve
    assert check["metric"] == "loss" and check["value"] != check["original"] and check["inside"] is True
    assert doc["bitwise_possible"] is False and doc["noise"]["seeds"] == 3


def test_a_first_check_of_a_member_is_judged_against_the_seeds_at_its_last_step(project, wide_study) -> None:
    """replay --steps 4 on "other hardware": its values differ in their last bits, and are judged on the curves
    before step 4 against the seeds' curves there, not their final values. Over 4 steps, 3 seeds' intervals are too
    wide to have caught a doubled learning rate (the seeds' own curve at twice the steps lies inside them), so the
    verdict is INCONCLUSIVE (exit 1), never WITHIN_NOISE, and says how many seeds would do."""
    _, members = wide_study
    result = project.harness("replay", members[0], "--steps", "4", *OTHER_HARDWARE)
    assert result.returncode == 1, result.stdout + result.stderr
    line = _verdict(result)
    assert line.startswith("verdict: INCONCLUSIVE over the first 4 of 12 steps: inside the noise of 3 seeds, but its "
                           "intervals could not have caught a doubled learning rate: loss "), line
    assert " seeds would narrow it enough, or calibrate the run (harness calibrate RUN_ID)" in line
    replay = project.client().get_run(result.last_line)
    assert replay.data.tags[tags.VERDICT] == Verdict.INCONCLUSIVE and replay.data.tags[tags.REPLAY_STEPS] == "4"


def test_a_planted_learning_rate_change_is_diverged_before_the_seeds_are_consulted(project, wide_study) -> None:
    """A member replayed with its learning rate x10 over its first 4 steps: the seeds' intervals are too wide there to
    catch anything (the check of the same replay without the change is INCONCLUSIVE), but harness.lr is a value no
    seed moves, so it decides DIVERGED at the step it differs, naming it, and the seeds are not consulted."""
    _, members = wide_study
    result = project.harness("replay", members[0], "--steps", "4", *OTHER_HARDWARE, "train.lr=5.0", "--no-localize")
    assert result.returncode == 1, result.stdout + result.stderr
    line = _verdict(result)
    assert line == "verdict: DIVERGED at step 0: harness.lr 0.5 vs 5 (abs 4.5, rel 9) (over the first 4 of 12 steps)", line
    assert "noise" not in line and "seeds" not in line, line
    assert "harness.lr differs at step 0: a value neither rounding nor a seed moves decides the verdict; not judged " \
           "against the noise of study " in result.stdout, result.stdout
    assert project.client().get_run(result.last_line).data.tags[tags.VERDICT] == Verdict.DIVERGED


def test_a_study_replay_judges_its_members_together(project, wide_study) -> None:
    study_id, members = wide_study
    result = project.harness("replay", study_id, "--members", "2", "--members-seed", "7", *OTHER_HARDWARE)
    assert result.returncode == 0, result.stdout + result.stderr
    assert _verdict(result) == ("verdict: WITHIN_NOISE: 2 of 3 members replayed; the 2 replays are equivalent to "
                                "their originals within one seed sd (TOST)")
    client = project.client()
    run = client.get_run(result.last_line)
    assert run.data.tags[tags.KIND] == tags.KIND_STUDY_REPLAY and run.data.tags[tags.REPLAY_OF] == study_id
    assert run.data.tags[tags.MLFLOW_PARENT_RUN_ID] == study_id and run.data.tags[tags.STUDY_MEMBERS_SEED] == "7"
    assert run.data.tags[tags.VERDICT] == Verdict.WITHIN_NOISE and run.info.status == "FINISHED"
    replays = [r for r in project.all_runs() if r.data.tags.get(tags.STUDY_REPLAY) == result.last_line]
    # The same seed draws the same members: random.Random(7).sample(range(3), 2).
    import random

    drawn = sorted(random.Random(7).sample(range(3), 2))
    assert sorted(r.data.tags[tags.REPLAY_OF] for r in replays) == sorted(members[i] for i in drawn)
    assert all(r.data.tags[tags.VERDICT] == Verdict.WITHIN_NOISE for r in replays)


def test_study_replay_options_are_checked_before_anything_runs(project, wide_study) -> None:
    study_id, members = wide_study
    before = len(project.all_runs())
    too_many = project.cli("replay", study_id, "--members", "4")
    assert too_many.returncode == 2 and "--members 4: the study has 3 finished members" in too_many.stderr
    zero = project.cli("replay", study_id, "--members", "0")
    assert zero.returncode == 2 and "--members 0: pass at least 1" in zero.stderr
    early = project.cli("replay", study_id, "--steps", "2")
    assert early.returncode == 2 and f"--steps: run {study_id} is a study" in early.stderr
    not_study = project.cli("replay", members[1], "--members", "2")
    assert not_study.returncode == 2 and "apply to a study" in not_study.stderr
    # Resume (like audit, and replay with --no-follow) takes one training run; a study is a group of them.
    resume = project.cli("resume", study_id)
    assert resume.returncode == 2 and f"run {study_id} is a study" in resume.stderr
    assert "`harness resume` applies to a training run" in resume.stderr and resume.stderr.count("\n") == 1
    assert len(project.all_runs()) == before
