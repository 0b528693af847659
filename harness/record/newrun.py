"""How a new run's record is built: what the user calls it (--name, --tag), its tags, its config as the store holds
it (params, config.yaml, secrets redacted), the code's patch and the declared data's manifest - one MLflow run.

Every recorded run opens here: `harness run`'s, a study's and its members' (commands/study.py), a replay's
(commands/replay.py, with the derived tags of record/derived.py), a calibration member's.
"""

from __future__ import annotations

import hashlib
import posixpath
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from harness import tags as T
from harness.config import Experiment, flatten, split_entry, to_container, to_yaml
from harness.configschema import ExperimentConfig
from harness.errors import UsageError
from harness.record import derived, redaction
from harness.store.tracking import Tracker
from harness.systems import git as gitsource
from harness.systems.git import GitState
from harness.version import __version__

_NAME_LIMIT = 250  # MLflow's run name and tag key columns
_TAG_VALUE_LIMIT = 8000  # MLflow's tag value column: longer would be cut, so it is refused
_TAG_KEY = re.compile(r"[\w./\- :]+")  # what MLflow accepts in a tag key


@dataclass(frozen=True)
class Labels:
    """What the user calls a run: `--name` (MLflow's run name, shown in the UI) and `--tag KEY=VALUE` tags of their own.

    Without a name a run is named after its experiment and the start of its id (`digits_cnn-1a2b3c4d`), not
    MLflow's random `hilarious-horse-989`."""

    name: str | None = None
    tags: Mapping[str, str] = field(default_factory=dict)


def labels(name: str | None, tags: Sequence[str] | Mapping[str, str] = ()) -> Labels:
    """--name and --tag KEY=VALUE checked: refused in one line (exit 2) before anything is recorded."""
    if name is not None:
        if not name.strip() or len(name) > _NAME_LIMIT or any(ord(c) < 32 or ord(c) == 127 for c in name):
            raise UsageError(f"--name {name!r}: a run name is 1 to {_NAME_LIMIT} printable characters. "
                               "Pass another, e.g. --name lr-0.1-baseline.")
        name = name.strip()
    pairs = list(tags.items()) if isinstance(tags, Mapping) else [_tag_pair(t) for t in tags]
    out: dict[str, str] = {}
    for key, value in pairs:
        if key.lower().startswith((T.PREFIX, T.MLFLOW_PREFIX)):
            raise UsageError(f"--tag {key}: the {key.split('.')[0]}. tags are {key.split('.')[0]}'s own (what "
                               "the record says); pick another key, e.g. --tag team.owner=ada.")
        if len(key) > _NAME_LIMIT or not _TAG_KEY.fullmatch(key):
            raise UsageError(f"--tag {key!r}: a tag key is up to {_NAME_LIMIT} letters, digits, '_', '-', '.', '/', "
                               "':' and spaces. Rename it.")
        norm = posixpath.normpath(key)
        if norm != key or norm == "." or norm.startswith(("..", "/")):  # MLflow stores tags as paths on some stores
            raise UsageError(f"--tag {key!r}: a tag key is a relative path with no '.', '..' or empty parts "
                               f"({norm!r} once normalized). Rename it.")
        if len(value) > _TAG_VALUE_LIMIT:
            raise UsageError(f"--tag {key}: its value has {len(value)} characters; MLflow holds {_TAG_VALUE_LIMIT}. "
                               "Shorten it.")
        if key in out:
            raise UsageError(f"--tag {key} is given twice; give it once.")
        out[key] = value
    return Labels(name, out)


def _tag_pair(pair: str) -> tuple[str, str]:
    key, sep, value = pair.partition("=")
    if not sep or not key.strip():
        raise UsageError(f"--tag {pair!r} is not KEY=VALUE; e.g. --tag dataset=mnist.")
    return key.strip(), value


def experiment_name(exp_dir: Path) -> str:
    return Path(exp_dir).resolve().name


