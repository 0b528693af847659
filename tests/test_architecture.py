"""The folder tree is the architecture: the import contracts in pyproject.toml ([tool.importlinter]) hold.

lint-imports reads the package's import graph without running it; a broken contract prints the chain of
imports that breaks it, which this test shows as its failure.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_import_contract_is_kept() -> None:
    # The console script where pip put it, else the module beside this interpreter (the same program).
    script = shutil.which("lint-imports")
    fallback = "from importlinter.cli import lint_imports_command; lint_imports_command()"
    command = [script] if script else [sys.executable, "-c", fallback]
    # The tree under test, not an installed copy: import-linter finds the package on sys.path.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([*command, "--no-cache"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout, proc.stdout


def test_the_independence_contract_names_every_verb_module() -> None:
    """A verb module added to harness/commands/ is one the contract must hold apart from the others: the composing
    layer (api, api_bundles, documents) alone may import the verbs."""
    text = (ROOT / "pyproject.toml").read_text()
    contract = text[text.index('type = "independence"'):]
    contract = contract[:contract.index("]") + 1]
    named = set(re.findall(r'"harness\.commands\.(\w+)"', contract))
    composing = {"__init__", "api", "api_bundles", "documents"}
    verbs = {p.stem for p in (ROOT / "harness" / "commands").glob("*.py")} - composing
    assert named == verbs, (sorted(verbs - named), sorted(named - verbs))
