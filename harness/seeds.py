"""The seeds a job's base seed decides: the per-rank seeds (one derivation, used where the run is recorded - the
launcher, which does not import torch - and where it is checked - the ranks), and the ranks' string-hash seed.

The hash seed: Python salts the hash of every str and bytes with a secret drawn at interpreter start, unless
PYTHONHASHSEED says otherwise, and the order of a set of strings (a vocabulary built from a set) follows those hashes.
A rank's secret is its interpreter's: a forked rank has the rank server's, a spawned one its own, and neither can
change it later. So the launcher decides the value before any rank or rank server starts - the user's
PYTHONHASHSEED where it is set, else one derived from the run's seed - and puts it in its own environment, which
every rank process (and the rank server, whose key holds it: executors/rankserver.py) is started with; the record
holds it (harness.seed.hash) and a rerun puts the recorded value back the same way (apply_recorded_hash_seed).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass

from harness import events, tags as T
from harness.errors import UsageError

HASH_SEED_VAR = "PYTHONHASHSEED"
RANDOM = "random"  # Python's own word for an unpinned secret
# Where a run's hash seed came from (harness.seed.hash.source).
FROM_SEED = "seed"  # derived from the run's seed (a study's members: from the study's)
FROM_ENV = HASH_SEED_VAR  # the user's PYTHONHASHSEED
FROM_RECORD = "record"  # a rerun's: the value of the record it reruns
FROM_TORCHRUN = "torchrun"  # torchrun started the rank processes: their own environment decided, nothing here could
_MAX = 2**32 - 1  # Python takes 0..4294967295


def derive_rank_seeds(seed: int, world_size: int) -> list[int]:
    """One independent 32-bit seed per rank, derived from the base seed (recorded with the run)."""
    import numpy as np  # here: the hash seed's callers (every launch, before the record) need no numpy

    children = np.random.SeedSequence(seed).spawn(world_size)
    return [int(child.generate_state(1)[0]) for child in children]


def derive_hash_seed(seed: int) -> int:
    """The PYTHONHASHSEED a run with base seed `seed` gets when the user sets none: in 1..2**32-1 (0 would turn
    the salting off altogether, which is a setting of its own, not a seed)."""
    digest = hashlib.sha256(f"harness hash seed {int(seed)}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % _MAX + 1


@dataclass(frozen=True)
class HashSeed:
    """The string-hash seed the ranks of this process's job run with, and where it came from."""

    value: str  # a PYTHONHASHSEED value, or "random"
    source: str

    def tags(self) -> dict[str, str]:
        return {T.HASH_SEED: self.value, T.HASH_SEED_SOURCE: self.source}


# What this process decided for its job's ranks. _SET is the value harness itself put in os.environ: a later job in
# the same process (the Python API, a calibration's replays) must not mistake it for the user's.
_current: HashSeed | None = None
_SET: str | None = None


def _check(value: str, where: str) -> str:
    text = value.strip()
    if text == RANDOM or (text.isdigit() and int(text) <= _MAX):
        return text
    raise UsageError(f"{where} PYTHONHASHSEED={value!r} is not \"random\" or a whole number in 0..{_MAX}. Set it to "
                     "one, or unset it (harness then derives one from the run's seed).")


def _users(environ: Mapping[str, str]) -> str | None:
    """The PYTHONHASHSEED the user set, None where there is none (or only the one harness put there)."""
    value = environ.get(HASH_SEED_VAR)
    return None if value is None or (_SET is not None and value == _SET) else value


def _put(value: str | None, environ: MutableMapping[str, str]) -> None:
    global _SET
    if value is None:
        if _SET is not None and environ.get(HASH_SEED_VAR) == _SET:
            del environ[HASH_SEED_VAR]
        _SET = None
        return
    environ[HASH_SEED_VAR] = value
    _SET = value


