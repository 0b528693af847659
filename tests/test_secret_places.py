"""Secrets where a line-by-line scan of the patch never looked: UTF-16 and binary files, file names, copies of a
store's redaction key, the training code's own prints of its config, and the git history an export ships; and the
documented example keys and marked fixture lines that are no secrets."""

from __future__ import annotations

import subprocess
import tarfile
from pathlib import Path

import pytest
from conftest import EXPERIMENTS, Project, git, make_project

from harness import secrets
from harness.errors import EXIT_USAGE
from harness.record import redaction
from harness.systems import git as gitsource, gitbundle, gitworktree

# Put together here, so that this file holds no token whole.
GHP = "ghp_" + "Q7w8E9r0" * 5
HF = "hf_" + "kL3m" * 9
AWS_EXAMPLE = ("AKIA" + "IOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/" + "bPxRfiCYEXAMPLEKEY")
OVERRIDE = "plain-override-pw-77"  # no token shape: only knowing it finds it
FROM_ENV = "env-secret-value-991"


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Project:
    """A repository whose history holds a token committed and deleted since, and one in a commit message."""
    project = make_project(tmp_path_factory.mktemp("places"))
    (project.root / "deploy.env").write_text(f"HF_TOKEN={HF}\n")
    git(project.root, "add", "-A")
    git(project.root, "commit", "-qm", "deploy settings")
    git(project.root, "rm", "-q", "deploy.env")
    git(project.root, "commit", "-qm", f"no settings in the repository\n\npushed with {GHP}")
    project.add_experiment("places", train_py=TRAIN, yaml_extra="  api_key: none\n")
    return project


def _check(project: Project, *args: str) -> tuple[int, str]:
    result = project.cli("check", "experiments/places", *args)
    return result.returncode, result.stdout + result.stderr


@pytest.mark.parametrize(("name", "content", "where"), [
    ("ps.txt", ("note\r\ntoken = " + GHP + "\r\n").encode("utf-16"), "ps.txt' line 2 (GitHub token)"),  # BOM
    ("ps32.txt", ("DB_PASSWORD=hunter2\n").encode("utf-32"), "ps32.txt' line 1 (literal DB_PASSWORD)"),
    ("nul.cfg", b"a\0b\nHF_TOKEN=abcdefgh12\n", "nul.cfg' line 2 (literal HF_TOKEN)"),
    ("raw16.txt", ("key " + GHP).encode("utf-16-le"), "raw16.txt' (GitHub token)"),  # no BOM
    ("model.bin", bytes(range(256)) * 8 + GHP.encode() + b"\0\xff" * 64, "model.bin' (GitHub token)"),
    (f"notes-{GHP}.txt", b"hello\n", "notes-<redacted>.txt' (GitHub token in the file name)"),
], ids=["utf-16", "utf-32", "utf-8-nul", "utf-16-no-bom", "binary", "file-name"])
def test_secrets_in_encodings_binaries_and_names_are_refused(project: Project, name: str, content: bytes,
                                                             where: str) -> None:
    path = project.root / "experiments" / "places" / name
    path.write_bytes(content)
    try:
        for args in ((), ("--allow-secret-in-diff",)):  # none of these can be cut from the patch
            code, out = _check(project, *args)
            assert code == EXIT_USAGE and f"'experiments/places/{where}" in out, out
            assert "cannot be cut from the stored patch" in out and GHP not in out, out
    finally:
        path.unlink()


def test_a_token_added_to_a_tracked_binary_is_refused(project: Project) -> None:
    """A changed binary file is stored as a delta against the committed one: the bytes it inserts are read."""
    path = project.root / "weights.bin"
    data = bytes(range(256)) * 64
    path.write_bytes(data)
    git(project.root, "add", "weights.bin")
    git(project.root, "commit", "-qm", "weights")
    try:
        path.write_bytes(data[:9000] + GHP.encode() + data[9000:])
        code, out = _check(project)
        assert code == EXIT_USAGE and "'weights.bin' (GitHub token, in its binary change)" in out, out
    finally:
        git(project.root, "rm", "-qf", "weights.bin")
        git(project.root, "commit", "-qm", "no weights")


