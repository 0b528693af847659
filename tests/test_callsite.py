"""Which line of the training code made a watched call, and through which framework function (harness.runtime.callsite):
real frames of real files - an experiment folder, a framework's package outside it, harness's own folder."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from harness.runtime.callsite import Sites


def _load(path: Path, name: str, source: str) -> ModuleType:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


FRAMEWORK = '''import functools
import sys


def _defaults(fn):
    @functools.wraps(fn)
    def insert_defaults(*args, **kwargs):
        return fn(*args, **kwargs)
    return insert_defaults


class Trainer:
    @_defaults
    def __init__(self, watched):
        self.frame = watched()


def seed_everything(watched):
    return _inner(watched)


def _inner(watched):
    return watched()
'''

TRAIN = '''import fw


def train(watched):
    a = fw.seed_everything(watched)
    b = fw.Trainer(watched).frame
    c = watched()
    return a, b, c
'''


def test_the_users_line_and_the_framework_function_it_called(tmp_path: Path) -> None:
    fw = _load(tmp_path / "site-packages" / "fw.py", "fw", FRAMEWORK)
    train = _load(tmp_path / "exp" / "train.py", "exp_train", TRAIN)
    # The watched function reads its caller's frames at once, as harness's wrappers do (a frame read later would
    # be at another line).
    own = _load(tmp_path / "own" / "hooks.py", "own_hooks",
                "import sys\n\nSITES = []\n\ndef watched():\n    caller = sys._getframe(1)\n    return [s.user_line(caller) for s in SITES]\n")
    framework = str(tmp_path / "site-packages") + "/"
    own.SITES[:] = [
        Sites(str(tmp_path / "exp")),
        Sites(str(tmp_path / "exp"), own=(framework,)),  # a frame of `own` first: harness made the call
        Sites(str(tmp_path), passed=(framework,)),  # `passed` folders are walked past even inside the experiment's
        Sites(str(tmp_path / "elsewhere")),  # no frame is the experiment's
    ]
    try:
        through_seed, through_trainer, direct = train.train(own.watched)
    finally:
        for name in ("fw", "exp_train", "own_hooks"):
            sys.modules.pop(name, None)
    # The outermost function of the framework's called from the user's line; a decorator's inner wrapper (<locals>)
    # is passed over for the function it wraps.
    assert through_seed == ["train.py:5 (fw.seed_everything)", None, "exp/train.py:5 (fw.seed_everything)", None]
    assert through_trainer == ["train.py:6 (fw.Trainer.__init__)", None, "exp/train.py:6 (fw.Trainer.__init__)", None]
    assert direct == ["train.py:7", "train.py:7", "exp/train.py:7", None]
    assert fw.Trainer.__init__.__qualname__ == "Trainer.__init__"
