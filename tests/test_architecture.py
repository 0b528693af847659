"""The folder tree is the architecture: the import contracts in pyproject.toml ([tool.importlinter]) hold.

lint-imports reads the package's import graph without running it; a broken contract prints the chain of
imports that breaks it, which this test shows as its failure. Besides the imports: one module closes runs, and no
module passes 600 lines.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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
    # the CLI draws from below the commands (terminal) and the backend names it offers (placement); a bundle's format (bundleformat).
    composing = {"__init__", "api", "api_bundles", "documents", "options", "terminal", "placement",
                 "bundleformat"}
    verbs = {p.stem for p in (ROOT / "harness" / "commands").glob("*.py")} - composing
    assert named == verbs, (sorted(verbs - named), sorted(named - verbs))


# A module is one concept, small enough to read in one sitting (docs/architecture.md, the house rules): past this
# many lines it holds a second concept that wants its own module.
MAX_MODULE_LINES = 600
# Modules allowed past it for now, each with why; a line here goes when its split lands.
_OVER_600_FOR_NOW: dict[str, str] = {}


def test_no_module_passes_600_lines() -> None:
    sizes = {path.relative_to(ROOT).as_posix(): len(path.read_text().splitlines())
             for path in sorted((ROOT / "harness").rglob("*.py"))}
    over = [f"{path}: {n} lines" for path, n in sizes.items() if n > MAX_MODULE_LINES and path not in _OVER_600_FOR_NOW]
    assert not over, (f"split each by concept into modules of one concept (under {MAX_MODULE_LINES} lines), moving "
                      "whole functions with `git mv` for the biggest piece:\n" + "\n".join(over))
    stale = sorted(path for path in _OVER_600_FOR_NOW if sizes.get(path, 0) <= MAX_MODULE_LINES)
    assert not stale, f"within {MAX_MODULE_LINES} lines now: take them off _OVER_600_FOR_NOW: {stale}"


MAX_COMMAND_PARAMETERS = 8
# The extras' verbs (trace, bisect, verify): they move to harness/extras/, each in its own folder, where this budget
# does not look; until then their keyword lists are theirs.
_EXTRAS = {"trace.py", "bisect.py", "verify.py"}


def test_no_public_command_function_takes_more_than_8_parameters() -> None:
    """A verb takes its options object (plus at most the store or a listener), not the options spread as keywords:
    a public function of harness/commands/ with more parameters than MAX_COMMAND_PARAMETERS (self excluded) is
    named with its count."""
    over = []
    for path in sorted((ROOT / "harness" / "commands").glob("*.py")):
        if path.name in _EXTRAS:
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
                continue
            a = node.args
            names = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, (a.vararg, a.kwarg)))]
            count = len([n for n in names if n not in ("self", "cls")])
            if count > MAX_COMMAND_PARAMETERS:
                over.append(f"{path.relative_to(ROOT).as_posix()}:{node.lineno} {node.name}: {count} parameters")
    assert not over, (f"take the verb's options object (harness/commands/options.py) instead of more than "
                      f"{MAX_COMMAND_PARAMETERS} parameters:\n" + "\n".join(over))


def _import_graph() -> dict[str, set[str]]:
    """harness's modules and what each imports when it runs: import statements (at the top or inside functions) and
    module names written as strings (importlib, a forkserver's preload), but not imports under `if TYPE_CHECKING:`,
    which only a type checker reads. The registry's f-string import of its built-in backends is added by hand."""
    root = ROOT / "harness"
    mods = {"harness." + ".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
            for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                       for n in ast.walk(node)}
        found: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "." in node.value:
                found.add(node.value)
        graph[name] = {m for m in found if m in mods and m != name}
    from harness.executors import BUILTIN

    graph["harness.executors"] |= {f"harness.executors.{backend}" for backend in BUILTIN}
    for name, targets in graph.items():  # importing a.b.c imports its packages a.b first
        for target in list(targets):
            parts = target.split(".")
            graph[name] |= {".".join(parts[:i]) for i in range(2, len(parts))
                            if not name.startswith(".".join(parts[:i]) + ".") and ".".join(parts[:i]) != name}
    return graph


def test_the_import_graph_has_no_circle() -> None:
    """A circle is two modules that each need the other loaded first: neither can be read, tested or replaced alone.
    Import-linter's layers see only the imports between layers; this sees every module, importlib strings included."""
    graph = _import_graph()
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for module in sorted(graph):
        if module not in state and (circle := visit(module)):
            raise AssertionError("an import circle: " + " -> ".join(circle) + ". Move what both need to a module "
                                 "below them, or hand it in as an argument.")


# What the repository tracks is source and documentation: a build product (a wheel, an archive) is in every clone and
# every bundle's copy of the history, and says nothing a reader can review.
MAX_TRACKED_KIB = 256
_BUILD_PRODUCTS = (".whl", ".tar.gz", ".zip", ".egg", ".so", ".pyc")


def test_the_repository_tracks_no_build_product_or_large_file() -> None:
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=False)
    if listed.returncode != 0:
        from infra import in_ci

        if in_ci():  # CI runs on a clone: the tracked files are always there to check
            pytest.fail(f"git ls-files failed in CI: {listed.stderr.strip()}")
        pytest.skip("not a git checkout (an unpacked source tree): nothing is tracked to check")
    tracked = [ROOT / name for name in listed.stdout.split("\0") if name]
    products = [p.relative_to(ROOT).as_posix() for p in tracked if p.name.endswith(_BUILD_PRODUCTS)]
    large = [f"{p.relative_to(ROOT).as_posix()} ({p.stat().st_size // 1024} KiB)" for p in tracked
             if p.is_file() and p.stat().st_size > MAX_TRACKED_KIB * 1024]
    assert not products and not large, f"untrack them (git rm --cached) and ignore them: {products + large}"
