"""Adversarial cases: a repository with a real submodule whose checkout holds uncommitted edits (issue 36 item 5).

The superproject's diff sees a submodule only as its commit: an edit inside it ran, yet the record said clean, and a
replay never checked the submodule out. Each submodule is recorded as a repository of its own (its commit, its
exact patch, its untracked files), the run is dirty, and a replay - from the repository, or from a bundle on a machine
with none - checks it out at that commit with that patch.
"""

from __future__ import annotations

import base64
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import Project, git, make_project

from harness import tags as T

# linear_ddp whose loss is scaled by a constant from the submodule: the submodule's code decides the result.
TRAIN = '''"""linear_ddp, its loss scaled by lib.scale.SCALE (a submodule) and lib.deep.factor.FACTOR (the submodule's own)."""

import torch
from torch import nn

from lib.deep.factor import FACTOR
from lib.scale import SCALE


def train(ctx):
    cfg = ctx.cfg
    data = torch.randn(cfg.samples, 10, generator=torch.Generator().manual_seed(ctx.seed))
    loader = ctx.loader(data, batch_size=cfg.batch_size)
    model = ctx.ddp(nn.Linear(10, 5))
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    for epoch in ctx.epochs(cfg.epochs):
        for batch in loader:
            optimizer.zero_grad()
            loss = ctx.backward(batch.to(ctx.device), lambda b: model(b).square().mean() * SCALE * FACTOR)
            optimizer.step()
            ctx.log({"loss": loss}, ctx.step)
'''
EDITED = "SCALE = 3.0  # not committed in the submodule\n"
DEEP_EDITED = "FACTOR = 0.5  # not committed in the submodule's submodule\n"


@dataclass
class Recorded:
    project: Project
    run_id: str
    lib_commit: str
    deep_commit: str
    check: str  # what `harness check` said of the edited tree


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Recorded:
    base = tmp_path_factory.mktemp("submodules")
    deep = base / "deep origin"
    deep.mkdir()
    (deep / "factor.py").write_text("FACTOR = 1.0\n")
    git(deep, "init", "-q", "-b", "main")
    git(deep, "add", "-A")
    git(deep, "commit", "-qm", "factor")
    lib = base / "lib origin"
    lib.mkdir()
    (lib / "scale.py").write_text("SCALE = 1.0\n")
    git(lib, "init", "-q", "-b", "main")
    git(lib, "-c", "protocol.file.allow=always", "submodule", "add", "-q", str(deep), "deep")
    git(lib, "add", "-A")
    git(lib, "commit", "-qm", "scale, with its own submodule")
    project = make_project(base)
    exp = project.root / "experiments" / "scaled"
    shutil.copytree(project.root / "experiments" / "linear_ddp", exp)
    (exp / "train.py").write_text(TRAIN)
    git(project.root, "-c", "protocol.file.allow=always", "submodule", "add", "-q", str(lib), "experiments/scaled/lib")
    git(project.root, "-c", "protocol.file.allow=always", "submodule", "update", "-q", "--init", "--recursive")
    git(project.root, "add", "-A")
    git(project.root, "commit", "-qm", "scaled, with its submodule")
    sub = exp / "lib"
    (sub / "scale.py").write_text(EDITED)
    (sub / "notes.txt").write_text("untracked, in the submodule\n")
    (sub / "deep" / "factor.py").write_text(DEEP_EDITED)
    check = project.harness("check", "experiments/scaled")
    assert check.returncode == 0, check.stderr
    run = project.harness("run", "experiments/scaled", "train.epochs=1")
    assert run.returncode == 0, run.stderr
    # The live tree is clean again: only the record holds the edit.
    git(sub, "checkout", "-q", "--", "scale.py")
    git(sub / "deep", "checkout", "-q", "--", "factor.py")
    (sub / "notes.txt").unlink()
    assert not git(project.root, "status", "--porcelain", "--ignore-submodules=none")
    return Recorded(project, run.last_line, git(sub, "rev-parse", "HEAD").strip(),
                    git(sub / "deep", "rev-parse", "HEAD").strip(), check.stdout + check.stderr)


def test_an_edit_inside_a_submodule_makes_the_tree_dirty(recorded: Recorded) -> None:
    assert "+uncommitted changes" in recorded.check, recorded.check
    assert "Submodules with changes of their own (git/submodules.json): 'experiments/scaled/lib', " \
           "'experiments/scaled/lib/deep'" in recorded.check, recorded.check
    run = recorded.project.client().get_run(recorded.run_id)
    assert run.data.tags[T.GIT_DIRTY] == "true"
    assert run.data.tags.get(T.GIT_SUBMODULES_SHA256)


