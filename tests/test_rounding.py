"""`harness calibrate` and the WITHIN_ROUNDING verdict; the doubled-learning-rate test that makes a seed verdict
INCONCLUSIVE; the CPU kernel level in the record.

The arithmetic is pinned on synthetic records; the end-to-end part is one real calibration of linear_ddp (one
epoch, 8 members: `harness run --calibrate`, as a user would) shared by the replays that are judged against it:
another CPU kernel level (ATEN_CPU_CAPABILITY=default, what an older CPU runs) and a learning rate 2% higher.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
from records import clone, make_record, tol

from harness import tags
from harness.judge import noise, rounding
from harness.judge.compare import compare_runs
from harness.judge.delta import environment_delta
from harness.judge.handoff import judge_noise, judge_rounding
from harness.judge.metricdiff import KIND_ROUNDING, as_series
from harness.judge.report import render_markdown
from harness.judge.verdicts import Verdict
from harness.runtime.perturb import NUDGE, NUDGE_ULPS, kernels_of, member_seeds, nudge, nudge_ulps, threads_vary

STEPS = np.arange(12, dtype=np.int64)
LOSS = 2.0 / (STEPS + 1.0)


def _run(run_id: str, loss: np.ndarray, **facts: str):
    rec = make_record(run_id, metrics={"loss": (STEPS.copy(), loss.astype(np.float64))}, final="f" * 64,
                      fingerprints={0: "0" * 64})
    rec.facts.update(facts)
    return rec


def _replay(original, loss: np.ndarray, final: str = "e" * 64):
    rep = clone(original, "repl0000")
    rep.metrics["loss"] = (STEPS.copy(), loss.astype(np.float64))
    rep.facts[tags.KIND] = tags.KIND_REPLAY
    rep.facts[tags.REPLAY_OF] = original.run_id
    rep.facts[tags.ENV_PREFIX + "cpu_capability"] = "DEFAULT"  # another machine's kernels
    rep.final_fingerprint, rep.fingerprints = final, {0: "1" * 64}
    return rep


def _rounding_growth(k: int) -> np.ndarray:
    """A member's relative distance from the original: a few ulps at step 0, growing as training carries it."""
    return (k + 1) * 1e-7 * np.exp(STEPS / 6.0)


def _envelope(original, steps: int = 8, members: int = 4):
    recs = [{"loss": (STEPS.copy(), LOSS * (1 + (-1) ** k * _rounding_growth(k)))} for k in range(members)]
    return rounding.measure(original.run_id, "cal00000", original.metrics, recs, steps, weights_differed=members)


def test_the_envelope_is_the_widest_member_widened_by_its_running_maximum_and_floored() -> None:
    original = _run("orig0000", LOSS)
    env = _envelope(original)
    m = env.metrics["loss"]
    assert m.steps == list(range(8)) and m.original == list(LOSS[:8])
    assert m.deviation == pytest.approx(list(LOSS[:8] * _rounding_growth(3)[:8]), rel=1e-6)
    widths = m.half_widths()
    rel = widths / LOSS[:8]
    assert rel == pytest.approx(rounding.SAFETY * _rounding_growth(3)[:8], rel=1e-6)
    # A step where every member agreed with the original keeps the width reached before it (rounding only grows).
    m.deviation[5] = 0.0
    assert m.half_widths()[5] / LOSS[5] == pytest.approx(rounding.SAFETY * _rounding_growth(3)[4], rel=1e-6)
    # Members that never differed leave the floor: FLOOR_ULPS float32 ulps of the value.
    flat = rounding.MetricEnvelope([0], [1.0], [0.0])
    assert flat.half_widths()[0] == rounding.FLOOR_ULPS * float(np.spacing(np.float32(1.0)))
    # Stored as JSON and read back unchanged; another format is refused.
    doc = json.loads(json.dumps(env.to_dict()))
    assert rounding.Envelope.from_dict(doc) == env
    with pytest.raises(ValueError, match="envelope format 99"):
        rounding.Envelope.from_dict({**doc, "format": 99})


def test_the_factor_comes_from_the_honest_replays_and_a_change_a_few_members_wide_leaves_the_envelope() -> None:
    """SAFETY is HEADROOM x the widest honest replay measured (in widest members), not the hand-set 8 it replaced:
    a change that moves the loss by 6x the widest member at its first step (as momentum 0.9 -> 0.91 does on the
    bench's MLP, benchmarks/margin_bench.py) is DIVERGED there, and an honest replay at the widest measured is inside.
    The weights and the carried envelope keep WIDE_SAFETY."""
    assert rounding.SAFETY == pytest.approx(rounding.HEADROOM * rounding.HONEST_WIDEST) and rounding.SAFETY < 6
    original = _run("orig0000", LOSS)
    env = _envelope(original)
    widest = _rounding_growth(3)
    planted = _replay(original, LOSS * (1 + np.where(STEPS >= 2, 6 * widest, 0.0)))
    cmp = judge_rounding(compare_runs(original, planted), original, planted, env)
    assert cmp.verdict == Verdict.DIVERGED and cmp.divergence.step == 2, cmp.summary()
    honest = _replay(original, LOSS * (1 + rounding.HONEST_WIDEST * widest))
    cmp = judge_rounding(compare_runs(original, honest), original, honest, env)
    assert cmp.verdict == Verdict.WITHIN_ROUNDING, cmp.summary()
    assert rounding.WeightsEnvelope(8, "ref", [1e-6], "").half_width() == pytest.approx(rounding.WIDE_SAFETY * 1e-6)


