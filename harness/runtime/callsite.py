"""Which line of the training code made a call harness watches (a seeding function, a determinism setter), and
through which framework function: `train.py:24 (lightning.fabric.utilities.seed.seed_everything)`.

A framework (Lightning, Accelerate) seeds and switches determinism from its own files, called from one line of the
user's; that line is what the user can change, and the framework function is what they called there."""

from __future__ import annotations

import os
from types import FrameType

# Never named as the call made: the libraries whose functions harness wraps (they call each other), and harness's
# own wrappers around them.
_PLAIN = ("torch", "numpy", "random", "harness")


class Sites:
    """Classifies code files as the experiment's (a path relative to its folder), harness's, or another's; cached."""

    def __init__(self, code_dir: str, own: tuple[str, ...] = (), passed: tuple[str, ...] = ()) -> None:
        self._root = os.path.realpath(code_dir) + os.sep
        self._code_dir = code_dir
        # Folders (each with a trailing separator), even inside the experiment's: frames in `own` end the walk
        # (harness's own calls), frames in `passed` are walked past as another's (torch's, harness's wrappers).
        self._own, self._passed = own, passed
        self._kinds: dict[str, str | None] = {}  # co_filename -> relative path, "" (another's) or None (own)

    def _kind(self, path: str) -> str | None:
        kind = self._kinds.get(path, "\0")
        if kind != "\0":
            return kind
        real = os.path.realpath(os.path.join(self._code_dir, path))  # relative: to the import's cwd, the code's
        if path.startswith("<") or real.startswith(self._passed):  # <string>, <frozen ...>
            kind = ""
        elif real.startswith(self._own):
            kind = None
        else:
            kind = os.path.relpath(real, self._root) if real.startswith(self._root) else ""
        self._kinds[path] = kind
        return kind

    def user_line(self, frame: FrameType | None) -> str | None:
        """'train.py:12' of the innermost frame in the experiment's code at or above `frame`, with the framework
        function it called in parentheses when the call went through one; None when harness's own code (one of
        `own`) made the call first, or no frame is the experiment's."""
        below: list[FrameType] = []  # the frames of another's code under the one being looked at, innermost first
        while frame is not None:
            kind = self._kind(frame.f_code.co_filename)
            if kind is None:
                return None
            if kind:
                via = _called(below)
                return f"{kind}:{frame.f_lineno}" + (f" ({via})" if via else "")
            below.append(frame)
            frame = frame.f_back
        return None


def _called(frames: list[FrameType]) -> str | None:
    """The function the user's line called: the outermost of `frames` - but not a decorator's inner wrapper
    (`<locals>`), which says less than the function it wraps."""
    theirs = [f for f in frames if _module(f).split(".")[0] not in _PLAIN]
    named = [f for f in theirs if "<locals>" not in getattr(f.f_code, "co_qualname", "")]
    return _function((named or theirs)[-1]) if theirs else None


def _module(frame: FrameType) -> str:
    return str(frame.f_globals.get("__name__", ""))


def _function(frame: FrameType) -> str:
    """'lightning.fabric.utilities.seed.seed_everything'."""
    module = _module(frame)
    name = getattr(frame.f_code, "co_qualname", frame.f_code.co_name)  # co_qualname: Python 3.11+
    return f"{module}.{name}" if module else name