def record_tags(cfg: ExperimentConfig, exp_dir: Path, git: GitState, image: dict[str, str]) -> dict[str, str]:
    """Tags known before anything runs: code, image, seeds, topology as configured."""
    from harness.seeds import hash_seed_tags

    rel = Path(exp_dir).resolve().relative_to(git.root.resolve()).as_posix()
    source = f"{rel}/{split_entry(cfg.entry)[0]}"
    tags: dict[str, str] = {
        T.VERSION: __version__,
        T.KIND: T.KIND_RUN,
        T.EXPERIMENT_PATH: rel,
        T.ENTRY: str(cfg.entry),
        T.GIT_COMMIT: git.commit,
        T.GIT_BRANCH: git.branch or "(detached)",
        T.GIT_DIRTY: str(git.dirty).lower(),
        T.MLFLOW_GIT_COMMIT: git.commit,
        T.MLFLOW_SOURCE_NAME: source,
        T.MLFLOW_SOURCE_TYPE: "PROJECT",
        T.SEED: str(cfg.seed),
        T.RANK_SEEDS: ",".join(map(str, cfg.rank_seeds)),
        T.WORLD_SIZE: str(cfg.world_size),
        T.THREADS_PER_RANK: str(cfg.threads_per_rank),
    }
    if git.branch:
        tags[T.MLFLOW_GIT_BRANCH] = git.branch
    if git.repo_url:
        tags[T.GIT_REPO_URL] = git.repo_url
        tags[T.MLFLOW_GIT_REPO_URL] = git.repo_url
    if git.dirty:
        tags[T.GIT_PATCH_SHA256] = hashlib.sha256(git.patch).hexdigest()
    if git.submodules:
        tags[T.GIT_SUBMODULES_SHA256] = hashlib.sha256(gitsource.submodules_json(git.submodules)).hexdigest()
    if git.redacted:
        tags[T.GIT_PATCH_REDACTED] = ", ".join(git.redacted)
    tags.update(hash_seed_tags())
    tags.update(image)
    return tags


def create_record(
    tracker: Tracker,
    exp: Experiment,
    exp_dir: Path,
    git: GitState,
    *,
    image: dict[str, str],
    extra_tags: dict[str, str] | None = None,
    run_name: str | None = None,
    experiment: str | None = None,
    data: dict | None = None,
) -> str:
    """One MLflow run holding the resolved config (written from `exp.composed`), the code state and the declared
    data's manifest."""
    from harness.record import data as D

    tags = record_tags(exp.config, exp_dir, git, image)
    tags.update({T.DATA_PREFIX + name: digest for name, digest in D.digests(data).items()})
    params, text, redacted = recordable_config(exp.composed, tracker.uri)
    # "auto" is no device: the param is logged once the launcher resolves it (record/recorder.py Recorder.start).
    params = {k: v for k, v in params.items() if not (k in T.RESOLVED_AT_LAUNCH and v == "auto")}
    if redacted:
        tags[T.CONFIG_REDACTED] = redacted
    tags.update(extra_tags or {})
    experiment = experiment or experiment_name(exp_dir)
    # The launcher ends the run when its ranks end; until then an error ends it FAILED (record/derived.py).
    with derived.opened(tracker, experiment, tags, run_name, close=False) as run_id:
        if run_name is None:  # named after what it is, not MLflow's random words: its experiment and its id's start
            tracker.rename_run(run_id, f"{experiment}-{run_id[:8]}")
        tracker.log_params(run_id, params)
        tracker.log_text(run_id, text, T.ARTIFACT_CONFIG)
        if git.dirty:
            tracker.log_bytes(run_id, git.patch, T.ARTIFACT_PATCH)
        if git.submodules:
            tracker.log_bytes(run_id, gitsource.submodules_json(git.submodules), T.ARTIFACT_SUBMODULES)
        if data is not None:
            tracker.log_text(run_id, D.dumps(data), T.ARTIFACT_DATA_MANIFEST)
            tracker.log_data_inputs(run_id, [(n, e["sha256"], e["path"]) for n, e in sorted(data["entries"].items())])
    return run_id


PARAM_LIMIT = 6000  # MLflow's longest param value (characters)


def fit_params(params: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Params as MLflow can hold them: a value longer than PARAM_LIMIT becomes its length and sha256 (never a silent
    cut; config.yaml holds it whole), with the keys so shortened."""
    out, long = {}, []
    for key, value in params.items():
        text = str(value)
        if len(text) > PARAM_LIMIT:
            long.append(key)
            value = f"<{len(text)} characters, sha256:{hashlib.sha256(text.encode()).hexdigest()[:16]}: whole in config.yaml>"
        out[key] = value
    return out, long


def recordable_config(cfg: DictConfig, store_uri: str) -> tuple[dict[str, str], str, str]:
    """(params, config.yaml, the harness.config.redacted tag) with every secret replaced by its placeholder.

    The ranks get `cfg` itself: only what the store holds is redacted."""
    from omegaconf import OmegaConf

    if not redaction.redact(to_container(cfg), None)[1]:  # no secret: the store's key is not even made
        return fit_params(flatten(cfg))[0], to_yaml(cfg), ""
    clean, keys = redaction.redact(to_container(cfg), redaction.store_key(store_uri))
    unresolved = OmegaConf.to_container(cfg, resolve=False)
    assert isinstance(unresolved, dict)  # cfg is a DictConfig
    sources = redaction.env_sources(unresolved, keys)
    return (fit_params(flatten(clean))[0], OmegaConf.to_yaml(OmegaConf.create(clean)),
            redaction.format_sources(keys, sources))


def data_paths(manifest: dict | None) -> dict[str, str]:
    from harness.record import data

    return data.paths(manifest)
