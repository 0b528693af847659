"""What changes while a run's ranks run: code edited in the working tree, declared data rewritten. The record was
made before; such a run must not close FINISHED with exit 0 as if the record held what ran.

One run serves every case: its training waits at a known point (a file the test creates) after it has started,
the test edits a module it imports only later, writes another with its recorded bytes (a change undone) and grows
its declared data, then lets it go on.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
from conftest import Project, git, make_project

TRAIN = '''
import importlib, pathlib, time


def train(ctx):
    gate = pathlib.Path(ctx.cfg.gate)
    pathlib.Path("written_by_training.txt").write_text("an output in its own folder, no code")
    (gate / "ready").write_text("")
    deadline = time.monotonic() + 300
    while not (gate / "go").exists():
        if time.monotonic() > deadline:
            raise RuntimeError("the test never said go")
        time.sleep(0.02)
    late = importlib.import_module("late")  # imported only now, after the test edited it
    table = pathlib.Path(ctx.data["table"]).read_bytes()  # read only now, after the test grew it
    ctx.log({"late": float(late.VALUE), "table_bytes": float(len(table))}, 0)
'''


def _wait_for(path: Path, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 300
    while not path.exists():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the run ended before its training reached the gate (exit {proc.returncode}): {err}{out}")
        assert time.monotonic() < deadline, "the training never reached the gate"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def edited(tmp_path_factory: pytest.TempPathFactory) -> tuple[Project, int, str, str]:
    """(project, exit code, stderr, run id) of a run whose module and data changed while it waited."""
    base = tmp_path_factory.mktemp("during")
    project = make_project(base)
    exp = project.add_experiment("during", train_py=TRAIN, commit=False)
    table = base / "outside" / "table.csv"
    table.parent.mkdir()
    table.write_bytes(b"a,b\n1,2\n")
    with open(exp / "experiment.yaml", "a") as fh:
        fh.write(f"data:\n  table: {table}\n")
    (exp / "late.py").write_text("VALUE = 1\n")
    (exp / "again.py").write_text("VALUE = 1\n")
    git(project.root, "add", "-A")
    git(project.root, "commit", "-qm", "during")
    gate = base / "gate"
    gate.mkdir()
    proc = project.popen("run", "experiments/during", "world_size=1", f"train.gate={gate}")
    try:
        _wait_for(gate / "ready", proc)
        (exp / "late.py").write_text("VALUE = 2\n")
        (exp / "again.py").write_text("VALUE = 1\n")  # written with the recorded bytes: changed and changed back
        with open(table, "ab") as fh:
            fh.write(b"3,4\n")
        (gate / "go").write_text("")
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    runs = project.all_runs()
    assert len(runs) == 1, (out, err)
    return project, proc.returncode, err, runs[0].info.run_id


def test_code_edited_while_the_ranks_run_fails_the_run(edited: tuple[Project, int, str, str]) -> None:
    project, code, err, run_id = edited
    run = project.client().get_run(run_id)
    assert run.data.tags["harness.git.dirty"] == "false"  # the record holds the commit: not what ran
    assert run.data.metrics["late"] == 2.0  # the edited module ran
    assert code == 1, err
    assert run.info.status == "FAILED" and "harness.failed_rank" not in run.data.tags  # no rank failed
    reason = run.data.tags["harness.status_reason"]
    assert "'experiments/during/late.py' changed in the working tree while the ranks ran" in reason
    assert "written_by_training.txt" not in reason  # what a training writes into its folder is no code
    assert "'experiments/during/again.py' was written while the ranks ran" in reason
    assert "late.py' changed in the working tree" in err


def test_data_grown_while_the_ranks_run_fails_the_run(edited: tuple[Project, int, str, str]) -> None:
    project, code, err, run_id = edited
    run = project.client().get_run(run_id)
    assert run.data.metrics["table_bytes"] == 12.0  # the new bytes were read
    assert code == 1, err
    assert run.info.status == "FAILED"
    reason = run.data.tags["harness.status_reason"]
    assert "data 'table': 'table.csv' changed (sha256 " in reason and "8 bytes recorded; now " in reason
    assert "while the ranks ran" in reason


def test_what_is_named_and_what_is_left_alone(tmp_path: Path) -> None:
    """In process, no run: which changes to a working tree and its data the close names."""
    from harness.record import data, unchanged
    from harness.systems import git as gitsource

    root = tmp_path / "repo"
    (root / "exp" / "__pycache__").mkdir(parents=True)
    for name in ("train.py", "model.py", "steady.py", "results.csv"):
        (root / "exp" / name).write_text(f"# {name}\n")
    git(root, "init", "-q", "-b", "main")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "code")
    (root / "exp" / "__pycache__" / "model.cpython-311.pyc").write_bytes(b"stale")  # untracked, so recorded
    table = tmp_path / "table.csv"
    table.write_bytes(b"a\n")
    since = time.time_ns()
    state = gitsource.inspect(root / "exp", max_untracked_mib=10)
    manifest = data.resolve_and_hash({"table": str(table)}, root / "exp", root)
    assert unchanged.changes(state, manifest, since) is None

    (root / "exp" / "out.txt").write_text("an output")  # what a training writes: no code
    (root / "exp" / "__pycache__" / "model.cpython-311.pyc").write_bytes(b"fresh")  # an import's cache: no code
    (root / "exp" / "model.py").unlink()
    (root / "exp" / "new_module.py").write_text("X = 1\n")
    (root / "exp" / "train.py").write_text("# train.py\n")  # the recorded bytes again
    assert gitsource.changed_files(state, since) == (["exp/model.py", "exp/new_module.py"], ["exp/train.py"])
    assert gitsource.changed_files(state) == (["exp/model.py", "exp/new_module.py"], [])
    assert "belongs in .gitignore" not in (unchanged.changes(state, manifest, since) or "")
    (root / "exp" / "results.csv").write_text("a result the training wrote\n")  # committed, so named
    said = unchanged.changes(state, manifest, since)
    assert said is not None and said.startswith(
        "'exp/model.py', 'exp/results.csv', 'exp/new_module.py' changed in the working tree while the ranks ran")
    assert "'exp/train.py' was written while the ranks ran (the recorded bytes are back" in said
    assert "a file the training writes itself belongs in .gitignore" in said

    assert data.changed_since(manifest) == [] and data.written_since(manifest, since) == []
    table.write_bytes(b"a\n")
    assert data.written_since(manifest, since) == [str(table)]
    table.write_bytes(b"b\n")
    assert [c.line() for c in data.changed_since(manifest)] == [
        "data 'table': 'table.csv' changed (sha256 87428fc52280, 2 bytes recorded; now 0263829989b6, 2 bytes)"]
    table.unlink()
    assert [c.line() for c in data.changed_since(manifest)] == [f"data 'table': the whole entry ({table}) is gone"]
    os.mkfifo(table)  # what cannot be hashed again is named as well, never an error of another kind
    assert unchanged.changes(None, manifest, since) == (
        f"data 'table': {table} is neither a file nor a folder (hashed again once the ranks ended). The run is FAILED, "
        "not FINISHED with a record of what did not run. Rerun it and leave the code and the data as they are until "
        "it ends.")
