"""Deterministic checkpoints and `harness resume`: a run whose rank is SIGKILLed, resumed, equals an
uninterrupted run bit for bit (real gloo ranks, real store, real checkpoint files)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from conftest import Project

# A kill planted right after rank 0 wrote a checkpoint's COMPLETE marker, before its Checkpoint message left
# for the launcher: the moment a kill used to leave a complete step whose digests no record held.
KILL_AFTER_MARKER_HOOK = '''
import harness.runtime.checkpoint as _checkpoint

_mark_complete = _checkpoint.mark_complete


def _mark_then_die(directory, step, *args, **kwargs):
    _mark_complete(directory, step, *args, **kwargs)
    if step == int(os.environ.get("KILL_AFTER_MARKER", "-1")):
        os.kill(os.getpid(), signal.SIGKILL)


_checkpoint.mark_complete = _mark_then_die
'''

KILL_HOOK = '''
            if ctx.rank == min(1, ctx.world_size - 1) and ctx.step == int(os.environ.get("KILL_AT", "-1")):
                os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no goodbye: a real crash
'''


def with_kill_hook(source: Path, after: str) -> str:
    text = source.read_text()
    assert after in text
    return "import os\nimport signal\n" + KILL_AFTER_MARKER_HOOK + text.replace(after, after + KILL_HOOK, 1)


def history(project: Project, run_id: str, key: str) -> list[tuple[int, str]]:
    return sorted((m.step, m.value.hex()) for m in project.client().get_metric_history(run_id, key))


@pytest.fixture(scope="module")
def killable(project: Project) -> tuple[str, str]:
    from conftest import EXPERIMENTS

    project.add_experiment("linear_kill", train_py=with_kill_hook(
        EXPERIMENTS / "linear_ddp/train.py", '            ctx.log({"loss": loss}, ctx.step)\n'))
    project.add_experiment("digits_kill", source="digits_cnn", train_py=with_kill_hook(
        EXPERIMENTS / "digits_cnn/train.py", '            ctx.log({"train_loss": loss}, ctx.step)\n'))
    return "experiments/linear_kill", "experiments/digits_kill"


@pytest.fixture(scope="module")
def uninterrupted(project: Project) -> Callable[..., str]:
    """The run of `exp` with `overrides`, never killed: one per module, for every test that compares with it."""
    runs: dict[tuple[str, ...], str] = {}

    def run(exp: str, *overrides: str) -> str:
        if (exp, *overrides) not in runs:
            clean = project.harness("run", exp, *overrides)
            assert clean.returncode == 0, clean.stderr
            runs[(exp, *overrides)] = clean.last_line
        return runs[(exp, *overrides)]

    return run


@pytest.mark.parametrize(
    "which,overrides,kill_at,keys",
    [
        (0, ["checkpoint_every=5"], 13, ["loss"]),
        # Workers, augmentation, dropout, momentum; killed mid-epoch so the resume replays the epoch's
        # first batches through the DataLoader workers.
        (1, ["checkpoint_every=10", "train.epochs=3"], 37, ["train_loss", "val_acc"]),
        # Every world size resumes bit for bit, not merely refused: from 3 ranks on, DDP's bucket layout
        # decides the sums, and a process that starts from a checkpoint must lay them out as the original did
        # (4 ranks stand for every size from 3: one case fewer keeps the suite's time).
        (0, ["checkpoint_every=5", "world_size=1"], 13, ["loss"]),
        (0, ["checkpoint_every=5", "world_size=4"], 9, ["loss"]),
        (1, ["checkpoint_every=8", "train.epochs=2", "world_size=4"], 20, ["train_loss", "val_acc"]),
    ],
    ids=["linear_ddp", "digits_cnn", "linear_ws1", "linear_ws4", "digits_ws4"],
)
def test_sigkilled_rank_then_resume_equals_uninterrupted(
    project: Project, killable, uninterrupted, which: int, overrides: list[str], kill_at: int, keys: list[str]
) -> None:
    exp = killable[which]
    crashed = project.harness("run", exp, *overrides, env={"KILL_AT": str(kill_at)})
    assert crashed.returncode == 1 and "was killed by SIGKILL" in crashed.stderr, crashed.stderr
    run_id = crashed.last_line
    assert project.client().get_run(run_id).info.status == "FAILED"
    resumed = project.harness("resume", run_id)
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.last_line == run_id  # the same MLflow run continues
    assert "Proved: steps" in resumed.stderr  # it re-executed the segment before the checkpoint first
    _assert_equal_runs(project, run_id, uninterrupted(exp, *overrides), keys)
    every = int(overrides[0].split("=")[1])
    assert project.client().get_run(run_id).data.tags["harness.resumed_from"] == str(kill_at // every * every)


def _assert_equal_runs(project: Project, run_id: str, clean: str, keys: list[str]) -> None:
    client = project.client()
    a, b = client.get_run(run_id), client.get_run(clean)
    assert a.info.status == "FINISHED"
    assert a.data.tags["harness.fingerprint"] == b.data.tags["harness.fingerprint"]
    for key in keys + ["harness.lr"]:
        # Same steps, same bits, and no step logged twice although steps after the checkpoint ran twice.
        assert history(project, run_id, key) == history(project, clean, key)
    # Every step's samples, those before the kill too (the killed ranks sent none: they came in the checkpoint).
    from harness.store.tracking import Tracker

    tracker = Tracker(project.uri)
    resumed_order, clean_order = (tracker.load_record(r).data_order for r in (run_id, clean))
    assert resumed_order == clean_order and sorted(resumed_order) == list(range(int(b.data.tags["harness.data_order.steps"])))
    assert a.data.tags["harness.data_order.steps"] == b.data.tags["harness.data_order.steps"]
    assert a.data.tags["harness.optimizer"] == b.data.tags["harness.optimizer"] == "torch.optim.sgd.SGD"


def _recorded_checkpoints(project: Project, run_id: str) -> dict[str, str]:
    import json

    return json.loads(Path(project.client().download_artifacts(run_id, "fingerprints.json")).read_text())["checkpoints"]


def test_rank_killed_right_after_the_checkpoint_marker_resumes_from_that_checkpoint(
    project: Project, killable, uninterrupted
) -> None:
    """Rank 0 killed between a checkpoint's COMPLETE marker and the message carrying its digests: the marker holds
    them, the run's close records them, and the resume proves itself against them and continues from that step."""
    crashed = project.harness("run", killable[0], "checkpoint_every=5", env={"KILL_AFTER_MARKER": "10"})
    assert crashed.returncode == 1 and "was killed by SIGKILL" in crashed.stderr, crashed.stderr
    run_id = crashed.last_line
    assert sorted(_recorded_checkpoints(project, run_id)) == ["0", "10", "5"]
    resumed = project.harness("resume", run_id)
    assert resumed.returncode == 0, resumed.stderr
    assert "Proved: steps 5-11 from the checkpoint of step 5 and step 10 from the checkpoint of step 10" in resumed.stderr, \
        resumed.stderr
    assert project.client().get_run(run_id).data.tags["harness.resumed_from"] == "10"
    _assert_equal_runs(project, run_id, uninterrupted(killable[0], "checkpoint_every=5"), ["loss"])


