"""A recorded run, made ready to run again: its stored config, and its code checked out and validated."""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import seeds, tags as T
from harness.config import Experiment, compose, split_entry, to_container, validate
from harness.configschema import ExperimentConfig
from harness.errors import RunRefused, UsageError
from harness.executors import Job, JobInputs, Topology, schema
from harness.record import confine, redaction
from harness.record.checkout import checkout
from harness.store.tracking import RunSummary, Tracker
from harness.systems import git as gitsource


def recorded_config(tracker: Tracker, run: RunSummary) -> Experiment:
    """The resolved config stored with the run, with auto device/backend pinned to what it ran on."""
    from omegaconf import OmegaConf

    text = tracker.read_text(run.run_id, T.ARTIFACT_CONFIG)
    if text is None:
        raise RunRefused(f"run '{run.run_id}' has no {T.ARTIFACT_CONFIG} artifact; it cannot be replayed.")
    pinned = {key: run.tags[tag] for key, tag in T.RESOLVED_AT_LAUNCH.items() if tag in run.tags}
    return Experiment.of(compose([("recorded config", OmegaConf.create(text)), ("recorded runtime", OmegaConf.create(pinned))],
                                 schema()))


def code_id(commit: str, patch_sha256: str | None, submodules_sha256: str | None = None) -> str:
    """What every node of a job must agree on: the commit and, for a dirty tree, the patch; with submodules, their
    record (each one's commit and patch)."""
    return commit + (f"+{patch_sha256}" if patch_sha256 else "") + (f"+s{submodules_sha256}" if submodules_sha256 else "")


def git_code_id(git: gitsource.GitState) -> str:
    """code_id of the code record `git` makes."""
    subs = hashlib.sha256(gitsource.submodules_json(git.submodules)).hexdigest() if git.submodules else None
    return code_id(git.commit, hashlib.sha256(git.patch).hexdigest() if git.dirty else None, subs)


def tags_code_id(tags: dict[str, str]) -> str:
    """code_id of a recorded run, from its tags."""
    return code_id(tags[T.GIT_COMMIT], tags.get(T.GIT_PATCH_SHA256), tags.get(T.GIT_SUBMODULES_SHA256))


@dataclass
class RecordedRun:
    """A harness run as the store holds it, made ready to run again (by replay, resume, audit and trace).

    The command loads it through harness/record/loading.py (which refuses what it cannot use), may replace
    `experiment` by a changed one (replay's --world-size, overrides, --executor), then enters `code()`.
    """

    tracker: Tracker
    run: RunSummary
    experiment: Experiment  # the resolved config stored with the run, device and backend pinned to what it ran on

    @property
    def cfg(self) -> ExperimentConfig:
        """The recorded experiment's typed values."""
        return self.experiment.config

    @classmethod
    def load(cls, tracker: Tracker, run: RunSummary) -> RecordedRun:
        return cls(tracker, run, recorded_config(tracker, run))

    def restore_secrets(self, overrides: list[str], command: str = "replay") -> list[str]:
        """Put the values the record redacted (redaction.py) back into `cfg`, from `overrides` (KEY=VALUE) or the
        environment variable they were read from; returns the other overrides. Raises when one is missing, naming
        `command` (the one that re-executes the run: replay, calibrate) with the KEY=VALUE to pass it."""
        from omegaconf import OmegaConf

        container = to_container(self.cfg)
        if not redaction.redacted_keys(container):
            return list(overrides)
        sources = redaction.parse_sources(self.run.tags.get(T.CONFIG_REDACTED))
        restored, rest = redaction.restore(container, list(overrides), sources, os.environ, self.run.run_id,
                                           redaction.store_key(self.tracker.uri), command)
        self.experiment = Experiment.of(compose([("recorded config", OmegaConf.create(restored))], schema()))
        return rest

    def job(self, tree: Path, exp_dir: Path, *, record: Any = None, topology: Any = None, **fields: Any) -> Any:
        """The job that runs this recorded code (inside `code()`); its image digest is the recorded one, and its ranks
        get the recorded string-hash seed (seeds.py)."""
        tags = self.run.tags
        seeds.apply_recorded_hash_seed(tags, self.run.run_id)
        data = fields.pop("data", {})
        inputs = JobInputs(tree, exp_dir, code_id=tags_code_id(tags), data=data)
        return Job(self.tracker, self.cfg, inputs, record=record, recorded=self.run, topology=topology or Topology(),
                   **fields)

    def check_data(
        self, repo: Path | None = None, *, allow_changes: bool = False, flag: str | None = None,
        paths: Mapping[str, str] | None = None,
    ) -> Any:
        """Hash the declared data again on this machine and hold it to the record (data.verify); before launch.

        The declaration is resolved against the experiment folder of the repository here (not the
        temporary worktree: data ignored by git, or outside the repository, is not in the code record);
        where there is no repository (an imported run), against that folder under the current one.
        `paths` (replay --data NAME=PATH) says where an entry lies on this machine instead.
        """
        from harness.record import data

        recorded = data.recorded_data(self.tracker, self.run.run_id)
        if recorded is None and not self.cfg.data:
            if paths:
                raise UsageError(f"run {self.run.run_id} declared no data; drop --data.")
            return data.DataCheck(None, [], {})
        root = gitsource.find_repo(repo or Path.cwd()) or (repo or Path.cwd())
        exp_dir = root / confine.recorded_path(self.run.tags[T.EXPERIMENT_PATH], "experiment folder", self.run.run_id)
        declarations = dict(self.cfg.data or {})
        for name, path in (paths or {}).items():
            if name not in declarations:
                raise UsageError(
                    f"--data {name}=...: run {self.run.run_id} declared no data named '{name}' "
                    f"(it declared: {', '.join(sorted(declarations)) or 'none'})."
                )
            declarations[name] = os.path.abspath(os.path.expanduser(path))
        return data.verify(
            declarations, recorded, exp_dir, root, run_id=self.run.run_id, allow_changes=allow_changes, flag=flag
        )

    @contextlib.contextmanager
    def code(self, repo: Path | None = None, commit: str | None = None) -> Iterator[tuple[Path, Path]]:
        """Check out the recorded code and validate `cfg` against it; yields (worktree, experiment folder).
        `commit`: another commit of the same repository instead (harness bisect's probes), without the patch."""
        with checkout(self.tracker, self.run, repo, commit=commit) as (tree, exp_dir):
            validate(self.experiment.composed, exp_dir, schema())  # the entry must exist in the recorded code
            confine.check_code(
                tree, exp_dir, split_entry(self.cfg.entry)[0], gitsource.recorded_symlinks(tree, exp_dir)
            )  # ...and lie in it
            yield tree, exp_dir
