"""The code record: the dirty tree as exact bytes, proved to round-trip, and what it refuses to hold.

Real git repositories in tmp_path, a real SQLite store, the real CLI and real ranks.
"""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import Project, Result, git
from harness.errors import EXIT_USAGE
from harness.systems import git as gitsource, gitworktree

EXP = "experiments/linear_ddp"

# Shared by the experiment's train.py and the test: what the ranks read of the awkward files.
CHECKSUM = '''
import hashlib
import os
from pathlib import Path

FILES = ["data/crlf.txt", "data/cr.txt", "data/latin1.txt", "data/blob.bin", "data/empty.txt",
         "data/link.txt", "after.txt", "données été/ü x.txt", "tools/run.sh"]


def tree_checksum(root="."):
    h = hashlib.sha256()
    for name in FILES:
        path = Path(root, name)
        h.update(name.encode() + b"\\0" + path.read_bytes() + b"\\0")
        h.update(str(os.access(path, os.X_OK)).encode())
    h.update(os.readlink(Path(root, "data/link.txt")).encode())
    h.update(str(Path(root, "old.txt").exists()).encode() + str(Path(root, "before.txt").exists()).encode())
    return int.from_bytes(h.digest()[:6], "big")  # 48 bits: exact as a float64 metric
'''

TRAIN = CHECKSUM + '''

import torch
from torch import nn


def train(ctx):
    tree = float(tree_checksum())  # a tree that replays differently logs another value
    data = torch.randn(ctx.cfg.samples, 10, generator=torch.Generator().manual_seed(ctx.seed))
    loader = ctx.loader(data, batch_size=ctx.cfg.batch_size)
    model = ctx.ddp(nn.Linear(10, 5))
    opt = torch.optim.SGD(model.parameters(), lr=ctx.cfg.lr)
    ctx.track(opt)
    for _ in ctx.epochs(ctx.cfg.epochs):
        for batch in loader:
            opt.zero_grad()
            out = model(batch)
            loss = nn.functional.mse_loss(out, torch.randn_like(out))
            loss.backward()
            opt.step()
            ctx.log({"loss": loss, "tree": tree}, ctx.step)
'''


def refused(result: Result, message: str) -> None:
    """Exit 2 and exactly one line on stderr: `Error: <message>`."""
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip().splitlines() == [f"Error: {message}"], result.stderr


def git_bytes(repo: Path, *args: str, index: Path | None = None) -> bytes:
    env = {**os.environ, **({"GIT_INDEX_FILE": str(index)} if index else {})}
    return subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True).stdout


def expected_patch(repo: Path, tmp: Path) -> bytes:
    """`git diff --binary` of the whole working tree (untracked files too), made here independently."""
    index = tmp / "independent-index"
    git_bytes(repo, "read-tree", "HEAD", index=index)
    git_bytes(repo, "add", "-A", index=index)
    return git_bytes(repo, "-c", "core.quotepath=off", "diff", "--cached", "--binary", "--full-index", "--no-renames", "--no-color",
                     "--src-prefix=a/", "--dst-prefix=b/", "HEAD", index=index)


def run_ids(project: Project) -> list[str]:
    return [r.info.run_id for r in project.all_runs()]


def verdict_line(stdout: str) -> str:
    return stdout.strip().splitlines()[-2]