def test_checkpoints_load_with_weights_only(project: Project, killable) -> None:
    run = project.harness("run", killable[0], "checkpoint_every=10", "train.epochs=2")
    assert run.returncode == 0, run.stderr
    client = project.client()
    root = Path(client.get_run(run.last_line).info.artifact_uri.removeprefix("file://")) / "checkpoints"
    steps = sorted(p.name for p in root.iterdir())
    assert steps == ["step-00000000"]  # 10 steps in all: step 10 is the end, not a checkpoint
    files = sorted((root / "step-00000000").iterdir())
    assert [f.name for f in files] == ["COMPLETE", "rank0.pt", "rank1.pt"]
    state = torch.load(files[1], weights_only=True)
    assert state["position"]["step"] == 0 and isinstance(state["rng"]["numpy"]["key"], torch.Tensor)
    import json

    fps = json.loads(Path(client.download_artifacts(run.last_line, "fingerprints.json")).read_text())
    assert fps["checkpoints"] == {"0": state["fingerprint"]}  # logged at that step


def test_resume_refuses_finished_and_checkpointless_runs(project: Project, killable) -> None:
    done = project.harness("run", killable[0], "train.epochs=1")
    assert done.returncode == 0
    refused = project.cli("resume", done.last_line)
    assert refused.returncode == 2 and "only FAILED or KILLED runs are resumed" in refused.stderr
    crashed = project.harness("run", killable[0], "train.epochs=2", env={"KILL_AT": "3"})
    assert crashed.returncode == 1
    none = project.cli("resume", crashed.last_line)
    assert none.returncode == 2 and "has no complete checkpoint" in none.stderr
    assert len(none.stderr.strip().splitlines()) == 1
    # The cause read from the record (its config and its loop: a ctx.loader), and the way out that applies.
    assert "(it ran with checkpoint_every=0, so none was saved)" in none.stderr, none.stderr
    assert none.stderr.strip().endswith("Run it again with checkpoint_every=N to make it resumable (and auditable).")
    # The way out it names works: the suggested command, run as given.
    suggested = none.stderr.split("`")[1]
    assert suggested == f"harness replay {crashed.last_line} --allow-incomplete", none.stderr
    rerun = project.harness(*suggested.split()[1:])
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert "the FAILED original reached" in rerun.stdout, rerun.stdout


