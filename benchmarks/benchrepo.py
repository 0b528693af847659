"""A throwaway git repository holding copies of the experiments, for the benchmarks that run the real CLI."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def git(repo: Path, *args: str) -> None:
    env = {**os.environ, "GIT_AUTHOR_NAME": "b", "GIT_AUTHOR_EMAIL": "b@example.invalid",
           "GIT_COMMITTER_NAME": "b", "GIT_COMMITTER_EMAIL": "b@example.invalid"}
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, env=env)


def project(base: Path, experiments: tuple[str, ...] = ("linear_ddp",), ignore: str = "mlruns/\n__pycache__/\nstores/\n") -> Path:
    """base/repo: a committed git repository with experiments/<name> for each of `experiments`."""
    repo = base / "repo"
    for name in experiments:
        shutil.copytree(ROOT / "experiments" / name, repo / "experiments" / name)
    (repo / ".gitignore").write_text(ignore)
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "bench")
    return repo
