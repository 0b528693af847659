"""ruff and mypy over harness/ are clean, with the settings in pyproject.toml ([tool.ruff], [tool.mypy]), and mypy
follows the seed and the world size from a loaded experiment to the ranks.

Both run as the modules beside this interpreter, on the tree under test, and a finding fails the test with
the tool's own report (file, line, rule).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("tool", [["ruff", "check", "harness"], ["mypy", "harness"]], ids=["ruff", "mypy"])
def test_harness_is_clean_under(tool: list[str]) -> None:
    # The tree under test, not an installed copy: mypy follows harness's imports through sys.path.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", *tool], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# The seed and the world size from a loaded experiment (and a replay's change of it) to the record and the ranks,
# one expression per hop: mypy with disallow-any-expr (this module only, so harness's cache serves) says where one
# of them is Any. UNTYPED is the same walk through the composed OmegaConf tree, which mypy cannot follow: the check
# must report it, or it proves nothing.
TYPED_PATH = '''# mypy: disallow-any-expr
from pathlib import Path

from harness import executors
from harness.commands.replay import apply_changes
from harness.config import load_experiment
from harness.executors.base import Job, JobInputs
from harness.executors.common import launch_spec
from harness.record.newrun import record_tags
from harness.store.tracking import Tracker
from harness.systems.git import GitState


def to_the_rank(exp_dir: Path, tracker: Tracker, git: GitState, world_size: int) -> list[int]:
    loaded = load_experiment(exp_dir, ["seed=3"], schema=executors.schema())
    replayed, _ = apply_changes(loaded, world_size, [], False)
    job = Job(tracker, replayed.config, JobInputs(exp_dir, exp_dir))
    seed = job.cfg.seed
    size = job.cfg.world_size
    ranks = job.cfg.rank_seeds
    tags = record_tags(job.cfg, exp_dir, git, {})
    spec = launch_spec(job.cfg, job.exp_dir, "cpu", "gloo", exp_dir / "logs")
    rank_seed = spec.rank_seeds[0]  # the ranks' Context takes them as ints (test_the_path_takes_the_typed_experiment)
    return [seed, size, *ranks, len(tags), spec.seed, spec.world_size, rank_seed]
'''
UNTYPED = TYPED_PATH.replace("seed = job.cfg.seed", "seed = loaded.composed.seed")


def test_mypy_follows_the_seed_and_the_world_size_to_the_rank(tmp_path: Path) -> None:
    (tmp_path / "typed_path.py").write_text(TYPED_PATH)
    (tmp_path / "untyped_path.py").write_text(UNTYPED)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "mypy", "--follow-imports=silent", str(tmp_path / "typed_path.py"),
                           str(tmp_path / "untyped_path.py")], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    report = proc.stdout + proc.stderr
    assert "typed_path.py" not in report.replace("untyped_path.py", ""), report
    line = UNTYPED.splitlines().index("    seed = loaded.composed.seed") + 1
    assert f"untyped_path.py:{line}: error: Expression has type \"Any\"" in report, report


def test_the_path_takes_the_typed_experiment() -> None:
    """Each function the seed and the world size pass through names the typed experiment, never DictConfig or Any
    (a parameter typed Any would hide an untyped value from mypy in the check above)."""
    import inspect
    import typing

    from harness.commands.replay import apply_changes
    from harness.config import Experiment, load_experiment
    from harness.configschema import ExperimentConfig
    from harness.executors import Job, early_ranks
    from harness.executors.common import check_runnable, launch_spec
    from harness.record.newrun import create_record, record_tags
    from harness.record.recorder import Recorder, checkpoint_plan
    from harness.runtime.context import Context
    from harness.runtime.rank.spec import LaunchSpec

    def hint(obj: typing.Any, name: str) -> str:
        if isinstance(obj, type) and name in obj.__dataclass_fields__:
            return str(obj.__dataclass_fields__[name].type)
        sig = inspect.signature(obj)
        return str(sig.return_annotation if name == "return" else sig.parameters[name].annotation)

    expected = {
        (load_experiment, "return"): "Experiment", (Experiment, "config"): "ExperimentConfig",
        (apply_changes, "recorded"): "Experiment", (apply_changes, "return"): "tuple[Experiment, list[str]]",
        (Experiment.with_changes, "return"): "Experiment", (Job, "cfg"): "ExperimentConfig",
        (early_ranks, "cfg"): "ExperimentConfig", (check_runnable, "cfg"): "ExperimentConfig",
        (create_record, "exp"): "Experiment", (record_tags, "cfg"): "ExperimentConfig",
        (Recorder.__init__, "cfg"): "ExperimentConfig", (checkpoint_plan, "cfg"): "ExperimentConfig",
        (launch_spec, "cfg"): "ExperimentConfig", (launch_spec, "return"): "LaunchSpec",
        (ExperimentConfig, "seed"): "int", (ExperimentConfig, "world_size"): "int",
        (LaunchSpec, "seed"): "int", (LaunchSpec, "world_size"): "int", (LaunchSpec, "rank_seeds"): "list[int]",
        (Context.__init__, "seed"): "int", (Context.__init__, "rank_seed"): "int",
        (Context.__init__, "world_size"): "int",
    }
    found = {(getattr(obj, "__qualname__", obj), name): hint(obj, name) for obj, name in expected}
    assert found == {(getattr(obj, "__qualname__", obj), name): want for (obj, name), want in expected.items()}
    assert typing.get_type_hints(ExperimentConfig.rank_seeds.func)["return"] == tuple[int, ...]
