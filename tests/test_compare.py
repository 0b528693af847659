"""Tests for the replay verdict logic and its reports, on synthetic run records."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from records import FACTS, LOCK, clone, make_record, tol

from harness import tags
from harness.errors import HarnessError
from harness.judge.compare import Comparison, compare_runs
from harness.judge.delta import environment_delta
from harness.judge.report import plot_metrics, render_markdown
from harness.judge.text import comparison_lines
from harness.judge.tolerance import format_tolerances, judged_tolerance, parse_tolerances
from harness.judge.verdicts import Verdict


def test_identical_runs_are_bitwise() -> None:
    a = make_record()
    b = clone(a)
    b.facts[tags.KIND] = "replay"  # role tags are not facts
    b.facts[tags.REPLAY_OF] = a.run_id
    cmp = compare_runs(a, b)
    assert cmp.verdict == Verdict.BITWISE
    assert cmp.exit_code == 0
    assert cmp.bitwise_possible and cmp.bitwise_blockers == []
    assert cmp.delta == []
    assert cmp.divergence is None
    assert cmp.fingerprints.compared == 3 and cmp.fingerprints.equal == 3
    assert all(m.bitwise_equal and m.steps_compared == 20 for m in cmp.metrics)
    assert cmp.summary() == "BITWISE: 2 metrics x 20 steps bit-identical, 3 fingerprints equal"


def test_one_ulp_at_step_7_with_zero_tolerance_diverges() -> None:
    a = make_record()
    b = clone(a)
    orig = a.metrics["loss"][1][7]
    b.metrics["loss"][1][7] = np.nextafter(orig, np.inf)
    b.final_fingerprint = "e" * 64  # a loss that parted parts the weights
    cmp = compare_runs(a, b)
    assert cmp.verdict == Verdict.DIVERGED and cmp.exit_code == 1
    d = cmp.divergence
    assert d is not None
    assert (d.kind, d.step, d.metric) == ("value", 7, "loss")
    assert d.original == orig and d.replay == np.nextafter(orig, np.inf)
    ulp = np.nextafter(orig, np.inf) - orig
    assert d.abs_diff == ulp
    assert d.rel_diff == pytest.approx(ulp / abs(orig), rel=1e-12)
    loss = next(m for m in cmp.metrics if m.name == "loss")
    assert loss.first_divergence == 7 and not loss.bitwise_equal and loss.max_abs_diff == ulp
    acc = next(m for m in cmp.metrics if m.name == "acc")
    assert acc.first_divergence is None and acc.bitwise_equal
    assert cmp.summary().startswith("DIVERGED at step 7: loss 0.125 vs 0.12500000000000003")


def test_one_ulp_within_atol() -> None:
    a = make_record()
    b = clone(a)
    b.metrics["loss"][1][7] = np.nextafter(a.metrics["loss"][1][7], np.inf)
    cmp = compare_runs(a, b, tolerance=tol(atol=1e-12))
    assert cmp.verdict == Verdict.WITHIN_TOLERANCE and cmp.exit_code == 0
    assert cmp.divergence is None
    # Same records judged with the tolerance stored in the original's config.
    a.config = {"replay": {"tolerance": tol(atol=1e-12)}}
    assert compare_runs(a, b).verdict == Verdict.WITHIN_TOLERANCE


def test_per_metric_tolerance_overrides_default() -> None:
    a = make_record()
    b = clone(a)
    b.metrics["acc"][1][:] += 1e-3
    # Default would pass it, the stricter per-metric entry must not (where the weights parted too).
    cmp = compare_runs(a, clone(b, final_fingerprint="e" * 64),
                       tolerance=tol(atol=1e-2, metrics={"acc": {"rtol": 0.0, "atol": 1e-6}}))
    assert cmp.verdict == Verdict.DIVERGED
    assert (cmp.divergence.metric, cmp.divergence.step) == ("acc", 0)
    # And the other way round: a loose per-metric entry beats a zero default.
    cmp = compare_runs(a, b, tolerance=tol(metrics={"acc": {"rtol": 0.0, "atol": 1e-2}}))
    assert cmp.verdict == Verdict.WITHIN_TOLERANCE
    acc = next(m for m in cmp.metrics if m.name == "acc")
    assert acc.atol == 1e-2 and acc.max_abs_diff == pytest.approx(1e-3)


def test_relative_tolerance_uses_original_magnitude() -> None:
    a = make_record(metrics={"x": (np.arange(3), np.array([100.0, 100.0, 100.0]))})
    b = clone(a)
    b.metrics["x"][1][:] = [100.5, 101.0, 101.5]
    cmp = compare_runs(a, b, tolerance=tol(rtol=0.01))
    assert cmp.verdict == Verdict.DIVERGED
    assert cmp.divergence.step == 2 and cmp.divergence.rel_diff == pytest.approx(0.015)


def test_missing_step_diverges_at_that_step() -> None:
    a = make_record()
    b = clone(a)
    s, v = b.metrics["acc"]
    b.metrics["acc"] = (np.delete(s, 12), np.delete(v, 12))
    cmp = compare_runs(a, b, tolerance=tol(atol=1.0))
    assert cmp.verdict == Verdict.DIVERGED
    d = cmp.divergence
    assert (d.kind, d.step, d.metric) == ("missing_step", 12, "acc")
    assert d.original == a.metrics["acc"][1][12] and d.replay is None
    acc = next(m for m in cmp.metrics if m.name == "acc")
    assert acc.steps_compared == 19 and acc.missing_steps == 1


def test_extra_step_diverges() -> None:
    a = make_record()
    b = clone(a)
    s, v = b.metrics["loss"]
    b.metrics["loss"] = (np.append(s, 25), np.append(v, 0.5))
    cmp = compare_runs(a, b)
    assert (cmp.divergence.kind, cmp.divergence.step) == ("extra_step", 25)


def test_earliest_step_wins_then_metric_name() -> None:
    a = make_record()
    b = clone(a)
    b.metrics["loss"][1][5] += 1.0
    b.metrics["acc"][1][9] += 1.0
    assert compare_runs(a, b).divergence.metric == "loss"
    b.metrics["acc"][1][5] += 1.0  # tie at step 5: "acc" < "loss"
    d = compare_runs(a, b).divergence
    assert (d.metric, d.step) == ("acc", 5)


def test_extra_metric_diverges() -> None:
    a = make_record()
    b = clone(a)
    b.metrics["lr"] = (np.arange(3, 20, dtype=np.int64), np.full(17, 0.1))
    cmp = compare_runs(a, b, tolerance=tol(atol=1.0))
    assert cmp.verdict == Verdict.DIVERGED
    assert (cmp.divergence.kind, cmp.divergence.metric, cmp.divergence.step) == ("extra_metric", "lr", 3)
    c = clone(a)
    del c.metrics["acc"]
    cmp = compare_runs(a, c, tolerance=tol(atol=1.0))
    assert (cmp.divergence.kind, cmp.divergence.metric, cmp.divergence.step) == ("missing_metric", "acc", 0)


def test_a_metric_with_no_common_step_says_so_with_both_step_lists() -> None:
    """Not "0 steps, max abs diff nan, ..., first divergence 101": where each run logged it, abbreviated."""
    a = make_record()
    a.metrics["test_loss"] = (np.arange(0, 101, dtype=np.int64), np.zeros(101))
    b = clone(a)
    b.metrics["test_loss"] = (np.array([101], dtype=np.int64), np.zeros(1))
    del b.metrics["acc"]
    cmp = compare_runs(a, b)
    lines = comparison_lines(cmp, [])
    assert "  test_loss: no common step: logged by run A at steps 0-100, run B at step 101; step 0 logged only by run A" \
        in lines, lines
    assert "  acc: no common step: logged by run A at steps 0-19, run B not at all; step 0 logged only by run A" in lines, lines
    assert not any("nan" in line for line in lines), lines
    b.metrics["test_loss"] = (np.arange(101, 1101, 2, dtype=np.int64), np.zeros(500))
    lines = comparison_lines(compare_runs(a, b), [])
    assert any(line.startswith("  test_loss: no common step") and "run B at steps 101, 103, 105, ... (500 steps)"
               in line for line in lines), lines


def test_differing_fingerprints_diverge_unless_the_tolerance_lets_weights_differ() -> None:
    a = make_record()
    b = clone(a)
    b.fingerprints[10] = "2" * 64
    cmp = compare_runs(a, b)
    assert cmp.verdict == Verdict.DIVERGED
    assert (cmp.divergence.kind, cmp.divergence.step) == ("fingerprint", 10)
    assert cmp.fingerprints.first_mismatch_step == 10 and cmp.fingerprints.equal == 2
    # Other weights are never within a tolerance set for the metrics, even with every value bit-identical.
    loose = compare_runs(a, b, tolerance=tol(rtol=1e-3, atol=1e-3))
    assert loose.verdict == Verdict.DIVERGED and loose.divergence.kind == "fingerprint" and loose.exit_code == 1
    # Only weights=any (config replay.tolerance.weights, or --tolerance weights=any) leaves them to the metrics.
    allowed = compare_runs(a, b, tolerance={**tol(rtol=1e-9), "weights": "any"})
    assert allowed.verdict == Verdict.WITHIN_TOLERANCE and allowed.exit_code == 0
    assert "2/3 fingerprints equal (weights may differ: weights=any)" in allowed.summary()
    a.config = {"replay": {"tolerance": {"default": {"rtol": 1e-9, "atol": 0.0}, "metrics": {}, "weights": "any"}}}
    assert compare_runs(a, b).verdict == Verdict.WITHIN_TOLERANCE
    assert compare_runs(a, b, tolerance=judged_tolerance(a, b, parse_tolerances(["weights=exact"]))).verdict == Verdict.DIVERGED


def test_values_within_tolerance_with_other_weights_diverge_and_say_how_to_let_the_metrics_decide() -> None:
    a = make_record()
    b = clone(a, final_fingerprint="e" * 64)
    b.metrics["loss"][1][7] = np.nextafter(a.metrics["loss"][1][7], np.inf)
    cmp = compare_runs(a, b, tolerance=tol(atol=1e-9))
    assert cmp.verdict == Verdict.DIVERGED and cmp.divergence.kind == "fingerprint"
    assert "weights=any would let the metrics decide" in cmp.summary()


def test_final_fingerprint_mismatch_blocks_bitwise() -> None:
    a = make_record()
    b = clone(a, final_fingerprint="e" * 64)
    cmp = compare_runs(a, b)
    assert cmp.verdict == Verdict.DIVERGED and cmp.divergence.kind == "fingerprint"
    assert cmp.fingerprints.final_equal is False and cmp.divergence.step is None


def test_bit_identical_despite_a_world_size_change_is_bitwise_and_lists_it() -> None:
    a = make_record()
    b = clone(a)
    b.facts[tags.WORLD_SIZE] = "4"
    cmp = compare_runs(a, b)
    # What was observed decides: every value and fingerprint bit-identical is BITWISE, the change beside it.
    assert cmp.verdict == Verdict.BITWISE and cmp.exit_code == 0
    assert cmp.summary() == (f"BITWISE: 2 metrics x 20 steps bit-identical, 3 fingerprints equal; "
                             f"bitwise despite 1 environment change: {tags.WORLD_SIZE}")
    assert any(line.startswith("Bitwise despite environment changes") for line in comparison_lines(cmp, []))
    assert "**Bitwise despite**" in render_markdown(cmp, [])
    # A value one ulp off is judged by tolerance then, and says why bitwise was not to be expected.
    near_b = clone(b)
    near_b.metrics["loss"][1][7] = np.nextafter(a.metrics["loss"][1][7], np.inf)
    near = compare_runs(a, near_b, tolerance=tol(atol=1e-9))
    assert near.verdict == Verdict.WITHIN_TOLERANCE and "bitwise impossible (1 environment change)" in near.summary()
    assert cmp.bitwise_possible is False
    assert [d.name for d in cmp.delta] == [tags.WORLD_SIZE]
    d = cmp.delta[0]
    assert (d.a, d.b, d.breaks_bitwise) == ("2", "4", True)
    assert "world size" in d.note
    assert len(cmp.bitwise_blockers) == 1 and tags.WORLD_SIZE in cmp.bitwise_blockers[0]


def test_delta_rules_and_order() -> None:
    a = make_record()
    b = clone(a)
    b.facts[tags.ENV_PREFIX + "hostname"] = "box-b"
    b.facts[tags.GIT_COMMIT] = "b" * 40
    b.facts[tags.DETERMINISM_PREFIX + "level"] = "off"
    b.facts[tags.VAR_PREFIX + "NCCL_DEBUG"] = "INFO"
    b.facts[tags.VERDICT] = "BITWISE"  # outcome, not a fact
    delta = {d.name: d for d in environment_delta(a, b)}
    assert list(delta) == sorted(delta)
    assert tags.VERDICT not in delta
    assert delta[tags.ENV_PREFIX + "hostname"].breaks_bitwise is False
    assert delta[tags.GIT_COMMIT].breaks_bitwise is False and delta[tags.GIT_COMMIT].note == "code differs"
    assert delta[tags.DETERMINISM_PREFIX + "level"].breaks_bitwise is True
    var = delta[tags.VAR_PREFIX + "NCCL_DEBUG"]
    assert (var.a, var.b, var.breaks_bitwise) == (None, "INFO", False)


def test_harness_own_bookkeeping_is_never_in_the_environment_delta() -> None:
    # A replay of a calibrated run sketches its weights after the calibration's steps (harness.weights.sketch_at),
    # and stops where asked: what harness did with the run, not what it ran under. It printed
    # "Environment delta: harness.weights.sketch_at: None -> 50 (differs)" on a BITWISE replay.
    from harness.runtime.plan import LaunchPlan

    a = make_record()
    a.facts[tags.CALIBRATION_MEMBERS] = "4"
    b = clone(a)
    b.facts.update(LaunchPlan(stop_at=50, sketch_at=50).tags())
    b.facts.update({tags.REPLAY_OF: a.run_id, tags.KIND: tags.KIND_REPLAY, tags.STUDY_REPLAY: "s" * 32})
    assert environment_delta(a, b) == []
    lines = comparison_lines(compare_runs(a, b), [])
    assert "Environment delta: none" in lines, lines
    # The nudge of a calibration member changes its arithmetic: it is a condition, and stays in the delta.
    b.facts.update(LaunchPlan(perturb_seed=3).tags())
    assert [d.name for d in environment_delta(a, b)] == [tags.PERTURB_SEED]
    assert set(LaunchPlan(stop_at=1, sketch_at=1).tags()) <= tags.BOOKKEEPING


def test_a_run_on_the_host_proves_nothing_about_an_image_either_way() -> None:
    host = make_record()
    host.facts.update({tags.IMAGE: "localhost:5000/harness-cpu:0.1", tags.IMAGE_DIGEST: tags.HOST})
    inside = clone(host)
    inside.facts[tags.IMAGE_DIGEST] = "sha256:" + "d" * 64
    [d] = environment_delta(host, inside)
    assert (d.name, d.breaks_bitwise) == (tags.IMAGE_DIGEST, False) and "library versions decide" in d.note
    # Both on the host: the image they name is in neither run, so another name changes nothing.
    other = clone(host)
    other.facts[tags.IMAGE] = "localhost:5000/harness-cpu:0.2"
    [d] = environment_delta(host, other)
    assert (d.name, d.breaks_bitwise) == (tags.IMAGE, False)
    # Two images, both unknown (records made before "host"): the reference is the only evidence, as it was.
    a, b = clone(host), clone(other)
    a.facts[tags.IMAGE_DIGEST] = b.facts[tags.IMAGE_DIGEST] = "unknown"
    assert [d.breaks_bitwise for d in environment_delta(a, b)] == [True]


def test_replay_failed_diverges_but_keeps_metric_table() -> None:
    a = make_record()
    b = clone(a, status="FAILED")
    b.metrics = {k: (s[:8], v[:8]) for k, (s, v) in b.metrics.items()}
    cmp = compare_runs(a, b, replay_failed="rank 1 raised RuntimeError")
    assert cmp.verdict == Verdict.DIVERGED and cmp.exit_code == 1
    assert cmp.divergence.kind == "replay_failed"
    assert "rank 1 raised RuntimeError" in cmp.divergence.detail
    assert cmp.divergence.step == 8  # where the logged metrics stop
    assert [m.steps_compared for m in cmp.metrics] == [8, 8]
    assert all(m.max_abs_diff == 0.0 for m in cmp.metrics)
    # A non-FINISHED status alone is enough.
    c = clone(a, status="KILLED")
    cmp = compare_runs(a, c)
    assert cmp.verdict == Verdict.DIVERGED and "KILLED" in cmp.divergence.detail


def test_nan_matches_nan_but_not_a_number() -> None:
    a = make_record()
    a.metrics["loss"][1][3] = np.nan
    b = clone(a)
    cmp = compare_runs(a, b)
    assert cmp.verdict == Verdict.BITWISE
    b.metrics["loss"][1][3] = 0.25
    b.final_fingerprint = "e" * 64
    cmp = compare_runs(a, b, tolerance=tol(rtol=1.0, atol=1.0))
    assert cmp.verdict == Verdict.DIVERGED
    assert (cmp.divergence.step, cmp.divergence.metric) == (3, "loss")
    assert math.isnan(cmp.divergence.original) and cmp.divergence.replay == 0.25


def test_infinite_values() -> None:
    a = make_record(metrics={"x": (np.arange(3), np.array([1.0, np.inf, 2.0]))})
    b = clone(a)
    assert compare_runs(a, b).verdict == Verdict.BITWISE
    b.metrics["x"][1][1] = 1e300
    # rtol * |inf| is inf, but an infinite difference must still fail.
    assert compare_runs(a, b, tolerance=tol(rtol=0.5)).verdict == Verdict.DIVERGED


def test_negative_zero_is_within_tolerance_not_bitwise() -> None:
    a = make_record(metrics={"x": (np.arange(4), np.array([1.0, 0.0, 2.0, 3.0]))})
    b = clone(a)
    b.metrics["x"][1][1] = -0.0
    cmp = compare_runs(a, b)
    assert cmp.verdict == Verdict.WITHIN_TOLERANCE
    assert cmp.metrics[0].bitwise_equal is False and cmp.metrics[0].max_abs_diff == 0.0


def test_rel_diff_is_inf_when_original_is_zero() -> None:
    a = make_record(metrics={"x": (np.arange(2), np.array([0.0, 1.0]))})
    b = clone(a)
    b.metrics["x"][1][0] = 1e-3
    d = compare_runs(a, b).divergence
    assert d.abs_diff == 1e-3 and d.rel_diff == math.inf


def test_lock_delta_names_changed_package() -> None:
    a = make_record()
    b = clone(a, lock=["numpy==2.2.0", "torch==2.13.0", "tqdm==4.66.0", "rich==13.0"])
    delta = {d.name: d for d in environment_delta(a, b)}
    assert set(delta) == {"lock:numpy", "lock:rich"}
    assert (delta["lock:numpy"].a, delta["lock:numpy"].b) == ("2.1.0", "2.2.0")
    assert (delta["lock:rich"].a, delta["lock:rich"].b) == (None, "13.0")
    c = clone(a, lock=["numpy==2.1.0", "torch==2.14.0", "tqdm==4.66.0"])
    torch_delta = [d for d in environment_delta(a, c) if d.name == "lock:torch"]
    assert len(torch_delta) == 1 and torch_delta[0].breaks_bitwise


def _env_lines(lines: list[str]) -> list[str]:
    at = next(i for i, line in enumerate(lines) if line.startswith("Environment delta"))
    return [line for line in lines[at + 1:] if line.startswith(("   ", " ! "))]


def test_packages_on_one_side_are_one_line_each_side() -> None:
    # `pip install -e '.[test]'` beside a run recorded without the test extra: 32 packages more in the replay.
    a = make_record(lock=[*LOCK, "left-behind==1.0", "gone-too==2.0"])
    extra = [f"extra-{i:02d}==1.{i}" for i in range(32)]
    b = clone(a, lock=[*LOCK, *extra, "nvidia-cublas==12.8"])
    b.facts[tags.REPLAY_OF] = a.run_id
    cmp = compare_runs(a, b)
    env = _env_lines(comparison_lines(cmp, []))
    assert len(env) == 3, env  # the 32, the 2, and the one that decides kernels; each where its first package stood
    assert env[0] == ("   lock: None -> 32 packages  (only in the replay: extra-00 1.0, extra-01 1.1, extra-02 1.2, "
                      "extra-03 1.3, extra-04 1.4, extra-05 1.5, +26 more)")
    assert env[1] == "   lock: 2 packages -> None  (only in the original: gone-too 2.0, left-behind 1.0)"
    assert env[2] == " ! lock:nvidia-cublas: None -> 12.8  (package only in the replay: numerical kernels may differ)"
    markdown = render_markdown(cmp, [])
    assert "only in the replay: extra-00 1.0" in markdown and "lock:extra-07" not in markdown
    # The JSON keeps every package: a script reads them one by one.
    assert sum(d["name"].startswith("lock:extra-") for d in cmp.to_dict()["delta"]) == 32


def test_compare_of_two_independent_runs_names_them_run_a_and_run_b() -> None:
    a = make_record()
    b = clone(a, lock=[*LOCK, "rich==13.0", "pygments==2.0", "local-pkg @ file:///wheels/local_pkg-1.0.whl"])
    a.lock.append("click==8.4")
    text = "\n".join(comparison_lines(compare_runs(a, b), []))
    assert "replay" not in text and "original" not in text, text
    # b is no replay of a. A package installed from a URL is named, not its URL.
    assert "lock: None -> 3 packages  (only in run B: local-pkg, pygments 2.0, rich 13.0)" in text
    assert "lock:click: 8.4 -> None  (package only in run A)" in text


def test_to_dict_is_json_serialisable() -> None:
    a = make_record()
    b = clone(a)
    b.facts[tags.WORLD_SIZE] = "4"
    b.metrics["loss"][1][0] = np.nan
    a.metrics["acc"][1][0] = 0.0
    b.metrics["acc"][1][0] = 1.0  # rel diff inf
    cmp = compare_runs(a, b)
    text = json.dumps(cmp.to_dict(), allow_nan=False)
    back = json.loads(text)
    assert back["verdict"] == Verdict.DIVERGED and back["exit_code"] == 1
    assert back["bitwise_possible"] is False
    by_name = {m["name"]: m for m in back["metrics"]}
    assert by_name["loss"]["max_abs_diff"] == "nan"
    assert by_name["acc"]["max_rel_diff"] == "inf"
    assert back["divergence"]["step"] == 0 and back["divergence"]["rel_diff"] == "inf"
    assert back["delta"][0]["name"] == tags.WORLD_SIZE


def test_render_markdown_has_verdict_and_delta_table() -> None:
    a = make_record()
    b = clone(a)
    b.facts[tags.WORLD_SIZE] = "4"
    b.facts[tags.ENV_PREFIX + "hostname"] = "box|b"
    b.metrics["loss"][1][7] += 0.5
    b.final_fingerprint = "e" * 64
    cmp = compare_runs(a, b)
    md = render_markdown(cmp, changes=["world_size=4"])
    assert md.startswith("# Replay verdict: DIVERGED")
    assert cmp.summary() in md
    assert "## Environment delta" in md and "| Fact | Original | Replay | Note |" in md
    assert f"| **{tags.WORLD_SIZE}** (breaks bitwise) | `2` | `4` |" in md
    assert "box\\|b" in md  # a pipe in a value must not split the row
    assert "Bitwise impossible" in md
    assert "world_size=4" in md
    assert "| loss | 20 |" in md
    assert "7 (value)" in md
    md_ok = render_markdown(compare_runs(a, clone(a)))
    assert md_ok.startswith("# Replay verdict: BITWISE") and "No differences" in md_ok
    assert "Bitwise impossible" not in md_ok


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 5_000


def test_plot_metrics_writes_one_png_per_metric(tmp_path: Path) -> None:
    a = make_record()
    a.metrics["train/loss step"] = (np.arange(20, dtype=np.int64), np.cos(np.arange(20.0)))
    b = clone(a)
    b.metrics["loss"][1][7] += 0.5
    cmp = compare_runs(a, b)
    paths = plot_metrics(a, b, cmp, tmp_path / "plots")
    assert sorted(p.name for p in paths) == ["metric_acc.png", "metric_loss.png", "metric_train_loss_step.png"]
    for p in paths:
        _assert_png(p)
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == sorted(p.name for p in paths)


def test_plot_metrics_handles_metric_in_one_run_and_many_points(tmp_path: Path) -> None:
    n = 50_000
    steps = np.arange(n, dtype=np.int64)
    a = make_record(n=n, metrics={"loss": (steps, np.exp(-steps / 1e4))})
    b = clone(a)
    b.metrics["loss"][1][40_000:] *= 1.001
    b.metrics["extra"] = (steps[:10], np.ones(10))
    cmp = compare_runs(a, b)
    paths = plot_metrics(a, b, cmp, tmp_path)
    assert [p.name for p in paths] == ["metric_extra.png", "metric_loss.png"]
    for p in paths:
        _assert_png(p)


def test_unsorted_duplicate_steps_are_normalised() -> None:
    a = make_record(metrics={"x": (np.array([2, 0, 1, 1]), np.array([3.0, 1.0, 9.0, 2.0]))})
    b = make_record(run_id="r", metrics={"x": (np.array([0, 1, 2]), np.array([1.0, 2.0, 3.0]))})
    cmp = compare_runs(a, b)
    assert cmp.verdict == Verdict.BITWISE and cmp.metrics[0].steps_compared == 3


def test_large_comparison_finds_first_divergence() -> None:
    # Speed is measured in benchmarks/compare_bench.py, not asserted here (machines are noisy).
    n = 100_000
    steps = np.arange(n, dtype=np.int64)
    rng = np.random.default_rng(0)
    metrics = {f"m{i}": (steps.copy(), rng.standard_normal(n)) for i in range(4)}
    a = make_record(n=n, metrics=metrics)
    b = clone(a)
    b.metrics["m3"][1][90_000] += 1.0
    s, v = b.metrics["m2"]
    b.metrics["m2"] = (np.delete(s, 95_000), np.delete(v, 95_000))
    cmp: Comparison = compare_runs(a, b)
    assert (cmp.divergence.metric, cmp.divergence.step) == ("m3", 90_000)


def _nan(payload: int, negative: bool = False) -> float:
    bits = 0x7FF8000000000000 | payload | (1 << 63 if negative else 0)
    return float(np.array([bits], dtype=np.uint64).view(np.float64)[0])


def test_nan_with_other_payload_and_inf_are_bitwise() -> None:
    x = np.array([1.0, _nan(0), np.inf, -np.inf, 0.5])
    a = make_record(metrics={"x": (np.arange(5), x)})
    b = clone(a)
    b.metrics["x"][1][1] = _nan(0x1234, negative=True)  # another payload and sign: still NaN
    assert b.metrics["x"][1][1:2].view(np.int64)[0] != a.metrics["x"][1][1:2].view(np.int64)[0]
    cmp = compare_runs(a, b)
    assert cmp.verdict == Verdict.BITWISE and cmp.metrics[0].bitwise_equal
    assert cmp.summary().startswith("BITWISE: 1 metric x 5 steps bit-identical")
    b.metrics["x"][1][2] = -np.inf  # inf != -inf
    assert compare_runs(a, b, tolerance=tol(rtol=1.0, atol=1.0)).divergence.step == 2


def test_clamped_history_values_are_never_bitwise() -> None:
    big = np.finfo(np.float64).max  # what MLflow's SQL store makes of inf
    a = make_record(metrics={"x": (np.arange(3), np.array([1.0, big, 2.0]))})
    a.metrics_exact = False  # read from MLflow's history: series.npz was missing
    b = clone(a)
    cmp = compare_runs(a, b)
    assert cmp.verdict == Verdict.WITHIN_TOLERANCE and not cmp.metrics[0].bitwise_equal
    assert cmp.notes == [f"metrics of run A {a.run_id} were read from MLflow's metric history "
                         "(metrics/series.npz is missing), which stores +-inf as +-1.8e308: such values are not "
                         "counted as bit-identical"]
    exact = make_record(metrics={"x": (np.arange(3), np.array([1.0, 3.0, 2.0]))})
    exact.metrics_exact = False  # history without clamped values is exact: BITWISE stays possible
    assert compare_runs(exact, clone(exact)).verdict == Verdict.BITWISE


def test_nothing_to_compare_is_not_a_pass() -> None:
    a = make_record(metrics={}, fingerprints={}, final=None)
    cmp = compare_runs(a, clone(a))
    assert Verdict.NOTHING_TO_COMPARE in tuple(Verdict)
    assert cmp.verdict == Verdict.NOTHING_TO_COMPARE and cmp.exit_code == 1
    assert cmp.summary() == (
        "NOTHING_TO_COMPARE: there was nothing to compare (no metrics, no fingerprints): "
        "log metrics with ctx.log and register the model with ctx.ddp"
    )
    assert json.loads(json.dumps(cmp.to_dict()))["verdict"] == Verdict.NOTHING_TO_COMPARE
    assert render_markdown(cmp).startswith("# Replay verdict: NOTHING_TO_COMPARE")
    # A fingerprint alone is something to compare.
    alone = make_record(metrics={}, fingerprints={})
    assert compare_runs(alone, clone(make_record(metrics={}, fingerprints={}))).verdict == Verdict.BITWISE


def test_weights_that_never_changed_are_said_next_to_the_verdict() -> None:
    a = make_record(metrics={"loss": (np.arange(160), np.ones(160))}, fingerprints={0: "0" * 64})
    a.facts[tags.WEIGHTS_CHANGED] = "false"
    a.facts[tags.INITIAL_FINGERPRINT] = "f" * 64
    b = clone(a)
    b.facts[tags.REPLAY_OF] = a.run_id
    cmp = compare_runs(a, b)
    assert cmp.delta == []  # outcome tags are no environment facts
    assert cmp.summary() == ("BITWISE: 1 metric x 160 steps bit-identical, 2 fingerprints equal - but the model's "
                             "weights never changed: nothing was trained")
    assert "weights never changed" in render_markdown(cmp)
    b.facts[tags.WEIGHTS_CHANGED] = "true"
    assert compare_runs(a, b).summary().endswith("but the original's model weights never changed: nothing was trained in it")
    assert compare_runs(clone(a, facts=FACTS), clone(a, facts=FACTS)).summary().endswith("fingerprints equal")


def test_config_delta_lists_every_key_and_marks_the_harmless_ones() -> None:
    a = make_record()
    a.config = {"world_size": 2, "device": "auto", "flush_interval_s": 2.0,
                "train": {"lr": 0.01, "batch_size": 10}, "replay": {"tolerance": tol()}}
    b = clone(a)
    b.config = {"world_size": 2, "device": "cpu", "flush_interval_s": 5.0,
                "train": {"lr": 0.02, "batch_size": 10}, "replay": {"tolerance": tol(atol=1.0)}}
    cmp = compare_runs(a, b)
    got = {c.key: (c.a, c.b, c.affects_result) for c in cmp.config_delta}
    # "auto" resolved to what the run recorded (cpu) is no change.
    assert got == {
        "flush_interval_s": ("2.0", "5.0", False),
        "replay.tolerance.default.atol": ("0.0", "1.0", False),
        "train.lr": ("0.01", "0.02", True),
    }
    assert cmp.to_dict()["config_delta"][2] == {"key": "train.lr", "a": "0.01", "b": "0.02", "affects_result": True}
    md = render_markdown(cmp)
    assert "## Config delta" in md and "| `train.lr` | `0.01` | `0.02` | yes |" in md
    assert md.index("## Config delta") < md.index("## Environment delta")


def test_incomplete_original_is_judged_up_to_where_it_stopped() -> None:
    full = make_record(n=20, fingerprints={0: "0" * 64, 10: "1" * 64, 15: "2" * 64})
    failed = clone(full, run_id="orig0000", status="FAILED", final_fingerprint=None,
                  fingerprints={0: "0" * 64, 10: "1" * 64})
    failed.metrics = {k: (s[:12], v[:12]) for k, (s, v) in full.metrics.items()}  # died after step 11
    replay = clone(full)
    replay.facts[tags.REPLAY_OF] = failed.run_id
    cmp = compare_runs(failed, replay, incomplete_original=True)
    assert cmp.verdict == Verdict.BITWISE, cmp.summary()
    assert cmp.summary() == ("BITWISE: 2 metrics x 12 steps bit-identical, 2 fingerprints equal "
                             "(compared the 12 steps the FAILED original reached)")
    assert compare_runs(failed, replay).verdict == Verdict.DIVERGED  # without it, the missing steps count
    replay.metrics["loss"][1][11] += 1e-9
    assert compare_runs(failed, replay, incomplete_original=True).divergence.step == 11


def test_a_failure_that_recurs_the_same_way_is_reproduced() -> None:
    full = make_record(n=20, fingerprints={0: "0" * 64, 10: "1" * 64})
    reason = "rank 0 raised: ValueError: boom at step 12 (train.py, line 16)"
    failed = clone(full, run_id="orig0000", status="FAILED", final_fingerprint=None)
    failed.facts[tags.STATUS_REASON] = reason
    failed.metrics = {k: (s[:12], v[:12]) for k, (s, v) in full.metrics.items()}
    replay = clone(failed)
    replay.facts[tags.REPLAY_OF] = failed.run_id
    cmp = compare_runs(failed, replay, replay_failed=f"the replay FAILED: {reason}", incomplete_original=True)
    assert cmp.verdict == Verdict.BITWISE and cmp.failed_alike, cmp.summary()
    assert cmp.summary().endswith("(compared the 12 steps the FAILED original reached; the replay failed the same way)")
    assert f"the replay failed as the original did: {reason}" in cmp.notes
    # Another reason is a divergence, even over identical steps.
    replay.facts[tags.STATUS_REASON] = "rank 1 was killed by SIGKILL"
    other = compare_runs(failed, replay, replay_failed="the replay FAILED: rank 1 was killed by SIGKILL",
                         incomplete_original=True)
    assert other.verdict == Verdict.DIVERGED and other.summary().startswith("DIVERGED: replay failed: the replay FAILED")


def test_two_plain_runs_are_named_run_a_and_run_b() -> None:
    a = make_record(n=10)
    b = clone(a, run_id="runb0000")
    b.metrics = {k: (s[:8], v[:8]) for k, (s, v) in a.metrics.items()}
    cmp = compare_runs(a, b)
    assert cmp.verdict == Verdict.DIVERGED and not cmp.of_replay
    assert "logged by run A but not by run B" in cmp.summary(), cmp.summary()


@pytest.mark.parametrize("spec", ["weights=maybe", "weights=", "weights=1e-3"])
def test_weights_tolerance_takes_any_or_exact_once(spec: str) -> None:
    with pytest.raises(HarnessError, match=r"weights take 'any' .* or 'exact', once"):
        parse_tolerances([spec])
    with pytest.raises(HarnessError, match="once"):
        parse_tolerances(["weights=any", "weights=exact"])
    given = parse_tolerances(["loss=1e-3", "weights=any"])
    assert format_tolerances(given) == "loss=0.001,0.0 weights=any"
    assert parse_tolerances(format_tolerances(given).split()) == given  # the tag reads back as given


def test_data_order_tells_a_data_change_from_an_arithmetic_one() -> None:
    a = make_record()
    a.data_order = {s: f"{s:016x}" for s in range(20)}
    b = clone(a)
    b.data_order = dict(a.data_order)
    b.metrics["loss"][1][7] = np.nextafter(a.metrics["loss"][1][7], np.inf)
    b.final_fingerprint = "e" * 64
    same = compare_runs(a, b)
    assert same.verdict == Verdict.DIVERGED and same.data_order.first_diff_step is None
    assert "data order: identical at the 20 common steps" in comparison_lines(same, [])[-1]
    b.data_order[5] = "f" * 16
    moved = compare_runs(a, b)
    assert moved.data_order.first_diff_step == 5 and "data order: first differs at step 5" in moved.data_order.describe()
    assert "## Data order" in render_markdown(moved, [])
    b.data_order = {}
    assert "not recorded by run B" in compare_runs(a, b).data_order.describe()
    a.data_order = {}
    assert compare_runs(a, b).data_order is None  # neither recorded one: nothing is said


# -- GPU facts, numerics variables and NCCL's configuration files (issue 23) ------------------------------------
# Records made by hand: each case is a pair of tag values, and a GPU cannot exist here.
H200 = {tags.DEVICE_PREFIX + "name": "NVIDIA H200", tags.DEVICE_PREFIX + "capability": "9.0",
        tags.DEVICE_PREFIX + "sm_count": "132", tags.DEVICE_PREFIX + "memory": "150754820096"}
CPU_DEVICE = {tags.DEVICE_PREFIX + "name": "cpu", tags.DEVICE_PREFIX + "capability": "none",
              tags.DEVICE_PREFIX + "sm_count": "none", tags.DEVICE_PREFIX + "memory": "none"}


def on(device: str, backend: str, **facts: str) -> dict[str, str]:
    return {**FACTS, tags.DEVICE: device, tags.BACKEND: backend, **facts}


def delta_of(a: dict[str, str], b: dict[str, str]) -> dict:
    return {d.name: d for d in environment_delta(make_record(facts=a), make_record(facts=b))}


def test_host_gpus_never_break_bitwise_and_a_cpu_run_ignores_gpu_facts() -> None:
    # A cpu run on a GPU host against one on a CPU host, and another count of identical GPUs.
    a = on("cpu", "gloo", **CPU_DEVICE, **{tags.ENV_PREFIX + "gpu": "NVIDIA H200, NVIDIA H200",
                                           tags.ENV_PREFIX + "gpu_count": "2"})
    b = on("cpu", "gloo", **CPU_DEVICE, **{tags.ENV_PREFIX + "gpu": "none", tags.ENV_PREFIX + "gpu_count": "0"})
    delta = delta_of(a, b)
    assert set(delta) == {tags.ENV_PREFIX + "gpu", tags.ENV_PREFIX + "gpu_count"}
    assert not any(d.breaks_bitwise for d in delta.values())
    assert compare_runs(make_record(facts=a), make_record(facts=b)).verdict == Verdict.BITWISE
    # Even a GPU model recorded for rank 0 of a cpu run (no GPU kernel ran) does not.
    cpu_on_gpu = on("cpu", "gloo", **{**CPU_DEVICE, tags.DEVICE_PREFIX + "name": "NVIDIA H200"})
    assert not delta_of(a, cpu_on_gpu)[tags.DEVICE_PREFIX + "name"].breaks_bitwise


def test_rank0_gpu_facts_break_bitwise_on_cuda_runs() -> None:
    a = on("cuda", "nccl", **H200, **{tags.ENV_PREFIX + "gpu": "NVIDIA H200", tags.ENV_PREFIX + "gpu_count": "1"})
    # Eight identical GPUs on the replay's host: only the host's list differs, so bitwise stays possible.
    more = {**a, tags.ENV_PREFIX + "gpu": ", ".join(["NVIDIA H200"] * 8), tags.ENV_PREFIX + "gpu_count": "8"}
    assert not any(d.breaks_bitwise for d in delta_of(a, more).values())
    h100 = {**a, tags.DEVICE_PREFIX + "name": "NVIDIA H100 80GB HBM3", tags.DEVICE_PREFIX + "sm_count": "114"}
    delta = delta_of(a, h100)
    assert delta[tags.DEVICE_PREFIX + "name"].breaks_bitwise and delta[tags.DEVICE_PREFIX + "sm_count"].breaks_bitwise
    assert "GPU model changed" in delta[tags.DEVICE_PREFIX + "name"].note
    sm80 = delta_of(a, {**a, tags.DEVICE_PREFIX + "capability": "8.0"})[tags.DEVICE_PREFIX + "capability"]
    assert sm80.breaks_bitwise and "capability" in sm80.note
    # Memory chooses no kernel.
    assert not delta_of(a, {**a, tags.DEVICE_PREFIX + "memory": "1"})[tags.DEVICE_PREFIX + "memory"].breaks_bitwise
    # A cuda record without rank 0's device (an older harness) cannot prove the same GPU.
    old = {k: v for k, v in a.items() if not k.startswith(tags.DEVICE_PREFIX)}
    assert delta_of(old, a)[tags.DEVICE_PREFIX + "name"].breaks_bitwise


@pytest.mark.parametrize("var", ["NVIDIA_TF32_OVERRIDE", "CUBLASLT_WORKSPACE_SIZE", "DISABLE_ADDMM_CUDA_LT",
                                 "TORCH_BLAS_PREFER_CUBLASLT", "CUDA_VISIBLE_DEVICES", "CUBLAS_WORKSPACE_CONFIG"])
def test_cuda_numerics_variables_break_bitwise_on_cuda_runs_only(var: str) -> None:
    name = tags.VAR_PREFIX + var
    assert delta_of(on("cuda", "nccl"), on("cuda", "nccl", **{name: "1"}))[name].breaks_bitwise
    assert not delta_of(on("cpu", "gloo"), on("cpu", "gloo", **{name: "1"}))[name].breaks_bitwise


@pytest.mark.parametrize("var", ["NCCL_NVLS_ENABLE", "NCCL_BUFFSIZE", "NCCL_P2P_LEVEL", "NCCL_P2P_DISABLE",
                                 "NCCL_SHM_DISABLE", "NCCL_COLLNET_ENABLE", "NCCL_ALGO"])
def test_nccl_numerics_variables_break_bitwise_on_nccl_runs_only(var: str) -> None:
    name = tags.VAR_PREFIX + var
    delta = delta_of(on("cuda", "nccl", **{name: "0"}), on("cuda", "nccl", **{name: "1"}))
    assert delta[name].breaks_bitwise and var in delta[name].note
    # A gloo run reads no NCCL variable (strict pins NCCL_NVLS_ENABLE=0 in every run; older records lack it).
    assert not delta_of(on("cpu", "gloo"), on("cpu", "gloo", **{name: "0"}))[name].breaks_bitwise
    # NCCL_DEBUG and the like change logging or transport only.
    debug = tags.VAR_PREFIX + "NCCL_DEBUG"
    assert not delta_of(on("cuda", "nccl"), on("cuda", "nccl", **{debug: "INFO"}))[debug].breaks_bitwise


def test_nccl_configuration_file_settings_break_bitwise_as_variables_do() -> None:
    conf = tags.NCCL_CONF_PREFIX
    a = on("cuda", "nccl", **{conf + "system": "/etc/nccl.conf sha256:" + "a" * 64, conf + "system.NCCL_DEBUG": "WARN",
                              conf + "user": "absent"})
    b = {**a, conf + "system": "/etc/nccl.conf sha256:" + "b" * 64, conf + "system.NCCL_DEBUG": "INFO"}
    delta = delta_of(a, b)
    assert set(delta) == {conf + "system", conf + "system.NCCL_DEBUG"}
    assert not any(d.breaks_bitwise for d in delta.values())  # another comment or a logging setting
    c = {**b, conf + "user": "/home/u/nccl.conf sha256:" + "c" * 64, conf + "user.NCCL_ALGO": "Tree"}
    algo = delta_of(a, c)[conf + "user.NCCL_ALGO"]
    assert (algo.a, algo.b, algo.breaks_bitwise) == (None, "Tree", True) and "configuration file" in algo.note
    gloo = {**on("cpu", "gloo"), conf + "user.NCCL_ALGO": "Tree"}
    assert not delta_of(on("cpu", "gloo"), gloo)[conf + "user.NCCL_ALGO"].breaks_bitwise


def test_a_determinism_setting_recorded_by_one_run_only_does_not_break_bitwise() -> None:
    # A record from before harness read the fp32_precision API back: it proves nothing either way.
    key = tags.DETERMINISM_PREFIX + "cuda_matmul_fp32_precision"
    missing = delta_of(FACTS, {**FACTS, key: "ieee"})[key]
    assert not missing.breaks_bitwise and "one run only" in missing.note
    assert delta_of({**FACTS, key: "ieee"}, {**FACTS, key: "tf32"})[key].breaks_bitwise


def test_the_learning_rate_is_judged_but_a_record_made_before_harness_logged_it_is_not_diverged() -> None:
    """harness.lr (harness's own metric) is compared like the loss; an original recorded before harness logged it
    lacks it, which is said, not called a divergence; a replay on another learning rate diverges where it acted."""
    a = make_record()
    steps = np.arange(20, dtype=np.int64)
    a.metrics[tags.METRIC_LR] = (steps.copy(), np.full(20, 0.01))
    b = clone(a)
    same = compare_runs(a, b)
    assert same.summary() == "BITWISE: 2 metrics x 20 steps + harness.lr bit-identical, 3 fingerprints equal"
    b.metrics[tags.METRIC_LR] = (steps.copy(), np.full(20, 0.02))
    a.facts[tags.OPTIMIZER_SETTINGS], b.facts[tags.OPTIMIZER_SETTINGS] = "lr=0.01, momentum=0", "lr=0.02, momentum=0"
    changed = compare_runs(a, b)
    assert changed.summary().startswith("DIVERGED at step 0: harness.lr 0.01 vs 0.02")
    assert [(d.name, d.breaks_bitwise, d.note) for d in changed.delta] == [
        (tags.OPTIMIZER_SETTINGS, False, "optimizer settings differ")]  # it follows the config: no environment change
    del a.facts[tags.OPTIMIZER_SETTINGS]
    old = clone(a)
    del old.metrics[tags.METRIC_LR]
    judged = compare_runs(old, clone(a))
    assert judged.verdict == Verdict.BITWISE and judged.summary().startswith("BITWISE: 2 metrics x 20 steps bit-identical")
    assert "harness.lr recorded by run B only: not compared" in judged.notes  # two independent runs: A and B