@pytest.mark.parametrize(("name", "text", "args", "said"), [
    ("mlflow.db.harness-key", "{key}\n", (), "whose name marks it as a secret (*.harness-key)"),
    ("key.txt", "{key}", (), "'experiments/places/key.txt' line 1 (a copy of a store's redaction key"),
    ("notes.md", "backup: {key}\n", ("--allow-secret-in-diff",),
     "'experiments/places/notes.md' line 1 (a copy of a store's redaction key"),
    ("marked.py", "K = '{key}'  # harness: not-a-secret\n", (),
     "'experiments/places/marked.py' line 1 (a copy of a store's redaction key"),
], ids=["its-name", "renamed", "inside-a-file", "marked"])
def test_the_stores_key_is_never_stored_whatever_its_name(project: Project, name: str, text: str,
                                                          args: tuple[str, ...], said: str) -> None:
    key = redaction.store_key(project.uri).secret.hex()
    path = project.root / "experiments" / "places" / name
    path.write_text(text.format(key=key))
    try:
        code, out = _check(project, *args)
        assert code == EXIT_USAGE and said in out and key not in out, out
    finally:
        path.unlink()


def test_documented_example_keys_pass(project: Project) -> None:
    fixture = project.root / "experiments" / "places" / "test_fixture.py"
    fixture.write_text(f'AWS_ID = "{AWS_EXAMPLE[0]}"\naws_secret_access_key = "{AWS_EXAMPLE[1]}"\n')
    try:
        code, out = _check(project)
        assert code == 0, out
    finally:
        fixture.unlink()
    assert secrets.in_line(f"id = {'AKIA' + 'Z7Q2W3E4R5T6Y7U8'}", "x.env") is not None  # any other key is one


def test_a_line_marked_not_a_secret_passes(project: Project) -> None:
    fixture = project.root / "experiments" / "places" / "test_fixture.py"
    fixture.write_text(f'FAKE = "{GHP}"  # harness: not-a-secret\n')
    (project.root / "experiments" / "places" / "fake.yaml").write_text(f"hf_token: {HF}  # harness: not-a-secret\n")
    try:
        code, out = _check(project)
        assert code == 0, out
        with open(fixture, "a") as fh:  # the mark covers its own line only
            fh.write(f'REAL = "{GHP}"\n')
        code, out = _check(project)
        assert code == EXIT_USAGE and "test_fixture.py' line 2 (GitHub token)" in out and "fake.yaml" not in out, out
    finally:
        fixture.unlink()
        (project.root / "experiments" / "places" / "fake.yaml").unlink()


# --- the training code prints its config and a variable: the stored logs hold neither -----------------------
TRAIN = (EXPERIMENTS / "linear_ddp" / "train.py").read_text().replace(
    "    cfg = ctx.cfg\n",
    "    cfg = ctx.cfg\n"
    "    import os\n"
    "    print(dict(ctx.cfg), list(ctx.cfg.items()), list(ctx.cfg.values()), flush=True)\n"
    "    print('variable', os.environ['PLACES_TOKEN'], flush=True)\n",
)


@pytest.fixture(scope="module")
def ran(project: Project) -> tuple[str, str]:
    """The run whose rank 0 prints its config and a secret variable: (its id, what the terminal showed)."""
    result = project.harness("run", "experiments/places", "train.epochs=1", f"train.api_key={OVERRIDE}",
                             env={"PLACES_TOKEN": FROM_ENV})
    assert result.returncode == 0, result.stderr
    return result.last_line, result.stdout + result.stderr


def test_rank_logs_are_stored_without_the_secrets_harness_knows(project: Project, ran: tuple[str, str]) -> None:
    _, shown = ran
    logs = b"".join(p.read_bytes() for p in project.store.rglob("*") if "logs" in p.parts and p.is_file())
    assert b"'lr': 0.01" in logs and b"variable <redacted>" in logs, logs[-2000:]
    store = b"".join(p.read_bytes() for p in project.store.rglob("*") if p.is_file() and "harness-key" not in p.name)
    assert OVERRIDE.encode() not in store and FROM_ENV.encode() not in store
    assert "variable <redacted>" in shown and OVERRIDE not in shown and FROM_ENV not in shown, shown


