"""The folder tree is the architecture: the import contracts in pyproject.toml ([tool.importlinter]) hold.

lint-imports reads the package's import graph without running it; a broken contract prints the chain of
imports that breaks it, which this test shows as its failure. Besides the imports: one module closes runs, no
module passes 600 lines, no function passes 80, and no private name is used outside its module.
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
    # The composing layer, and the modules the verbs and the CLI share that are no verb: the options types, the
    # results' lines as the CLI prints them (text), the backends as it offers them (backends); a bundle's format.
    composing = {"__init__", "api", "api_bundles", "documents", "options", "text", "backends", "bundleformat"}
    verbs = {p.stem for p in (ROOT / "harness" / "commands").glob("*.py")} - composing
    assert named == verbs, (sorted(verbs - named), sorted(named - verbs))


# What starts a process: the CLI parses, calls a command and prints; a server, a rank or a tool it needs is started
# below it (the MLflow UI: harness/store/ui.py), where its life - its process group, its deadlines - is owned.
_PROCESS_MODULES = {"subprocess", "multiprocessing", "pty", "concurrent.futures"}
_PROCESS_CALLS = {"Popen", "fork", "forkpty", "system", "popen", "posix_spawn", "posix_spawnp", "create_subprocess_exec",
                  "create_subprocess_shell", "ProcessPoolExecutor"}


def _starts_processes(path: Path) -> list[str]:
    """Where the module at `path` imports a module that starts processes, or calls what starts one."""
    found = []
    shown = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if name in _PROCESS_CALLS or re.fullmatch(r"(spawn|exec)[lv]p?e?", name):
                found.append(f"{shown}:{node.lineno} calls {ast.unparse(func)}()")
            continue
        else:
            continue
        for name in names:
            if name in _PROCESS_MODULES or name.split(".")[0] in _PROCESS_MODULES - {"concurrent.futures"}:
                found.append(f"{shown}:{node.lineno} imports {name}")
    return found


def test_the_cli_starts_no_process() -> None:
    started = [where for path in sorted((ROOT / "harness" / "cli").rglob("*.py")) for where in _starts_processes(path)]
    assert not started, ("the CLI only parses, calls a command and prints: start the process in the layer that owns "
                         "its life (a server: harness/store/ui.py, behind a command):\n" + "\n".join(started))


def test_the_process_check_sees_each_way_to_start_one(tmp_path: Path) -> None:
    module = tmp_path / "starts.py"
    module.write_text("import os\nimport subprocess\nfrom multiprocessing import Process\n"
                      "p = subprocess.Popen(['true'])\nos.system('true')\nos.spawnlp(0, 'true')\nos.fork()\n")
    found = [line.split(" ", 1)[1] for line in _starts_processes(module)]
    assert found == ["imports subprocess", "imports multiprocessing", "imports multiprocessing.Process",
                     "calls subprocess.Popen()", "calls os.system()", "calls os.spawnlp()", "calls os.fork()"], found
def test_every_extra_is_registered_and_held_apart() -> None:
    """A folder added to harness/extras is an extra the registry loads (extensions.BUILTIN) and the contract holds
    apart from the others; the core's own contract forbids importing any of them."""
    import importlib

    from harness import extensions

    folders = {p.name for p in (ROOT / "harness" / "extras").iterdir() if (p / "__init__.py").is_file()}
    assert set(extensions.BUILTIN) == folders
    text = (ROOT / "pyproject.toml").read_text()
    contract = text[text.index('name = "The extras stand alone'):]
    contract = contract[:contract.index("]") + 1]
    assert set(re.findall(r'"harness\.extras\.(\w+)"', contract)) == folders
    assert set(extensions.extras()) >= folders
    for extra in extensions.extras().values():  # the names the registry gives without importing are the module's
        assert extra.api is None or set(extra.names) == set(importlib.import_module(extra.api).__all__), extra.name