def test_calibrate_ends_with_a_table_of_half_widths_and_what_a_replay_is_held_to() -> None:
    """The terminal's end of `harness calibrate`: the half-width per metric at a few steps spread over the M (a value
    logged less often: its latest at or before the column's step), the weights', the rule a replay is judged by."""
    from harness.commands.calibrate import Calibration

    original = _run("orig0000", LOSS)
    env = _envelope(original, steps=8)
    env.metrics["val"] = rounding.MetricEnvelope([3, 7], [0.5, 0.25], [1e-6, 2e-6])  # once an "epoch"
    env.weights, env.reference_bitwise = rounding.WeightsEnvelope(8, "ref00000", [1e-5, 3e-5], "fc.weight"), True
    widths, val = env.metrics["loss"].half_widths(), env.metrics["val"].half_widths()
    lines = Calibration("orig0000", "cal00000", env, ["m1", "m2"], 12).table().splitlines()
    assert lines[0] == "calibration cal00000 of run orig0000: 4 members x 8 steps; the run itself re-executed bit for bit here"
    assert lines[1].split() == ["half-width", "step", "0", "step", "2", "step", "5", "step", "7"]
    assert lines[2].split() == ["loss", *(f"±{w:.3g}" for w in widths[[0, 2, 5, 7]])]
    assert lines[3].split() == ["val", "-", "-", f"±{val[0]:.3g}", f"±{val[1]:.3g}"]
    assert lines[4] == (f"weights after step 8: ±{8 * 3e-5:.3g} relative (members up to 3e-05, farthest tensor "
                        "fc.weight; 4 of 4 differed)")
    assert lines[5] == (f"a replay of run orig0000 is WITHIN_ROUNDING where every logged value of steps 0-7 lies within "
                        f"the half-width and its weights after step 8 within ±{8 * 3e-5:.3g}, else DIVERGED at the "
                        "first step outside; steps 8-11 by the tolerance")


def test_a_replay_inside_the_envelope_is_within_rounding_and_says_against_what() -> None:
    original = _run("orig0000", LOSS)
    env = _envelope(original, steps=12)
    replay = _replay(original, LOSS * (1 + 2e-7 * np.exp(STEPS / 6.0)))
    cmp = compare_runs(original, replay)
    assert cmp.verdict == Verdict.DIVERGED  # zero tolerance: without a calibration it is a divergence
    cmp = judge_rounding(cmp, original, replay, env)
    assert cmp.verdict == Verdict.WITHIN_ROUNDING and cmp.exit_code == 0 and cmp.divergence is None
    line = cmp.summary()
    assert line.startswith("WITHIN_ROUNDING: 1 metric x 12 steps not bit-identical, inside the rounding envelope of 4 "
                           "members over the first 12 steps (calibration cal00000) at all 12 judged values, at most ")
    assert "bitwise impossible (1 environment change)" in line and "the weights differ as the calibration's members' did" in line
    assert "not bit-identical, but inside the rounding envelope" in render_markdown(cmp)
    assert json.loads(json.dumps(cmp.to_dict()))["rounding"]["members"] == 4


def test_a_replay_whose_values_are_bit_identical_but_weights_not_says_so() -> None:
    """Only the weights parted (a rounding below what the logged loss shows): the line must not call the metrics
    not bit-identical."""
    original = _run("orig0000", LOSS)
    env = _envelope(original, steps=12)
    replay = _replay(original, LOSS.copy())
    cmp = judge_rounding(compare_runs(original, replay), original, replay, env)
    assert cmp.verdict == Verdict.WITHIN_ROUNDING, cmp.summary()
    assert cmp.summary().startswith("WITHIN_ROUNDING: 1 metric x 12 steps bit-identical, the weights not, inside "), cmp.summary()
    replay.metrics["acc"] = (STEPS.copy(), np.ones(12))
    original.metrics["acc"] = (STEPS.copy(), np.ones(12))
    replay.metrics["loss"] = (STEPS.copy(), LOSS * (1 + 2e-7 * np.exp(STEPS / 6.0)))
    env = _envelope(original, steps=12)
    env.metrics["acc"] = rounding.MetricEnvelope(list(range(12)), [1.0] * 12, [0.0] * 12)
    cmp = judge_rounding(compare_runs(original, replay), original, replay, env)
    assert cmp.summary().startswith("WITHIN_ROUNDING: loss not bit-identical (1 of 2 metrics x 12 steps), inside "), cmp.summary()


def test_a_real_change_leaves_the_envelope_at_its_first_step_and_no_seed_rescues_it() -> None:
    original = _run("orig0000", LOSS)
    env = _envelope(original)
    changed = LOSS.copy()
    changed[1:] *= 1 + 1.7e-4  # lr x1.02 at step 1 (the measured size)
    replay = _replay(original, changed)
    cmp = judge_rounding(compare_runs(original, replay), original, replay, env)
    assert cmp.verdict == Verdict.DIVERGED and cmp.divergence.kind == KIND_ROUNDING and cmp.divergence.step == 1
    assert cmp.summary().startswith("DIVERGED at step 1: loss at step 1: 1 vs 1.0002 (abs 0.00017, envelope ±")
    assert "outside at 7 of 8 judged steps, outside the rounding envelope of 4 members over the first 8 steps " \
           "(calibration cal00000)" in cmp.summary()
    # A study member outside its rounding envelope is not judged against the seeds: a seed explains no such change.
    members = [_run(f"m{i}", LOSS * (1 + 0.05 * i)) for i in range(5)]
    assert judge_noise(cmp, original, replay, "study0", members).verdict == Verdict.DIVERGED


def test_a_sudden_parting_after_steps_well_inside_is_diverged_with_a_note_on_what_else_does_that() -> None:
    original = _run("orig0000", LOSS)
    env = _envelope(original, steps=12)
    jumped = LOSS * (1 + 1e-7 * np.exp(STEPS / 6.0))
    jumped[6:] *= 1 + 5e-5  # a max-pool tie flipped at step 6, say: inside before, far outside after
    replay = _replay(original, jumped)
    cmp = judge_rounding(compare_runs(original, replay), original, replay, env)
    assert cmp.verdict == Verdict.DIVERGED and cmp.divergence.step == 6
    note = next(n for n in cmp.notes if "sudden parting" in n)
    assert note.startswith("loss stayed inside the envelope for its 6 judged steps before step 6 (at most ") and \
        "harness calibrate RUN_ID --members 32" in note
    changed = LOSS.copy()
    changed[1:] *= 1 + 1.7e-4  # a change from the first update on: no such note
    replay = _replay(original, changed)
    assert not any("sudden" in n for n in judge_rounding(compare_runs(original, replay), original, replay, env).notes)


