"""Download the wheels scripts/gpu-check.sh installs on a GPU machine that cannot reach a package index.

The machine it is written for (one H200, CUDA torch 2.11 under Python 3.12, x86-64) has torch, numpy, click and
the scientific stack, but not MLflow, OmegaConf or GitPython. This script downloads cp312 manylinux x86-64 wheels
of what harness imports and that machine lacks, with everything they need, into `.whl/` (git-ignored), writes
`.whl/requirements.txt` (what gpu-check.sh asks pip for there) and prints the folder's size; it refuses a folder
over 55 MiB, because the working tree and its carried paths travel to that machine within 64 MiB.

usage: python scripts/gpu_wheels.py [--dest .whl] [--list]
  --list  print the requirements, one a line, and download nothing
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIMIT_MIB = 55.0

# Every third-party module harness (and the example experiments the check runs) imports, by import name, and the
# distribution that provides it. tests/test_gpu_check.py holds this table to the imports the code really makes, so
# a new import without a wheel fails there rather than on the GPU machine.
MODULES = {
    "alembic": "alembic",
    "click": "click",
    "cryptography": "cryptography",
    "git": "gitpython",
    "matplotlib": "matplotlib",
    # mlflow-skinny is the same `mlflow` package without the UI's static files and the server's extras (pandas,
    # pyarrow, Flask, ...: over 40 MiB): harness's SQLite store needs only its sqlalchemy store, which takes
    # sqlalchemy and alembic (both listed, as harness imports them itself).
    "mlflow": "mlflow-skinny>=3,<4",
    "numpy": "numpy",
    "omegaconf": "omegaconf>=2.3",
    "psutil": "psutil",
    "requests": "requests",
    "scipy": "scipy",
    "sklearn": "scikit-learn",
    "sqlalchemy": "sqlalchemy",
    "torch": "torch",
    "tqdm": "tqdm",
    "yaml": "pyyaml",
}

# Distributions the GPU machine's image already holds (/work/.library/device/KINDS.md, "Python packages already
# there", read 2026-11-17); torch above all, whose CUDA build must be the machine's own. Downloading them again
# would only add size: pip keeps an installed distribution that satisfies the requirement.
DEVICE_HAS = frozenset({
    "click", "matplotlib", "numpy", "psutil", "requests", "scipy", "scikit-learn", "torch", "tqdm", "pyyaml",
})

# pip matches each manylinux tag exactly: the ones cp312 x86-64 wheels of these packages are published under.
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64")


def distribution(requirement: str) -> str:
    """'mlflow-skinny>=3,<4' -> 'mlflow-skinny'."""
    for sep in "<>=!~;[ ":
        requirement = requirement.split(sep, 1)[0]
    return requirement.strip().lower()


def requirements() -> list[str]:
    """What the GPU machine must be given, sorted: every imported distribution it does not already hold."""
    return sorted({req for req in MODULES.values() if distribution(req) not in DEVICE_HAS}, key=distribution)


def download(dest: Path) -> int:
    reqs = requirements()
    if dest.exists():
        shutil.rmtree(dest)  # one version of each: two wheels of one package stop the whole install there
    dest.mkdir(parents=True)
    (dest / "requirements.txt").write_text("".join(f"{r}\n" for r in reqs))
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", "--abi", "cp312", *platforms, "-d", str(dest), *reqs]
    proc = subprocess.run(cmd)
    if proc.returncode != 0:
        print(f"gpu-wheels: pip download failed (exit {proc.returncode})", file=sys.stderr)
        return 1
    wheels = sorted(dest.glob("*.whl"))
    mib = sum(w.stat().st_size for w in wheels) / 2**20
    names = [w.name.split("-", 1)[0].replace("_", "-").lower() for w in wheels]  # NAME-VERSION-...whl
    if len(set(names)) != len(names):
        print(f"gpu-wheels: two versions of one package in {dest}: {sorted(names)}", file=sys.stderr)
        return 1
    print(f"gpu-wheels: {len(wheels)} wheels, {mib:.1f} MiB in {dest} (limit {LIMIT_MIB:.0f} MiB)")
    if mib > LIMIT_MIB:
        print(f"gpu-wheels: {dest} is over {LIMIT_MIB:.0f} MiB: the working tree and carried paths must stay "
              "under 64 MiB", file=sys.stderr)
        return 1
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=ROOT / ".whl")
    parser.add_argument("--list", action="store_true", help="print the requirements and download nothing")
    args = parser.parse_args()
    if args.list:
        print("\n".join(requirements()))
        return 0
    return download(args.dest)


if __name__ == "__main__":
    sys.exit(main())
