"""Values the training does not determine (wall clocks a script logs: nanoGPT's mfu, the transformers Trainer's
train_runtime), a tolerance of inf, and compare lines for a step only one run logged - judged on synthetic records."""

from __future__ import annotations

import math

import numpy as np
import pytest
from records import clone, make_record

from harness import tags
from harness.errors import UsageError
from harness.judge.compare import compare_runs, follows, judged_again
from harness.judge.delta import IGNORED_TAGS
from harness.judge.metricdiff import KIND_FINGERPRINT
from harness.judge.report import render_markdown
from harness.judge.text import comparison_lines
from harness.judge.tolerance import format_tolerances, judged_tolerance, never_judged, parse_tolerances
from harness.judge.undetermined import looks_like_clock
from harness.judge.verdicts import Verdict

CLOCKS = ("mfu", "train_runtime")


def _run(n: int = 10) -> object:
    """A run logging its loss, nanoGPT's mfu and the Trainer's train_runtime (at the last step), fingerprinted."""
    steps = np.arange(n, dtype=np.int64)
    return make_record(n=n, metrics={
        "loss": (steps.copy(), 1.0 / (steps + 1.0)),
        "mfu": (steps.copy(), np.full(n, 0.31)),
        "train_runtime": (np.array([n - 1]), np.array([12.5])),
    }, fingerprints={0: "0" * 64, 5: "1" * 64})


def _replay_of(a: object, **changes: object) -> object:
    b = clone(a, **changes)
    b.facts[tags.REPLAY_OF] = a.run_id
    b.metrics["mfu"] = (b.metrics["mfu"][0], b.metrics["mfu"][1] + 0.02)  # another machine's speed
    b.metrics["train_runtime"] = (b.metrics["train_runtime"][0], np.array([13.75]))
    return b


def test_a_clock_that_differs_where_the_training_is_bit_identical_stays_bitwise() -> None:
    a = _run()
    b = _replay_of(a)
    cmp = compare_runs(a, b)
    assert (cmp.verdict, cmp.exit_code, cmp.divergence) == (Verdict.BITWISE, 0, None)
    assert cmp.undetermined == list(CLOCKS)
    assert cmp.summary() == (
        "BITWISE: 1 metric x 10 steps bit-identical, 3 fingerprints equal; mfu, train_runtime differ: not determined "
        "by the training (every fingerprint and every other value bit-identical)")
    # Judged again from the two records (verify, bundles) it is the same verdict; the report and the lines name them.
    assert judged_again(a, b).verdict == Verdict.BITWISE and cmp.to_dict()["undetermined"] == list(CLOCKS)
    # A bundle's replay recorded DIVERGED on them (by a harness without this rule) still follows from its records.
    assert follows(Verdict.BITWISE, Verdict.DIVERGED, False, False, undetermined=True)
    assert not follows(Verdict.BITWISE, Verdict.DIVERGED, False, False)
    md = render_markdown(cmp)
    assert "| mfu | 10 |" in md and "no (not determined by the training)" in md
    assert "None: mfu, train_runtime differ, but not as a function of the training" in md
    assert any(line.startswith("  mfu: 10 steps") and line.endswith("(not determined by the training)")
               for line in comparison_lines(cmp, []))

    # Only where the evidence is there. The weights that never moved would be equal whatever happened:
    still = _replay_of(a)
    still.facts[tags.WEIGHTS_CHANGED] = "false"
    assert compare_runs(a, still).verdict == Verdict.DIVERGED
    # no final weights compared (a record without them):
    assert compare_runs(clone(a, final_fingerprint=None), _replay_of(a, final_fingerprint=None)).verdict == Verdict.DIVERGED
    # another value differs too (the loss, by one ulp, within no tolerance):
    loss = _replay_of(a)
    loss.metrics["loss"][1][7] = np.nextafter(loss.metrics["loss"][1][7], 1.0)
    assert compare_runs(a, loss).verdict == Verdict.DIVERGED
    # nothing else logged to be bit-identical beside them:
    bare = clone(a, metrics={k: v for k, v in a.metrics.items() if k != "loss"})
    assert compare_runs(bare, _replay_of(bare)).verdict == Verdict.DIVERGED
    # a step of it logged by one run only (the code took another path):
    extra = _replay_of(a)
    extra.metrics["train_runtime"] = (np.array([8, 9]), np.array([11.0, 13.75]))
    assert compare_runs(a, extra).verdict == Verdict.DIVERGED
    # harness's own learning rate is set by the training:
    own = {**a.metrics, tags.METRIC_LR: (np.arange(10), np.full(10, 0.1))}
    lr = clone(a, metrics=own)
    lr_b = clone(lr)
    lr_b.metrics[tags.METRIC_LR] = (np.arange(10), np.full(10, 0.2))
    assert compare_runs(lr, lr_b).verdict == Verdict.DIVERGED


