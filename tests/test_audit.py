"""`harness audit`: random checkpoint-to-checkpoint segments replayed against the record."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import Project
from snippets import UNSEEDED


@pytest.fixture(scope="module")
def checkpointed(project: Project) -> str:
    result = project.harness("run", "experiments/linear_ddp", "checkpoint_every=5")
    assert result.returncode == 0, result.stderr
    return result.last_line


def audit(project: Project, run_id: str, *args: str):
    result = project.harness("audit", run_id, *args)
    lines = result.stdout.strip().splitlines()
    return result, lines


def test_honest_run_passes_every_segment(project: Project, checkpointed: str) -> None:
    result, lines = audit(project, checkpointed, "--segments", "5", "--seed", "7")
    assert result.returncode == 0, result.stdout + result.stderr
    assert lines[-2].startswith("verdict: BITWISE: 5 of 5 segments")
    assert "P(catching one bad segment) = 5/5 = 1.00" in result.stdout
    assert [l.split(":")[0] for l in lines[:5]] == [f"segment {i} steps {5 * i}-{5 * i + 5}" for i in range(5)]
    client = project.client()
    tags = client.get_run(lines[-1]).data.tags
    assert tags["harness.kind"] == "audit" and tags["mlflow.parentRunId"] == checkpointed
    assert tags["harness.verdict"] == "BITWISE" and tags["harness.audit.seed"] == "7"
    report = Path(client.download_artifacts(lines[-1], "audit/report.md")).read_text()
    assert "5 of 5" in report and "seed 7" in report


def test_draw_is_seeded_and_partial(project: Project, checkpointed: str) -> None:
    first, lines = audit(project, checkpointed, "--segments", "2", "--seed", "3")
    again, lines_again = audit(project, checkpointed, "--segments", "2", "--seed", "3")
    assert first.returncode == again.returncode == 0, first.stderr
    drawn = [l.split(":")[0] for l in lines if l.startswith("segment ")]
    assert len(drawn) == 2 and drawn == [l.split(":")[0] for l in lines_again if l.startswith("segment ")]
    assert "P(catching one bad segment) = 2/5 = 0.40; compute = 40.0%" in first.stdout


def _tamper(project: Project, run_id: str, step: int) -> None:
    """Alter rank 0's checkpoint at `step` consistently (weights and the hash stored in the file)."""
    from harness.runtime import checkpoint
    from harness.runtime.fingerprint import fingerprint

    root = Path(project.client().get_run(run_id).info.artifact_uri.removeprefix("file://")) / "checkpoints"
    path = checkpoint.path_for(root, step, 0)
    state = torch.load(path, weights_only=True)
    state["model"]["weight"] = state["model"]["weight"] + 1e-3
    model = torch.nn.Linear(10, 5)
    model.load_state_dict(state["model"])
    state["fingerprint"] = fingerprint(model)
    checkpoint.save_atomic(state, path)


def _unseal(project: Project, run_id: str, refused_by: tuple[str, ...], what: str) -> None:
    """The seal refuses the edited run first (harness/record/seal.py); without it (a run recorded before seals
    existed) the audit's own checks are what catch the edit."""
    result = project.cli(*refused_by)
    assert result.returncode == 2 and f"was changed after it was sealed: {what}" in result.stderr, result.stderr
    project.client().delete_tag(run_id, "harness.seal")
    (Path(project.client().get_run(run_id).info.artifact_uri.removeprefix("file://")) / "seal" / "manifest.json").unlink()


def test_altered_checkpoint_is_caught_when_drawn(project: Project) -> None:
    run = project.harness("run", "experiments/linear_ddp", "checkpoint_every=5")
    assert run.returncode == 0, run.stderr
    _tamper(project, run.last_line, 10)
    _unseal(project, run.last_line, ("audit", run.last_line, "-k", "1"),
            "artifact checkpoints/step-00000010/rank0.pt (sha256 ")
    result, lines = audit(project, run.last_line, "--segments", "5", "--seed", "1")
    assert result.returncode == 1, result.stdout + result.stderr
    assert lines[-2].startswith("verdict: DIVERGED in segment 2 (steps 10-15): start checkpoint step-00000010/rank0.pt")
    assert project.client().get_run(lines[-1]).data.tags["harness.verdict"] == "DIVERGED"
    # The segments that do not start at the altered checkpoint still pass.
    assert sum(l.endswith("s)") and ": ok" in l for l in lines) == 4