@pytest.mark.parametrize(
    "every,loop,notices,cause,way_out",
    [
        (0, "ctx.loader", "", "it ran with checkpoint_every=0, so none was saved", "with checkpoint_every=N"),
        (0, "lightning", "", "with it none could have been saved: Lightning's Trainer runs the loop",
         "checkpoint with Lightning itself"),
        (5, "own", "checkpoint_every=5: no checkpoint at step 0 or after: ...",
         "checkpoint_every was 5, but the loop is driven by neither a training ctx.loader nor ctx.steps()",
         "`for it in ctx.steps(max_iters):`"),
        (10, "accelerate", "", "checkpoint_every was 10, but Accelerate's loop iterates a DataLoader of its own",
         "Pass a ctx.loader(...) to accelerator.prepare"),
        (10, "transformers", "", "checkpoint_every was 10, but it stopped before the Trainer saved its first "
         "checkpoint", "with checkpoint_every=N"),
        (0, "transformers", "", "it ran with checkpoint_every=0, so none was saved", "with checkpoint_every=N"),
        (10, "ctx.steps", "checkpoint_every=10: no checkpoint at step 20: a step's first batch was drawn before ...",
         "checkpoint_every was 10, but a step's first batch was drawn before the previous optimizer step",
         "Draw each step's batches at the top of the step"),
        (10, "ctx.loader", "", "checkpoint_every was 10, but it stopped before its first checkpoint was complete",
         "with checkpoint_every=N"),
        (5, None, "", "checkpoint_every was 5, but its loop gave harness no step boundary to save at (see the run's "
         "harness.notices) or it stopped before the first was complete", "with checkpoint_every=N"),
    ],
    ids=["every0", "every0-lightning", "own-loop", "accelerate", "transformers", "every0-transformers", "prefetch",
         "died-first", "unrecorded-loop"],
)
def test_no_checkpoint_is_explained_from_the_record(every: int, loop: str | None, notices: str, cause: str,
                                                    way_out: str) -> None:
    """Why a run has no checkpoint, read from its record (checkpoint_every, harness.loop, harness.notices) - never
    "checkpoint_every was 0" for a run that had 5 - with the way out its loop has."""
    from harness.runtime import boundaries

    said, fix = boundaries.no_checkpoint(every, loop, notices)
    assert cause in said and way_out in fix, (said, fix)


# Rank 0 waits at each step of LAUNCHER_AT once it logged it (its values in the store first): the test stops the
# launcher (SIGSTOP) at the first, its ranks running on, and SIGKILLs it at the second, once the checkpoint after the
# first is complete - the record ends at the first step, the checkpoints run past it.
LAUNCHER_HOOK = '''
            signals = os.environ.get("LAUNCHER_SIGNALS")
            if signals and ctx.rank == 0 and str(ctx.step) in os.environ["LAUNCHER_AT"].split(","):
                import pathlib
                import time
                here = pathlib.Path(signals)
                time.sleep(0.5)  # everything logged so far reaches the store (flush_interval_s is short)
                (here / f"at-{ctx.step}").touch()
                while not (here / f"done-{ctx.step}").exists():
                    time.sleep(0.05)
'''