def test_awkward_dirty_tree_is_recorded_and_replayed_bitwise(fresh_project: Project, tmp_path: Path) -> None:
    p = fresh_project
    exp = p.root / EXP
    (exp / "tools").mkdir()
    (exp / "tools/run.sh").write_bytes(b"#!/bin/sh\necho hi\n")
    (exp / "old.txt").write_bytes(b"to be deleted\n")
    (exp / "before.txt").write_bytes(b"to be renamed\r\n")
    git(p.root, "add", "-A")
    git(p.root, "commit", "-qm", "files to change")

    (exp / "train.py").write_text(TRAIN)
    (exp / "data").mkdir()
    (exp / "data/crlf.txt").write_bytes(b"one\r\ntwo\r\n")
    (exp / "data/cr.txt").write_bytes(b"one\rtwo\rno newline at the end")
    (exp / "data/latin1.txt").write_bytes("café, été, naïve\n".encode("latin-1"))
    (exp / "data/blob.bin").write_bytes(bytes(range(256)) * 8 + b"\0\0\r\n")
    (exp / "data/empty.txt").write_bytes(b"")
    os.chmod(exp / "tools/run.sh", 0o755)
    os.symlink("crlf.txt", exp / "data/link.txt")
    (exp / "old.txt").unlink()
    (exp / "before.txt").rename(exp / "after.txt")
    (exp / "données été").mkdir()
    (exp / "données été/ü x.txt").write_bytes("spaces and accents\n".encode())
    scope: dict = {}
    exec(CHECKSUM, scope)
    checksum = float(scope["tree_checksum"](exp))
    patch = expected_patch(p.root, tmp_path)

    run = p.harness("run", EXP, "train.epochs=2")
    assert run.returncode == 0, run.stderr
    client = p.client()
    original = client.get_run(run.last_line)
    assert {m.value for m in client.get_metric_history(run.last_line, "tree")} == {checksum}
    stored = Path(client.download_artifacts(run.last_line, "git/uncommitted.patch", str(tmp_path))).read_bytes()
    assert stored == patch
    assert original.data.tags["harness.git.patch_sha256"] == hashlib.sha256(patch).hexdigest()

    # The replay must take every byte from the record: the user's tree goes back to clean.
    git(p.root, "stash", "-u")
    assert git(p.root, "status", "--porcelain") == ""
    result = p.harness("replay", run.last_line)
    assert result.returncode == 0, result.stdout + result.stderr
    assert verdict_line(result.stdout).startswith("verdict: BITWISE")
    assert client.get_run(result.last_line).data.tags["harness.git.patch_sha256"] == hashlib.sha256(patch).hexdigest()
    assert git(p.root, "status", "--porcelain") == ""


def test_altered_patch_is_refused_at_replay(fresh_project: Project) -> None:
    p = fresh_project
    (p.root / EXP / "helper.py").write_text("SCALE = 3\n")
    run = p.harness("run", EXP, "train.epochs=1")
    assert run.returncode == 0, run.stderr
    [artifact] = [f for f in p.store.rglob("uncommitted.patch") if run.last_line in f.parts]
    altered = artifact.read_bytes().replace(b"SCALE = 3", b"SCALE = 4")
    artifact.write_bytes(altered)
    expected = p.client().get_run(run.last_line).data.tags["harness.git.patch_sha256"]
    result = p.cli("replay", run.last_line)
    # The seal catches the edit first (harness/record/seal.py) ...
    refused(result, f"run {run.last_line} was changed after it was sealed: artifact git/uncommitted.patch (sha256 "
                    f"{expected[:12]} -> {hashlib.sha256(altered).hexdigest()[:12]}). Use an intact copy of the run (its "
                    "original store, or a bundle exported before the edit), or record it again with `harness run`.")
    assert run_ids(p) == [run.last_line]
    # ... and a run recorded before seals existed (no seal tag, no manifest) is held to its patch's sha256.
    client = p.client()
    client.delete_tag(run.last_line, "harness.seal")
    [manifest] = [f for f in p.store.rglob("manifest.json") if run.last_line in f.parts and f.parent.name == "seal"]
    manifest.unlink()
    result = p.cli("replay", run.last_line)
    assert result.stderr.strip().splitlines()[0].startswith(f"Warning: run {run.last_line} has no seal")
    result.stderr = result.stderr.strip().split("\n", 1)[1]
    refused(result, f"the recorded patch was altered in run {run.last_line} (git/uncommitted.patch: sha256 "
                    f"expected {expected}, got {hashlib.sha256(altered).hexdigest()}); the replay would run code "
                    "that never ran. Restore the artifact from a backup of the store, or replay another run.")
    assert run_ids(p) == [run.last_line]  # no replay run was started