def test_where_anything_else_differs_the_clock_is_not_the_divergence_named() -> None:
    a = _run()
    # The loss parts at step 7 (and the weights with it); mfu differs from step 0: the loss is named.
    b = _replay_of(a, final_fingerprint="e" * 64)
    b.metrics["loss"][1][7:] += 1e-3
    cmp = compare_runs(a, b)
    assert cmp.verdict == Verdict.DIVERGED and cmp.undetermined == []
    assert (cmp.divergence.step, cmp.divergence.metric) == (7, "loss")
    assert cmp.summary().startswith("DIVERGED at step 7: loss ")
    # Only the clocks differ, the weights too: the weights are the divergence, the clocks said beside it.
    c = _replay_of(a, final_fingerprint="e" * 64)
    cmp = compare_runs(a, c)
    assert cmp.divergence.kind == KIND_FINGERPRINT
    assert "mfu, train_runtime (named like a clock) differ" in cmp.summary()
    # Nothing to prove the training bit-identical (no fingerprint): the clock is what differs, with the way out.
    d = make_record(metrics={"loss": a.metrics["loss"], "mfu": a.metrics["mfu"]}, fingerprints={}, final=None)
    e = clone(d)
    e.metrics["mfu"] = (e.metrics["mfu"][0], e.metrics["mfu"][1] * 2)
    cmp = compare_runs(d, e)
    assert cmp.verdict == Verdict.DIVERGED and cmp.divergence.metric == "mfu"
    assert any("--tolerance mfu=inf leaves it unjudged" in note for note in cmp.notes), cmp.notes
    # A name is a hint, not proof: it orders what is named, never what is judged.
    assert all(map(looks_like_clock, ["mfu", "train/mfu", "eval_runtime", "train_samples_per_second",
                                      "eval_steps_per_second", "tok/s", "iter_time_ms"]))
    assert not any(map(looks_like_clock, ["loss", "val_loss", "timestep_loss", "total_flos", "epoch", "harness.lr"]))


def test_a_tolerance_of_inf_leaves_the_metric_unjudged_and_nan_is_refused() -> None:
    given = parse_tolerances(["eval_runtime=inf", "loss=1e-6"])
    assert given["eval_runtime"] == {"atol": math.inf, "rtol": 0.0}
    assert format_tolerances(given) == "eval_runtime=inf loss=1e-06,0.0"
    assert parse_tolerances(format_tolerances(given).split()) == given  # the recorded tag reads back the same
    for spec in ("eval_runtime=nan", "eval_runtime=1e-3,nan"):
        with pytest.raises(UsageError, match=r"nan is no tolerance\. Pass eval_runtime=inf") as err:
            parse_tolerances([spec])
        assert "\n" not in str(err.value)
    with pytest.raises(UsageError, match="numbers >= 0"):
        parse_tolerances(["eval_runtime=-inf"])

    steps = np.arange(4, dtype=np.int64)
    a = make_record(n=4, metrics={"loss": (steps, np.ones(4)), "eval_runtime": (steps.copy(), np.full(4, 2.0))},
                    fingerprints={}, final=None)  # no weights to prove anything: only the tolerance can settle it
    b = clone(a)
    b.facts[tags.REPLAY_OF] = a.run_id
    b.metrics["eval_runtime"] = (steps.copy(), np.full(4, 3.0))
    tol = judged_tolerance(a, b, given)
    assert never_judged(tol, "eval_runtime") and not never_judged(tol, "loss")
    cmp = compare_runs(a, b, tolerance=tol)
    assert cmp.verdict == Verdict.BITWISE and [m.name for m in cmp.metrics] == ["loss"]
    assert "eval_runtime not judged: its tolerance is inf" in cmp.notes
    assert "eval_runtime never judged (inf)" in "\n".join(comparison_lines(cmp, []))
    # Recorded on the replay (harness.replay.tolerance), it is what the replay is judged by again.
    b.facts[tags.TOLERANCE] = format_tolerances(given)
    assert judged_again(a, b).verdict == Verdict.BITWISE
    # The config's form (replay.tolerance.metrics.KEY: {atol: .inf}) is the same; an infinite default judges as before.
    b.facts.pop(tags.TOLERANCE)
    b.config = {"replay": {"tolerance": {"metrics": {"eval_runtime": {"atol": math.inf}}}}}
    assert compare_runs(a, b).verdict == Verdict.BITWISE
    b.config = {"replay": {"tolerance": {"default": {"atol": math.inf}}}}
    assert compare_runs(a, b).verdict == "WITHIN_TOLERANCE"