# --- export: the history it ships -------------------------------------------------------------------------
def test_export_warns_of_secrets_in_the_history_it_ships(project: Project, ran: tuple[str, str],
                                                         tmp_path: Path) -> None:
    full = project.harness("export", ran[0], "-o", str(tmp_path / "full.tar.gz"))
    assert full.returncode == 0, full.stderr
    warned = [line for line in full.stderr.splitlines() if "the code bundle carries secrets in its git history" in line]
    assert len(warned) == 1, full.stderr
    assert "'deploy.env' line 1 (Hugging Face token)" in warned[0] and "message line 3 (GitHub token)" in warned[0]
    assert "--tree-only" in warned[0] and HF not in full.stderr and GHP not in full.stderr


def test_export_can_ship_the_recorded_tree_alone(project: Project, ran: tuple[str, str], tmp_path: Path) -> None:
    commit = project.client().get_run(ran[0]).data.tags["harness.git.commit"]
    only = project.harness("export", ran[0], "-o", str(tmp_path / "tree.tar.gz"), "--tree-only")
    assert only.returncode == 0, only.stderr
    assert "carries secrets" not in only.stderr, only.stderr
    with tarfile.open(tmp_path / "tree.tar.gz") as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith(".bundle"))
        (tmp_path / "code.bundle").write_bytes(tar.extractfile(member).read())  # type: ignore[union-attr]
    with gitbundle.repository_from_bundle(tmp_path / "code.bundle", commit) as repo:
        assert git(repo, "rev-list", "--all").split() == [commit]  # the same commit id, nothing before it
        objects = subprocess.run(["git", "cat-file", "--batch-all-objects", "--batch"], cwd=repo, capture_output=True,
                                 check=True).stdout
        assert HF.encode() not in objects and b"deploy.env" not in objects
        assert "experiments/places/train.py" in git(repo, "ls-tree", "-r", "--name-only", commit)


def test_a_tree_only_bundle_with_submodules_checks_out(tmp_path: Path) -> None:
    """A history-free code bundle holds the submodules' commits without theirs too; a replay's checkout from it
    (no live repository has the commits) finds every file."""
    lib, root = tmp_path / "lib", tmp_path / "repo"
    for repo in (lib, root):
        repo.mkdir()
        git(repo, "init", "-q", "-b", "main")
    (lib / "old.txt").write_text(f"HF_TOKEN={HF}\n")
    git(lib, "add", "-A")
    git(lib, "commit", "-qm", "old")
    git(lib, "rm", "-q", "old.txt")
    (lib / "util.py").write_text("X = 1\n")
    git(lib, "add", "-A")
    git(lib, "commit", "-qm", "util")
    (root / "train.py").write_text("print(1)\n")
    git(root, "-c", "protocol.file.allow=always", "submodule", "add", "-q", str(lib), "lib")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "with lib")
    commit, sub_commit = git(root, "rev-parse", "HEAD"), git(lib, "rev-parse", "HEAD")
    subs = (gitsource.Submodule("lib", sub_commit, b""),)
    changes = list(gitbundle.shipped_changes(root / "lib", sub_commit))
    assert redaction.shipped_secrets(changes) == [f"commit {changes[1][0][:12]} 'old.txt' line 1 (Hugging Face token)"]
    assert redaction.shipped_secrets(gitbundle.shipped_changes(root / "lib", sub_commit, tree_only=True)) == []
    gitbundle.bundle_commit(root, commit, tmp_path / "code.bundle", subs, tree_only=True)
    with gitbundle.repository_from_bundle(tmp_path / "code.bundle", commit) as repo:
        assert set(git(repo, "rev-list", "--all").split()) == {commit, sub_commit}  # nothing before either
        with gitworktree.worktree(repo, commit, None, submodules=subs) as tree:
            assert (tree / "train.py").read_text() == "print(1)\n" and (tree / "lib" / "util.py").is_file()
            assert not (tree / "lib" / "old.txt").exists()