def test_moved_submodule_and_nested_repository_are_refused(fresh_project: Project, tmp_path: Path) -> None:
    p = fresh_project
    other = tmp_path / "sub repo"
    other.mkdir()
    git(other, "init", "-q", "-b", "main")
    git(other, "commit", "-q", "--allow-empty", "-m", "one")
    git(p.root, "-c", "protocol.file.allow=always", "submodule", "-q", "add", str(other), "libs/sub")
    git(p.root, "commit", "-qm", "submodule")
    head = git(p.root, "rev-parse", "HEAD")
    git(p.root / "libs/sub", "commit", "-q", "--allow-empty", "-m", "two")
    moved = git(p.root / "libs/sub", "rev-parse", "HEAD")
    refused(p.cli("run", EXP), (
        f"submodule 'libs/sub' is checked out at {moved[:12]}, not at the commit recorded in {head[:12]}; the "
        "code record cannot hold a submodule change. Commit the submodule update (git add 'libs/sub' && git "
        "commit), or check it out at the recorded commit."))
    git(p.root / "libs/sub", "checkout", "-q", "HEAD~1")

    nested = p.root / EXP / "vendor lib"
    nested.mkdir()
    git(nested, "init", "-q", "-b", "main")
    (nested / "x.py").write_text("X = 1\n")
    git(nested, "add", "-A")
    git(nested, "commit", "-qm", "nested")
    refused(p.cli("run", EXP), (
        f"'{EXP}/vendor lib' is an untracked git repository inside the repository; the code record cannot hold "
        "it. Add it to .gitignore, or add it as a submodule and commit the submodule."))
    assert run_ids(p) == []


@pytest.mark.parametrize("setting", ["gitattributes", "autocrlf"])
def test_file_git_would_convert_is_refused(fresh_project: Project, setting: str) -> None:
    p = fresh_project
    if setting == "gitattributes":
        (p.root / ".gitattributes").write_text("*.txt text eol=lf\n")
        git(p.root, "add", ".gitattributes")
        git(p.root, "commit", "-qm", "eol")
    else:
        git(p.root, "config", "core.autocrlf", "true")
    (p.root / EXP / "notes.txt").write_bytes(b"windows\r\nline endings\r\n")
    refused(p.cli("run", EXP), (
        f"'{EXP}/notes.txt' cannot be recorded exactly: git stores it differently from its bytes on disk (a "
        ".gitattributes filter or eol setting, or core.autocrlf). Commit it, or remove the attribute for it."))
    assert run_ids(p) == []


def test_large_untracked_file_is_refused_until_the_limit_allows_it(fresh_project: Project) -> None:
    p = fresh_project
    (p.root / EXP / "data.bin").write_bytes(b"\0" * 10240)
    refused(p.cli("run", EXP, "record.max_untracked_mib=0.001"), (
        f"'{EXP}/data.bin' is an untracked file of 0.01 MiB (10240 bytes), over the code record's limit of "
        "0.001 MiB (record.max_untracked_mib). Commit it, add it to a .gitignore, or keep data outside the "
        "repository and declare it as data; or raise the limit (record.max_untracked_mib=50)."))
    assert run_ids(p) == []
    run = p.harness("run", EXP, "record.max_untracked_mib=0.1", "train.epochs=1")
    assert run.returncode == 0, run.stderr
    assert p.client().get_run(run.last_line).data.tags["harness.git.dirty"] == "true"


def test_untracked_files_warning_names_them(fresh_project: Project) -> None:
    p = fresh_project
    for i in range(7):
        (p.root / EXP / f"scratch{i}.py").write_text(f"# scratch {i}\n")
    result = p.harness("check", EXP)
    assert result.returncode == 0, result.stderr
    warning = next(line for line in result.stderr.splitlines() if line.startswith("Warning: uncommitted changes"))
    names = ", ".join(f"'{EXP}/scratch{i}.py'" for i in range(5))
    assert warning.endswith(f"Untracked files among them: {names} and 2 more."), warning


