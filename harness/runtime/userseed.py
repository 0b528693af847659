"""Seeds the training code sets itself: the global RNGs' seeding functions, wrapped in each rank after harness's own
seeding, note a call made from the experiment's code (file:line, function, value) and still seed exactly as before.

A study whose code seeds itself (torch.manual_seed(1337) in train) gives bit-identical members whatever
harness's seed; this is how the study can say where.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from harness import version  # its file is in the package's folder
from harness.messages import UserSeed, UserSeeds
from harness.runtime.callsite import Sites

# harness's whole package, every layer (not this module's folder): its calls are its own.
_OWN = os.path.dirname(os.path.abspath(version.__file__)) + os.sep
# The framework integrations are the training code's side: a Trainer made through harness.transformers seeds from
# the user's Trainer(...) line, as one made directly does (walked past, as another's code).
_INTEGRATIONS = tuple(os.path.join(os.path.dirname(_OWN), name) for name in ("transformers.py", "lightning.py",
                                                                              "accelerate.py"))
_MAX_CALLS = 20  # distinct (line, function, value) kept: a seed per step in a loop is one line, said once


@dataclass
class Watch:
    """The wrapped functions of one rank and the user's calls seen so far; stop() puts the originals back."""

    code_dir: str
    calls: list[UserSeed] = field(default_factory=list)
    _restore: list[tuple[Any, str, Any]] = field(default_factory=list)
    _sites: Sites | None = None  # which files are the experiment's: frames are walked per call

    def message(self) -> UserSeeds | None:
        return UserSeeds(tuple(self.calls)) if self.calls else None

    def stop(self) -> None:
        for owner, name, original in reversed(self._restore):
            setattr(owner, name, original)
        self._restore.clear()

    def _wrap(self, owner: Any, name: str, shown: str) -> None:
        original = getattr(owner, name, None)
        if original is None or getattr(original, "_harness_seed_watch", None) is self:
            return
        watch = self

        @functools.wraps(original)
        def seeding(*args: Any, **kwargs: Any) -> Any:
            where = watch._user_caller(sys._getframe(1))
            if where is not None:
                watch._note(where, shown, args, kwargs)
            return original(*args, **kwargs)

        seeding._harness_seed_watch = self  # type: ignore[attr-defined]
        setattr(owner, name, seeding)
        self._restore.append((owner, name, original))

    def _user_caller(self, frame: Any) -> str | None:
        """'train.py:12' of the innermost frame in the experiment's code, with the framework function called there
        ('train.py:12 (lightning.fabric.utilities.seed.seed_everything)'), unless harness made the call (its own
        seeding, a DataLoader worker's, or one wrapped function calling another: torch.manual_seed seeds CUDA too)."""
        if self._sites is None:
            self._sites = Sites(self.code_dir, (_OWN,), passed=_INTEGRATIONS)
        return self._sites.user_line(frame)

    def _note(self, where: str, function: str, args: tuple, kwargs: dict) -> None:
        value = args[0] if args else next(iter(kwargs.values()), None)
        call = UserSeed(where, function, _shown(value))
        if call not in self.calls and len(self.calls) < _MAX_CALLS:
            self.calls.append(call)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def watch(code_dir: str) -> Watch:
    """Wrap torch's, numpy's and random's global seeding functions in this process (before the entry is imported,
    so that `from torch import manual_seed` binds the wrapper too)."""
    import random

    import numpy
    import torch

    w = Watch(code_dir)
    targets: list[tuple[Any, str, str]] = [
        (torch, "manual_seed", "torch.manual_seed"),
        (torch.random, "manual_seed", "torch.manual_seed"),  # the same function as torch.manual_seed
        (torch.cuda, "manual_seed", "torch.cuda.manual_seed"),
        (torch.cuda, "manual_seed_all", "torch.cuda.manual_seed_all"),
        (numpy.random, "seed", "numpy.random.seed"),
        (random, "seed", "random.seed"),
    ]
    for owner, name, shown in targets:
        w._wrap(owner, name, shown)
    return w


def describe(calls: list[UserSeed] | tuple[UserSeed, ...]) -> str:
    """'train.py:12 torch.manual_seed(1337); train.py:13 random.seed(1337)'."""
    return "; ".join(f"{c.where} {c.function}({c.value})" for c in calls)


def send_once(w: Watch | None, send: Callable[[Any], None] | None) -> None:
    """Rank 0: the user's seeding calls, if any, to the launcher (one message for the whole job)."""
    if w is None or send is None:
        return
    message = w.message()
    if message is not None:
        send(message)


def foreign(calls: tuple[UserSeed, ...], seed: int, rank_seeds: Sequence[int]) -> list[UserSeed]:
    """The calls that seeded with a value harness did not derive from the recorded seed (its base seed, a rank's
    seed): those values, not the record's seed, decide what the RNGs draw. L.seed_everything(ctx.seed) is not one."""
    ours = {str(seed), *map(str, rank_seeds)}
    return [c for c in calls if c.value not in ours]


def foreign_warning(calls: list[UserSeed], seed: int) -> str:
    """The run's one warning that its code seeds the RNGs itself, naming where (and the framework call, if any)."""
    # By value alone 1337 + ctx.seed cannot be told from 1337: the warning says what holds unless it is computed.
    return (f"the training code seeds the RNGs itself with values harness did not give it ({describe(calls[:4])}"
            f"{' ...' if len(calls) > 4 else ''}): unless they are computed from ctx.seed, the recorded seed={seed} no "
            "longer decides what it draws, and another seed (a study's members) changes nothing there. Seed with "
            "ctx.seed or ctx.rank_seed (L.seed_everything(ctx.seed), set_seed(ctx.seed)), or drop the call: harness "
            "seeds every RNG.")
