"""The ranks' string-hash seed (harness/seeds.py): pinned per run, recorded, put back by a replay.

A training whose logged value follows the order of a set of strings runs with the seed derived from its run seed (forked
from the rank server) and with the user's PYTHONHASHSEED (spawned ranks); each logs exactly what a Python started with
that PYTHONHASHSEED computes, and the replay is bitwise. The rest drives harness/seeds.py in this process.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import Project

from harness import events, seeds, tags as T

# What the ranks log: depends on the string-hash secret through the set's order and hash() itself.
ORDER = 'sum(i * (hash(w) % 97) for i, w in enumerate({"alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", ' \
        '"theta", "iota", "kappa", "lambda", "mu"}))'
TRAIN = f'''
import torch
from torch import nn


def train(ctx):
    model = ctx.ddp(nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        ctx.log({{"order": float({ORDER})}}, step)
'''
USERS = "4242"


def order_under(hash_seed: str) -> float:
    """ORDER as a Python started with PYTHONHASHSEED=hash_seed computes it."""
    out = subprocess.run([sys.executable, "-c", f"print({ORDER})"], env={**os.environ, "PYTHONHASHSEED": hash_seed},
                         capture_output=True, text=True, check=True).stdout
    return float(out)


@pytest.fixture(scope="module")
def runs(project: Project) -> dict[str, str]:
    """A run with the derived hash seed (forked ranks) and one with the user's PYTHONHASHSEED (spawned ranks)."""
    project.add_experiment("hashseed", train_py=TRAIN)
    with pytest.MonkeyPatch.context() as mp:  # a developer's own PYTHONHASHSEED would be this run's user's
        mp.delenv("PYTHONHASHSEED", raising=False)
        derived = project.harness("run", "experiments/hashseed", "seed=7")
    assert derived.returncode == 0, derived.stderr
    users = project.harness("run", "experiments/hashseed", "seed=7", "launcher=spawn", env={"PYTHONHASHSEED": USERS})
    assert users.returncode == 0, users.stderr
    return {"derived": derived.last_line, "users": users.last_line}


def _logged(project: Project, run_id: str) -> tuple[dict[str, str], list[float]]:
    client = project.client()
    return client.get_run(run_id).data.tags, [m.value for m in client.get_metric_history(run_id, "order")]


def test_a_run_records_its_hash_seed_and_its_ranks_run_with_it(project: Project, runs: dict[str, str]) -> None:
    value = str(seeds.derive_hash_seed(7))
    tags, logged = _logged(project, runs["derived"])
    assert (tags.get(T.HASH_SEED), tags.get(T.HASH_SEED_SOURCE)) == (value, seeds.FROM_SEED)
    assert logged == [order_under(value)] * 2
    # The user's PYTHONHASHSEED wins over the derived one, is recorded as the user's, and reaches spawned ranks.
    tags, logged = _logged(project, runs["users"])
    assert (tags.get(T.HASH_SEED), tags.get(T.HASH_SEED_SOURCE)) == (USERS, seeds.FROM_ENV)
    assert logged == [order_under(USERS)] * 2 != [order_under(value)] * 2


def test_a_replay_puts_the_recorded_hash_seed_back(project: Project, runs: dict[str, str]) -> None:
    # Forked from a rank server started under the record's value; this shell's own PYTHONHASHSEED is set aside.
    value = str(seeds.derive_hash_seed(7))
    replay = project.harness("replay", runs["derived"], env={"PYTHONHASHSEED": USERS})
    assert replay.returncode == 0, replay.stderr
    assert "verdict: BITWISE" in replay.stdout, replay.stdout
    assert f"PYTHONHASHSEED={USERS} in this shell is set aside: run {runs['derived']}'s ranks ran with {value}" \
        in replay.stderr
    tags, logged = _logged(project, replay.last_line)
    assert (tags.get(T.HASH_SEED), tags.get(T.HASH_SEED_SOURCE)) == (value, seeds.FROM_RECORD)
    assert logged == [order_under(value)] * 2