def test_framework_output_folders_are_named_with_the_ctx_output_dir_fix(fresh_project: Project) -> None:
    # What a Lightning script writes into its working folder (the experiment folder) without default_root_dir.
    p = fresh_project
    logs = p.root / EXP / "lightning_logs" / "version_0"
    (logs / "checkpoints").mkdir(parents=True)
    (logs / "checkpoints" / "epoch=0-step=4.ckpt").write_bytes(b"\0" * 10240)
    (logs / "hparams.yaml").write_text("lr: 0.1\n")
    hint = (" lightning_logs/ is what a training framework writes into its working folder, which in a rank is the "
            "experiment folder: point it at ctx.output_dir (Lightning: Trainer(default_root_dir=ctx.output_dir) or "
            "**harness.lightning.trainer_kwargs(ctx); wandb: wandb.init(dir=ctx.output_dir)), and add lightning_logs/ "
            "to .gitignore.")
    refused(p.cli("run", EXP, "record.max_untracked_mib=0.001"), (
        f"'{EXP}/lightning_logs/version_0/checkpoints/epoch=0-step=4.ckpt' is an untracked file of 0.01 MiB (10240 "
        "bytes), over the code record's limit of 0.001 MiB (record.max_untracked_mib). Commit it, add it to a "
        "'.gitignore, or keep data outside the repository and declare it as data; or raise the limit "
        f"(record.max_untracked_mib=50).{hint}").replace("'.gitignore", ".gitignore"))
    result = p.cli("check", EXP)
    assert result.returncode == 0, result.stderr
    warning = next(line for line in result.stderr.splitlines() if line.startswith("Warning: uncommitted changes"))
    assert warning.endswith(hint), warning
    assert gitsource.framework_outputs(["a/wandb/run-1/files/x", "outputs/2026-12-02/y", "wandb.py", "lightning_logs"]) \
        == ["wandb/", "outputs/"]


def test_untracked_secret_is_refused_unless_allowed(fresh_project: Project, tmp_path: Path) -> None:
    p = fresh_project
    (p.root / EXP / ".env").write_text("API_TOKEN=tok-allowed-on-purpose\n")
    refused(p.cli("run", EXP), (
        f"'{EXP}/.env' is an untracked file whose name marks it as a secret (.env); it would be stored with "
        "the run's code. Add it to .gitignore, commit it if it holds no secret, or pass "
        "--allow-untracked-secrets knowingly."))
    assert run_ids(p) == []
    # Its name allowed, its content is still read (issue 36): a literal token is refused by file and line ...
    content = p.cli("run", EXP, "--allow-untracked-secrets")
    assert content.returncode == EXIT_USAGE and f"'{EXP}/.env' line 1 (literal API_TOKEN)" in content.stderr
    assert "tok-allowed-on-purpose" not in content.stderr and run_ids(p) == []
    # ... and --allow-secret-in-diff records the file with the token cut out.
    run = p.harness("run", EXP, "train.epochs=1", "--allow-untracked-secrets", "--allow-secret-in-diff")
    assert run.returncode == 0, run.stderr
    stored = Path(p.client().download_artifacts(run.last_line, "git/uncommitted.patch", str(tmp_path))).read_bytes()
    assert b"+API_TOKEN=<redacted>" in stored and b"tok-allowed-on-purpose" not in stored


@pytest.mark.parametrize("name", ["id_ed25519.pub", "server.PEM", "credentials.json", "prod.env", ".env.local",
                                  "secrets.yaml", ".netrc", "vault.kdbx"])
def test_secret_names(name: str) -> None:
    assert gitsource.secret_pattern(f"a/b/{name}".encode()) is not None


@pytest.mark.parametrize("name", ["environment.py", "keys.py", "env/x.py", "monkey.txt", "credential_check.py"])
def test_ordinary_names_are_not_secrets(name: str) -> None:
    assert gitsource.secret_pattern(name.encode()) is None