def test_the_old_import_paths_give_the_moved_modules() -> None:
    """What moved into harness/extras is imported under its old name as the same module object (no second copy:
    a class compared with isinstance, a monkeypatch, are the module's own)."""
    import importlib

    from harness import aliases

    for old, new in aliases.MOVED.items():
        assert importlib.import_module(old) is importlib.import_module(new), old
    from harness.optrace.tracer import OpTracer  # a submodule of a moved package

    assert OpTracer.__module__ == "harness.extras.trace.optrace.tracer"
    assert importlib.import_module("harness.optrace.diff") is importlib.import_module("harness.extras.trace.optrace.diff")
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("harness.optrace.nothing")


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


# A function is one step, readable without a scroll: past this many lines (its `def` to its last line; a command's
# decorators are its options table, not its body) it holds a second step that wants a name of its own.
MAX_FUNCTION_LINES = 80


def _function_lengths() -> dict[str, int]:
    """'path:qualified name' -> lines, of every function and method in the package."""
    lengths: dict[str, int] = {}

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lengths[f"{where}{child.name}"] = (child.end_lineno or child.lineno) - child.lineno + 1
                visit(child, f"{where}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{where}{child.name}.")
            else:
                visit(child, where)

    for path in sorted((ROOT / "harness").rglob("*.py")):
        visit(ast.parse(path.read_text(), filename=str(path)), path.relative_to(ROOT).as_posix() + ":")
    return lengths


def test_no_function_passes_80_lines() -> None:
    lengths = _function_lengths()
    over = [f"{name}: {n} lines" for name, n in sorted(lengths.items())
            if n > MAX_FUNCTION_LINES]
    assert not over, (f"cut each into named steps of at most {MAX_FUNCTION_LINES} lines (a helper per step, named "
                      "for what it does):\n" + "\n".join(over))


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_crossings() -> list[str]:
    """Every use, in one harness module, of a private name of another: `from harness.x import _y`, and `x._y` where
    `x` names another harness module (however it was imported)."""
    root = ROOT / "harness"
    modules = {"harness." + ".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
               for p in root.rglob("*.py")}
    found = []
    for name, path in sorted(modules.items()):
        rel = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text(), filename=str(path))
        aliases: dict[str, str] = {}  # a local name -> the harness module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("harness"):
                for a in node.names:
                    if f"{node.module}.{a.name}" in modules:
                        aliases[a.asname or a.name] = f"{node.module}.{a.name}"
                    elif _private(a.name) and node.module != name:
                        found.append(f"{rel}:{node.lineno} imports {a.name} from {node.module}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("harness"):
                        aliases[a.asname or a.name] = a.name
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                target = aliases.get(ast.unparse(node.value))
                if target is not None and target != name:
                    found.append(f"{rel}:{node.lineno} reads {target}.{node.attr}")
    return found


def test_no_private_name_crosses_a_module() -> None:
    """A name another module uses is a seam: public, named for what it is, with a docstring. A private one crossing
    over is a seam nobody promised to keep, which a change inside its module breaks without a word."""
    crossings = _private_crossings()
    assert not crossings, ("make each public (drop the underscore, say what it is in a docstring) or move it to the "
                           "module that uses it:\n" + "\n".join(crossings))


MAX_COMMAND_PARAMETERS = 8


def test_no_public_command_function_takes_more_than_8_parameters() -> None:
    """A verb takes its options object (plus at most the store or a listener), not the options spread as keywords:
    a public function of harness/commands/ (or of an extra's command.py and api.py) with more parameters than
    MAX_COMMAND_PARAMETERS (self excluded) is named with its count."""
    over = []
    verbs = [*(ROOT / "harness" / "commands").glob("*.py"), *(ROOT / "harness" / "extras").rglob("command.py"),
             *(ROOT / "harness" / "extras").rglob("api.py")]
    for path in sorted(verbs):
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
