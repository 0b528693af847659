"""scripts/bootstrap.py, the README's set-up: which torch build it installs where, a machine that cannot make a virtual
environment told how to fix it in one line (nothing half-made left), and .ci/run running the README's own lines.
The whole script runs in CI itself, which sets up through it (.ci/run)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.unit


def _bootstrap():
    spec = importlib.util.spec_from_file_location("bootstrap", ROOT / "scripts" / "bootstrap.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("system,driver,chosen,answers,args,said", [
    ("Linux", False, None, True, ["--index-url", "https://download.pytorch.org/whl/cpu"], "the CPU build"),
    ("Linux", False, None, False, [], "did not answer within 5 s"),
    ("Linux", True, None, None, [], "PyPI's is the CUDA build"),
    ("Darwin", False, None, None, [], "Darwin: its build runs on the CPU and the Apple GPU"),
    ("Linux", False, "https://download.pytorch.org/whl/cu130", None,
     ["--index-url", "https://download.pytorch.org/whl/cu130"], "from https://download.pytorch.org/whl/cu130"),
    ("Linux", False, "", None, [], "from your package index"),
])
def test_torch_comes_from_the_index_this_machine_needs(system: str, driver: bool, chosen: str | None,
                                                      answers: bool | None, args: list[str], said: str) -> None:
    """Never PyPI's CUDA build on a Linux machine without a driver while the CPU index answers; the user's index when
    given; and the CPU index is asked only where it is the choice (answers=None would reach the network)."""
    got, what = _bootstrap().torch_index(system, driver, chosen, answers)
    assert got == args and said in what, (got, what)


def test_a_python_without_venv_support_is_told_the_fix_and_leaves_nothing(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    bootstrap = _bootstrap()

    def no_ensurepip(self, env_dir):  # what Debian's python3 without python3-venv does
        Path(env_dir, "bin").mkdir(parents=True)
        raise subprocess.CalledProcessError(1, ["python3", "-m", "ensurepip"])

    monkeypatch.setattr(bootstrap.venv.EnvBuilder, "create", no_ensurepip)
    assert bootstrap.make_venv(tmp_path / ".venv") is None
    said = capsys.readouterr().err.strip()
    assert len(said.splitlines()) == 1 and "sudo apt install python3-venv" in said, said
    assert not (tmp_path / ".venv").exists()


def test_an_existing_torch_is_read_from_the_environment(tmp_path: Path) -> None:
    assert _bootstrap().torch_version(Path(sys.executable))[:2] >= (2, 13)
    assert _bootstrap().torch_version(Path("/bin/false")) is None


def test_ci_runs_the_readmes_own_set_up_and_test_lines() -> None:
    """The README's two commands, as written, are the lines .ci/run runs (a fresh clone, then them)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Set-up"):readme.index("## Quick start")]
    commands = [block.strip() for block in re.findall(r"```bash\n(.*?)```", section, re.S)]
    set_up = next(c for c in commands if "scripts/bootstrap.py" in c)
    tests = next(c for c in commands if "pytest" in c)
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert set_up in ci and tests in ci, (set_up, tests)