def test_no_secret_reaches_the_store(fresh_project: Project) -> None:
    p = fresh_project
    secrets = {"dotenv": "ghp_dotenvSECRETvalue123", "torch": "torch-SECRET-42abc", "nccl": "nccl-SECRET-77xyz"}
    with open(p.root / ".gitignore", "a") as fh:
        fh.write(".env\n")
    git(p.root, "commit", "-qam", "ignore .env")
    (p.root / ".env").write_text(f"GITHUB_TOKEN={secrets['dotenv']}\n")
    (p.root / EXP / "helper.py").write_text("SCALE = 3\n")  # dirty, so a patch is stored too
    run = p.harness("run", EXP, "train.epochs=1",
                    env={"TORCH_TOKEN": secrets["torch"], "NCCL_AUTH_KEY": secrets["nccl"]})
    assert run.returncode == 0, run.stderr
    tags = p.client().get_run(run.last_line).data.tags
    assert tags["harness.var.TORCH_TOKEN"] == "<redacted>" and tags["harness.var.NCCL_AUTH_KEY"] == "<redacted>"
    assert tags["harness.git.repo_url"] == "https://example.invalid/lab/project.git"
    files = [f for f in p.store.rglob("*") if f.is_file()]
    assert any(f.name == "mlflow.db" for f in files) and any(f.name == "uncommitted.patch" for f in files)
    for f in files:
        data = f.read_bytes()
        for planted in [*secrets.values(), "s3cret"]:
            assert planted.encode() not in data, f"{planted} found in {f}"


HOSTILE_DIFF_CONFIG = {
    "diff.noprefix": "true", "diff.mnemonicPrefix": "true", "color.ui": "always", "color.diff": "always",
    "diff.external": "/bin/false", "diff.renames": "copies", "diff.relative": "true", "diff.context": "0",
    "diff.submodule": "log", "diff.suppressBlankEmpty": "true", "core.quotepath": "true",
    "diff.algorithm": "patience", "diff.indentHeuristic": "false",
}


def test_user_diff_config_does_not_change_the_patch(tmp_path: Path) -> None:
    root = tmp_path / "repo ü"
    root.mkdir()
    git(root, "init", "-q", "-b", "main")
    (root / "a.py").write_text("def f():\n    return 1\n\n\ndef g():\n    return 2\n")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "base")
    (root / "a.py").write_text("def f():\n    return 10\n\n\ndef g():\n\n    return 2\n")
    (root / "données.txt").write_bytes(b"x\r\n")
    (root / "renamed.py").write_bytes((root / "a.py").read_bytes())
    plain = gitsource.inspect(root, max_untracked_mib=None)
    order = tmp_path / "order"
    order.write_text("renamed.py\n")
    for key, value in {**HOSTILE_DIFF_CONFIG, "diff.orderFile": str(order)}.items():
        git(root, "config", key, value)
    hostile = gitsource.inspect(root, max_untracked_mib=None)
    assert hostile.patch == plain.patch
    with gitworktree.worktree(root, hostile.commit, hostile.patch) as tree:
        assert _snapshot(tree) == _snapshot(root)


def test_file_converted_on_checkout_is_refused_at_replay(tmp_path: Path) -> None:
    """The recorded bytes were right, but `git apply` in the replay worktree writes through an attribute."""
    from harness.errors import HarnessError

    root = tmp_path / "repo"
    root.mkdir()
    git(root, "init", "-q", "-b", "main")
    (root / ".gitattributes").write_text("*.dat text eol=crlf\n")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "crlf on checkout")
    (root / ".gitattributes").write_text("")  # the dirty tree drops the attribute: its .dat stays LF
    (root / "x.dat").write_bytes(b"1\n2\n")
    state = gitsource.inspect(root, max_untracked_mib=None)
    recorded, converted = gitsource.blob_id(b"1\n2\n"), gitsource.blob_id(b"1\r\n2\r\n")
    with pytest.raises(HarnessError) as err:
        with gitworktree.worktree(root, state.commit, state.patch):
            pass
    assert str(err.value) == (
        f"'x.dat' in the replay worktree is not what was recorded (mode 100644 blob {converted} instead of mode "
        f"100644 blob {recorded}): git converted it on checkout (a .gitattributes filter or eol setting, or "
        "core.autocrlf of this repository). Remove that setting for it, or replay in a clone without it.")
    assert git(root, "worktree", "list").count("\n") == 0  # the temporary worktree is gone