def test_after_the_envelope_a_metric_the_members_never_moved_is_judged_by_the_tolerance_and_the_line_says_so() -> None:
    original = _run("orig0000", LOSS)
    still = [{"loss": (STEPS.copy(), LOSS.copy())} for _ in range(4)]  # no member moved the loss: no growth to carry
    env = rounding.measure(original.run_id, "cal00000", original.metrics, still, 4, weights_differed=4)
    replay = _replay(original, LOSS * (1 + 2e-7 * np.exp(STEPS / 6.0)))
    cmp = judge_rounding(compare_runs(original, replay), original, replay, env)
    assert cmp.verdict == Verdict.DIVERGED and cmp.divergence.step == 4 and cmp.rounding.within and not cmp.rounding.carried
    # ... and says how to hold them to rounding too.
    assert cmp.summary().endswith("; the first 4 steps inside the rounding envelope of 4 members over the first 4 steps, "
                                  "the steps after them judged by the tolerance (to hold them to rounding too: harness "
                                  "calibrate orig0000 --steps N, up to the run's steps; or replay --tolerance "
                                  "METRIC=ATOL,RTOL)"), cmp.summary()
    loose = judge_rounding(compare_runs(original, replay, tolerance={**tol(rtol=1e-3), "weights": "any"}), original,
                           replay, env)
    assert loose.verdict == Verdict.WITHIN_TOLERANCE and loose.summary().endswith("judged by the tolerance")
    # replay --steps 4: the envelope covers all it judged.
    early = judge_rounding(compare_runs(original, replay, first_steps=4), original, replay, env)
    assert early.verdict == Verdict.WITHIN_ROUNDING and early.summary().startswith("WITHIN_ROUNDING over the first 4 of 12 steps")


def test_after_the_envelope_the_members_growth_carries_it_and_a_late_jump_still_leaves_it() -> None:
    """Steps from M on: the envelope carried forward at the members' growth rate, fitted on the window's second half
    (here exactly 1/6 per step), from its width at step M-1; the line says which steps each envelope judged."""
    from harness.judge import carried

    original = _run("orig0000", LOSS)
    env = _envelope(original, steps=8)
    g = carried.growth(env.metrics["loss"], 8)
    assert g is not None and g.last == 7 and abs(g.rate - 1 / 6) < 1e-9, g
    assert g.width == pytest.approx(rounding.WIDE_SAFETY * _rounding_growth(3)[7])  # the widest member, at step 7
    assert carried.growth(env.metrics["loss"], 2) is None  # two steps fit no rate
    honest = _replay(original, LOSS * (1 + 2e-7 * np.exp(STEPS / 6.0)))
    cmp = judge_rounding(compare_runs(original, honest), original, honest, env)
    assert cmp.verdict == Verdict.WITHIN_ROUNDING and cmp.exit_code == 0, cmp.summary()
    assert cmp.rounding.carried["loss"].judged == 4 and cmp.rounding.carried["loss"].outside is None
    assert ("(steps 0-7 by the rounding envelope of 4 members over the first 8 steps, loss steps 8-11 by the envelope "
            "carried forward x1.1814 per step from ±1.03e-05 relative at step 7)") in cmp.summary(), cmp.summary()
    # A change from step 10 that jumps: rounding grows from where the replay was, it does not jump past the members.
    late = LOSS * (1 + 2e-7 * np.exp(STEPS / 6.0))
    late[10:] *= 1 + 1e-3
    replay = _replay(original, late)
    cmp = judge_rounding(compare_runs(original, replay), original, replay, env)
    assert cmp.verdict == Verdict.DIVERGED and cmp.divergence.kind == KIND_ROUNDING and cmp.divergence.step == 10, cmp.summary()
    assert "outside the envelope carried forward from step 7 at its members' growth rate" in cmp.summary()
    assert "loss steps 8-11 by the envelope carried forward" in cmp.summary()
    # Where the members measured no growth, the tolerance holds those steps bit for bit: this honest replay is DIVERGED.
    assert judge_rounding(compare_runs(original, honest), original, honest, rounding.measure(
        original.run_id, "cal00000", original.metrics, [], 8)).verdict != Verdict.WITHIN_ROUNDING


def test_a_carried_envelope_wider_than_its_ceiling_decides_nothing_and_a_study_takes_over_where_they_meet() -> None:
    from harness.judge import carried

    original = _run("orig0000", LOSS)
    fast = [{"loss": (STEPS.copy(), LOSS * (1 + (-1) ** k * 1e-5 * (k + 1) * np.exp(STEPS / 2.0)))} for k in range(4)]
    env = rounding.measure(original.run_id, "cal00000", original.metrics, fast, 8, weights_differed=4)
    # The replay grows as fast as the members did, 1.5x the widest inside the window, then beyond carried.CEILING
    # (and the width measured at step 7) at step 8, inside the carried width - rounding's growth and a change both fit.
    rel = np.where(STEPS < 8, 6e-5, 2.5e-4) * np.exp(STEPS / 2.0)
    replay = _replay(original, LOSS * (1 + rel))
    cmp = judge_rounding(compare_runs(original, replay), original, replay, env)
    assert cmp.verdict == Verdict.INCONCLUSIVE and cmp.exit_code == 1, cmp.summary()
    assert cmp.summary().startswith("INCONCLUSIVE: loss at step 8: "), cmp.summary()
    assert "a study of the run's seeds (harness run ... --seeds N) judges those steps, or a calibration that measures " \
           "them (harness calibrate orig0000 --steps 9)" in cmp.summary()
    # With a study: the carried envelope judges until it meets the seeds' spread, the seeds from there.
    seeds = [_run(f"seed{k:04d}", LOSS * (1 + 0.005 * (k + 1) * (-1) ** k)) for k in range(4)]
    spread = carried.seeds_spread(as_series(*original.metrics["loss"]), [as_series(*r.metrics["loss"]) for r in seeds])
    assert spread[1] == pytest.approx(0.02 * LOSS)
    cmp = judge_rounding(compare_runs(original, replay), original, replay, env, seeds=seeds)
    held = cmp.rounding.carried["loss"]
    assert (held.first, held.seeds_from, held.undecided) == (8, 9, None) and cmp.verdict == Verdict.DIVERGED, cmp.summary()
    assert cmp.divergence.kind != KIND_ROUNDING and cmp.divergence.step >= held.seeds_from  # for judge_noise to take


