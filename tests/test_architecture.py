"""The folder tree is the architecture: the import contracts in pyproject.toml ([tool.importlinter]) hold.

lint-imports reads the package's import graph without running it; a broken contract prints the chain of
imports that breaks it, which this test shows as its failure. Besides the imports: one module closes runs.
"""

from __future__ import annotations

import ast
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


# The store's primitives that end or reopen a run, and the one module allowed to call each: a close made anywhere
# else could skip the seal or cut its reason differently (record/closing.py is the one door).
_CLOSE_DOORS = {
    "terminate_run": "harness/record/closing.py",
    "reopen_run": "harness/record/closing.py",
    "set_terminated": "harness/store/tracking.py",  # MLflow's own, inside Tracker.terminate_run
    # The store's old doors, gone: a caller that still uses one would close a run unsealed if it came back.
    "end_run": "harness/runtime/usermlflow.py",  # there: the training code's own mlflow.end_run, not the store's
    "end_run_at": None,
}


def _calls_of(names: set[str]) -> list[tuple[str, int, str]]:
    """(module path, line, method) of every call `<anything>.<method>(...)` in the package whose method is in names."""
    found = []
    for path in sorted((ROOT / "harness").rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in names:
                found.append((path.relative_to(ROOT).as_posix(), node.lineno, node.func.attr))
    return found


def test_only_the_closing_module_ends_or_reopens_a_run() -> None:
    calls = _calls_of(set(_CLOSE_DOORS))
    stray = [f"{path}:{line} calls .{name}()" for path, line, name in calls if path != _CLOSE_DOORS[name]]
    assert not stray, ("close a run through harness/record/closing.py (close, close_copy, reopen, close_or_keep), "
                       "never the store's primitive:\n" + "\n".join(stray))
    assert ("harness/record/closing.py", "terminate_run") in {(path, name) for path, _, name in calls}


def test_the_independence_contract_names_every_verb_module() -> None:
    """A verb module added to harness/commands/ is one the contract must hold apart from the others: the composing
    layer (api, api_bundles, documents) alone may import the verbs."""
    text = (ROOT / "pyproject.toml").read_text()
    contract = text[text.index('type = "independence"'):]
    contract = contract[:contract.index("]") + 1]
    named = set(re.findall(r'"harness\.commands\.(\w+)"', contract))
    # The composing layer, and the modules the verbs and the CLI share that are no verb: the options types, what
    # the CLI draws from below the commands (terminal) and the backend names it offers (placement).
    composing = {"__init__", "api", "api_bundles", "documents", "options", "terminal", "placement"}
    verbs = {p.stem for p in (ROOT / "harness" / "commands").glob("*.py")} - composing
    assert named == verbs, (sorted(verbs - named), sorted(named - verbs))