@pytest.fixture
def environ(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    monkeypatch.setattr(seeds, "_SET", None)
    monkeypatch.setattr(seeds, "_current", None)
    monkeypatch.setattr(seeds, "_said", set())
    return {}


def test_the_hash_seed_follows_the_run_seed_unless_the_user_set_one(environ: dict[str, str]) -> None:
    assert seeds.derive_hash_seed(0) != seeds.derive_hash_seed(1)
    assert all(1 <= seeds.derive_hash_seed(s) <= 2**32 - 1 for s in (0, 1, 2**63 - 1))
    first = seeds.pin_hash_seed(0, environ=environ)
    assert first == seeds.HashSeed(str(seeds.derive_hash_seed(0)), seeds.FROM_SEED)
    assert environ["PYTHONHASHSEED"] == first.value
    # A second run in the same process (the Python API) does not take harness's own value for the user's.
    assert seeds.pin_hash_seed(1, environ=environ).value == environ["PYTHONHASHSEED"] == str(seeds.derive_hash_seed(1))
    environ["PYTHONHASHSEED"] = "0"
    assert seeds.pin_hash_seed(1, environ=environ) == seeds.HashSeed("0", seeds.FROM_ENV)
    assert seeds.hash_seed_tags() == {T.HASH_SEED: "0", T.HASH_SEED_SOURCE: "PYTHONHASHSEED"}


def test_under_torchrun_the_hash_seed_is_recorded_as_the_rank_started(environ: dict[str, str]) -> None:
    assert seeds.pin_hash_seed(3, starts_ranks=False, environ=environ) == seeds.HashSeed("random", "torchrun")
    assert environ == {}  # too late for this process: nothing is set
    assert f"start torchrun with PYTHONHASHSEED={seeds.derive_hash_seed(3)}" in seeds.unpinned_warning(3)
    environ["PYTHONHASHSEED"] = "9"  # given to torchrun: recorded as the user's
    assert seeds.pin_hash_seed(3, starts_ranks=False, environ=environ) == seeds.HashSeed("9", seeds.FROM_ENV)


def test_a_record_without_a_hash_seed_reruns_unpinned_and_says_so(environ: dict[str, str]) -> None:
    seeds.pin_hash_seed(0, environ=environ)  # an earlier run of this process: its value is taken back
    heard: list[object] = []
    with events.listening(heard.append):
        assert seeds.apply_recorded_hash_seed({T.SEED: "0"}, "old1", environ=environ) is None
        seeds.apply_recorded_hash_seed({T.SEED: "0"}, "old1", environ=environ)
    assert environ == {} and seeds.hash_seed_tags() == {}
    assert len(heard) == 1 and "run old1 recorded no hash seed" in str(heard[0])
    # One whose user had set PYTHONHASHSEED recorded it among its ranks' variables: that is put back.
    assert seeds.apply_recorded_hash_seed({T.VAR_PREFIX + "PYTHONHASHSEED": "5"}, "old2", environ=environ).value == "5"
    assert environ == {"PYTHONHASHSEED": "5"}


def test_an_api_command_gives_the_callers_environment_back(fresh_project: Project, monkeypatch: pytest.MonkeyPatch) -> None:
    # The value harness pins is for the ranks of that command: a later subprocess of the caller's must not inherit it
    # (a `harness run` started from it would record harness's own value as its user's).
    import harness

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    exp = fresh_project.root / "experiments" / "linear_ddp"
    before = seeds.hash_seed_tags()  # what an earlier command of this process left (one not called through the API)
    checked = harness.check(harness.CheckOptions(exp, ("seed=7",), tracking_uri=fresh_project.uri))
    assert checked.cfg.seed == 7 and "PYTHONHASHSEED" not in os.environ and seeds.hash_seed_tags() == before
    monkeypatch.setenv("PYTHONHASHSEED", USERS)
    harness.check(harness.CheckOptions(exp, ("seed=7",), tracking_uri=fresh_project.uri))
    assert os.environ["PYTHONHASHSEED"] == USERS
