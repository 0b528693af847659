"""Values neither rounding nor a seed moves decide the verdict before any envelope or study is consulted
(harness/judge/decisive.py); and the text beside a verdict says what judged it, on synthetic run records.

End to end: tests/test_noise.py (a study member replayed with its learning rate x10) and tests/test_rounding.py (a
calibrated run replayed with another learning rate) run the same rule through the CLI.
"""

from __future__ import annotations

import numpy as np
from records import clone, make_record, tol

from harness import tags
from harness.judge import rounding
from harness.judge.compare import compare_runs
from harness.judge.handoff import judge_noise, judge_rounding
from harness.judge.metricdiff import KIND_DATA_ORDER, KIND_VALUE
from harness.judge.report import render_markdown
from harness.judge.text import comparison_lines
from harness.judge.verdicts import Verdict

STEPS = np.arange(12, dtype=np.int64)
LOSS = 2.0 / (STEPS + 1.0)
LR = np.full(12, 0.01)


def _run(run_id: str, loss: np.ndarray, lr: np.ndarray = LR, **facts: str):
    rec = make_record(run_id, metrics={"loss": (STEPS.copy(), loss.astype(np.float64)),
                                       tags.METRIC_LR: (STEPS.copy(), lr.astype(np.float64))},
                      final="f" * 64, fingerprints={0: "0" * 64})
    rec.facts[tags.STUDY] = "study0"
    rec.facts.update(facts)
    return rec


def _replay(original, loss: np.ndarray, lr: np.ndarray = LR, other_machine: bool = True, fingerprint0: str = "1" * 64):
    rep = clone(original, "repl0000")
    rep.metrics["loss"] = (STEPS.copy(), loss.astype(np.float64))
    rep.metrics[tags.METRIC_LR] = (STEPS.copy(), lr.astype(np.float64))
    rep.facts[tags.KIND] = tags.KIND_REPLAY
    rep.facts[tags.REPLAY_OF] = original.run_id
    if other_machine:
        rep.facts[tags.ENV_PREFIX + "cpu_capability"] = "DEFAULT"  # another machine's kernels: bitwise impossible
    rep.final_fingerprint, rep.fingerprints = "e" * 64, {0: fingerprint0}
    return rep


# Five seeds whose losses spread by a few tenths of a percent; each member's own learning rate is the recorded one.
MEMBERS = [_run(f"m{i}", LOSS * (1 + 0.003 * (i - 2))) for i in range(5)]


def _envelope(original, steps: int = 12, members: int = 4):
    """Members nudged by rounding: the loss apart by ~1e-7, growing; the learning rate the recorded one, exactly."""
    growth = 1e-7 * np.exp(STEPS / 6.0)
    recs = [{"loss": (STEPS.copy(), LOSS * (1 + (-1) ** k * (k + 1) * growth)),
             tags.METRIC_LR: (STEPS.copy(), LR.copy())} for k in range(members)]
    return rounding.measure(original.run_id, "cal00000", original.metrics, recs, steps, weights_differed=members)


def test_a_learning_rate_x10_is_diverged_at_step_0_before_the_seeds_or_the_envelope_are_consulted() -> None:
    original = MEMBERS[2]
    # The loss a hair off, as on another machine (inside the seeds' noise and the envelope), the rate x10.
    replay = _replay(original, LOSS * (1 + 1e-8), lr=LR * 10)
    cmp = compare_runs(original, replay)
    assert cmp.verdict == Verdict.DIVERGED and cmp.divergence.kind == KIND_VALUE and cmp.divergence.decisive
    studied = judge_noise(cmp, original, replay, "study0", MEMBERS)
    assert studied.verdict == Verdict.DIVERGED and studied.noise is None and studied.exit_code == 1
    assert studied.summary() == "DIVERGED at step 0: harness.lr 0.01 vs 0.1 (abs 0.09, rel 9)"
    assert ("harness.lr differs at step 0: a value neither rounding nor a seed moves decides the verdict; not judged "
            "against the noise of study study0") in studied.notes
    cmp = compare_runs(original, replay)
    calibrated = judge_rounding(cmp, original, replay, _envelope(original))
    assert calibrated.verdict == Verdict.DIVERGED and calibrated.rounding is None
    assert calibrated.summary() == "DIVERGED at step 0: harness.lr 0.01 vs 0.1 (abs 0.09, rel 9)"
    assert any(line.startswith("A bitwise match is impossible (decided by harness.lr at step 0, a value neither "
                               "rounding nor a seed moves): ") for line in comparison_lines(calibrated, []))
    assert any("not judged against the rounding envelope of calibration cal00000" in n for n in calibrated.notes)
    # Without the change the same replay passes both: the rate alone decided.
    same = _replay(original, LOSS * (1 + 1e-8))
    assert judge_noise(compare_runs(original, same), original, same, "study0", MEMBERS).verdict == Verdict.WITHIN_NOISE
    assert judge_rounding(compare_runs(original, same), original, same, _envelope(original)).verdict == Verdict.WITHIN_ROUNDING