def _launcher_killed(project: Project, signals: Path, stop: int, kill: int, *args: str) -> str:
    """`harness ARGS` with its launcher stopped once step `stop` is recorded and SIGKILLed at step `kill`, its ranks
    having run on; then closed FAILED with `harness mark`, as a user would once its heartbeat is stale. What the
    launcher printed to stderr."""
    import os
    import signal
    import time

    launcher = project.popen(*args, env={"LAUNCHER_SIGNALS": str(signals), "LAUNCHER_AT": f"{stop},{kill}"})

    def reached(step: int) -> None:
        deadline = time.monotonic() + 120
        while not (signals / f"at-{step}").exists():
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
            time.sleep(0.05)

    reached(stop)
    os.kill(launcher.pid, signal.SIGSTOP)  # the launcher records nothing more; its ranks run on
    (signals / f"done-{stop}").touch()
    reached(kill)
    os.kill(launcher.pid, signal.SIGKILL)
    _, stderr = launcher.communicate(timeout=60)
    client = project.client()
    run_id = client.search_runs([client.get_experiment_by_name("linear_launcher_kill").experiment_id])[0].info.run_id
    deadline = time.monotonic() + 30
    while (marked := project.cli("mark", run_id, "--status", "FAILED")).returncode:  # once its heartbeat is stale
        assert "heartbeat" in marked.stderr and time.monotonic() < deadline, marked.stderr
        time.sleep(0.3)
    return stderr


def test_resume_after_a_sigkilled_launcher_records_every_step(project: Project, killable, uninterrupted,
                                                               tmp_path: Path) -> None:
    """A launcher killed while its ranks ran ahead of its record (steps 0-6 recorded, the checkpoint of step 10
    complete): the resume continues from the last checkpoint at or before step 7, so steps 7-9 are re-executed and
    recorded. The same for that resume's launcher killed (steps 0-12 recorded, the checkpoint of step 15 complete):
    the next continues from step 10. The record is the uninterrupted run's: what a replay judges, the same."""
    from conftest import EXPERIMENTS
    from harness.store.tracking import Tracker

    exp = "experiments/linear_launcher_kill"
    project.add_experiment("linear_launcher_kill", train_py=(
        "import os\n" + (EXPERIMENTS / "linear_ddp/train.py").read_text().replace(
            '            ctx.log({"loss": loss}, ctx.step)\n',
            '            ctx.log({"loss": loss}, ctx.step)\n' + LAUNCHER_HOOK, 1)))
    _launcher_killed(project, tmp_path, 6, 11, "run", exp, "checkpoint_every=5", "flush_interval_s=0.1",
                     "heartbeat_s=0.3")
    client = project.client()
    run_id = client.search_runs([client.get_experiment_by_name("linear_launcher_kill").experiment_id])[0].info.run_id
    assert sorted(step for step, _ in history(project, run_id, "loss")) == list(range(7))
    said = _launcher_killed(project, tmp_path, 12, 16, "resume", run_id)
    assert "resuming from step 5, the last checkpoint at or before the first step the record lacks" in said
    assert sorted(step for step, _ in history(project, run_id, "loss")) == list(range(13))
    resumed = project.harness("resume", run_id)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from step 10, the last checkpoint at or before the first step the record lacks" in resumed.stderr
    assert client.get_run(run_id).data.tags["harness.resumed_from"] == "5,10"
    clean = uninterrupted("experiments/linear_kill", "checkpoint_every=5")
    _assert_equal_runs(project, run_id, clean, ["loss"])
    # What a replay judges besides the metrics: the fingerprints the killed launcher never wrote came with the checkpoint.
    resumed_record, clean_record = (Tracker(project.uri).load_record(r) for r in (run_id, clean))
    assert resumed_record.fingerprints == clean_record.fingerprints and resumed_record.fingerprints
    assert resumed_record.checkpoints == clean_record.checkpoints
