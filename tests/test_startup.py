"""Start-up: ranks started before the run is recorded, and the progress bar's rate and ETA.

The ranks are real spawned processes (they import torch while the launcher records); the rate and ETA
are a pure function, tested without a clock.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from conftest import ROOT, pid_alive
from harness.executors.console import progress_note, rate_and_eta
from harness.errors import RunFailed
from harness.executors.launch import LaunchSpec, launch, start_ranks


def test_rate_and_eta_count_from_the_first_step_not_from_start_up() -> None:
    # 30 s of start-up before the first step, then 10 steps in 2 s: 5 steps/s, 90 steps left -> 18 s.
    first, last = (1, 130.0), (11, 132.0)
    assert rate_and_eta(first, last, total=101) == (5.0, 18.0)
    assert progress_note(5.0, 18.0) == "5 step/s, 00:18 left"
    # One step seen: nothing to measure yet (the start-up is never a step's duration).
    assert rate_and_eta(first, first, total=101) == (None, None)
    assert progress_note(None, None) == ""
    # No total yet (before the training loader is known): a rate, no ETA; done past total: 0 s left.
    assert rate_and_eta(first, last, total=None) == (5.0, None)
    assert rate_and_eta(first, (120, 140.0), total=101)[1] == 0.0


def _spec(log_dir: Path) -> LaunchSpec:
    return LaunchSpec(
        code_dir=str(ROOT / "experiments" / "linear_ddp"), entry_file="train.py", entry_func="train", world_size=2,
        device="cpu", backend="gloo", seed=0, rank_seeds=[1, 2], threads_per_rank=1, determinism="strict",
        fingerprint_every=5, train_cfg={"lr": 0.01, "epochs": 1, "batch_size": 10, "samples": 100},
        log_dir=str(log_dir),
    )


def _wait_alive(ranks, deadline_s: float = 120) -> list[int]:
    deadline = time.monotonic() + deadline_s
    procs = ranks.context.processes
    while not all(p.pid for p in procs):
        assert time.monotonic() < deadline, "ranks never started"
        time.sleep(0.1)
    return [p.pid for p in procs]


def test_rank_dying_while_the_run_is_recorded_fails_the_launch_and_leaves_nothing(tmp_path: Path) -> None:
    ranks = start_ranks(2, tmp_path / "logs")
    pids = _wait_alive(ranks)
    os.kill(pids[1], signal.SIGKILL)  # rank 1 dies while the launcher would still be recording
    with pytest.raises(RunFailed, match=r"^rank 1 was killed by SIGKILL"):
        launch(_spec(tmp_path / "logs"), lambda msg: None, ranks=ranks)
    assert not any(pid_alive(p) for p in pids)


def test_ranks_whose_launcher_gives_up_exit_by_themselves(tmp_path: Path) -> None:
    # A launcher that dies before the run exists (SIGKILL, a failed record) closes its end of their
    # spec pipes: the ranks, still waiting for a spec, end on their own; stop() is the polite way.
    ranks = start_ranks(2, tmp_path / "logs")
    pids = _wait_alive(ranks)
    for inbox in ranks.inboxes:
        inbox.close()
    for proc in ranks.context.processes:
        proc.join(timeout=300)
        assert proc.exitcode == 0, proc.exitcode
    ranks.stop()  # idempotent once they are gone
    assert not any(pid_alive(p) for p in pids)
    assert {"rank0.log", "rank1.log"} <= {p.name for p in (tmp_path / "logs").iterdir()}


def test_ranks_on_a_gpu_give_init_process_group_their_device(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    import torch.distributed as dist

    from harness.executors.launch import device_id

    assert device_id(torch.device("cpu")) == {}
    assert device_id(torch.device("cuda", 3)) == {"device_id": torch.device("cuda", 3)}
    # A torch before 2.3 (none installable here) has no device_id: a stand-in with that older signature.
    def older(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1, store=None, group_name="",
              pg_options=None):  # type: ignore[no-untyped-def]
        raise AssertionError("not called")

    monkeypatch.setattr(dist, "init_process_group", older)
    assert device_id(torch.device("cuda", 3)) == {}
