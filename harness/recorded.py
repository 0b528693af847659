"""A recorded run, made ready to run again: its stored config, and its code checked out and validated."""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from omegaconf import DictConfig

from harness import gitsource, runner
from harness import tags as T
from harness.config import validate
from harness.errors import HarnessError
from harness.tracking import RunSummary, Tracker


@dataclass
class RecordedRun:
    """A harness run as the store holds it, loaded by replay, resume and audit.

    Each command checks the run's status itself, may adjust `cfg` (replay's --world-size, overrides,
    --executor), then enters `code()`.
    """

    tracker: Tracker
    run: RunSummary
    cfg: DictConfig  # the resolved config stored with the run, device and backend pinned to what it ran on

    @classmethod
    def load(cls, tracker: Tracker, run: RunSummary) -> RecordedRun:
        return cls(tracker, run, runner.recorded_config(tracker, run))

    def job(self, tree: Path, exp_dir: Path, *, record: Any = None, topology: Any = None, **fields: Any) -> Any:
        """The job that runs this recorded code (inside `code()`); its image digest is the recorded one."""
        from harness.executors import Job, Topology

        tags = self.run.tags
        return Job(
            self.tracker, self.cfg, tree, exp_dir, record=record, recorded=self.run, topology=topology or Topology(),
            code_id=runner.code_id(tags[T.GIT_COMMIT], tags.get(T.GIT_PATCH_SHA256)), **fields,
        )

    def check_data(self, repo: Path | None = None, *, allow_changes: bool = False, flag: str | None = None) -> Any:
        """Hash the declared data again on this machine and hold it to the record (data.verify); before launch.

        The declaration is resolved against the experiment folder of the repository here (not the
        temporary worktree: data ignored by git, or outside the repository, is not in the code record).
        """
        from harness import data

        recorded = data.recorded_data(self.tracker, self.run.run_id)
        if recorded is None and not self.cfg.data:
            return data.DataCheck(None, [], {})
        root = Path(gitsource.open_repo(repo or Path.cwd()).working_tree_dir)
        exp_dir = root / self.run.tags[T.EXPERIMENT_PATH]
        return data.verify(
            self.cfg.data, recorded, exp_dir, root, run_id=self.run.run_id, allow_changes=allow_changes, flag=flag
        )

    @contextlib.contextmanager
    def code(self, repo: Path | None = None) -> Iterator[tuple[Path, Path]]:
        """Check out the recorded code and validate `cfg` against it; yields (worktree, experiment folder)."""
        with checkout(self.tracker, self.run, repo) as (tree, exp_dir):
            validate(self.cfg, exp_dir)  # the entry must exist in the recorded code
            yield tree, exp_dir


@contextlib.contextmanager
def checkout(
    tracker: Tracker, run: RunSummary, repo: Path | None = None, base: Path | None = None
) -> Iterator[tuple[Path, Path]]:
    """The run's recorded code (commit + patch) in a temporary worktree; yields (worktree, experiment folder).

    The user's working tree and index are never touched.
    """
    commit = run.tags[T.GIT_COMMIT]
    root = Path(gitsource.open_repo(repo or Path.cwd()).working_tree_dir)
    if not gitsource.has_commit(root, commit):
        url = run.tags.get(T.GIT_REPO_URL)
        source = f"git fetch {url} {commit}" if url else f"git fetch <remote> {commit}"
        raise HarnessError(
            f"commit {commit[:12]} of run {run.run_id} is not in the repository at {root}. "
            f"Fetch it ({source}) or run this inside a clone that has it."
        )
    patch = None
    if run.tags.get(T.GIT_DIRTY) == "true":
        patch = tracker.read_bytes(run.run_id, T.ARTIFACT_PATCH)
        if patch is None:
            raise HarnessError(f"run {run.run_id} was dirty but its {T.ARTIFACT_PATCH} artifact is missing.")
        expected = run.tags.get(T.GIT_PATCH_SHA256, "(no tag)")
        got = hashlib.sha256(patch).hexdigest()
        if got != expected:
            raise HarnessError(
                f"the recorded patch of run {run.run_id} was altered ({T.ARTIFACT_PATCH}: sha256 expected "
                f"{expected}, got {got}); the replay would run code that never ran. Restore the artifact from a "
                "backup of the store, or replay another run."
            )
    with gitsource.worktree(root, commit, patch, base) as tree:
        yield tree, tree / run.tags[T.EXPERIMENT_PATH]
