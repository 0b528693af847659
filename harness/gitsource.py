"""The only boundary to git: commit, branch, dirty patch, remote URL, and replay worktrees."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator
from harness.errors import HarnessError
from harness.urls import strip_credentials


@dataclass(frozen=True)
class GitState:
    root: Path
    commit: str
    branch: str | None  # None on a detached HEAD
    dirty: bool
    patch: str  # tracked and untracked (not ignored) changes against `commit`, binary-safe
    repo_url: str | None  # origin's URL with any credentials stripped


def _git():  # lazy: gitpython spawns `git` on import checks
    import git

    return git


def open_repo(path: Path):
    git = _git()
    try:
        return git.Repo(path, search_parent_directories=True)
    except (git.InvalidGitRepositoryError, git.NoSuchPathError):
        raise HarnessError(
            f"'{path}' is not inside a git repository; harness records the commit of every run. "
            "Run `git init` and commit the experiment first."
        ) from None


def inspect(path: Path) -> GitState:
    """Read the repository holding `path`; the user's index and tree are never modified."""
    repo = open_repo(path)
    if not repo.head.is_valid():
        raise HarnessError(f"git repository '{repo.working_tree_dir}' has no commits yet. Commit the experiment first.")
    commit = repo.head.commit.hexsha
    branch = None if repo.head.is_detached else repo.active_branch.name
    patch = _working_tree_patch(repo)
    url = None
    with contextlib.suppress(Exception):
        remote = repo.remotes.origin if "origin" in repo.remotes else (repo.remotes[0] if repo.remotes else None)
        url = strip_credentials(next(remote.urls)) if remote is not None else None
    return GitState(Path(repo.working_tree_dir), commit, branch, bool(patch), patch, url)


def _working_tree_patch(repo) -> str:
    # A throwaway index seeded from HEAD: `add -A` then sees untracked files too, and the
    # user's real index (staged work) stays exactly as it was.
    with tempfile.TemporaryDirectory() as tmp:
        env = {"GIT_INDEX_FILE": os.path.join(tmp, "index")}
        repo.git.read_tree("HEAD", env=env)
        repo.git.add("-A", env=env)
        return repo.git.diff("--cached", "--binary", "HEAD", env=env, strip_newline_in_stdout=False)


def has_commit(root: Path, commit: str) -> bool:
    git = _git()
    repo = open_repo(root)
    try:
        repo.commit(commit)
        return True
    except (ValueError, git.BadName, git.GitCommandError):
        return False


@contextlib.contextmanager
def worktree(root: Path, commit: str, patch: str | None) -> Iterator[Path]:
    """A detached temporary worktree at `commit` with `patch` applied; removed afterwards."""
    git = _git()
    repo = open_repo(root)
    tmp = Path(tempfile.mkdtemp(prefix="harness-replay-"))
    path = tmp / "tree"
    repo.git.worktree("add", "--detach", str(path), commit)
    try:
        if patch:
            patch_file = tmp / "uncommitted.patch"
            patch_file.write_text(patch)
            try:
                git.Repo(path).git.apply("--binary", "--whitespace=nowarn", str(patch_file))
            except git.GitCommandError as err:
                msg = (err.stderr or str(err)).strip().splitlines()
                raise HarnessError(
                    f"the recorded patch does not apply to {commit[:12]}: {msg[0] if msg else err}. "
                    "The commit in this repository differs from the recorded one."
                ) from None
        yield path
    finally:
        with contextlib.suppress(git.GitCommandError):
            repo.git.worktree("remove", "--force", str(path))
        with contextlib.suppress(git.GitCommandError):
            repo.git.worktree("prune")
        shutil.rmtree(tmp, ignore_errors=True)