def test_a_member_that_blew_up_holds_the_replay_only_to_the_steps_before_it() -> None:
    original = _run("orig0000", LOSS)
    recs = [{"loss": (STEPS.copy(), LOSS * (1 + (-1) ** k * _rounding_growth(k)))} for k in range(4)]
    recs[2]["loss"][1][3:] = np.nan  # rounding alone broke this member's training at step 3
    env = rounding.measure(original.run_id, "cal00000", original.metrics, recs, 12, weights_differed=4)
    assert env.blown_up() == ("loss", 3)
    changed = LOSS.copy()
    changed[4:] *= 1.5  # a real change from step 4: its envelope of inf there held it (WITHIN_ROUNDING, exit 0)
    replay = _replay(original, changed)
    cmp = judge_rounding(compare_runs(original, replay), original, replay, env)
    assert cmp.verdict == Verdict.DIVERGED and cmp.divergence.step == 4, cmp.summary()
    assert cmp.rounding.steps == 3 and cmp.rounding.blown_up
    assert "the first 3 steps inside the rounding envelope of 4 members over the first 3 steps, the steps after them " \
           "judged by the tolerance" in cmp.summary() and "--steps N" not in cmp.summary()  # more steps would not help
    assert "went to NaN or inf in loss at step 3 where the run did not" in " ".join(cmp.notes)
    # A member whose weights ended NaN: the weights are not held to an envelope of NaN width.
    env = _envelope(original, steps=12)
    env.weights = rounding.WeightsEnvelope(12, "ref00000", [1e-7, math.nan, 2e-7], "w")
    moved = type("Distance", (), {"relative": 0.5, "widest": "w"})()
    near = _replay(original, LOSS * (1 + 1e-7))
    cmp = judge_rounding(compare_runs(original, near), original, near, env, moved)
    assert cmp.rounding.weights is None and any("NaN or infinite distance" in n for n in cmp.notes), cmp.notes


def test_an_envelope_whose_members_kept_the_weights_explains_no_other_weights() -> None:
    original = _run("orig0000", LOSS)
    env = _envelope(original, steps=12)
    env.weights_differed = 0
    replay = _replay(original, LOSS * (1 + 2e-7))
    cmp = judge_rounding(compare_runs(original, replay), original, replay, env)
    assert cmp.verdict == Verdict.DIVERGED and cmp.rounding is None
    assert any("members ended equal to the original's" in n for n in cmp.notes)


def test_a_sketch_measures_the_weights_distance_exactly_for_small_tensors_and_closely_for_large() -> None:
    import copy

    import torch
    from torch import nn

    from harness.judge.weightdistance import Sketch, distance
    from harness.runtime.sketch import WIDTH, sketch

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(300, 500), nn.Linear(500, 10), nn.BatchNorm1d(10))
    reference = Sketch.load(Sketch.of(sketch(model, 7)).dump())  # as recorded: through the .npz and back
    assert reference.step == 7 and distance(reference, reference).relative == 0.0

    def exact(other: nn.Module) -> float:
        a, b = other.state_dict(), model.state_dict()
        num = sum(float(((a[k].double() - b[k].double()) ** 2).sum()) for k in b if b[k].is_floating_point())
        return math.sqrt(num / sum(float((b[k].double() ** 2).sum()) for k in b if b[k].is_floating_point()))

    nudged = copy.deepcopy(model)
    nudge(nudged, 3)  # the size a calibration measures (perturb.NUDGE), far above the float64 sums' rounding
    got = distance(Sketch.of(sketch(nudged, 7)), reference)
    assert got.relative == pytest.approx(exact(nudged), rel=0.15), (got, exact(nudged))
    small = copy.deepcopy(model)
    with torch.no_grad():
        small[1].bias[3] += 1e-3  # 10 elements <= WIDTH: kept whole, so exact
    got = distance(Sketch.of(sketch(small, 7)), reference)
    assert got.widest == "1.bias" and got.relative == pytest.approx(exact(small), rel=1e-9) and 10 <= WIDTH
    # Structured changes of a large tensor - every element shifted alike, every 256th column - are estimated as well as
    # random ones (a sign drawn from a weak bit, or a width that divides the row, would cancel them or pile them up).
    wide = nn.Linear(3000, 1000).requires_grad_(False)
    base = Sketch.of(sketch(wide, 0))
    norm = math.sqrt(sum(float((t.double() ** 2).sum()) for t in wide.state_dict().values()))
    for change in (lambda w: w.add_(1e-6), lambda w: w[:, ::256].add_(1e-6), lambda w: w.view(-1)[::1024].add_(1e-6)):
        moved = copy.deepcopy(wide)
        change(moved.weight)
        true = float((moved.weight.double() - wide.weight.double()).norm()) / norm
        assert distance(Sketch.of(sketch(moved, 0)), base).relative == pytest.approx(true, rel=0.2)
    other = Sketch.of(sketch(nn.Sequential(nn.Linear(300, 400)), 7))
    assert math.isinf(distance(other, reference).relative)  # another model: no distance means anything


def test_a_nudge_moves_each_weight_by_whole_ulps_up_to_the_nudge_and_a_16_bit_one_by_one() -> None:
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8, dtype=torch.bfloat16), nn.Linear(8, 8, dtype=torch.float64))
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    moved = nudge(model, 5)
    after = dict(model.named_parameters())
    assert nudge_ulps(torch.float32) == NUDGE_ULPS == 256 and nudge_ulps(torch.bfloat16) == nudge_ulps(torch.float16) == 1
    # float32: each element a whole number of its own ulps away, up to 256 (in its binade), both ways, most of them far.
    ulp = torch.nextafter(before["0.weight"], torch.tensor(float("inf"))) - before["0.weight"]
    steps = (after["0.weight"].detach() - before["0.weight"]) / ulp
    assert torch.equal(steps, steps.round()) and int(steps.abs().max()) <= 256
    assert int((steps > 0).sum()) > 1000 and int((steps < 0).sum()) > 1000 and float(steps.abs().median()) > 64
    # bfloat16: one of its own ulps at most (256 of them would move a weight by twice its size).
    rel = ((after["1.weight"].detach() - before["1.weight"]).float() / before["1.weight"].float()).abs()
    assert 0 < float(rel.max()) <= 2.0**-7
    # float64: the same relative size as float32, not 256 float64 ulps (rounding-invisible there).
    rel64 = ((after["2.weight"].detach() - before["2.weight"]) / before["2.weight"]).abs()
    assert 1e-6 < float(rel64.max()) <= 2 * NUDGE
    assert moved == sum(int((after[k].detach() != before[k]).sum()) for k in before)
    # The same seed draws the same nudge (every rank of a member agrees); another seed another one.
    again = {k: v.clone() for k, v in before.items()}
    twin = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8, dtype=torch.bfloat16), nn.Linear(8, 8, dtype=torch.float64))
    twin.load_state_dict(again)
    nudge(twin, 5)
    assert all(torch.equal(a, b) for a, b in zip(twin.parameters(), model.parameters()))
    twin.load_state_dict(again)
    nudge(twin, 6)
    assert not torch.equal(twin[0].weight, model[0].weight)
    # Elements that are not finite (a mask kept as a parameter) stay as they are; none is pushed to inf.
    big = float(torch.finfo(torch.float32).max)
    odd = nn.Linear(4, 1)
    with torch.no_grad():
        odd.weight.copy_(torch.tensor([[float("-inf"), float("nan"), big, -big]]))
    nudge(odd, 1)
    w = odd.weight.detach()
    assert w[0, 0] == float("-inf") and torch.isnan(w[0, 1]) and bool(torch.isfinite(w[0, 2:]).all())


