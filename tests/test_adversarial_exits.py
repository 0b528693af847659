"""Adversarial cases: training code that leaves its rank without returning from `train` (issue 36 item 6).

os._exit(0) skips every finally and exit handler: the rank's process ends with status 0 as if it had finished, its
buffered metrics and its share of the end-of-run collectives (the final fingerprint) lost. The launcher knows a rank
finished only when the rank said so (its progress reached the teardown after `train` returned): any other exit is a
failure, named as that rank's. sys.exit(0) raises SystemExit, which unwinds like a return: the rank finishes as one
that returned, with everything it logged and its final fingerprint.

A rank that returned leaves its process fast too (harness/shutdown.py: no teardown of torch), and so does a forked rank
that failed (multiprocessing's own os._exit): what the training code wrote to a file it never closed or flushed is
written all the same, as Python's teardown would have.
"""

from __future__ import annotations

import pytest
from conftest import Project

from harness import tags as T
from harness.errors import EXIT_FAILED

# linear_ddp whose ranks write a text file and a binary one, keep them open in a global and never flush or close them;
# the ranks in `train.failers` raise once they have.
UNCLOSED = '''"""linear_ddp that leaves two files of each rank open and unflushed."""

import os

import torch
from torch import nn

OPEN = []  # the files stay alive until the process ends, as a module's own log file does


def train(ctx):
    cfg = ctx.cfg
    text = open(os.path.join(cfg.out_dir, f"rank{ctx.rank}.txt"), "w")
    binary = open(os.path.join(cfg.out_dir, f"rank{ctx.rank}.bin"), "wb")
    OPEN.extend([text, binary])
    data = torch.randn(cfg.samples, 10, generator=torch.Generator().manual_seed(ctx.seed))
    loader = ctx.loader(data, batch_size=cfg.batch_size)
    model = ctx.ddp(nn.Linear(10, 5))
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    for epoch in ctx.epochs(cfg.epochs):
        for batch in loader:
            optimizer.zero_grad()
            loss = ctx.backward(batch.to(ctx.device), lambda b: model(b).square().mean())
            optimizer.step()
            ctx.log({"loss": loss}, ctx.step)
    for i in range(cfg.lines):
        text.write(f"rank {ctx.rank} line {i}\\n")
        binary.write(i.to_bytes(4, "little"))
    if ctx.rank in cfg.failers:
        raise RuntimeError("planted after the files were written")
'''

# `train.leave` (os._exit or sys.exit, with status 0) on the ranks in `train.leavers`, after the first epoch logged.
LEAVING = '''"""linear_ddp that leaves its process after one epoch, on some ranks, in one of two ways."""

import os
import sys

import torch
from torch import nn


def train(ctx):
    cfg = ctx.cfg
    data = torch.randn(cfg.samples, 10, generator=torch.Generator().manual_seed(ctx.seed))
    loader = ctx.loader(data, batch_size=cfg.batch_size)
    model = ctx.ddp(nn.Linear(10, 5))
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    for epoch in ctx.epochs(cfg.epochs):
        for batch in loader:
            optimizer.zero_grad()
            loss = ctx.backward(batch.to(ctx.device), lambda b: model(b).square().mean())
            optimizer.step()
            ctx.log({"loss": loss}, ctx.step)
        if ctx.rank in cfg.leavers:
            if cfg.leave == "os._exit":
                os._exit(0)
            sys.exit(0)
'''


@pytest.fixture(scope="module")
def leaving(project: Project) -> str:
    project.add_experiment("leaving", train_py=LEAVING, yaml_extra="")
    return "experiments/leaving"


def _run(project: Project, folder: str, *overrides: str):
    result = project.harness("run", folder, "train.epochs=2", *overrides)
    run_id = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else None
    return result, run_id


def _failure_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("FAILED:")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


def test_os_exit_0_after_logging_fails_the_run_naming_the_rank(project: Project, leaving: str) -> None:
    result, _ = _run(project, leaving, "world_size=1", "train.leave=os._exit", "train.leavers=[0]")
    assert result.returncode == EXIT_FAILED, result.stderr[-3000:]
    line = _failure_line(result.stderr)
    assert "rank 0 left without returning from train" in line, line
    assert "logged no metrics" not in result.stderr
    run = [r for r in project.all_runs() if r.data.tags.get(T.FAILED_RANK) == "0"
           and "left without returning" in r.data.tags.get(T.STATUS_REASON, "")]
    assert run and run[0].info.status == T.FAILED


def test_os_exit_0_in_rank_1_only_is_named_as_rank_1_leaving(project: Project, leaving: str) -> None:
    result, _ = _run(project, leaving, "world_size=2", "train.leave=os._exit", "train.leavers=[1]")
    assert result.returncode == EXIT_FAILED, result.stderr[-3000:]
    line = _failure_line(result.stderr)
    assert line.startswith("FAILED: rank 1 left without returning from train"), line
    assert "Connection reset" not in line and "rank 0 raised" not in line, line


def test_sys_exit_0_finishes_as_a_return_with_its_metrics_and_final_fingerprint(project: Project, leaving: str) -> None:
    result, run_id = _run(project, leaving, "world_size=2", "train.leave=sys.exit", "train.leavers=[0,1]")
    assert result.returncode == 0, result.stderr[-3000:]
    run = project.client().get_run(run_id)
    assert run.info.status == T.FINISHED
    assert run.data.tags.get(T.FINGERPRINT), run.data.tags
    history = project.client().get_metric_history(run_id, "loss")
    assert [m.step for m in history] == [0, 1, 2, 3, 4]  # the first epoch: 100 samples, 2 ranks, batches of 10
    assert "logged no metrics" not in result.stderr


@pytest.fixture(scope="module")
def unclosed(project: Project) -> str:
    project.add_experiment("unclosed", train_py=UNCLOSED)
    return "experiments/unclosed"


def _written(folder, rank: int, lines: int) -> None:
    """Rank `rank`'s two files hold every line and every number it wrote (more than a buffer's worth each)."""
    assert (folder / f"rank{rank}.txt").read_text() == "".join(f"rank {rank} line {i}\n" for i in range(lines))
    assert (folder / f"rank{rank}.bin").read_bytes() == b"".join(i.to_bytes(4, "little") for i in range(lines))


def test_files_the_code_left_open_hold_everything_it_wrote_on_every_rank(project: Project, unclosed: str,
                                                                          tmp_path) -> None:
    result, run_id = _run(project, unclosed, "world_size=2", f"train.out_dir={tmp_path}", "train.lines=5000",
                          "train.failers=[]")
    assert result.returncode == 0, result.stderr[-3000:]
    assert project.client().get_run(run_id).info.status == T.FINISHED
    for rank in (0, 1):
        _written(tmp_path, rank, 5000)


def test_files_a_failed_rank_left_open_hold_everything_it_wrote(project: Project, unclosed: str, tmp_path) -> None:
    result, _ = _run(project, unclosed, "world_size=2", f"train.out_dir={tmp_path}", "train.lines=5000",
                     "train.failers=[1]")
    assert result.returncode == EXIT_FAILED, result.stderr[-3000:]
    assert "rank 1 raised: RuntimeError: planted after the files were written" in _failure_line(result.stderr)
    _written(tmp_path, 1, 5000)
