"""Set up harness in this checkout: a virtual environment in .venv, the torch build this machine needs, harness with
its examples' extras. The README's first command runs it, then activates .venv and runs the main job.

Why each step is here:
- A virtual environment, because Debian 12 and Ubuntu 24.04 refuse `pip install` into the system Python
  (externally-managed-environment). It sees the system's packages (system_site_packages): a container image's
  torch - the CUDA build the image was made for - is used as it is, never downloaded again.
- torch before anything else: PyPI's `torch` on Linux is the CUDA build (several GB), which a bare requirement
  would pull. Kept when one of at least MIN_TORCH is importable already; else, on Linux without an NVIDIA driver
  (no `nvidia-smi`), the CPU build from PyTorch's wheel index; with a driver, and on macOS, PyPI's.
  HARNESS_TORCH_INDEX=URL picks the index (say, https://download.pytorch.org/whl/cu130 for a CUDA 13.0 driver).

Exit 0 ready, 1 a step failed (its one-line cause above), 2 a Python too old. Run it again at any time: what is
there already is kept.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import urllib.request
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv"
TORCH = "2.13.0"
MIN_TORCH = (2, 13)
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PYPI_PIP = "https://pypi.org/pypi/pip/json"  # pip's release files, with their sha256
INDEX_DEADLINE_S = 5  # a wheel index that does not answer in this time is taken as unreachable


def say(line: str) -> None:
    print(f"setup: {line}", file=sys.stderr, flush=True)


def make_venv(where: Path, pip_index: str = PYPI_PIP) -> Path | None:
    """The environment's python, made when missing; None (said) when this Python cannot make one.

    Debian's and Ubuntu's python3 come without ensurepip (it is their python3-venv package): the environment is then
    made without pip, and pip put into it by the system's pip where there is one, else from its wheel on PyPI."""
    python = where / "bin" / "python"
    if (where / "bin" / "pip").exists():
        return python
    try:
        venv.EnvBuilder(system_site_packages=True, with_pip=True).create(where)
        return python
    except (subprocess.CalledProcessError, OSError) as err:
        shutil.rmtree(where, ignore_errors=True)  # a half-made environment would be taken as made next time
        why = f"{type(err).__name__}: {err}"
    try:
        venv.EnvBuilder(system_site_packages=True, with_pip=False).create(where)
    except OSError as err:
        why = f"{type(err).__name__}: {err}"
    else:
        say("this Python has no ensurepip (Debian's and Ubuntu's python3 without python3-venv): pip is put into the "
            "environment another way.")
        if pip_from_system(python) or pip_from_pypi(python, where, pip_index):
            return python
        why = "no pip to put into it"
    shutil.rmtree(where, ignore_errors=True)
    say(f"could not make a virtual environment with pip in {where} ({why}). On Debian or Ubuntu install the "
        "python3-venv package (sudo apt install python3-venv), then run this again.")
    return None


def pip_from_system(python: Path) -> bool:
    """pip into the environment by the system's own pip (pip 22.3 and later install into another interpreter)."""
    has = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True, check=False)
    return has.returncode == 0 and subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "pip"], check=False).returncode == 0


def pip_from_pypi(python: Path, where: Path, index: str) -> bool:
    """pip into the environment from pip's own wheel on PyPI, its sha256 checked against what PyPI publishes: a wheel
    runs itself (`python pip.whl/pip install pip.whl`)."""
    try:
        with urllib.request.urlopen(index, timeout=30) as answer:
            files = json.load(answer)["urls"]
        wheel = next(f for f in files if f["filename"].endswith("-py3-none-any.whl"))
        with urllib.request.urlopen(wheel["url"], timeout=120) as answer:
            data = answer.read()
    except (OSError, ValueError, KeyError, StopIteration) as err:
        say(f"pip's wheel could not be fetched from {index} ({type(err).__name__}: {err}).")
        return False
    if hashlib.sha256(data).hexdigest() != wheel["digests"]["sha256"]:
        say(f"pip's wheel from {wheel['url']} does not have the sha256 {index} publishes: not installed.")
        return False
    path = where / wheel["filename"]
    path.write_bytes(data)
    try:
        return subprocess.run([str(python), f"{path}/pip", "install", "--no-index", str(path)],
                              check=False).returncode == 0
    finally:
        path.unlink()


def torch_version(python: Path) -> tuple[int, ...] | None:
    """The (major, minor) of the torch `python` imports; None when it has none."""
    found = subprocess.run([str(python), "-c", "import torch; print(torch.__version__)"], capture_output=True,
                           text=True, check=False)
    if found.returncode != 0:
        return None
    parts = found.stdout.strip().split("+")[0].split(".")
    return tuple(int(p) for p in parts[:2] if p.isdigit())


def reachable(url: str, deadline_s: float = INDEX_DEADLINE_S) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=deadline_s):
            return True
    except (OSError, ValueError):
        return False


def torch_index(system: str, has_driver: bool, chosen: str | None, answers: bool | None = None) -> tuple[list[str], str]:
    """pip's index arguments for torch and what to say about them. `chosen`: HARNESS_TORCH_INDEX ("" = the default
    index); `answers`: whether the CPU index answered (asked only where it is the choice)."""
    if chosen is not None:
        return (["--index-url", chosen] if chosen else []), f"torch {TORCH} from {chosen or 'your package index'}"
    if system != "Linux":
        return [], f"torch {TORCH} from your package index ({system}: its build runs on the CPU and the Apple GPU)"
    if has_driver:
        return [], (f"torch {TORCH} from your package index (an NVIDIA driver is here: PyPI's is the CUDA build; "
                    "HARNESS_TORCH_INDEX picks another, e.g. https://download.pytorch.org/whl/cu130)")
    if answers is None:
        answers = reachable(CPU_INDEX)
    if answers:
        return ["--index-url", CPU_INDEX], f"torch {TORCH}, the CPU build (no NVIDIA driver here), from {CPU_INDEX}"
    return [], (f"torch {TORCH} from your package index: PyTorch's CPU index ({CPU_INDEX}) did not answer within "
                f"{INDEX_DEADLINE_S} s (on Linux PyPI's torch is the CUDA build, several GB; HARNESS_TORCH_INDEX picks "
                "another index)")


def pip(python: Path, *args: str) -> bool:
    done = subprocess.run([str(python), "-m", "pip", "install", *args], check=False)
    if done.returncode != 0:
        say(f"`pip install {' '.join(args)}` failed (exit {done.returncode}; its output is above).")
    return done.returncode == 0


def main() -> int:
    if sys.version_info < (3, 10):  # noqa: UP036 - run by whatever python3 the machine has, before harness is
        say(f"harness needs Python 3.10 or later; this is {platform.python_version()}. Run it with a newer python3.")
        return 2
    python = make_venv(VENV)
    if python is None:
        return 1
    have = torch_version(python)
    if have is not None and have >= MIN_TORCH:
        say(f"torch {'.'.join(map(str, have))} is importable already: kept.")
    else:
        args, what = torch_index(platform.system(), shutil.which("nvidia-smi") is not None,
                                 os.environ.get("HARNESS_TORCH_INDEX"))
        say(f"installing {what}.")
        if not pip(python, f"torch=={TORCH}", *args):
            return 1
    if not pip(python, "-e", f"{ROOT}[examples]"):
        return 1
    say(f"ready: {VENV} (in a new shell: . .venv/bin/activate).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