def _sharded_member(rank: int, world: int, store: str, out: str) -> None:
    """One rank of a model whose parameters are DTensors sharded over 2 ranks (as FSDP2 or tensor parallelism leave
    them): nudged as a calibration member is, then gathered; rank 0 writes the whole weights and an unsharded
    twin's, nudged alike."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)
        model = torch.nn.Linear(16, 6)
        twin = torch.nn.Linear(16, 6)
        twin.load_state_dict(model.state_dict())
        model.weight = torch.nn.Parameter(distribute_tensor(model.weight.detach(), mesh, [Shard(0)]))
        model.bias = torch.nn.Parameter(distribute_tensor(model.bias.detach(), mesh, [Replicate()]))
        nudge(model, 3)
        nudge(twin, 3)
        whole = {k: v.full_tensor() for k, v in model.state_dict().items()}  # collective: every rank calls it
        if rank == 0:
            # The sketch runs in rank 0 alone: it must refuse a sharded tensor before any collective (one in rank
            # 0 alone would hang the job); the rank turns that into a notice.
            from harness.runtime.sketch import sketch

            try:
                refused = f"sketched: {sketch(model, 5)}"
            except ValueError as err:
                refused = str(err)
            torch.save({"sharded": whole, "unsharded": twin.state_dict(), "sketch": refused}, out)
    finally:
        dist.destroy_process_group()


def test_a_member_whose_script_wraps_its_own_ddp_is_nudged_when_it_makes_its_optimizer(tmp_path) -> None:
    """No ctx.ddp or ctx.register (a script's own DDP): the member's nudge lands on the parameters of its optimizer as
    the optimizer is made, before the first forward - before, no member differed and the calibration judged nothing.
    A model registered after it is not nudged twice; the constructor is torch's own again once the context closes."""
    import multiprocessing as mp

    import torch
    from torch import nn

    from harness.runtime.context import Context
    from harness.runtime.plan import LaunchPlan

    def member(perturb_seed: int | None, register_after: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Linear(16, 4)
        start = model.weight.detach().clone()
        _, there = mp.Pipe()
        plan = None if perturb_seed is None else LaunchPlan("", 0, perturb_seed=perturb_seed)
        ctx = Context(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), cfg={}, seed=0, rank_seed=0,
                      fingerprint_every=100, channel=there, output_dir=str(tmp_path / f"out{perturb_seed}"),
                      checkpoints=plan)
        try:
            assert torch.equal(model.weight, start)
            torch.optim.SGD(model.parameters(), lr=0.1)
            if register_after:
                ctx.register(model)
            made = model.weight.detach().clone()
        finally:
            ctx.close()
        torch.optim.SGD(model.parameters(), lr=0.1)  # after the context: torch's own constructor, no nudge
        assert torch.equal(model.weight, made)
        return start, made

    start, made = member(None)
    assert torch.equal(made, start)  # not a member: untouched
    expected = nn.Linear(16, 4)
    with torch.no_grad():
        expected.weight.copy_(start)
    optimizer_view = nn.Module()  # the optimizer's parameters, named as the context names them
    optimizer_view.register_parameter("g0_0", expected.weight)
    optimizer_view.register_parameter("g0_1", expected.bias)
    nudge(optimizer_view, 3)
    start, made = member(3)
    assert not torch.equal(made, start) and torch.equal(made, expected.weight.detach())
    _, twice = member(3, register_after=True)
    assert torch.equal(twice, made)  # registering the model afterwards nudged nothing again
    _, reference = member(0)  # the reference member: the run itself, not nudged
    assert torch.equal(reference, start)


def test_a_sharded_model_is_nudged_shard_by_shard_exactly_as_an_unsharded_one(tmp_path) -> None:
    import torch
    import torch.multiprocessing as mp

    out = tmp_path / "weights.pt"
    mp.spawn(_sharded_member, args=(2, str(tmp_path / "store"), str(out)), nprocs=2, join=True)
    got = torch.load(out)
    assert got["sketch"].startswith("weight is sharded across the ranks (a DTensor, (Shard(dim=0),)): rank 0 holds "
                                    "only its shard"), got["sketch"]  # the replicated bias was sketched whole
    for name, value in got["unsharded"].items():
        assert torch.equal(got["sharded"][name], value), name
    # ... and nudged at all (the twin moved from where both started).
    torch.manual_seed(0)
    assert not torch.equal(torch.nn.Linear(16, 6).weight, got["unsharded"]["weight"])


def test_weights_that_left_the_members_distance_diverge_though_every_metric_is_inside() -> None:
    from harness.judge.weightdistance import Distance

    original = _run("orig0000", LOSS)
    env = _envelope(original, steps=12)
    env.weights = rounding.WeightsEnvelope(12, "ref00000", [1e-7, 3e-7, 2e-7, 1.5e-7], "fc.weight")
    replay = _replay(original, LOSS * (1 + 2e-7 * np.exp(STEPS / 6.0)))
    inside = judge_rounding(compare_runs(original, replay), original, replay, env, Distance(2e-6, "fc.weight", 3e-6))
    assert inside.verdict == Verdict.WITHIN_ROUNDING
    assert "; the weights after step 12: relative distance 2e-06 from the run's, 0.83x the envelope's half-width " \
           "(members up to 3e-07)" in inside.summary(), inside.summary()
    outside = judge_rounding(compare_runs(original, replay), original, replay, env, Distance(5e-5, "fc.bias", 1e-4))
    assert outside.verdict == Verdict.DIVERGED and outside.divergence.kind == KIND_ROUNDING and outside.divergence.step == 12
    assert outside.summary().startswith("DIVERGED at step 12: the weights after step 12: relative distance 5e-05 from "
                                        "the run's (farthest: fc.bias), outside the envelope ±2.4e-06 (members up to "
                                        "3e-07), outside the rounding envelope of 4 members"), outside.summary()
    doc = env.to_dict()
    assert rounding.Envelope.from_dict(json.loads(json.dumps(doc))).weights == env.weights


def test_a_seed_verdict_that_could_not_have_caught_a_doubled_learning_rate_is_inconclusive() -> None:
    """3 seeds: the 99.97% intervals are so wide that the seeds' own curve at twice the steps - where a doubled
    learning rate lands early in training - lies inside them. That is no evidence, so no pass."""
    def member(run_id: str, scale: float):
        rec = _run(run_id, 2.0 * scale / (STEPS + 1.0))
        rec.facts[tags.STUDY] = "study0"
        return rec

    wide = [member(f"m{i}", s) for i, s in enumerate([1.0, 0.6, 1.5])]
    original = wide[0]
    replay = _replay(original, original.metrics["loss"][1] * (1 + 1e-6))
    replay.facts[tags.THREADS_PER_RANK] = "2"
    cmp = judge_noise(compare_runs(original, replay), original, replay, "study0", wide)
    assert cmp.noise.within and cmp.verdict == Verdict.INCONCLUSIVE and cmp.exit_code == 1
    power = cmp.noise.power
    assert power is not None and not power.caught and power.seeds == 3
    assert cmp.summary().startswith("INCONCLUSIVE: inside the noise of 3 seeds, but its intervals could not have caught "
                                    "a doubled learning rate: loss mean over steps ")
    assert "or calibrate the run (harness calibrate RUN_ID)" in cmp.summary()
    # Seeds that agree closely: the same replay is WITHIN_NOISE, and the test says what it would have caught.
    close = [member(f"m{i}", s) for i, s in enumerate([1.0, 1.01, 0.99, 1.005, 0.995])]
    replay = _replay(close[0], close[0].metrics["loss"][1] * (1 + 1e-6))
    replay.facts[tags.THREADS_PER_RANK] = "2"
    cmp = judge_noise(compare_runs(close[0], replay), close[0], replay, "study0", close)
    assert cmp.verdict == Verdict.WITHIN_NOISE and cmp.noise.power.caught


def test_seeds_needed_is_the_fewest_that_would_exclude_the_doubled_rate() -> None:
    spread = noise.spread([1.0, 1.2, 0.8])
    c = noise.NoiseCheck("loss", 1.0, 1.0, spread, True, 1, level=0.99, interval=(0.0, 2.0), steps=(0, 2))
    distance = 0.9
    n = noise._seeds_needed(c, distance)
    assert n is not None and n > 3
    # Caught means MARGIN half-widths from the centre, not just outside (the proxy is rough: see noise.Power).
    half = lambda k: noise._t(k - 1, 0.5 + 0.99 / 2) * 0.2 * math.sqrt(1 + 1 / k)  # noqa: E731
    assert noise.MARGIN * half(n) <= distance < noise.MARGIN * half(n - 1)
    # A prediction interval never narrows below z x sd, however many seeds: then no number is advice.
    assert noise._seeds_needed(c, 0.75) is None


def test_claims_share_one_false_alarm_bound() -> None:
    assert noise.claims_level(1) == pytest.approx(0.95)
    assert noise.claims_level(10) == pytest.approx(1 - 0.05 / 10)
    values = [1.0, 1.1, 0.9, 1.05]
    one, ten = noise.another_mean(values), noise.another_mean(values, noise.claims_level(10))
    assert ten[0] < one[0] and one[1] < ten[1]


def test_the_cpu_kernel_level_is_recorded_and_breaks_bitwise() -> None:
    from harness.record.provenance import env_vars, torch_facts

    assert torch_facts()["cpu_capability"] not in ("", "unknown")
    assert env_vars({"ATEN_CPU_CAPABILITY": "default", "DNNL_MAX_CPU_ISA": "AVX2", "HOME": "/root"}) == {
        "ATEN_CPU_CAPABILITY": "default", "DNNL_MAX_CPU_ISA": "AVX2"}
    a = make_record("a")
    b = clone(a, "b")
    a.facts[tags.ENV_PREFIX + "cpu_capability"], b.facts[tags.ENV_PREFIX + "cpu_capability"] = "AVX512", "DEFAULT"
    b.facts[tags.VAR_PREFIX + "ATEN_CPU_CAPABILITY"] = "default"
    broken = {d.name: d.note for d in environment_delta(a, b) if d.breaks_bitwise}
    assert set(broken) == {tags.ENV_PREFIX + "cpu_capability", tags.VAR_PREFIX + "ATEN_CPU_CAPABILITY"}, broken
    assert "CPU kernel level changed" in broken[tags.ENV_PREFIX + "cpu_capability"]


# ---------------------------------------------------------------------------------------------
# End to end: one calibrated linear_ddp run, replayed as a user on another machine would.

@pytest.fixture(scope="module")
def calibrated(project) -> dict[str, str]:
    """`harness run experiments/linear_ddp train.epochs=1 --calibrate`: 5 steps, 8 members (the defaults)."""
    result = project.harness("run", "experiments/linear_ddp", "train.epochs=1", "train.lr=0.011", "--calibrate")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "calibrate " in result.stderr and ": 8 members x 5 steps = 40 training steps (the run took 5)" in result.stderr
    run_id = result.last_line
    calibration = next(r for r in project.all_runs() if r.data.tags.get(tags.CALIBRATION_OF) == run_id)
    return {"run": run_id, "calibration": calibration.info.run_id}


def _verdict(result) -> str:
    return result.stdout.strip().splitlines()[-2]


def test_runs_counts_a_calibration_on_its_run_and_no_member_as_a_verdict(project, calibrated) -> None:
    """The calibration and its 9 members (the reference and 8 nudged) are one cell of the run's row, not 10 rows; the
    members, never judged, are no verdict of the run's."""
    import json

    listed = project.cli("runs", "linear_ddp", "-n", "500", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = {row["run_id"]: row for row in json.loads(listed.stdout)["runs"]}
    assert rows[calibrated["run"]]["nested"].get("calibration") == 10, rows[calibrated["run"]]
    assert calibrated["calibration"] not in rows
    assert all(row["nested_under"] is None for row in rows.values())
    assert "FINISHED" not in (rows[calibrated["run"]]["verdicts"] or "")
    assert "FINISHED" not in project.client().get_run(calibrated["run"]).data.tags.get(tags.REPLAYS, "")
    every = project.cli("runs", "linear_ddp", "-n", "500", "--json", "--kind", "calibration")
    assert calibrated["calibration"] in {row["run_id"] for row in json.loads(every.stdout)["runs"]}


def test_a_calibration_is_a_sealed_run_of_nudged_members_nested_under_the_run(project, calibrated, tmp_path) -> None:
    client = project.client()
    cal = client.get_run(calibrated["calibration"])
    assert cal.info.status == "FINISHED" and cal.data.tags[tags.KIND] == tags.KIND_CALIBRATION
    assert cal.data.tags[tags.MLFLOW_PARENT_RUN_ID] == calibrated["run"] and cal.data.tags[tags.SEAL].startswith("v1:")
    assert (cal.data.tags[tags.CALIBRATION_MEMBERS], cal.data.tags[tags.CALIBRATION_STEPS]) == ("8", "5")
    assert float(cal.data.tags[tags.CALIBRATION_NUDGE]) == NUDGE == 256 * 2.0**-23
    members = [r for r in project.all_runs() if r.data.tags.get(tags.CALIBRATION) == calibrated["calibration"]]
    # Member 0 is the reference: the run itself, re-executed, not nudged; 1-8 are the nudged members.
    # The thread count varies only where this machine's cores hold 2 ranks on the other count (perturb.threads_vary):
    # on fewer, the members take the seeds whose kernels keep it.
    cores = len(os.sched_getaffinity(0))
    vary = threads_vary(2, 1, cores)
    seeds = member_seeds(8, vary)
    assert sorted(int(r.data.tags[tags.PERTURB_SEED]) for r in members) == [0, *seeds]
    assert all(r.data.tags[tags.SKETCH_AT] == "5" for r in members)
    assert all(r.data.tags[tags.MLFLOW_PARENT_RUN_ID] == calibrated["calibration"] and tags.VERDICT not in r.data.tags
               for r in members)
    # Each member also ran on its share of this machine's other kernels, and its record says which ran (rank 0's
    # read-back of the settings in force): the thread count doubled, oneDNN off, both, or the run's own.
    ran = {(r.data.tags[tags.CALIBRATION_KERNELS], r.data.tags[tags.DETERMINISM_PREFIX + "intra_op_threads"],
            r.data.tags[tags.DETERMINISM_PREFIX + "onednn_enabled"]) for r in members}
    threaded = {("other thread count", "2", "True"), ("oneDNN off + other thread count", "2", "False")}
    assert ran == {("the run's own kernels", "1", "True"), ("oneDNN off", "1", "False"), *(threaded if vary else ())}, ran
    doc = json.loads(open(client.download_artifacts(cal.info.run_id, tags.ARTIFACT_ENVELOPE, str(tmp_path))).read())
    assert doc["members"] == 8 and doc["steps"] == 5 and doc["weights_differed"] == 8 and doc["nudge"] == NUDGE
    # The reference re-executed the run bit for bit (same machine), and the weights' distance after the 5 steps is
    # each member's from the reference's, measured on their sketches: the nudge's size, and never zero (every member
    # started nudged).
    reference = next(r for r in members if r.data.tags[tags.PERTURB_SEED] == "0")
    assert doc["reference_bitwise"] is True and doc["weights"]["reference"] == reference.info.run_id
    assert doc["weights"]["step"] == 5 and len(doc["weights"]["distances"]) == 8
    assert all(0 < d < 4 * NUDGE for d in doc["weights"]["distances"]), doc["weights"]
    assert doc["weights"]["widest_tensor"] in ("module.bias", "module.weight", "bias", "weight")
    from harness.store.tracking import Tracker

    store = Tracker(project.uri)
    assert store.read_bytes(cal.info.run_id, tags.ARTIFACT_WEIGHTS_SKETCH) == \
        store.read_bytes(reference.info.run_id, tags.ARTIFACT_WEIGHTS_SKETCH)  # kept with the calibration, sealed
    # Every member started nudged: they differ from the run from step 0, and by the nudge's size only (a step where
    # all of them happened to round to the run's value is possible: the envelope keeps its earlier width there).
    deviation, original = doc["metrics"]["loss"]["deviation"], doc["metrics"]["loss"]["original"]
    assert deviation[0] > 0 and all(d < 4 * NUDGE * abs(o) for d, o in zip(deviation, original)), deviation


def test_other_cpu_kernels_are_within_rounding_and_a_2_percent_learning_rate_is_not(project, calibrated) -> None:
    other = project.harness("replay", calibrated["run"], env={"ATEN_CPU_CAPABILITY": "default"})
    assert other.returncode == 0, other.stdout + other.stderr
    line = _verdict(other)
    assert line.startswith(("verdict: WITHIN_ROUNDING: 1 metric x 5 steps not bit-identical, inside the rounding "
                            "envelope of 8 members over the first 5 steps", "verdict: BITWISE")), line
    replayed = project.client().get_run(other.last_line)
    assert replayed.data.tags[tags.VERDICT] in (Verdict.WITHIN_ROUNDING, "BITWISE")
    # The replay sketched its weights after the calibration's 5 steps and was held to the members' distances.
    assert replayed.data.tags[tags.SKETCH_AT] == "5"
    if line.startswith("verdict: WITHIN_ROUNDING"):
        assert "; the weights after step 5: relative distance " in line and "x the envelope's half-width" in line, line
    assert "harness.env.cpu_capability" in other.stdout  # the delta names the kernels that changed
    changed = project.harness("replay", calibrated["run"], "--allow-changes", "train.lr=0.01122")
    assert changed.returncode == 1, changed.stdout + changed.stderr
    line = _verdict(changed)
    # The learning rate is a value neither rounding nor a seed moves: it decides, and the envelope is not consulted.
    assert line == "verdict: DIVERGED at step 0: harness.lr 0.011 vs 0.0112 (abs 0.00022, rel 0.02)", line
    assert "envelope" not in line, line
    assert "Note: harness.lr differs at step 0: a value neither rounding nor a seed moves decides the verdict; not " \
           "judged against the rounding envelope of calibration " in changed.stdout, changed.stdout
    assert "A bitwise match is impossible" not in changed.stdout  # the same machine: only the config changed


def test_an_edited_envelope_is_refused(project, calibrated) -> None:
    client = project.client()
    client.set_tag(calibrated["calibration"], tags.CALIBRATION_STEPS, "50")
    try:
        # A replay that is not bit-identical consults the envelope (a bitwise one needs none).
        result = project.harness("replay", calibrated["run"], "--steps", "2", "--allow-changes", "train.lr=0.01122")
        assert result.returncode == 2, result.stdout + result.stderr
        assert f"run {calibrated['calibration']} was changed after it was sealed: tag {tags.CALIBRATION_STEPS}" \
            in result.stderr, result.stderr
        # Refused before the replay ran: nothing was recorded for it.
        assert not [r for r in project.all_runs() if r.data.tags.get(tags.REPLAY_STEPS) == "2"
                    and r.data.tags.get(tags.CHANGES) == "train.lr=0.01122"]
    finally:
        client.set_tag(calibrated["calibration"], tags.CALIBRATION_STEPS, "5")


def test_calibrate_refuses_bad_input_before_recording(project, calibrated) -> None:
    before = len(project.all_runs())
    for args, said in ((["--members", "1"], "--members 1: a calibration takes 2 to 32 members"),
                       (["--steps", "0"], "--steps 0: a calibration re-executes at least 1 step"),
                       (["--steps", "6"], "--steps 6: run "),):
        result = project.cli("calibrate", calibrated["run"], *args)
        assert result.returncode == 2 and said in result.stderr, result.stderr
    cal = project.cli("calibrate", calibrated["calibration"])
    assert cal.returncode == 2 and "is a calibration (harness calibrate) of run" in cal.stderr
    study = project.cli("run", "experiments/linear_ddp", "--seeds", "3", "--calibrate")
    assert study.returncode == 2 and "--calibrate calibrates one run" in study.stderr
    assert len(project.all_runs()) == before


def test_a_bundle_carries_the_calibration_and_the_imported_run_is_judged_by_it(project, calibrated, tmp_path) -> None:
    from harness.record.calibration import envelope_of
    from harness.store.tracking import Tracker

    archive = tmp_path / "run.tar.gz"
    exported = project.harness("export", calibrated["run"], "-o", str(archive))
    assert exported.returncode == 0, exported.stderr
    other = f"sqlite:///{tmp_path / 'other.db'}"
    imported = project.harness("import", str(archive), "--tracking-uri", other, cwd=tmp_path)
    assert imported.returncode == 0, imported.stderr
    envelope = envelope_of(Tracker(other), imported.last_line)
    assert envelope is not None and envelope.run_id == imported.last_line and envelope.members == 8
    assert envelope.weights is not None and Tracker(other).read_bytes(envelope.calibration_id,
                                                                      tags.ARTIFACT_WEIGHTS_SKETCH) is not None
    assert envelope.calibration_id != calibrated["calibration"]  # the copy in this store, as its id here


def test_ctrl_c_during_a_calibration_marks_it_killed_and_exits_130(project, tmp_path) -> None:
    import contextlib
    import os
    import signal
    import time

    from snippets import crash_experiment

    # 30 steps of 0.1 s: each member trains for 3 s, a window the signal cannot miss.
    exp, train = crash_experiment(project, "crashing", steps=30, fail_rank=-1, fail_step=-1, sleep=0.1)
    env = {"PID_DIR": str(tmp_path)}
    run = project.harness("run", exp, train, env=env)
    assert run.returncode == 0, run.stderr
    pid = tmp_path / "rank0"
    pid.unlink()
    proc = project.popen("calibrate", run.last_line, "--members", "2", "--steps", "29", env=env)
    deadline = time.monotonic() + 120
    # The members run one after another in the same ranks, each train() writing rank 0's pid file as it starts: the
    # second write is member 1's start.
    starts: set[int] = set()
    while len(starts) < 2:
        with contextlib.suppress(FileNotFoundError):
            starts.add(pid.stat().st_mtime_ns)
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "member 1 never started"
        time.sleep(0.05)
    time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: the whole foreground group
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    # Said before the cost is paid: the step the envelope will not cover.
    assert ("; a replay's step 29 is held to the envelope carried forward at the members' growth rate (--steps 30 "
            "measures the whole run)") in err, err
    assert "interrupted by SIGINT while member 1 ran: it is marked KILLED and records no envelope. Run harness " \
           f"calibrate {run.last_line} again." in err, err
    killed = [r for r in project.all_runs() if r.data.tags.get(tags.CALIBRATION_OF) == run.last_line]
    assert [r.info.status for r in killed] == ["KILLED"]
    its_members = [r for r in project.all_runs() if r.data.tags.get(tags.CALIBRATION) == killed[0].info.run_id]
    # The reference ran, member 1 was killed; member 2, recorded with them, never started and says so.
    assert sorted(r.info.status for r in its_members) == ["FINISHED", "KILLED", "KILLED"]
    never = next(r for r in its_members if r.data.tags[tags.PERTURB_SEED] == "2")
    assert never.data.tags[tags.STATUS_REASON] == "never started: interrupted while calibration member 1 ran"


def test_members_vary_the_thread_count_only_where_the_cores_hold_it() -> None:
    """2 ranks of 1 thread on 2 cores: another thread count (2 each) would oversubscribe them, so the members take
    the seeds whose kernels keep it - still half of them with oneDNN off; on 4 cores they vary it in turn."""
    assert threads_vary(2, 1, 4) and not threads_vary(2, 1, 2) and threads_vary(2, 4, 4)
    assert member_seeds(8, True) == list(range(1, 9))
    kept = member_seeds(8, False)
    assert len(kept) == 8 == len(set(kept)) and not any(kernels_of(s).other_threads for s in kept)
    assert {kernels_of(s).onednn_off for s in kept} == {True, False}, kept
