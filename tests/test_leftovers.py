"""Nothing a job started outlives it: whatever ends the job (it finishes, a rank raises, a stall, a rank SIGKILLed,
Ctrl-C, SIGTERM, the launcher SIGKILLed), every rank's DataLoader workers, subprocesses and their children end with
it; and hundreds of DataLoader forks beside harness's busy threads finish.

Real CLI, real git repository, real SQLite store, real 2-rank gloo jobs, real signals.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import hangs
import pytest
from conftest import Project

ENDINGS = ("finished", "raised", "stalled", "rank-sigkill", "ctrl-c", "sigterm", "launcher-sigkill")


@pytest.fixture(scope="module")
def planted(project: Project) -> Project:
    return hangs.add(project)


def test_however_a_job_ends_every_process_its_ranks_started_ends_with_it(planted: Project, tmp_path: Path) -> None:
    # The seven endings at once: each job waits idle for its end most of the time, so they cost one job's time.
    mode = {"finished": "none", "raised": "raise", "stalled": "sleep", "rank-sigkill": "self-kill"}
    procs = {ending: hangs.start(planted, mode.get(ending, "wait"), tmp_path / ending, "stall_s=4") for ending in ENDINGS}
    deadline = time.monotonic() + 180
    waiting = [e for e in ENDINGS if mode.get(e, "wait") == "wait"]
    while waiting and time.monotonic() < deadline:
        for ending in list(waiting):
            if procs[ending].poll() is not None:  # it ended by itself: the checks below say how
                waiting.remove(ending)
            elif hangs.pids(tmp_path / ending).get("ready"):
                waiting.remove(ending)
                launcher = procs[ending].pid
                if ending == "ctrl-c":
                    os.killpg(launcher, signal.SIGINT)  # the terminal's Ctrl-C: the launcher's whole group
                elif ending == "sigterm":
                    os.kill(launcher, signal.SIGTERM)
                else:
                    os.kill(launcher, signal.SIGKILL)  # it can clean nothing up: the kernel and the guardian must
        time.sleep(0.1)
    assert not waiting, waiting
    expected_code = {"finished": 0, "ctrl-c": 130, "sigterm": 143, "launcher-sigkill": -9}
    for ending, proc in procs.items():
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == expected_code.get(ending, 1), (ending, err[-2000:])
        found = hangs.pids(tmp_path / ending)
        # Each kind was really there: two ranks, their workers, their subprocesses' children.
        assert {"rank0", "rank1", "worker", "grandchild"} <= set(found), (ending, found)
        assert len(found["grandchild"]) == 2 and len(found["worker"]) >= 2, (ending, found)
        assert hangs.all_gone(tmp_path / ending) == [], ending
        # ... and nothing else of the command: its rank server and multiprocessing's resource tracker end too.
        deadline = time.monotonic() + 20
        while (left := hangs.session_left(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left, (ending, left)
        if ending == "rank-sigkill":
            run = planted.client().get_run(out.strip().splitlines()[-1])
            assert run.data.tags["harness.status_reason"].startswith("rank 1 was killed by SIGKILL"), run.data.tags
        if ending == "stalled":
            run = planted.client().get_run(out.strip().splitlines()[-1])
            assert run.data.tags["harness.status_reason"].startswith("stalled: "), run.data.tags


FORKS = '''
import torch
from torch.utils.data import TensorDataset

from harness.runtime import forkgate


def train(ctx):
    data = TensorDataset(torch.randn(8, 4), torch.randn(8, 1))
    loader = ctx.loader(data, 2, num_workers=2)
    model = ctx.ddp(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for epoch in ctx.epochs(ctx.cfg.epochs):
        for x, y in loader:  # every epoch forks both workers again
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            # The metric sender busy: a batch of points at every step, sent while the next epoch's workers fork.
            ctx.log({f"m{i}": float(i) for i in range(64)}, ctx.step)
    ctx.log({"forks": float(forkgate.forks())}, ctx.step)
'''


def test_hundreds_of_dataloader_forks_beside_busy_harness_threads_finish(project: Project) -> None:
    # Before the gate, harness's threads ran through every fork (see docs/troubleshooting.md for what was measured);
    # here every epoch of every rank forks two DataLoader workers while rank 0's sender is pickling batches.
    project.add_experiment("forks", train_py=FORKS)
    result = project.harness("run", "experiments/forks", "train={epochs: 100}", "stall_s=20", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    run = project.client().get_run(result.last_line)
    assert run.data.metrics["forks"] >= 200  # rank 0's own forks: two workers an epoch
