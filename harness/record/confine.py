"""The code a run records lies inside its git tree: entry, experiment folder and their symlinks, resolved."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

from harness.errors import RepositoryError, RunRefused


def inside(root: Path, path: Path) -> bool:
    """`path`, every symlink resolved, is `root` or below it."""
    # realpath, not Path.resolve: a symlink loop must be refused in one line, not raise.
    real, top = os.path.realpath(path), os.path.realpath(root)
    return real == top or real.startswith(top.rstrip(os.sep) + os.sep)


def check_code(root: Path, exp_dir: Path, entry_file: str, symlinks: Sequence[Path] = ()) -> None:
    """Refuse code the record would not hold: it would be recorded clean, and change under a replay unseen.

    `symlinks`: the links of the experiment folder the code record holds (gitsource.recorded_symlinks)."""
    exp_dir = Path(exp_dir)
    if not inside(root, exp_dir):
        raise RepositoryError(
            f"the experiment folder '{exp_dir}' lies outside the git repository {root} (it resolves to "
            f"{os.path.realpath(exp_dir)}); the record would not hold its code. Move or copy it into the "
            "repository and commit it."
        )
    entry = exp_dir / entry_file
    if not inside(root, entry):
        raise RepositoryError(
            f"entry file '{entry_file}' resolves to {os.path.realpath(entry)}, outside the git repository {root}; "
            "the record would not hold it. Copy it into the repository, commit it and point 'entry' at it."
        )
    for path in symlinks:
        if not inside(root, path):
            raise RepositoryError(
                f"'{path.relative_to(root)}' is a symbolic link to {os.path.realpath(path)}, outside the git "
                f"repository {root}; the record would hold the link, not what it points at. Replace it with the "
                "file itself, committed (or add it to .gitignore and declare it as data)."
            )


def recorded_path(rel: str, what: str, run_id: str) -> str:
    """A path the record holds (relative to the checkout) that must stay in the checkout: no absolute, no '..'."""
    pure = PurePosixPath(rel)
    if pure.is_absolute() or ".." in pure.parts or "\\" in rel or (len(rel) > 1 and rel[1] == ":"):
        raise RunRefused(
            f"run {run_id} records {what} '{rel}', which leaves the checkout (absolute or '..'); the record was "
            "altered or made by a broken tool. Replay another run."
        )
    return rel
