"""A recorded run's code, checked out: its commit and patch (and its submodules') in a temporary worktree, from the
live repository or the code bundle an imported run carries.

Apart from harness/record/rerun.py (which also builds the job to run it) so that a backend that checks a run's code
out where its ranks will run (Slurm) needs nothing of the executors' registry: no import circle through it.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from pathlib import Path

from harness import scratch, tags as T
from harness.errors import RepositoryError, RunRefused
from harness.record import confine
from harness.store.tracking import RunSummary, Tracker
from harness.systems import git as gitsource, gitbundle, gitworktree


@contextlib.contextmanager
def checkout(
    tracker: Tracker, run: RunSummary, repo: Path | None = None, base: Path | None = None, commit: str | None = None
) -> Iterator[tuple[Path, Path]]:
    """The run's recorded code (commit + patch) in a temporary worktree; yields (worktree, experiment folder).
    `commit`: that commit of the live repository instead, as committed (no patch: the patch belongs to the run's).

    The user's working tree and index are never touched.
    """
    with contextlib.ExitStack() as stack:
        if commit is not None and commit != run.tags[T.GIT_COMMIT]:
            root = gitsource.find_repo(repo or Path.cwd())
            if root is None or not gitsource.has_commit(root, commit):
                raise RepositoryError(f"commit {commit[:12]} is not in the repository at {repo or Path.cwd()}. "
                                   "Run this inside a clone that has it (git fetch).")
            path = confine.recorded_path(run.tags[T.EXPERIMENT_PATH], "experiment folder", run.run_id)
            with gitworktree.worktree(root, commit, None, base) as tree:
                yield tree, tree / path
            return
        root = _code_source(stack, tracker, run, repo)
        with _checkout_from(tracker, run, root, run.tags[T.GIT_COMMIT], base) as checked_out:
            yield checked_out


def _code_source(stack: contextlib.ExitStack, tracker: Tracker, run: RunSummary, repo: Path | None) -> Path:
    """The repository to check the recorded commit out from.

    The live repository (`repo`, else the one holding the current folder) wins when it has the commit;
    otherwise the code bundle an imported run carries (harness import), in a temporary repository.
    """
    commit = run.tags[T.GIT_COMMIT]
    live = gitsource.find_repo(repo or Path.cwd())
    if live is not None and gitsource.has_commit(live, commit):
        return live
    tmp = stack.enter_context(scratch.folder("code-bundle"))
    bundle = tracker.download(run.run_id, T.ARTIFACT_CODE_BUNDLE, tmp)
    if bundle is not None:
        return stack.enter_context(gitbundle.repository_from_bundle(bundle, commit))
    if live is None:
        gitsource.open_repo(repo or Path.cwd())  # raises its one line: not inside a git repository
    url = run.tags.get(T.GIT_REPO_URL)
    source = f"git fetch {url} {commit}" if url else f"git fetch <remote> {commit}"
    raise RepositoryError(
        f"commit {commit[:12]} of run {run.run_id} is not in the repository at {live}. "
        f"Fetch it ({source}) or run this inside a clone that has it."
    )


@contextlib.contextmanager
def _checkout_from(
    tracker: Tracker, run: RunSummary, root: Path, commit: str, base: Path | None
) -> Iterator[tuple[Path, Path]]:
    patch = None
    if run.tags.get(T.GIT_DIRTY) == "true":
        patch = _code_artifact(tracker, run, T.ARTIFACT_PATCH, T.GIT_PATCH_SHA256, "patch was", "was dirty")
    with gitworktree.worktree(root, commit, patch, base, recorded_submodules(tracker, run)) as tree:
        yield tree, tree / confine.recorded_path(run.tags[T.EXPERIMENT_PATH], "experiment folder", run.run_id)


def _code_artifact(tracker: Tracker, run: RunSummary, artifact: str, digest_tag: str, what: str, had: str) -> bytes:
    """An artifact of the run's code record, held to the sha256 its tag recorded: an edited one would replay code
    that never ran."""
    raw = tracker.read_bytes(run.run_id, artifact)
    if raw is None:
        raise RunRefused(f"run {run.run_id} {had} but its {artifact} artifact is missing. Restore it from a backup "
                           "of the store, or replay another run.")
    expected, got = run.tags.get(digest_tag, "(no tag)"), hashlib.sha256(raw).hexdigest()
    if got != expected:
        raise RunRefused(
            f"the recorded {what} altered in run {run.run_id} ({artifact}: sha256 expected {expected}, got {got}); the "
            "replay would run code that never ran. Restore the artifact from a backup of the store, or replay another run."
        )
    return raw


def recorded_submodules(tracker: Tracker, run: RunSummary) -> tuple[gitsource.Submodule, ...]:
    """The submodules the run's code record holds (each one's commit and patch), checked against their tag."""
    expected = run.tags.get(T.GIT_SUBMODULES_SHA256)
    if expected is None:
        return ()
    raw = _code_artifact(tracker, run, T.ARTIFACT_SUBMODULES, T.GIT_SUBMODULES_SHA256, "submodules were",
                         "recorded submodules")
    try:
        return gitsource.submodules_from_json(raw)
    except ValueError as err:
        raise RunRefused(f"run {run.run_id}'s {T.ARTIFACT_SUBMODULES} is malformed ({err}). Replay another run.") from None