def test_a_rate_changed_late_is_named_at_its_step_over_an_earlier_rounding_difference() -> None:
    original = MEMBERS[2]
    lr = LR.copy()
    lr[5:] *= 0.5
    replay = _replay(original, LOSS * (1 + 1e-8), lr=lr)
    cmp = judge_noise(compare_runs(original, replay), original, replay, "study0", MEMBERS)
    assert cmp.verdict == Verdict.DIVERGED and cmp.summary().startswith("DIVERGED at step 5: harness.lr 0.01 vs 0.005 ")


def test_another_data_order_is_diverged_at_its_step_and_a_tolerance_given_for_the_rate_hands_it_on() -> None:
    original = MEMBERS[2]
    original.data_order = {int(s): f"{s:016x}" for s in STEPS}
    try:
        replay = _replay(original, LOSS * (1 + 1e-8))
        replay.data_order = {**original.data_order, 3: "f" * 16}
        cmp = judge_noise(compare_runs(original, replay), original, replay, "study0", MEMBERS)
        assert cmp.verdict == Verdict.DIVERGED and cmp.divergence.kind == KIND_DATA_ORDER and cmp.divergence.step == 3
        assert cmp.summary().startswith("DIVERGED at step 3: the data order differs: the ranks' batches held other "
                                        "samples"), cmp.summary()
        assert any(n.startswith("the data order differs at step 3: a value neither") for n in cmp.notes)
        # Two runs of other seeds (harness compare of two members): the seed moves the data order, which decides
        # nothing there; their learning rates are still held.
        seeded = clone(replay, "m9")
        seeded.facts[tags.SEED] = "9"
        other = compare_runs(original, seeded)
        assert other.divergence.kind == KIND_VALUE and other.divergence.metric == "loss" and not other.divergence.decisive
        seeded.metrics[tags.METRIC_LR] = (STEPS.copy(), LR * 2)
        assert compare_runs(original, seeded).divergence.decisive
    finally:
        original.data_order = {}
    # A tolerance given for the rate is the user's word: within it, the rate decides nothing.
    replay = _replay(original, LOSS * (1 + 1e-8), lr=LR * 1.001)
    loose = compare_runs(original, replay, tolerance=tol(metrics={tags.METRIC_LR: {"rtol": 0.01, "atol": 0.0}}))
    assert loose.divergence.metric == "loss" and not loose.divergence.decisive
    assert judge_noise(loose, original, replay, "study0", MEMBERS).verdict == Verdict.WITHIN_NOISE


def test_the_text_says_what_judged_the_verdict() -> None:
    original = _run("orig0000", LOSS)
    inside = _replay(original, LOSS * (1 + 2e-7 * np.exp(STEPS / 6.0)))
    within = judge_rounding(compare_runs(original, inside), original, inside, _envelope(original))
    assert within.verdict == Verdict.WITHIN_ROUNDING
    lines = comparison_lines(within, [])
    assert any(line.startswith("A bitwise match is impossible (judged by the rounding envelope of calibration "
                               "cal00000): ") for line in lines), lines
    assert "judged by tolerance" not in "\n".join(lines)
    assert "> The verdict is judged by the rounding envelope of calibration cal00000 instead." in render_markdown(within)
    # Per metric, what the envelope saw, beside where the values first differed.
    loss = next(line for line in lines if line.startswith("  loss:"))
    assert loss.endswith("inside the rounding envelope at its 12 judged steps (first differs at step 0)"), loss
    # An envelope over the first 4 steps, carried forward after them: both named, and each metric's steps after it.
    short = judge_rounding(compare_runs(original, inside), original, inside, _envelope(original, steps=4))
    assert short.verdict == Verdict.WITHIN_ROUNDING, short.summary()
    lines = comparison_lines(short, [])
    assert any("(judged by the rounding envelope of calibration cal00000 over the first 4 steps, then by it carried "
               "forward at its members' growth rate, and the tolerance for the rest)" in line for line in lines), lines
    loss = next(line for line in lines if line.startswith("  loss:"))
    assert loss.endswith("inside the rounding envelope at its 4 judged steps, the envelope carried forward at its 8 "
                         "steps after them (first differs at step 0)"), loss
    # Members that never moved the loss: nothing to carry, the tolerance after the 4 steps.
    still = rounding.measure(original.run_id, "cal00000", original.metrics,
                             [{"loss": (STEPS.copy(), LOSS.copy())} for _ in range(4)], 4, weights_differed=4)
    short = judge_rounding(compare_runs(original, inside), original, inside, still)
    assert short.verdict == Verdict.DIVERGED and short.divergence.step == 4
    lines = comparison_lines(short, [])
    assert any("(judged by the rounding envelope of calibration cal00000 over the first 4 steps, then the tolerance)"
               in line for line in lines), lines
    loss = next(line for line in lines if line.startswith("  loss:"))
    assert loss.endswith("inside the rounding envelope at its 4 judged steps, first outside its tolerance at step 4 "
                         "(first differs at step 0)"), loss
    # A study's noise.
    member = MEMBERS[2]
    other = _replay(member, LOSS * (1 + 1e-8))
    noisy = judge_noise(compare_runs(member, other), member, other, "study0", MEMBERS)
    assert noisy.verdict == Verdict.WITHIN_NOISE
    assert any(line.startswith("A bitwise match is impossible (judged by the noise of study study0's 5 seeds)")
               for line in comparison_lines(noisy, []))


