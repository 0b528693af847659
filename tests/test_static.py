"""ruff and mypy over harness/ are clean, with the settings in pyproject.toml ([tool.ruff], [tool.mypy]).

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
