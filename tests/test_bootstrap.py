"""scripts/bootstrap.py, the README's set-up: which torch build it installs where, a machine that cannot make a virtual
environment told how to fix it in one line (nothing half-made left), and .ci/run running the README's own lines.
The whole script runs in CI itself, which sets up through it (.ci/run)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bootstrap():
    from conftest import script

    return script("bootstrap")


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


def test_a_python_that_cannot_make_an_environment_is_told_the_fix_and_leaves_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    bootstrap = _bootstrap()

    def read_only(self, env_dir):  # a folder it may not write
        Path(env_dir, "bin").mkdir(parents=True)
        raise PermissionError(13, "Permission denied", str(env_dir))

    monkeypatch.setattr(bootstrap.venv.EnvBuilder, "create", read_only)
    assert bootstrap.make_venv(tmp_path / ".venv") is None
    said = capsys.readouterr().err.strip()
    assert len(said.splitlines()) == 1 and "Permission denied" in said and "python3-venv" in said, said
    assert not (tmp_path / ".venv").exists()


def _without_ensurepip(bootstrap, monkeypatch: pytest.MonkeyPatch) -> None:
    """Debian's and Ubuntu's python3 without python3-venv: an environment with pip fails in ensurepip."""
    create = bootstrap.venv.EnvBuilder.create

    def no_ensurepip(self, env_dir):
        if self.with_pip:
            Path(env_dir, "bin").mkdir(parents=True)
            raise subprocess.CalledProcessError(1, ["python3", "-m", "ensurepip"])
        return create(self, env_dir)

    monkeypatch.setattr(bootstrap.venv.EnvBuilder, "create", no_ensurepip)


@pytest.mark.cli
def test_without_ensurepip_the_systems_pip_puts_pip_into_the_environment(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    bootstrap = _bootstrap()
    _without_ensurepip(bootstrap, monkeypatch)
    python = bootstrap.make_venv(tmp_path / ".venv", pip_index="http://127.0.0.1:9/unused")
    assert python is not None
    assert subprocess.run([str(python), "-m", "pip", "--version"], capture_output=True, check=False).returncode == 0


@pytest.mark.cli
def test_without_any_pip_the_wheel_from_the_index_is_checked_and_installed(tmp_path: Path) -> None:
    """pip's wheel served on the loopback as PyPI's JSON describes it: installed into an environment without pip;
    the same wheel under another sha256 is refused, and nothing is installed."""
    import ensurepip
    import functools
    import hashlib
    import http.server
    import json
    import threading
    import venv

    bootstrap = _bootstrap()
    [wheel] = (Path(ensurepip.__file__).parent / "_bundled").glob("pip-*.whl")
    served = tmp_path / "served"
    served.mkdir()
    (served / wheel.name).write_bytes(wheel.read_bytes())
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(served))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        for name, sha in (("bad.json", "0" * 64), ("pip.json", hashlib.sha256(wheel.read_bytes()).hexdigest())):
            (served / name).write_text(json.dumps({"urls": [{"filename": wheel.name, "url": f"{base}/{wheel.name}",
                                                             "digests": {"sha256": sha}}]}))
        where = tmp_path / "env"
        venv.EnvBuilder(with_pip=False).create(where)
        python = where / "bin" / "python"
        assert not bootstrap.pip_from_pypi(python, where, f"{base}/bad.json")
        assert subprocess.run([str(python), "-m", "pip", "--version"], capture_output=True).returncode != 0
        assert bootstrap.pip_from_pypi(python, where, f"{base}/pip.json")
        assert subprocess.run([str(python), "-m", "pip", "--version"], capture_output=True).returncode == 0
        assert not list(where.glob("*.whl"))  # the downloaded wheel does not stay
    finally:
        server.shutdown()


@pytest.mark.cli  # it starts Pythons that import torch
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