# --- the round trip as a property, straight through gitsource ------------------------------------

# "\udce9": the byte 0xe9 alone, a name that is not UTF-8 (os.fsencode gives it back as is).
_NAME = st.text(alphabet=list("abcXY z_-.é日ü\t\n\r\udce9"), min_size=1, max_size=6).filter(lambda n: n not in (".", ".."))
_DIRS = ("", "sub dir", "ñ d/deeper")  # no generated name can equal one of them
_BYTES = st.one_of(
    st.binary(max_size=48),
    st.lists(st.sampled_from([b"a", b"\r\n", b"\n", b"\r", b"\0", b"\xe9", b"\xff\xfe", b" ", b"\\"]),
             max_size=24).map(b"".join),
)
_FILES = st.dictionaries(st.tuples(st.sampled_from(_DIRS), _NAME).map(lambda t: os.path.join(*filter(None, t))),
                         st.tuples(_BYTES, st.booleans()), max_size=6)
_CHANGE = st.sampled_from(["keep", "modify", "delete", "chmod", "modify+chmod", "symlink"])


def _snapshot(root: Path) -> dict[str, tuple]:
    """Every file and symlink under root (but .git) with its bytes or target and executable bit."""
    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != ".git"] if Path(dirpath) == root else dirnames  # a worktree's .git is a file
        top = Path(dirpath) == root
        for name in [f for f in filenames if not (top and f == ".git")] + [
            d for d in dirnames if os.path.islink(os.path.join(dirpath, d))
        ]:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, root)
            st_ = os.lstat(full)
            if stat.S_ISLNK(st_.st_mode):
                out[rel] = ("link", os.readlink(full))
            else:
                out[rel] = ("file", Path(full).read_bytes(), bool(st_.st_mode & stat.S_IXUSR))
    return out


def _write(path: Path, data: bytes, executable: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    os.chmod(path, 0o755 if executable else 0o644)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(committed=_FILES, changes=st.lists(st.tuples(_CHANGE, _BYTES), min_size=6, max_size=6), added=_FILES)
def test_patch_round_trips_any_tree(committed: dict, changes: list, added: dict) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp, "repo é x")
        root.mkdir()
        git(root, "init", "-q", "-b", "main")
        for rel, (data, executable) in committed.items():
            _write(root / rel, data, executable)
        git(root, "add", "-A")
        git(root, "commit", "-q", "--allow-empty", "-m", "base")
        for (rel, (_, executable)), (change, data) in zip(committed.items(), changes):
            path = root / rel
            if change == "delete":
                path.unlink()
            elif change == "symlink":
                path.unlink()
                os.symlink(data.replace(b"\0", b"") or b"target", os.fsencode(path))
            else:
                if "modify" in change:
                    path.write_bytes(data)
                if "chmod" in change:
                    os.chmod(path, 0o644 if executable else 0o755)
        for rel, (data, executable) in added.items():
            if not os.path.lexists(root / rel):
                _write(root / rel, data, executable)
        status = git_bytes(root, "status", "--porcelain", "-z")

        state = gitsource.inspect(root, max_untracked_mib=None, allow_secrets=True)
        assert git_bytes(root, "status", "--porcelain", "-z") == status  # the user's index is untouched
        with gitworktree.worktree(root, state.commit, state.patch) as tree:
            assert _snapshot(tree) == _snapshot(root)
