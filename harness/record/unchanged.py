"""A run closes FINISHED only while what its ranks read is what its record holds.

The record is made before the ranks run; a file edited in the working tree, or declared data rewritten, while they
run would reach them and not the record. So once they have ended well the code (where they ran the working tree
itself) and the declared data are read again, and a change is named: the run closes FAILED with it (exit 1).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from harness.errors import HarnessError
from harness.record import data as D
from harness.systems import git as gitsource
from harness.systems.git import GitState


def changes(git: GitState | None, data: Mapping[str, Any] | None, since_ns: int | None = None) -> str | None:
    """One line naming what changed since the record was made, the reason its run is FAILED; None when the code
    and the data are as recorded.

    `git`: the code record of ranks that ran the working tree (None: they ran a checkout of it, which no one edits).
    `data`: the declared data's recorded manifest (None: none declared). Both are read again in full (git's hash of
    every recorded file; the data through the hash cache, so an unchanged file costs a stat). `since_ns`:
    time.time_ns() before either was read; a file written since then that holds its recorded bytes again is named
    too - changed and changed back, the ranks may have read the change in between.
    """
    said = []
    code, code_again = gitsource.changed_files(git, since_ns) if git is not None else ([], [])
    if git is not None and code:
        said.append(f"{gitsource.first_few(code)} changed in the working tree while the ranks ran, so the code they "
                    f"imported may not be the code recorded ({git.commit[:12]}{' + patch' if git.dirty else ''})")
    try:
        differ = D.changed_since(data)
    except HarnessError as err:  # unreadable now, or written while it was hashed again: not the recorded bytes either
        said.append(f"{str(err).split('. ')[0].rstrip('.')} (hashed again once the ranks ended)")
        differ = None
    if differ:
        more = f" (and {len(differ) - 1} more)" if len(differ) > 1 else ""
        said.append(f"{differ[0].line()}{more} while the ranks ran, so they may have read bytes other than the "
                    "recorded ones")
    again = code_again + (D.written_since(data, since_ns) if since_ns is not None and differ == [] else [])
    if again:
        said.append(f"{gitsource.first_few(again)} {'was' if len(again) == 1 else 'were'} written while the ranks "
                    "ran (the recorded bytes are back, but the ranks may have read a change in between)")
    if not said:
        return None
    # A tracked file the training itself rewrites (its results, committed) is named too: its own writes and an edit
    # from outside look alike.
    written_by_it = any(not path.endswith(".py") for path in code + code_again)
    return ("; ".join(said) + ". The run is FAILED, not FINISHED with a record of what did not run. Rerun it and "
            "leave the code and the data as they are until it ends" + (
                " (a file the training writes itself belongs in .gitignore, out of the code record; if it is "
                "committed, git rm --cached it)" if written_by_it else "") + ".")
