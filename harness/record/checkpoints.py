"""Where a run's checkpoints live on this machine, and how they reach a remote artifact store and back.

Ranks always read and write checkpoints in a local folder (runtime/checkpoint.py's layout). With a local
artifact store (the default SQLite store's file:// root) that folder IS the run's artifact folder:
nothing is copied, as before. With a server that holds the artifacts (`mlflow server
--serve-artifacts`, an mlflow-artifacts:/ or s3:// root) the folder is a staging folder: the launcher
uploads each step once it is complete (rank files first, the COMPLETE marker last, so a step is
complete in the store only when all of it arrived), and resume and audit download the steps they
need into it first. run, resume and audit all go through `open_for`.
"""

from __future__ import annotations

import functools
import os
import queue
import shutil
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness import tags as T
from harness.errors import HarnessError, RunRefused, StoreUnavailable
from harness.runtime import checkpoint

if TYPE_CHECKING:
    from harness.store.outages import Outages
    from harness.store.tracking import Tracker


class CheckpointStore:
    """One run's checkpoints: `directory` is where ranks find them on this machine."""

    def __init__(self, tracker: Tracker, run_id: str, directory: Path, remote: bool) -> None:
        self.tracker = tracker
        self.run_id = run_id
        self.directory = directory
        self.remote = remote
        self._uploads: queue.Queue[int | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._outages: Outages | None = None
        self.error: BaseException | None = None

    # -- reading (resume, audit) --------------------------------------------------------------------
    def _remote_step_dirs(self) -> list[tuple[int, str]]:
        """(step, artifact path) of every step folder in the store, ascending."""
        found = []
        for path, is_dir in self.tracker.list_artifacts(self.run_id, T.ARTIFACT_CHECKPOINTS):
            step = checkpoint.step_of(Path(path).name)
            if is_dir and step is not None:
                found.append((step, path))
        return sorted(found)

    def _remote_complete(self, path: str, world_size: int) -> bool:
        names = {Path(p).name for p, _ in self.tracker.list_artifacts(self.run_id, path)}
        return {checkpoint.COMPLETE_MARKER, *(f"rank{r}.pt" for r in range(world_size))} <= names

    def fetch(self, step: int, world_size: int) -> bool:
        """Make `step` available in `directory`; False if the store holds no complete step of this world size."""
        if self.remote and step not in checkpoint.complete_steps(self.directory, world_size):
            name = checkpoint.step_dir(Path(T.ARTIFACT_CHECKPOINTS), step).as_posix()
            if not self.tracker.list_artifacts(self.run_id, name):
                return False  # the store has no such step (MLflow's download would fail on it)
            # Into a scratch folder first, then renamed: a cut-off download never looks like a step.
            with tempfile.TemporaryDirectory(dir=self.directory, prefix=".download-") as tmp:
                got = self.tracker.download(self.run_id, name, Path(tmp))  # tmp/step-N
                if got is None:
                    return False
                target = checkpoint.step_dir(self.directory, step)
                shutil.rmtree(target, ignore_errors=True)
                os.replace(got, target)
        return step in checkpoint.complete_steps(self.directory, world_size)

    def require(self, steps: list[int], world_size: int, needed_by: str, imported_from: str | None = None) -> None:
        """Fetch `steps`, which the run recorded; refuse (exit 2) when the files of any are not in its artifacts.

        An imported run whose bundle was made without --with-checkpoints has the fingerprints of its checkpoints
        but not their files: without this, audit and trace would judge the missing files as a divergence.
        """
        missing = [step for step in sorted(set(steps)) if not self.fetch(step, world_size)]
        if not missing:
            return
        self.cleanup()
        shown = ", ".join(map(str, missing[:5])) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        where = (f"it was imported from a bundle made without --with-checkpoints. Export run {imported_from} again "
                 f"with `harness export {imported_from} -o FILE.tar.gz --with-checkpoints` where it was recorded and "
                 "import that" if imported_from else
                 f"they were removed. Put them back under {T.ARTIFACT_CHECKPOINTS}/ in the run's artifacts")
        raise RunRefused(
            f"run {self.run_id} recorded a checkpoint at step{'s' if len(missing) > 1 else ''} {shown}, which "
            f"{needed_by} needs, but its files are not in the run's artifacts: {where}, or replay the run in full "
            f"(`harness replay {self.run_id}`)."
        )

    def latest(self, world_size: int) -> int | None:
        """The last step complete in the store, fetched; None if there is none."""
        if not self.remote:
            return checkpoint.latest_complete(self.directory, world_size)
        # From the last step down: one listing per step tried, not one per step the run saved.
        for step, path in reversed(self._remote_step_dirs()):
            if self._remote_complete(path, world_size) and self.fetch(step, world_size):  # marker: its world size
                return step
        return None

    def saved(self, world_size: int) -> dict[int, dict[str, Any]]:
        """step -> the digests ({"sha256", "tensors", "ranks"}) held by the COMPLETE marker of every step complete
        in `directory`: what a Checkpoint message said, or would have said had rank 0 lived to send it. A step
        whose digests the record lacks takes these (the run's close, a resume); one whose marker holds none
        (written by an older harness) is left out."""
        out = {}
        for step in checkpoint.complete_steps(self.directory, world_size):
            digests = checkpoint.saved_digests(self.directory, step)
            if digests is not None:
                out[step] = digests
        return out

    # -- writing (the launcher of a run) ------------------------------------------------------------
    def start_uploads(self, outages: Outages) -> None:
        """Upload steps handed to `completed` in the background: the launcher never waits on the store."""
        if not self.remote:
            return
        self._outages = outages
        self._thread = threading.Thread(target=self._upload_loop, name="harness-checkpoints", daemon=True)
        self._thread.start()

    def completed(self, step: int) -> None:
        """Rank 0 marked `step` complete in `directory`."""
        if self._thread is not None:
            self._uploads.put(step)

    def _upload_loop(self) -> None:
        assert self._outages is not None
        while (step := self._uploads.get()) is not None:
            if self.error is not None:
                continue  # the store gave up on an earlier step; close() reports it
            local = checkpoint.step_dir(self.directory, step)
            artifact_dir = checkpoint.step_dir(Path(T.ARTIFACT_CHECKPOINTS), step).as_posix()
            files = sorted(p for p in local.iterdir() if p.name != checkpoint.COMPLETE_MARKER)
            try:
                for path in [*files, local / checkpoint.COMPLETE_MARKER]:
                    # A folder is a framework's own checkpoint (harness.transformers: the Trainer's), whole.
                    log = (functools.partial(self.tracker.log_dir, self.run_id, path, f"{artifact_dir}/{path.name}")
                           if path.is_dir() else functools.partial(self.tracker.log_file, self.run_id, path, artifact_dir))
                    self._outages.retry(log)
            except Exception as err:
                self.error = err

    def close(self) -> None:
        """Wait for every upload (each retried through outages up to their limit); raise if one failed."""
        if self._thread is not None:
            self._uploads.put(None)
            self._thread.join()
            self._thread = None
        if self.error is not None:
            raise StoreUnavailable(
                f"could not upload the checkpoints of run {self.run_id} to the tracking store: {self.error}. "
                f"They are kept in {self.directory}."
            )

    def cleanup(self) -> None:
        """Remove the staging folder (a local store's folder is the run's artifacts: kept)."""
        if self.remote and self.error is None:
            shutil.rmtree(self.directory.parent, ignore_errors=True)


def open_for(tracker: Tracker, run_id: str) -> CheckpointStore:
    """The run's checkpoint folder: its artifact folder for a local store, else a staging folder.

    The staging folder's name is the run's, so every launcher of the run on this machine (the nodes of
    a multi-node job sharing /tmp) writes to the same one.
    """
    local = tracker.local_artifact_dir(run_id)
    if local is not None:
        return CheckpointStore(tracker, run_id, local / T.ARTIFACT_CHECKPOINTS, remote=False)
    staging = Path(tempfile.gettempdir()) / f"harness-checkpoints-{run_id}" / T.ARTIFACT_CHECKPOINTS
    try:
        staging.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise HarnessError(f"cannot create the checkpoint staging folder {staging}: {err.strerror}. "
                           "Set TMPDIR to a writable folder.") from None
    return CheckpointStore(tracker, run_id, staging, remote=True)
