"""A replay's record is sealed once: its verdict is written before the run is closed, so the close seals the run
with the verdict in it, and the run is never reopened for it.

The seal's own functions are wrapped to count their calls (each call goes through to the real one); the run, the
replay's ranks and the store are real.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from conftest import CPU, Project

import harness
from harness import tags as T
from harness.commands.replay import ReplayResult
from harness.judge.verdicts import Verdict
from harness.record import seal
from harness.store.tracking import Tracker


def test_a_replay_is_sealed_once_with_its_verdict_and_never_reopened(
    fresh_project: Project, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = fresh_project
    outcome = harness.run(harness.RunOptions(p.root / "experiments" / "linear_ddp", ("train.epochs=1", CPU),
                                             tracking_uri=p.uri))
    assert outcome.status == "FINISHED", outcome
    calls: Counter[tuple[str, str]] = Counter()

    def counted(name: str) -> Any:
        real = getattr(seal, name)

        def call(tracker: Any, run_id: str, *args: Any, **kwargs: Any) -> Any:
            calls[(name, run_id)] += 1
            return real(tracker, run_id, *args, **kwargs)
        return call

    for name in ("seal", "open_for_verdict", "open_for_resume"):
        monkeypatch.setattr(seal, name, counted(name))
    result = harness.replay(harness.ReplayOptions(outcome.run_id, tracking_uri=p.uri, repo=p.root))
    assert isinstance(result, ReplayResult) and result.judged.verdict == Verdict.BITWISE, result
    replay_id = result.outcome.run_id
    assert calls[("seal", replay_id)] == 1, calls
    assert calls[("open_for_verdict", replay_id)] == 0 and calls[("open_for_resume", replay_id)] == 0, calls
    assert not [key for key in calls if key[1] == outcome.run_id], calls  # the original is not resealed either

    monkeypatch.undo()
    tracker = Tracker(p.uri, writable=False)
    closed = tracker.harness_run(replay_id)
    assert closed.status == "FINISHED" and closed.tags.get(T.VERDICT) == Verdict.BITWISE, closed.tags
    assert seal.verdict_sealed(tracker, closed)  # the seal holds the verdict and the closed status
    seal.check(tracker, replay_id)  # and the whole record as it is now
