"""The package as an index would show it: `python -m build` makes an sdist and a wheel, `twine check` passes both,
and the wheel's METADATA carries the licence, the project URLs and a long description whose links work off-site."""

from __future__ import annotations

import email.parser
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
REPO_URL = "https://github.com/harness-repro/harness"
# What the sdist is built from: what a clean checkout holds that the build reads. Built from a copy, so that the
# build's own egg-info and build/ folders never land in the tree under test (other tests may be reading it).
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "CHANGELOG.md", "harness")


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("dist")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, src / name)
    # The sdist first, then the wheel built from the unpacked sdist (build's default): a file the sdist leaves out
    # breaks the wheel. --no-isolation: the build backend installed beside the tests, no download.
    proc = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(src)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def _wheel_metadata(dist: Path) -> email.message.Message:
    (wheel,) = dist.glob("*.whl")
    with zipfile.ZipFile(wheel) as zf:
        (name,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        return email.parser.Parser().parsestr(zf.read(name).decode())


def test_twine_check_passes_the_sdist_and_the_wheel(dist: Path) -> None:
    files = sorted(dist.iterdir())
    assert sorted(f.suffix for f in files) == [".gz", ".whl"], files
    proc = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", *map(str, files)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("PASSED") == 2, proc.stdout


def test_wheel_metadata_shows_the_licence_the_urls_and_the_authors(dist: Path) -> None:
    meta = _wheel_metadata(dist)
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta["License-File"] == "LICENSE"
    urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL"))
    assert {"Homepage", "Documentation", "Issues", "Changelog"} <= set(urls)
    assert all(u.startswith(REPO_URL) for u in urls.values()), urls
    assert meta["Author"] == "The harness developers"
    assert "Intended Audience :: Science/Research" in meta.get_all("Classifier")
    assert "reproducibility" in meta["Keywords"].split(",")
    (wheel,) = dist.glob("*.whl")
    with zipfile.ZipFile(wheel) as zf:
        licence = [n for n in zf.namelist() if n.endswith(".dist-info/licenses/LICENSE")]
        assert licence and "Apache License" in zf.read(licence[0]).decode()
        # Only the package: no tests, experiments or scripts installed into site-packages.
        assert {n.split("/")[0] for n in zf.namelist()} == {"harness", wheel.name.split("-")[0] + "-0.1.0.dist-info"}
        # PEP 561: without the marker (and the stub that names the lazily loaded API) a type checker treats
        # `harness.run` & co. as untyped (Any).
        assert {"harness/py.typed", "harness/__init__.pyi"} <= set(zf.namelist())


_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def test_long_description_links_work_on_an_index_page(dist: Path) -> None:
    # A package index renders the README away from the repository: a relative link there leads nowhere.
    description = _wheel_metadata(dist).get_payload()
    assert isinstance(description, str) and description.startswith("# harness")
    links = _LINK.findall(description)
    assert links, "the long description links to no docs"
    relative = [t for t in links if not re.match(r"^[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]
    assert not relative, f"relative links break on a package index page: {relative}"
    # ... and the absolute links into this repository name files that are here.
    prefix = f"{REPO_URL}/blob/main/"
    missing = [t for t in links if t.startswith(prefix) and not (ROOT / t[len(prefix):].split("#", 1)[0]).exists()]
    assert not missing, missing


def test_dependency_floors_are_the_versions_tested(dist: Path) -> None:
    # The floors of the main dependencies are the versions CHANGELOG.md says CI tests, and what is installed here
    # meets them: a floor below what any test tried would be a promise nobody checked.
    from importlib.metadata import version

    from packaging.requirements import Requirement
    from packaging.version import Version

    tested = re.search(r"^Tested with: (.+)$", (ROOT / "CHANGELOG.md").read_text(encoding="utf-8"), re.M)
    assert tested, "CHANGELOG.md has no 'Tested with:' line"
    stated = dict(item.strip().split(" ") for item in tested.group(1).rstrip(".").split(","))
    declared = {Requirement(r).name.lower(): Requirement(r) for r in _wheel_metadata(dist).get_all("Requires-Dist")
                if "extra ==" not in r}
    for name in ("torch", "mlflow", "omegaconf", "gitpython", "click"):
        floor = next(Version(s.version) for s in declared[name].specifier if s.operator == ">=")
        assert floor == Version(stated[name]), f"{name}: floor {floor}, CHANGELOG.md says {stated[name]} is tested"
        assert version(name) in declared[name].specifier, f"{name} {version(name)} installed: {declared[name]}"