def pin_hash_seed(seed: int, *, starts_ranks: bool = True,
                  environ: MutableMapping[str, str] | None = None) -> HashSeed:
    """Decide a new run's hash seed, before any rank or rank server starts: the user's PYTHONHASHSEED, else one
    derived from `seed`, set in this process's environment for the ranks to start with. `starts_ranks` False: this
    process is a rank torchrun started, whose secret its own environment fixed - it is recorded as it is, and
    without a PYTHONHASHSEED that is "random" (source FROM_TORCHRUN: the caller warns with unpinned_warning)."""
    global _current
    env = os.environ if environ is None else environ
    users = _users(env)
    if not starts_ranks:
        _current = HashSeed(_check(users, "torchrun's") if users is not None else RANDOM,
                            FROM_ENV if users is not None else FROM_TORCHRUN)
        return _current
    if users is not None:
        _current = HashSeed(_check(users, "the environment's"), FROM_ENV)
        _put(None, env)  # forget one of harness's own that the user's replaced
    else:
        value = str(derive_hash_seed(seed))
        _put(value, env)
        _current = HashSeed(value, FROM_SEED)
    return _current


def unpinned_warning(seed: int) -> str:
    """What a run whose ranks torchrun started without PYTHONHASHSEED is told before it is recorded."""
    return (f"torchrun started the ranks without PYTHONHASHSEED: their string hashes (the order of a set of strings) "
            f"are random and no replay can repeat them; start torchrun with PYTHONHASHSEED={derive_hash_seed(seed)} "
            f"(harness's value for seed {seed}) to pin them")


def recorded_hash_seed(tags: Mapping[str, str]) -> str | None:
    """The hash seed a run's ranks had, from its record: harness.seed.hash, else the PYTHONHASHSEED its ranks
    reported among their variables (set by its user, before harness pinned one); None where neither is there."""
    return tags.get(T.HASH_SEED) or tags.get(T.VAR_PREFIX + HASH_SEED_VAR)


_said: set[str] = set()  # runs whose missing hash seed was said already (a calibration replays one run K+1 times)


def apply_recorded_hash_seed(tags: Mapping[str, str], run_id: str,
                             environ: MutableMapping[str, str] | None = None) -> HashSeed | None:
    """Put a recorded run's hash seed back for the ranks that rerun it (replay, resume, audit, trace, calibrate,
    and the side that executes a Docker or Slurm job), whatever this shell's PYTHONHASHSEED says. A record without
    one (made before harness pinned it, or under torchrun without PYTHONHASHSEED) ran with random string hashes
    that nothing can repeat: the rerun's ranks run as they always did - random, or this shell's PYTHONHASHSEED -
    and a notice says so once per run."""
    global _current
    env = os.environ if environ is None else environ
    value = recorded_hash_seed(tags)
    if value is None or value.strip() == RANDOM:
        _put(None, env)
        users = _users(env)
        _current = HashSeed(_check(users, "the environment's"), FROM_ENV) if users is not None else None
        if run_id not in _said:
            _said.add(run_id)
            events.emit(events.Notice(
                f"run {run_id} recorded no hash seed (its ranks' string hashes were random): where its results depend "
                "on the order of a set of strings, this rerun may differ from it"
                + (f"; this one runs with your PYTHONHASHSEED={users}" if users is not None else "")))
        return _current
    value = _check(value, f"run {run_id}'s recorded")
    users = _users(env)
    if users is not None and users != value:
        events.emit(events.Notice(f"PYTHONHASHSEED={users} in this shell is set aside: run {run_id}'s ranks ran with "
                                  f"{value}, and so do these"))
    _put(value, env)
    _current = HashSeed(value, FROM_RECORD)
    return _current


@contextlib.contextmanager
def given_back() -> Iterator[None]:
    """Around one command of the Python API: the value harness puts in os.environ is for the ranks of that command
    only, so the caller's PYTHONHASHSEED (and this module's state) is as it was once the command ends - a later
    subprocess of the caller's, a `harness run` say, never takes harness's value for its user's."""
    global _current, _SET
    before, saved = os.environ.get(HASH_SEED_VAR), (_current, _SET)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(HASH_SEED_VAR, None)
        else:
            os.environ[HASH_SEED_VAR] = before
        _current, _SET = saved


def hash_seed_tags() -> dict[str, str]:
    """The tags of the hash seed this process's job runs with (none where it runs unpinned)."""
    return _current.tags() if _current is not None else {}