def test_the_cli_takes_a_tolerance_of_inf_and_refuses_nan_in_one_line(fresh_project) -> None:
    # Said before the store is even opened (there is none yet here), as replay says it.
    project = fresh_project
    refused = project.cli("compare", "aaaa", "bbbb", "--tolerance", "eval_runtime=nan")
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        "Error: --tolerance 'eval_runtime=nan': nan is no tolerance. Pass eval_runtime=inf to leave the metric "
        "unjudged, or finite numbers >= 0."], refused.stderr
    taken = project.cli("compare", "aaaa", "bbbb", "--tolerance", "eval_runtime=inf")
    # Taken: what refuses it now is the next check, the missing store.
    assert taken.returncode == 2 and taken.stderr.startswith("Error: no store at "), taken.stderr


def test_compare_lines_say_which_run_logged_a_step_only_one_run_logged() -> None:
    a = make_record()
    b = clone(a)
    s, v = b.metrics["loss"]
    b.metrics["loss"] = (np.append(s, 25), np.append(v, 0.5))  # a step only run B logged
    s, v = b.metrics["acc"]
    b.metrics["acc"] = (np.delete(s, 3), np.delete(v, 3))  # a step only run A logged
    lines = comparison_lines(compare_runs(a, b), [])
    loss = next(line for line in lines if line.startswith("  loss:"))
    acc = next(line for line in lines if line.startswith("  acc:"))
    assert loss.endswith("step 25 logged only by run B") and "first divergence" not in loss, loss
    assert acc.endswith("step 3 logged only by run A") and "first divergence" not in acc, acc
    b.metrics["loss"] = (s.copy(), np.zeros(s.size))  # a value that differs is still "first divergence N"
    assert any(line.startswith("  loss:") and "first divergence 0" in line
               for line in comparison_lines(compare_runs(a, b), []))


def test_the_replay_records_the_undetermined_metrics_and_counts_as_bitwise() -> None:
    from harness.commands.replay import verdict_tags
    from harness.record.replays import tally
    from harness.rundata import RunSummary

    a = _run()
    cmp = compare_runs(a, _replay_of(a))
    recorded = verdict_tags(cmp, render_markdown(cmp))  # what record_verdict writes on the replay run
    assert recorded[tags.VERDICT] == Verdict.BITWISE and recorded[tags.UNDETERMINED] == "mfu,train_runtime"
    assert "not determined by the training" in recorded[tags.MLFLOW_RUN_NOTE]  # the MLflow UI's description
    replay = RunSummary(run_id="r1", experiment="exp", experiment_id="1", run_name="replay", status="FINISHED",
                        start_time=0, end_time=0, tags={tags.KIND: tags.KIND_REPLAY, tags.REPLAY_OF: a.run_id,
                                                        **recorded}, params={}, metric_keys=[], artifact_uri="")
    assert tally([replay]) == {a.run_id: "BITWISE 1"}  # `harness runs` and the original's harness.replays
    # Not a fact of the run: a replay of this replay shows no environment delta for it.
    assert tags.UNDETERMINED in IGNORED_TAGS


def test_a_loss_or_an_evaluation_over_equal_weights_is_never_waved_through() -> None:
    # Fingerprints are taken every fingerprint_every steps: weights equal there prove nothing of a loss between them
    # (a precision change in the forward pass), and an evaluation that differs over equal weights does not reproduce.
    a = _run()
    for key in ("loss", "val_loss_epoch"):
        b = _replay_of(a)
        b.metrics = {k: v for k, v in b.metrics.items() if k not in CLOCKS}
        base = clone(a, metrics={k: v for k, v in a.metrics.items() if k not in CLOCKS})
        if key != "loss":
            base.metrics[key] = (np.array([4, 9]), np.array([0.5, 0.25]))
            b.metrics[key] = (np.array([4, 9]), np.array([0.75, 0.25]))
        else:
            b.metrics["loss"] = (b.metrics["loss"][0], b.metrics["loss"][1] * 1.5)
        cmp = compare_runs(base, b)
        assert (cmp.verdict, cmp.undetermined) == (Verdict.DIVERGED, []), cmp.summary()
    # harness's own learning rate, bit-identical, vouches for nothing: a clock beside it alone stays DIVERGED.
    lr_only = {tags.METRIC_LR: (np.arange(10), np.full(10, 0.1)), "mfu": a.metrics["mfu"]}
    c = clone(a, metrics=lr_only)
    assert compare_runs(c, _replay_of(clone(c, metrics={**lr_only, "train_runtime": a.metrics["train_runtime"]}))
                        ).verdict == Verdict.DIVERGED