def test_per_metric_lines_name_the_step_the_envelope_decided_at_not_the_first_difference() -> None:
    original = _run("orig0000", LOSS)
    jumped = LOSS * (1 + 1e-7 * np.exp(STEPS / 6.0))
    jumped[6:] *= 1 + 5e-5
    replay = _replay(original, jumped)
    cmp = judge_rounding(compare_runs(original, replay), original, replay, _envelope(original))
    assert cmp.verdict == Verdict.DIVERGED and cmp.divergence.step == 6
    loss = next(line for line in comparison_lines(cmp, []) if line.startswith("  loss:"))
    assert loss.endswith("first outside the rounding envelope at step 6 (first differs at step 0)"), loss
    assert "first divergence 0" not in loss
    assert "first outside the rounding envelope at step 6 (first differs at step 0)" in render_markdown(cmp)


def test_a_same_machine_jump_after_a_bit_identical_prefix_is_no_rounding() -> None:
    original = _run("orig0000", LOSS)
    jumped = LOSS.copy()
    jumped[6:] *= 1 + 3e-4  # bit-identical until step 6, then far outside (hundreds of half-widths)
    replay = _replay(original, jumped, other_machine=False, fingerprint0="0" * 64)
    cmp = judge_rounding(compare_runs(original, replay), original, replay, _envelope(original))
    assert cmp.verdict == Verdict.DIVERGED and cmp.divergence.step == 6 and cmp.bitwise_possible
    note = next(n for n in cmp.notes if "step 6" in n and "envelope" in n)
    assert note.startswith("every value was bit-identical before step 6, in the run's own environment, then loss left "
                           "the envelope at "), note
    assert note.endswith("so this is a change that acts from that step (the code, the config, the data), not rounding")
    assert "--members 32" not in note and "sudden parting" not in note
    # On another machine the same jump may still be a near-tie that rounding flipped: there the note offers that.
    elsewhere = _replay(original, jumped, fingerprint0="0" * 64)
    other = judge_rounding(compare_runs(original, elsewhere), original, elsewhere, _envelope(original))
    assert any("harness calibrate RUN_ID --members 32" in n for n in other.notes)


def test_a_first_check_holds_only_what_it_compared_and_says_one_thing_of_the_weights() -> None:
    original = _run("orig0000", LOSS)
    # The script's own MLflow metric (logged at MLflow's step 0): replay --steps K does not compare it.
    original.metrics["test_loss"] = (np.array([0]), np.array([0.5]))
    original.facts[tags.USER_MLFLOW_METRICS] = "test_loss"
    original.steps_total = 12
    replay = _replay(original, LOSS * (1 + 2e-7 * np.exp(STEPS / 6.0)))
    replay.metrics["test_loss"] = (np.array([0]), np.array([0.7]))
    env = _envelope(original)
    env.metrics["test_loss"] = rounding.MetricEnvelope([0], [0.5], [0.3])  # wide enough to hold it
    cmp = judge_rounding(compare_runs(original, replay, first_steps=6), original, replay, env)
    assert any(n.startswith("test_loss (logged through MLflow at the script's own steps) not compared") for n in cmp.notes)
    assert cmp.verdict == Verdict.WITHIN_ROUNDING and set(cmp.rounding.judged) == {"loss", tags.METRIC_LR}
    line = cmp.summary()
    assert " at all 12 judged values, " in line, line  # loss and harness.lr at steps 0-5, not test_loss
    # No checkpoint of step 6 in the original: the weights after it were not compared, and nothing says they differ.
    assert line.endswith("; weights after step 6 not compared: the original has no checkpoint fingerprint of step 6")
    assert "differ as the calibration's members' did" not in line, line