def test_nondeterministic_step_is_caught(project: Project) -> None:
    project.add_experiment("unseeded", train_py=UNSEEDED)
    run = project.harness("run", "experiments/unseeded", "checkpoint_every=2")
    assert run.returncode == 0, run.stderr
    result, lines = audit(project, run.last_line, "--segments", "5", "--seed", "0")
    assert result.returncode == 1, result.stdout
    assert "segment 0 steps 0-2: ok" in result.stdout
    # Targets come from os.urandom from step 3 on: the segment holding step 3 cannot reproduce.
    assert "segment 1 steps 2-4: FAILED - end fingerprint at step 4" in result.stdout
    assert "; tensors that differ: bias, weight (of 2)" in result.stdout  # per-tensor digests name them
    assert lines[-2].startswith("verdict: DIVERGED in segment 1 (steps 2-4)")


def test_audit_refuses_runs_without_checkpoints(project: Project) -> None:
    plain = project.harness("run", "experiments/linear_ddp", "train.epochs=1")
    result, _ = audit(project, plain.last_line, "--segments", "1")
    assert result.returncode == 2 and "no checkpoint chain to audit" in result.stderr


# --- checkpoints the run recorded whose files are not there: refused, never judged -------------------------


def test_imported_run_without_checkpoint_files_is_refused_by_audit_and_trace(project: Project, checkpointed: str,
                                                                              tmp_path: Path) -> None:
    bundle = tmp_path / "no checkpoints.tar.gz"
    exported = project.harness("export", checkpointed, "-o", str(bundle))  # without --with-checkpoints
    assert exported.returncode == 0, exported.stderr
    elsewhere = Project(tmp_path / "elsewhere", tmp_path / "elsewhere" / "store")
    elsewhere.store.mkdir(parents=True)
    imported = elsewhere.harness("import", str(bundle))
    assert imported.returncode == 0, imported.stderr
    run_id = imported.last_line
    before = len(elsewhere.all_runs())
    for args, who in ((["audit", run_id, "--segments", "2", "--seed", "7"], "the audit"),
                      (["trace", run_id, "--step", "7"], "a trace of step 7")):
        result = elsewhere.cli(*args)
        assert result.returncode == 2, result.stdout + result.stderr
        assert result.stderr.startswith(f"Error: run {run_id} recorded a checkpoint at step"), result.stderr
        assert f"which {who} needs, but its files are not in the run's artifacts: it was imported from a bundle made " \
               f"without --with-checkpoints. Export run {checkpointed} again with `harness export {checkpointed} -o " \
               "FILE.tar.gz --with-checkpoints`" in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert len(elsewhere.all_runs()) == before  # no DIVERGED audit, no trace


def test_removed_checkpoint_files_are_refused_but_a_trace_before_the_first_needs_none(project: Project) -> None:
    import shutil

    run = project.harness("run", "experiments/linear_ddp", "checkpoint_every=5", "train.epochs=2")  # 10 steps
    assert run.returncode == 0, run.stderr
    root = Path(project.client().get_run(run.last_line).info.artifact_uri.removeprefix("file://")) / "checkpoints"
    shutil.rmtree(root / "step-00000005")
    _unseal(project, run.last_line, ("trace", run.last_line, "--step", "6"), "artifact checkpoints/step-00000005/COMPLETE (removed)")
    before = len(project.all_runs())
    result, _ = audit(project, run.last_line, "--segments", "2")  # both segments: 0-5 and 5-10
    assert result.returncode == 2, result.stdout + result.stderr
    assert "recorded a checkpoint at step 5, which the audit needs, but its files are not in the run's artifacts: " \
           "they were removed. Put them back under checkpoints/" in result.stderr, result.stderr
    traced = project.cli("trace", run.last_line, "--step", "6")
    assert traced.returncode == 2 and "which a trace of step 6 needs" in traced.stderr, traced.stderr
    assert len(project.all_runs()) == before
    # Step 3 restarts from step 0's checkpoint, which is there: traced as ever.
    fine = project.harness("trace", run.last_line, "--step", "3")
    assert fine.returncode == 0, fine.stdout + fine.stderr
