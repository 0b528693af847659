"""`harness replay RUN --steps K`: a first check that trains only the first K steps, stops every rank there and
judges those steps (real runs, real gloo ranks, a real store), and its refusals; the noise rule at step K-1 on
synthetic records."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import Project, pid_alive
from records import clone, make_record

from harness import tags
from harness.judge.compare import compare_runs
from harness.judge.handoff import judge_noise
from harness.judge.verdicts import Verdict


@pytest.fixture(scope="module")
def checkpointed(project: Project) -> str:
    """linear_ddp (world size 2), one epoch of 5 steps, checkpointed every 3 steps: step 3's weights are on record."""
    result = project.harness("run", "experiments/linear_ddp", "train.epochs=1", "checkpoint_every=3")
    assert result.returncode == 0, result.stderr
    return result.last_line


def logged_steps(project: Project, run_id: str) -> set[int]:
    client = project.client()
    return {m.step for key in client.get_run(run_id).data.metrics for m in client.get_metric_history(run_id, key)}


def test_first_steps_replay_is_bitwise_and_stops_there(project: Project, checkpointed: str) -> None:
    result = project.harness("replay", checkpointed, "--steps", "3")
    assert result.returncode == 0, result.stderr
    verdict = result.stdout.strip().splitlines()[-2]
    assert verdict.startswith("verdict: BITWISE over the first 3 of 5 steps: 1 metric x 3 steps + harness.lr bit-identical, "
                               "2 fingerprints equal"), verdict  # step 0's, and the weights after step 3
    assert "including the weights after step 3 (the original's checkpoint of that step)" in verdict
    assert "data order: identical at the 3 common steps" in result.stdout  # sent as at an end, though it stopped
    # Its own consequences (the request, the steps of data order it recorded, no final weights) are no change of
    # environment: the verdict says "over the first 3 of 5 steps".
    assert "Environment delta: none" in result.stdout, result.stdout
    run = project.client().get_run(result.last_line)
    assert run.info.status == "FINISHED"
    assert run.data.tags[tags.REPLAY_STEPS] == "3" and run.data.tags[tags.VERDICT] == Verdict.BITWISE
    assert logged_steps(project, result.last_line) == {0, 1, 2}
    assert "Traceback" not in result.stderr and "peer" not in result.stderr.lower()


def test_a_changed_learning_rate_diverges_at_its_step(project: Project, checkpointed: str) -> None:
    result = project.harness("replay", checkpointed, "--steps", "3", "--allow-changes", "train.lr=0.05",
                             "--no-localize")
    assert result.returncode == 1, result.stderr
    verdict = result.stdout.strip().splitlines()[-2]
    # Step 0's loss is taken before the first update, which the new learning rate made: the rate names the step.
    assert verdict.startswith("verdict: DIVERGED at step 0: harness.lr 0.01 vs 0.05 ") and verdict.endswith(
        "(over the first 3 of 5 steps)"), verdict
    run = project.client().get_run(result.last_line)
    assert run.info.status == "FINISHED" and run.data.tags[tags.VERDICT] == Verdict.DIVERGED


def test_a_loop_of_its_own_stops_at_the_step_and_leaves_no_rank(project: Project, tmp_path: Path) -> None:
    from snippets import OWN_LOOP

    project.add_experiment("own_loop", train_py=OWN_LOOP)
    run = project.harness("run", "experiments/own_loop", f"train={{iters: 8, pid_dir: '{tmp_path}'}}")
    assert run.returncode == 0, run.stderr
    for rank in (0, 1):
        (tmp_path / f"rank{rank}").unlink()
    result = project.harness("replay", run.last_line, "--steps", "4")
    # The script's own MLflow metric, logged after step 4, is not reached: no change of environment either.
    assert "Environment delta: none" in result.stdout, result.stdout
    assert result.returncode == 0, result.stderr
    verdict = result.stdout.strip().splitlines()[-2]
    assert verdict.startswith("verdict: BITWISE over the first 4 of 8 steps: "), verdict
    assert "weights after step 4 not compared: the original has no checkpoint fingerprint of step 4" in verdict
    assert "step skipped" not in result.stderr + result.stdout  # the stop went past the loop's `except Exception`
    replayed = project.client().get_run(result.last_line)
    assert replayed.info.status == "FINISHED" and replayed.data.tags[tags.REPLAY_STEPS] == "4"
    assert logged_steps(project, result.last_line) <= {0, 1, 2, 3}  # no final evaluation, no own MLflow call past it
    for rank in (0, 1):
        assert not pid_alive(int((tmp_path / f"rank{rank}").read_text())), f"rank {rank} left behind"


@pytest.mark.parametrize("args, says", [
    (("--steps", "0"), "--steps 0: a first check trains at least 1 step"),
    (("--steps", "6"), "took 5 steps. Pass --steps 5 or fewer"),
    (("--steps", "2", "--allow-incomplete"), "Pass one of them"),
])
def test_bad_steps_are_refused_in_one_line_and_record_nothing(project: Project, checkpointed: str, args, says) -> None:
    before = len(project.all_runs())
    result = project.cli("replay", checkpointed, *args)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and says in lines[0], result.stderr
    assert len(project.all_runs()) == before


def _member(run_id: str, i: int, early: float, final: float):
    """Study member i of 10 steps whose loss is `early` at step 2 and `final` at its end."""
    steps = np.arange(10, dtype=np.int64)
    loss = np.linspace(2.0 + 0.05 * i, final, 10)
    loss[2] = early
    rec = make_record(run_id, metrics={"loss": (steps, loss)})
    rec.facts[tags.STUDY] = "study0"
    return rec


def test_a_first_check_is_judged_against_the_seeds_before_its_stop() -> None:
    """The seeds spread widely at step 2 and agree at their ends: a replay of the first 3 steps that differs at
    step 2 by less than that spread is WITHIN_NOISE - judged on the curves before step 3 (the last point step 2's
    value), not on the final values, which it never reached."""
    members = [_member(f"m{i}", i, early, 0.5 + 1e-6 * i) for i, early in enumerate([1.0, 1.2, 0.8, 1.1, 0.9])]
    original = members[0]
    replay = clone(original)
    replay.facts.update({tags.KIND: tags.KIND_REPLAY, tags.REPLAY_OF: original.run_id, tags.THREADS_PER_RANK: "2"})
    steps, loss = original.metrics["loss"]
    replay.metrics = {"loss": (steps[:3].copy(), np.array([loss[0], loss[1], 1.05]))}
    cmp = judge_noise(compare_runs(original, replay, first_steps=3), original, replay, "study0", members)
    assert cmp.verdict == Verdict.WITHIN_NOISE and cmp.noise is not None
    assert cmp.noise.checks[-1].label == "loss at step 2" and cmp.noise.checks[-1].value == 1.05
    assert cmp.summary().startswith("WITHIN_NOISE over the first 3 of 10 steps: every segment mean and value before "
                                    "step 3 inside its"), cmp.summary()
    far = clone(replay)
    far.metrics = {"loss": (steps[:3].copy(), np.array([loss[0], loss[1], 30.0]))}
    assert judge_noise(compare_runs(original, far, first_steps=3), original, far, "study0", members).verdict == Verdict.DIVERGED