def test_each_submodule_is_recorded_with_its_commit_and_exact_patch(recorded: Recorded, tmp_path: Path) -> None:
    client = recorded.project.client()
    local = Path(client.download_artifacts(recorded.run_id, T.ARTIFACT_SUBMODULES, str(tmp_path)))
    entry, nested = json.loads(local.read_bytes())["submodules"]  # a parent before its own submodules
    assert entry["path"] == "experiments/scaled/lib" and entry["commit"] == recorded.lib_commit
    patch = base64.b64decode(entry["patch"])
    assert b"+SCALE = 3.0  # not committed in the submodule" in patch and b"-SCALE = 1.0" in patch
    assert b"+untracked, in the submodule" in patch and entry["untracked"] == ["notes.txt"]
    assert b"factor.py" not in patch  # the nested submodule's edit is in its own patch
    assert nested["path"] == "experiments/scaled/lib/deep" and nested["commit"] == recorded.deep_commit
    assert b"+FACTOR = 0.5" in base64.b64decode(nested["patch"]) and nested["untracked"] == []


def test_replay_checks_the_submodule_out_with_its_patch(recorded: Recorded) -> None:
    """The live submodule holds SCALE = 1.0 again: only a checkout of the recorded patch reproduces the run."""
    result = recorded.project.harness("replay", recorded.run_id)
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout
    assert result.stdout.strip().splitlines()[-2].startswith("verdict: BITWISE"), result.stdout


def test_a_bundle_carries_the_submodule_to_a_machine_without_the_repository(recorded: Recorded, tmp_path: Path) -> None:
    out = tmp_path / "run.tar.gz"
    exported = recorded.project.harness("export", recorded.run_id, "-o", str(out))
    assert exported.returncode == 0, exported.stderr
    clean = Project(tmp_path / "elsewhere", tmp_path / "elsewhere" / "store")
    clean.store.mkdir(parents=True)
    imported = clean.harness("import", str(out))
    assert imported.returncode == 0, imported.stderr
    assert not (clean.root / ".git").exists()
    result = clean.harness("replay", imported.last_line)
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout
    assert result.stdout.strip().splitlines()[-2].startswith("verdict: BITWISE"), result.stdout


def test_a_submodules_untracked_files_follow_the_repositorys_rules(tmp_path: Path) -> None:
    """A secret-named untracked file inside a submodule is refused as one in the repository is (nothing recorded)."""
    from harness.errors import HarnessError
    from harness.systems import git as gitsource

    lib = tmp_path / "lib origin"
    lib.mkdir()
    (lib / "scale.py").write_text("SCALE = 1.0\n")
    git(lib, "init", "-q", "-b", "main")
    git(lib, "add", "-A")
    git(lib, "commit", "-qm", "scale")
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    git(repo, "-c", "protocol.file.allow=always", "submodule", "add", "-q", str(lib), "lib")
    git(repo, "commit", "-qm", "lib")
    assert not gitsource.inspect(repo, max_untracked_mib=10).dirty
    (repo / "lib" / ".env").write_text("TOKEN=x\n")
    with pytest.raises(HarnessError, match=r"'lib/\.env' is an untracked file whose name marks it as a secret"):
        gitsource.inspect(repo, max_untracked_mib=10)
    state = gitsource.inspect(repo, max_untracked_mib=10, allow_secrets=True)
    assert state.dirty and state.patch == b"" and state.submodules[0].untracked == (".env",)


def test_a_secret_inside_a_submodules_changes_is_refused_naming_its_path(recorded: Recorded) -> None:
    """A submodule's patch is stored beside the repository's: the same secret rules hold for it."""
    sub = recorded.project.root / "experiments" / "scaled" / "lib"
    token = "ghp_" + "A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8"
    (sub / "config.local").write_text(f"token: {token}\n")
    try:
        check = recorded.project.harness("check", "experiments/scaled")
        run = recorded.project.harness("run", "experiments/scaled", "train.epochs=1")
    finally:
        (sub / "config.local").unlink()
    for result in (check, run):
        assert result.returncode == 2, result.stdout + result.stderr
        assert "'experiments/scaled/lib/config.local' line 1" in result.stderr, result.stderr
        assert token not in result.stdout + result.stderr
