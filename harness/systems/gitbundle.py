"""A run's code as a `git bundle` (a bundle's one ref names the recorded commit, one more ref each submodule's) and
the repository made back from one. Part of the one door to git, with harness/systems/git.py."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from harness import scratch
from harness.errors import RepositoryError
from harness.systems.git import (
    DIFF_ARGS,
    DIFF_CONFIG,
    GIT_TIMEOUT_S,
    GitFailed,
    Submodule,
    has_commit,
    repo_object_format,
    run_git,
)

BUNDLE_REF = "refs/harness/recorded"  # the one ref of a run's code bundle, naming the recorded commit


SUBMODULE_REFS = "refs/harness/submodules/"  # a code bundle's refs naming its submodules' commits, one each


def _objects(root: Path) -> str:
    return run_git(root, ["rev-parse", "--path-format=absolute", "--git-path", "objects"]).strip().decode()


def bundle_commit(root: Path, commit: str, dest: Path, submodules: Sequence[Submodule] = (),
                  tree_only: bool = False) -> None:
    """Write a git bundle holding `commit` and its history to `dest`: the code travels without the remote. With
    `submodules`, each one's commit too (from its checkout under `root`), under SUBMODULE_REFS. With `tree_only`,
    the commits without their history: the same commit ids, with their trees and nothing before them.

    A bundle must name a ref; it is made in a scratch repository that borrows the objects of `root`
    (git alternates), so the user's refs stay as they are. A history-free bundle is made from it marked shallow
    at the commits (git's own cut: the commit objects keep their parents' ids, the parents stay behind).
    """
    if not has_commit(root, commit):
        raise RepositoryError(
            f"commit {commit[:12]} is not in the repository at {root}. Run the export inside a clone that has it."
        )
    alternates = [_objects(root)]
    for sub in submodules:
        sub_root = root / sub.path
        if not ((sub_root / ".git").exists() and has_commit(sub_root, sub.commit)):
            raise RepositoryError(
                f"commit {sub.commit[:12]} of submodule '{sub.path}' is not in its checkout at {sub_root}. Run the "
                f"export inside a clone whose submodules have it (git submodule update --init)."
            )
        alternates.append(_objects(sub_root))
    with scratch.folder("bundle") as tmp:
        bare = Path(tmp, "scratch.git")
        run_git(Path(tmp), ["init", "-q", "--bare", f"--object-format={repo_object_format(root)}", str(bare)])
        (bare / "objects" / "info" / "alternates").write_text("".join(f"{a}\n" for a in alternates))
        run_git(bare, ["update-ref", BUNDLE_REF, commit])
        refs = [BUNDLE_REF]
        for index, sub in enumerate(submodules):
            refs.append(f"{SUBMODULE_REFS}{index}")
            run_git(bare, ["update-ref", refs[-1], sub.commit])
        if tree_only:
            (bare / "shallow").write_text("".join(f"{c}\n" for c in sorted({commit, *(s.commit for s in submodules)})))
        run_git(bare, ["bundle", "create", "-q", str(dest), *refs])


def shipped_changes(root: Path, commit: str, tree_only: bool = False) -> Iterator[tuple[str, str, bytes]]:
    """(commit, message, patch) of each commit a code bundle of `commit` ships, newest first: its whole history,
    or with `tree_only` the commit alone as one patch creating its tree. The patches are exact bytes, binary
    hunks included, in the record's own diff format (systems/git.py)."""
    if tree_only:
        empty = run_git(root, ["hash-object", "-t", "tree", "--stdin"], stdin=b"").strip().decode("ascii")
        message = run_git(root, ["log", "-1", "--format=%B", commit]).decode(errors="replace")
        yield commit, message, run_git(root, ["diff", *DIFF_ARGS, empty, commit], config=DIFF_CONFIG)
        return
    # One `git log -p` for the whole history, read as it comes (a long history with binaries runs to gigabytes):
    # a marker no commit message holds opens each commit.
    args = ["git", *(a for item in DIFF_CONFIG for a in ("-c", item)), "log", "-p",
            "--format=%x01%x02%H%n%B%x01%x03", *DIFF_ARGS, commit]
    deadline = time.monotonic() + GIT_TIMEOUT_S
    with subprocess.Popen(args, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL) as proc:
        assert proc.stdout is not None  # stdout=PIPE
        pending = b""
        try:
            for block in iter(lambda: proc.stdout.read(1 << 20), b""):  # type: ignore[union-attr]
                if time.monotonic() > deadline:
                    raise RepositoryError(
                        f"reading the git history of {commit[:12]} in '{root}' for secrets took over {GIT_TIMEOUT_S} s. "
                        "Export with --tree-only (the recorded commit without its history).")
                *done, pending = (pending + block).split(b"\x01\x02")
                yield from (_commit_of(chunk) for chunk in done if chunk)
            if pending:
                yield _commit_of(pending)
        finally:
            proc.kill()
    if proc.returncode not in (0, -9):
        raise RepositoryError(f"`git log` of {commit[:12]} failed in '{root}'. Check the repository with `git status`.")


def _commit_of(chunk: bytes) -> tuple[str, str, bytes]:
    """(commit, message, patch) of one commit of shipped_changes' `git log -p`."""
    head, _, patch = chunk.partition(b"\x01\x03")
    sha, _, text = head.partition(b"\n")
    return sha.decode("ascii"), text.decode(errors="replace"), patch.lstrip(b"\n")


@contextlib.contextmanager
def repository_from_bundle(bundle: Path, commit: str) -> Iterator[Path]:
    """A temporary repository holding only what `bundle` holds; refused unless it contains `commit`."""
    heads = run_git(bundle.parent, ["bundle", "list-heads", str(bundle)]).split()
    object_format = "sha256" if heads and len(heads[0]) == 64 else "sha1"
    tmp = scratch.make("bundled")
    try:
        repo = tmp / "repo"
        run_git(tmp, ["init", "-q", f"--object-format={object_format}", str(repo)])
        specs = [f"{BUNDLE_REF}:{BUNDLE_REF}"]
        if any(h.startswith(SUBMODULE_REFS.encode()) for h in heads):  # the submodules' commits, when it carries them
            specs.append(f"{SUBMODULE_REFS}*:{SUBMODULE_REFS}*")
        try:
            run_git(repo, ["fetch", "-q", str(bundle), *specs])
        except GitFailed:  # a bundle without history (export --tree-only): the repository is made shallow there
            ids = [h.decode("ascii") for h in heads if len(h) in (40, 64) and not h.startswith(b"refs/")]
            (repo / ".git" / "shallow").write_text("".join(f"{i}\n" for i in ids))
            run_git(repo, ["fetch", "-q", str(bundle), *specs])
        if not has_commit(repo, commit):
            raise RepositoryError(
                f"the code bundle {bundle.name} does not hold the recorded commit {commit[:12]}. "
                "Export the run again from a repository that has it."
            )
        yield repo
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
