"""A recorded commit and its dirty-tree patch checked out in a scratch git worktree (submodules too), and the
worktrees a killed process left behind pruned. Part of the one door to git, with harness/systems/git.py."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from harness import scratch
from harness.errors import RepositoryError
from harness.systems.git import (
    GitFailed,
    Submodule,
    gitpython,
    has_commit,
    open_repo,
    repo_object_format,
    run_git,
    shown_path,
    verify_patch,
)

_WORKTREE_PREFIX = "harness-code-"
_STALE = re.compile(rf"{_WORKTREE_PREFIX}(\d+)-[^/]*/tree$")


def prune_stale_worktrees(repo: Any) -> list[str]:
    """Remove the worktrees that harness processes killed before their cleanup left registered in the user's
    repository (`git worktree list`), with their folders; returns their paths."""
    git = gitpython()
    removed: list[str] = []
    try:
        listing = repo.git.worktree("list", "--porcelain")
    except git.GitCommandError:
        return removed
    for line in listing.splitlines():
        if not line.startswith("worktree "):
            continue
        path = line[len("worktree "):]
        match = _STALE.search(path)
        if match is None or scratch.alive(int(match.group(1))):
            continue
        with contextlib.suppress(git.GitCommandError):
            repo.git.worktree("remove", "--force", path)
        shutil.rmtree(Path(path).parent, ignore_errors=True)
        removed.append(path)
    if removed:
        with contextlib.suppress(git.GitCommandError):
            repo.git.worktree("prune")
    return removed


def _apply(path: Path, commit: str, patch: bytes, patch_file: Path, what: str) -> None:
    """Apply a recorded patch to the checkout at `path` (of `commit`) and check every byte it touches."""
    patch_file.write_bytes(patch)
    try:
        run_git(path, ["apply", "--binary", "--whitespace=nowarn", str(patch_file)])
    except GitFailed as err:
        raise RepositoryError(
            f"the recorded patch{what} does not apply to {commit[:12]}: {err.detail}. "
            "The commit in this repository differs from the recorded one."
        ) from None
    # git apply writes through checkout filters and eol conversion: the bytes the ranks
    # would read may differ from the ones recorded.
    mismatch = verify_patch(path, commit, patch, path)
    if mismatch is not None:
        raise RepositoryError(
            f"'{mismatch.path}'{what} in the replay worktree is not what was recorded ({mismatch.found} instead of "
            f"{mismatch.expected}): git converted it on checkout (a .gitattributes filter or eol setting, or "
            "core.autocrlf of this repository). Remove that setting for it, or replay in a clone without it."
        )


def _check_out_submodule(root: Path, tree: Path, sub: Submodule, scratch_dir: Path) -> None:
    """The submodule at its recorded commit, in its folder of the replay worktree, with its patch applied.

    Its objects come from the repository's own checkout of it (root/PATH), or from `root` itself when that holds
    them (a code bundle carries the submodules' commits): a shared clone borrows them, so nothing is fetched from
    the submodule's URL and nothing is registered in the user's repositories."""
    shown = shown_path(os.fsencode(sub.path))
    dest = tree / sub.path
    if not dest.resolve().is_relative_to(tree.resolve()):  # a symbolic link of the commit on the way
        raise RepositoryError(f"submodule '{shown}' lies outside the worktree of the recorded commit (a symbolic link "
                           "on its path). Replay another run.")
    source = None
    for candidate in (root / sub.path, root):
        if (candidate / ".git").exists() and has_commit(candidate, sub.commit):
            source = candidate
            break
    if source is None:
        raise RepositoryError(
            f"commit {sub.commit[:12]} of submodule '{shown}' is not in the repository at {root / sub.path}. "
            f"Fetch it there (git -C '{shown}' fetch), or run this inside a clone that has it."
        )
    dest.mkdir(parents=True, exist_ok=True)
    shallow = Path(run_git(source, ["rev-parse", "--path-format=absolute", "--git-path", "shallow"]).strip().decode())
    if shallow.is_file():  # a code bundle without history (export --tree-only): git's clone would not borrow from it
        run_git(dest, ["init", "-q", f"--object-format={repo_object_format(source)}", "."])
        objects = run_git(source, ["rev-parse", "--path-format=absolute", "--git-path", "objects"]).strip().decode()
        (dest / ".git" / "objects" / "info" / "alternates").write_text(objects + "\n")
        shutil.copyfile(shallow, dest / ".git" / "shallow")
    else:
        run_git(dest, ["clone", "-q", "--no-checkout", "--shared", str(source), "."])
    run_git(dest, ["checkout", "-q", "--detach", sub.commit])
    if sub.patch:
        _apply(dest, sub.commit, sub.patch, scratch_dir / "submodule.patch", f" of submodule '{shown}'")


@contextlib.contextmanager
def worktree(root: Path, commit: str, patch: bytes | None, base: Path | None = None,
             submodules: Sequence[Submodule] = ()) -> Iterator[Path]:
    """A detached temporary worktree at `commit` with `patch` applied and checked byte for byte; removed afterwards.
    Each of `submodules` is checked out in it at its commit, its own patch applied.

    `base`: the folder to make it in (default: the system's temporary folder).
    """
    git = gitpython()
    repo = open_repo(root)
    prune_stale_worktrees(repo)
    # The pid in the name: a worktree whose process was killed is known as stale by the next one.
    tmp = Path(tempfile.mkdtemp(prefix=f"{_WORKTREE_PREFIX}{os.getpid()}-", dir=base))
    path = tmp / "tree"
    try:
        repo.git.worktree("add", "--detach", str(path), commit)
    except git.GitCommandError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        with contextlib.suppress(git.GitCommandError):
            repo.git.worktree("prune")
        lines = [line.strip() for line in str(err.stderr or "").splitlines() if line.strip()]
        said = [line[line.index("error:"):] for line in lines if "error:" in line] or [lines[-1].strip("'")] if lines else []
        detail = shown_path(os.fsencode(said[0])) if said else f"exit {err.status}"
        raise RepositoryError(
            f"commit {commit[:12]} cannot be checked out ({detail}); git refuses its tree (a '.git' path, or a "
            "name this filesystem cannot hold). Replay a run whose commit git can check out."
        ) from None
    try:
        if patch:
            _apply(path, commit, patch, tmp / "uncommitted.patch", "")
        for sub in submodules:  # parents first: a nested one's folder is in its parent's checkout
            _check_out_submodule(root, path, sub, tmp)
        yield path
    finally:
        with contextlib.suppress(git.GitCommandError):
            repo.git.worktree("remove", "--force", str(path))
        with contextlib.suppress(git.GitCommandError):
            repo.git.worktree("prune")
        shutil.rmtree(tmp, ignore_errors=True)
