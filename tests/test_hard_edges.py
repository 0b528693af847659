"""Hard edges, tried as a new user would: every bad input or broken rank ends in one line, a documented exit
code and a closed run - never a traceback from harness, a hang, or silent wrong training.

Real CLI, real git repository, real SQLite store, real 2-rank gloo workers.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import Project, Result, git, pid_alive

# A small training script whose misbehaviour is chosen by train.mode; every rank writes its pid first.
EDGES = '''
import os, pathlib, time
import torch
import torch.distributed as dist
from torch import nn


class Finalizer:
    """In a reference cycle: freed by a full collection only, which harness's teardown runs."""

    def __init__(self, rank, group):
        self.rank, self.group, self.me = rank, group, self

    def __del__(self):
        # Each rank enters a collective the other never joins: both wait, alive, in harness's teardown.
        if self.rank == 0:
            dist.all_reduce(torch.ones(1), group=self.group)  # TEARDOWN_LINE
        else:
            dist.barrier()  # TEARDOWN_PEER_LINE


def train(ctx):
    mode = ctx.cfg.mode
    pathlib.Path(ctx.cfg.pid_dir, f"rank{ctx.rank}").write_text(str(os.getpid()))
    data = torch.randn(40, 4, generator=torch.Generator().manual_seed(ctx.seed))
    loader = ctx.loader(data, batch_size=5, pin_memory=True)
    if mode == "nolog":
        return
    group = dist.new_group([0, 1]) if mode in ("group", "teardown") else None  # the user's own second group
    if mode == "teardown":
        finalizer = Finalizer(ctx.rank, group)  # long-lived: promoted to the oldest generation while training
    model = ctx.ddp(nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.0 if mode == "frozen" else 0.1)
    for epoch in ctx.epochs(2):
        for x in loader:
            opt.zero_grad()
            if mode == "apart":  # trains the replica, not the DDP model: gradients are never all-reduced
                loss = model.module(x * (ctx.rank + 1)).pow(2).mean()
            else:
                loss = model(x).pow(2).mean()
            if mode == "hang" and ctx.rank == 1 and ctx.step == 2:
                time.sleep(600)  # HANG_LINE
            if mode == "group" and ctx.rank == 0 and ctx.step == 2:
                dist.all_reduce(torch.ones(1), group=group)  # GROUP_LINE: rank 1 never joins, and waits in backward
            loss.backward()
            opt.step()
            if mode == "str":
                ctx.log({"accuracy": "high"}, ctx.step)
            ctx.log({"loss": loss, "nan": float("nan"), "inf": float("inf"), "ninf": -float("inf")}, ctx.step)
    if ctx.is_main:
        (ctx.output_dir / "note.txt").write_text("written by rank 0")
    if mode == "teardown":
        del finalizer  # garbage now, in a cycle: harness's teardown collects it
        dist.destroy_process_group()
'''
HANG_LINE = next(i for i, line in enumerate(EDGES.splitlines(), 1) if "HANG_LINE" in line)
GROUP_LINE = next(i for i, line in enumerate(EDGES.splitlines(), 1) if "GROUP_LINE" in line)
TEARDOWN_LINE = next(i for i, line in enumerate(EDGES.splitlines(), 1) if "TEARDOWN_LINE" in line)
TEARDOWN_PEER_LINE = next(i for i, line in enumerate(EDGES.splitlines(), 1) if "TEARDOWN_PEER_LINE" in line)
BACKWARD_LINE = next(i for i, line in enumerate(EDGES.splitlines(), 1) if "loss.backward()" in line)

# The plain-DDP habits (loss.backward(), loader.sampler.set_epoch, model.module) under world-size-invariant mode.
PLAIN = '''
import torch
from torch import nn


def train(ctx):
    data = torch.randn(64, 4, generator=torch.Generator().manual_seed(ctx.seed))
    loader = ctx.loader(data, batch_size=4)
    model = ctx.ddp(nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(2):
        loader.sampler.set_epoch(epoch)
        for x in loader:
            opt.zero_grad()
            if ctx.cfg.use_ctx_backward:
                loss = ctx.backward(x, lambda x: model(x).pow(2).mean())
            else:
                loss = model(x).pow(2).mean()
                loss.backward()
            opt.step()
            ctx.log({"loss": loss}, ctx.step)
    torch.save(model.module.state_dict(), ctx.output_dir / "weights.pt")
'''
INVARIANT = ["determinism.world_size_invariant=true", "determinism.shards=4"]


def run_edges(project: Project, tmp_path: Path, mode: str, *extra: str) -> Result:
    project.add_experiment("edges", train_py=EDGES, yaml_extra="timeout_s: 1800\n")
    return project.harness("run", "experiments/edges", f"train={{mode: {mode}, pid_dir: '{tmp_path}'}}", *extra)


def only_error_line(result: Result) -> str:
    """The stderr of a refused command: exactly one line, `Error: ...`, and nothing on stdout."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


def assert_ranks_gone(tmp_path: Path) -> None:
    for rank in (0, 1):
        assert not pid_alive(int((tmp_path / f"rank{rank}").read_text())), f"rank {rank} left behind"


# -- ranks that fail, hang or train wrongly ----------------------------------------------------------


def test_failing_rank_is_named_first_and_peers_are_summarised(project: Project, tmp_path: Path) -> None:
    from snippets import crash_experiment

    exp, train = crash_experiment(project, "crashing", steps=1000, fail_rank=1, fail_step=3, sleep=0.05)
    result = project.harness("run", exp, train, env={"PID_DIR": str(tmp_path)})
    assert result.returncode == 1
    failed = [line for line in result.stderr.splitlines() if line.startswith("FAILED: ")]
    assert len(failed) == 1 and failed[0].startswith(
        "FAILED: rank 1 raised: RuntimeError: boom at step 3 (train.py, line 13)"), result.stderr
    # The user's own traceback is shown once; the peer's "connection closed" never is.
    assert result.stderr.count("Traceback") == 1 and "Connection closed by peer" not in result.stderr
    assert result.stderr.index("Traceback") < result.stderr.index("FAILED: ")
    run = project.client().get_run(result.last_line)
    assert run.info.status == "FAILED" and run.data.tags["harness.status_reason"] == failed[0][len("FAILED: "):]


# Errors as torch raises them (texts from NVIDIA/nccl#795, #1241, #1928, #2076, NVIDIA/Megatron-LM#935, pytorch#64241).
_NCCL = "NCCL error in: /opt/pytorch/pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3763, "
_WATCHDOG = ("[PG 1 Rank 0] Process group watchdog thread terminated with exception: [Rank 0] Watchdog caught collective "
             "operation timeout: WorkNCCL(SeqNum=199, OpType=ALLREDUCE, NumelIn=466119168, NumelOut=466119168, "
             "Timeout(ms)=600000) ran for 600060 milliseconds before timing out.\nException raised from checkTimeout at "
             "/opt/pytorch/pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:567 (most recent call first):")
PEER_CAUSED = {
    "remote exited": _NCCL + "remote process exited or there was a network error, NCCL version 2.28.8\nncclRemoteError: "
                     "A call failed possibly due to a network error or a remote process exiting prematurely.\nLast error:\n"
                     "NET/OFI Request 0x7f14cc5b60c0 completed with error. RC: 113. Error: 2 (UNDELIVERABLE).",
    "reset by peer": _NCCL + "unhandled system error, NCCL version 2.21.5\nncclSystemError: System call (e.g. socket, "
                     "malloc) or external library call failed or device error.\nLast error:\nsocketProgressOpt: Call to "
                     "recv from 172.31.0.12<33759> failed : Connection reset by peer",
    "closed by remote peer": _NCCL + "internal error - please report this issue to the NCCL developers, NCCL version "
                             "2.14.3\nncclInternalError: Internal check failed.\nLast error:\nNet : Connection closed by "
                             "remote peer node-22<47861>",
    "aborted on the peer": "NCCL communicator was aborted on rank 1. Original reason for failure was: [Rank 1] Watchdog "
                           "caught collective operation timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE) ran for 600013 ms",
    "own abort, peer's cause": "NCCL communicator was aborted on rank 0. Original reason for failure was: NCCL error: "
                               "remote process exited or there was a network error, NCCL version 2.21.5",
    "gloo": "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:28765",
}
OWN = {
    "internal error": _NCCL + "internal error - please report this issue to the NCCL developers, NCCL version 2.18.6\n"
                      "ncclInternalError: Internal check failed.\nLast error:\nFailed to CUDA calloc 6291456 bytes",
    "invalid usage": _NCCL + "invalid usage (run with NCCL_DEBUG=WARN for details), NCCL version 2.17.1\n"
                     "ncclInvalidUsage: This usually reflects invalid usage of NCCL library.\nLast error:\n"
                     "Duplicate GPU detected : rank 0 and rank 1 both on CUDA device 1000",
    "watchdog timeout": _WATCHDOG,
    "own abort, own timeout": "NCCL communicator was aborted on rank 0. Original reason for failure was: " + _WATCHDOG,
}


@pytest.mark.parametrize("name", sorted(PEER_CAUSED))
def test_nccl_errors_that_say_a_peer_failed_are_consequences(name: str) -> None:
    import torch.distributed as dist

    from harness.runtime.rank.failure import is_peer_error

    assert is_peer_error(dist.DistBackendError(PEER_CAUSED[name]), rank=0)


@pytest.mark.parametrize("name", sorted(OWN))
def test_a_ranks_own_nccl_error_is_a_cause_not_a_consequence(name: str) -> None:
    import torch.distributed as dist

    from harness.runtime.rank.failure import is_peer_error

    assert not is_peer_error(dist.DistBackendError(OWN[name]), rank=0)
    # The same words raised on another rank than the one whose communicator aborted: there, a consequence.
    if name.startswith("own abort"):
        assert is_peer_error(dist.DistBackendError(OWN[name]), rank=1)


def test_a_hanging_rank_ends_the_job_naming_it(project: Project, tmp_path: Path) -> None:
    start = time.monotonic()
    result = run_edges(project, tmp_path, "hang", "timeout_s=12")
    elapsed = time.monotonic() - start
    assert result.returncode == 1, result.stderr
    reason = project.client().get_run(result.last_line).data.tags["harness.status_reason"]
    assert reason.startswith("no progress for 12 s (timeout_s): "), reason
    # Rank 1 sleeps at its step 2 (where the stack dump shows it); rank 0 waits for it in the all-reduce.
    # Rank 1, stuck in the experiment's own code, comes first; rank 0 waits inside torch for it.
    assert reason.startswith(
        f"no progress for 12 s (timeout_s): rank 1 at step 2 in train.py:{HANG_LINE} (train), rank 0 at step 2 "
        f"waiting in backward (DDP's gradient all-reduce) called at train.py:{BACKWARD_LINE} (train)."), reason
    assert "raise timeout_s" in reason
    assert project.client().get_run(result.last_line).info.status == "FAILED"
    assert elapsed < 150  # 12 s of silence, not gloo's own 30-minute timeout
    assert_ranks_gone(tmp_path)


def stalled(project: Project, tmp_path: Path, mode: str, timeout_s: int) -> str:
    """Run the edges experiment in `mode`, which deadlocks; harness's own stall check must end it (never the test's
    timeout, nor gloo's own): its status reason, after checking the run failed and no rank was left behind."""
    start = time.monotonic()
    result = run_edges(project, tmp_path, mode, f"timeout_s={timeout_s}")
    elapsed = time.monotonic() - start
    assert result.returncode == 1, result.stderr
    run = project.client().get_run(result.last_line)
    assert run.info.status == "FAILED"
    # timeout_s of silence and the stack dump, not the process group's timeout (timeout_s + 30 s) nor gloo's 30 min.
    assert elapsed < timeout_s + 25 + 30, elapsed
    assert_ranks_gone(tmp_path)
    return run.data.tags["harness.status_reason"]


def test_a_deadlock_in_teardown_after_destroy_process_group_is_ended_naming_rank_frame_and_collective(
        project: Project, tmp_path: Path) -> None:
    # train() destroys the default group and returns; a finalizer that harness's teardown runs enters a collective
    # the other rank never joins, on each rank. Before, a rank in its teardown was never judged: the run hung until a
    # test's timeout.
    reason = stalled(project, tmp_path, "teardown", 8)
    assert reason == (
        f"no progress for 8 s (timeout_s): rank 0 in its teardown after training waiting in all_reduce called at "
        f"train.py:{TEARDOWN_LINE} (__del__), rank 1 in its teardown after training waiting in barrier called at "
        f"train.py:{TEARDOWN_PEER_LINE} (__del__). Their stacks are in logs/rank<N>.stacks.txt; raise timeout_s if a "
        "step can take longer."), reason


def test_a_deadlock_in_the_users_own_process_group_names_both_ranks_and_their_collectives(
        project: Project, tmp_path: Path) -> None:
    reason = stalled(project, tmp_path, "group", 8)
    assert reason.startswith(
        f"no progress for 8 s (timeout_s): rank 0 at step 2 waiting in all_reduce called at train.py:{GROUP_LINE} "
        f"(train), rank 1 at step 2 waiting in backward (DDP's gradient all-reduce) called at "
        f"train.py:{BACKWARD_LINE} (train)."), reason


def test_entry_that_cannot_be_imported_is_one_line(project: Project) -> None:
    project.add_experiment("unimportable", train_py="import torch\nimport not_a_module_anywhere\n\n\ndef train(ctx):\n    pass\n")
    result = project.harness("run", "experiments/unimportable")
    assert result.returncode == 1
    assert ("FAILED: rank 0: entry import failed: ModuleNotFoundError: No module named 'not_a_module_anywhere' "
            "(train.py, line 2)") in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert project.client().get_run(result.last_line).info.status == "FAILED"


# Rank 1 raises at once; rank 0 raises the same error 1.5 s after rank 1 is gone (rank 1's lock on a file is released
# when it exits): the order a loaded machine's scheduler may pick, made certain.
FAIL_ALIKE = '''
import fcntl
import os
import time


def train(ctx):
    path = ctx.cfg.lock
    if ctx.rank == 1:
        fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.rename(path + ".tmp", path)
    else:
        while not os.path.exists(path):
            time.sleep(0.01)
        fcntl.flock(os.open(path, os.O_RDONLY), fcntl.LOCK_EX)
        time.sleep(1.5)
    raise ValueError("no data in the data folder")
'''
FAIL_ALIKE_LINE = next(i for i, line in enumerate(FAIL_ALIKE.splitlines(), 1) if "raise ValueError" in line)


def test_ranks_that_fail_alike_are_named_by_the_lowest_whichever_failed_first(project: Project, tmp_path: Path) -> None:
    """The launcher gives the other ranks a moment before stopping them: both report, and the line names rank 0 with
    rank 1 as failing the same way, not whichever rank the scheduler ran first."""
    project.add_experiment("fail_alike", train_py=FAIL_ALIKE)
    result = project.harness("run", "experiments/fail_alike", f"train.lock={tmp_path / 'rank1.lock'}")
    assert result.returncode == 1, result.stderr
    failed = [line for line in result.stderr.splitlines() if line.startswith("FAILED:")]
    assert failed == [f"FAILED: rank 0 raised: ValueError: no data in the data folder (train.py, line {FAIL_ALIKE_LINE}) "
                      "(rank 1 failed the same way)"], result.stderr


def test_non_numeric_metric_names_key_and_type(project: Project, tmp_path: Path) -> None:
    result = run_edges(project, tmp_path, "str")
    assert result.returncode == 1
    assert ("FAILED: rank 0: ctx.log: metric 'accuracy' is a str ('high'); log numbers (int, float or a "
            "one-element tensor).") in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert project.client().get_run(result.last_line).info.status == "FAILED"
    assert_ranks_gone(tmp_path)


# MaxUnpool2d has no deterministic kernel on any device (torch.use_deterministic_algorithms' own list): the CPU
# op that strict mode refuses, as it refuses interpolate's, AdaptiveAvgPool2d's or grid_sample's backward on CUDA.
STRICT_REFUSES = '''
import torch
from torch import nn


def train(ctx):
    x = torch.randn(1, 1, 4, 4, generator=torch.Generator().manual_seed(ctx.seed))
    pooled, indices = nn.functional.max_pool2d(x, 2, return_indices=True)
    restored = nn.functional.max_unpool2d(pooled, indices, 2)  # REFUSED_LINE
    ctx.log({"loss": restored.sum()}, 0)
'''
REFUSED_LINE = next(i for i, line in enumerate(STRICT_REFUSES.splitlines(), 1) if "REFUSED_LINE" in line)


def test_an_op_strict_mode_refuses_fails_with_one_line_naming_it_and_the_way_out(project: Project) -> None:
    project.add_experiment("refused", train_py=STRICT_REFUSES)
    result = project.harness("run", "experiments/refused")
    assert result.returncode == 1, result.stderr
    failed = [line for line in result.stderr.splitlines() if line.startswith("FAILED: ")]
    assert failed == [
        "FAILED: rank 0: max_unpooling2d_forward_out has no deterministic implementation, so "
        f"determinism.level=strict refused it (train.py, line {REFUSED_LINE}). Use another op there, or set "
        "determinism.level=warn to let it run with a warning (its results may then differ between runs, so a "
        "replay need not be BITWISE). (rank 1 failed the same way)"], result.stderr
    assert "Traceback" not in result.stderr
    run = project.client().get_run(result.last_line)
    assert run.info.status == "FAILED" and run.data.tags["harness.status_reason"] == failed[0][len("FAILED: "):]
    # The way out it names works: the same code runs to its end under warn.
    warned = project.harness("run", "experiments/refused", "determinism.level=warn")
    assert warned.returncode == 0, warned.stderr
    assert project.client().get_run(warned.last_line).info.status == "FINISHED"


# torch's text (at::Context::alertNotDeterministic) for the kernels that strict mode refuses on CUDA only.
_TORCH_ALERT = ("{} does not have a deterministic implementation, but you set 'torch.use_deterministic_algorithms(True)'. "
                "You can turn off determinism just for this operation, or you can use the 'warn_only=True' option, if "
                "that's acceptable for your application. You can also file an issue at "
                "https://github.com/pytorch/pytorch/issues to help us prioritize adding deterministic support for this "
                "operation.")


@pytest.mark.parametrize("op", [
    "upsample_bilinear2d_backward_out_cuda", "upsample_bicubic2d_backward_out_cuda",
    "adaptive_avg_pool2d_backward_cuda", "nll_loss2d_forward_out_cuda_template", "grid_sampler_2d_backward_cuda",
    "_histc_cuda with floating point input",
])
def test_strict_refusal_error_text_names_the_cuda_kernel(op: str) -> None:
    from harness.runtime.refusals import refusal_line, refused_op

    assert refused_op(_TORCH_ALERT.format(op)) == op
    # TORCH_SHOW_CPP_STACKTRACES=1 appends the C++ stack on lines of their own.
    assert refused_op(_TORCH_ALERT.format(op) + "\nException raised from alertNotDeterministic at Context.cpp:91") == op
    line = refusal_line(op, "model.py, line 40")
    assert line.startswith(f"{op} has no deterministic implementation, so determinism.level=strict refused it "
                           "(model.py, line 40). ") and "determinism.level=warn" in line and "\n" not in line


def test_errors_that_are_not_a_strict_refusal_are_left_alone() -> None:
    from harness.runtime.refusals import refused_op

    warn_only = ("adaptive_avg_pool2d_backward_cuda does not have a deterministic implementation, but you set "
                 "'torch.use_deterministic_algorithms(True, warn_only=True)'. You can file an issue ...")
    for text in (warn_only, "", "boom at step 3", "CUDA error: an illegal memory access was encountered",
                 "the model does not have a deterministic implementation, but you set it up wrong"):
        assert refused_op(text) is None, text
    # Re-raised inside another library's text, it is still the refusal, and still names the kernel.
    assert refused_op("layer 3 (Upsample): " + _TORCH_ALERT.format("upsample_bilinear2d_backward_out_cuda")) == (
        "upsample_bilinear2d_backward_out_cuda")


def test_ranks_that_train_apart_fail_the_run(project: Project, tmp_path: Path) -> None:
    result = run_edges(project, tmp_path, "apart")
    assert result.returncode == 1
    assert "the ranks ended with different parameters (rank 0: " in result.stderr, result.stderr
    assert "their gradients were not synchronised" in result.stderr


def test_invariant_mode_refuses_gradients_outside_ctx_backward(project: Project) -> None:
    project.add_experiment("plain", train_py=PLAIN)
    result = project.harness("run", "experiments/plain", *INVARIANT, "train.use_ctx_backward=false")
    assert result.returncode == 1
    assert ("FAILED: rank 0: step 0: gradients reached the model outside ctx.backward in world-size-invariant "
            "mode") in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    run = project.client().get_run(result.last_line)
    assert run.info.status == "FAILED" and "loss = ctx.backward(batch, loss_fn)" in run.data.tags["harness.status_reason"]


def test_plain_script_converted_to_ctx_backward_trains_equal_replicas(project: Project, tmp_path: Path) -> None:
    # set_epoch on loader.sampler and model.module keep working in invariant mode; finishing at all proves
    # the replicas ended with equal parameters (checked across ranks at the end of every run).
    project.add_experiment("plain", train_py=PLAIN)
    result = project.harness("run", "experiments/plain", *INVARIANT, "train.use_ctx_backward=true")
    assert result.returncode == 0, result.stderr
    client = project.client()
    import torch

    weights = torch.load(client.download_artifacts(result.last_line, "outputs/weights.pt", str(tmp_path)), weights_only=True)
    assert set(weights) == {"weight", "bias"}
    losses = [m.value for m in client.get_metric_history(result.last_line, "loss")]
    assert len(losses) == 8 and losses[-1] < losses[0]  # 64 samples, 4 shards of 4 per step, 2 epochs


# -- what a finished run proves ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def nan_run(project: Project, tmp_path_factory: pytest.TempPathFactory) -> Result:
    tmp = tmp_path_factory.mktemp("nan")
    result = run_edges(project, tmp, "nan")
    assert result.returncode == 0, result.stderr
    return result


def test_nan_and_inf_are_recorded_exactly_and_outputs_become_artifacts(project: Project, nan_run: Result, tmp_path: Path) -> None:
    from harness.store.tracking import Tracker

    record = Tracker(project.uri).load_record(nan_run.last_line)
    assert np.isnan(record.metrics["nan"][1]).all() and len(record.metrics["nan"][1]) == 8
    assert (record.metrics["inf"][1] == np.inf).all() and (record.metrics["ninf"][1] == -np.inf).all()
    note = project.client().download_artifacts(nan_run.last_line, "outputs/note.txt", str(tmp_path))
    assert Path(note).read_text() == "written by rank 0"
    # No progress bar off a terminal: its carriage returns would litter logs.
    assert "\r" not in nan_run.stderr
    replay = project.harness("replay", nan_run.last_line)
    assert replay.returncode == 0 and "verdict: BITWISE: 4 metrics x 8 steps + harness.lr bit-identical" in replay.stdout, replay.stdout


def test_run_that_logs_nothing_warns_and_its_replay_has_nothing_to_compare(project: Project, tmp_path: Path) -> None:
    result = run_edges(project, tmp_path, "nolog")
    assert result.returncode == 0
    assert "Warning: the run logged no metrics and registered no model" in result.stderr
    replay = project.harness("replay", result.last_line)
    assert replay.returncode == 1
    assert "verdict: NOTHING_TO_COMPARE: there was nothing to compare" in replay.stdout


def test_model_that_never_changed_is_called_out(project: Project, tmp_path: Path) -> None:
    result = run_edges(project, tmp_path, "frozen")
    assert result.returncode == 0
    assert "Warning: the model's weights never changed" in result.stderr
    tags = project.client().get_run(result.last_line).data.tags
    assert tags["harness.weights_changed"] == "false"
    assert tags["harness.fingerprint.initial"] == tags["harness.fingerprint"]


def test_loader_refuses_a_sampler_of_its_own(project: Project) -> None:
    script = ("import torch\n\n\ndef train(ctx):\n    data = torch.zeros(8, 2)\n"
              "    ctx.loader(data, batch_size=2, sampler=torch.utils.data.SequentialSampler(data))\n")
    project.add_experiment("own_sampler", train_py=script)
    result = project.harness("run", "experiments/own_sampler")
    assert result.returncode == 1
    assert "FAILED: rank 0: ctx.loader(..., sampler=...): ctx.loader makes the sampler itself" in result.stderr


# -- liveness ---------------------------------------------------------------------------------------------


def test_killed_launcher_leaves_a_stale_run_that_mark_closes(project: Project, tmp_path: Path) -> None:
    project.add_experiment("edges", train_py=EDGES, yaml_extra="timeout_s: 1800\n")
    proc = project.popen("run", "experiments/edges", f"train={{mode: hang, pid_dir: '{tmp_path}'}}", "heartbeat_s=1")
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"rank{r}").exists() for r in (0, 1)):
        assert proc.poll() is None and time.monotonic() < deadline, "ranks never started"
        time.sleep(0.2)
    client = project.client()
    edges = client.get_experiment_by_name("edges").experiment_id
    running = client.search_runs([edges], "attributes.status = 'RUNNING'")
    assert len(running) == 1
    run_id = running[0].info.run_id
    live = project.harness("mark", run_id, "--status", "FAILED")
    assert live.returncode == 2 and "heartbeat" in only_error_line(live)
    os.kill(proc.pid, signal.SIGKILL)  # nothing can record this: the run stays RUNNING
    proc.communicate(timeout=30)
    assert_ranks_gone(tmp_path)  # the ranks die with their launcher
    time.sleep(4)  # > STALE_FACTOR heartbeats
    listing = project.harness("runs")
    row = next(line for line in listing.stdout.splitlines() if line.startswith(run_id))
    assert "STALE" in row.split(), listing.stdout
    closed = project.harness("mark", run_id, "--status", "FAILED")
    assert closed.returncode == 0, closed.stderr
    assert client.get_run(run_id).info.status == "FAILED"


# -- validation before launch ---------------------------------------------------------------------------

REFUSED = [
    (["seed=-1"], "Error: seed must be within [0, 2**63-1] (0 to 9223372036854775807), got -1."),
    (["seed=99999999999999999999999"], "Error: seed must be within [0, 2**63-1] (0 to 9223372036854775807), got 99999999999999999999999."),
    (["train.lr="], "Error: override 'train.lr=' has no value. Give one (train.lr=VALUE), or write train.lr=null to set it to null."),
    (["lr=0.1"], "Error: overrides: unknown key 'lr'. Did you mean train.lr? (the experiment's own settings live under train:)"),
    (["train.x=[1,"], "Error: override 'train.x=[1,' is not a valid value (while parsing a flow node)."),
    (["timeout_s=0"], "Error: timeout_s must be > 0 seconds, got 0.0."),
    (["flush_interval_s=nan"], "Error: flush_interval_s must be > 0, got nan."),
    (["determinism=strict"], "Error: overrides: 'determinism' is a section with keys level, world_size_invariant, "
                             "shards; set them by name (e.g. determinism.level=...), not determinism='strict'."),
    (["fingerprint_evry=3"], "Error: overrides: unknown key 'fingerprint_evry'. Did you mean fingerprint_every?"),
    (["+train.extra=1"], "Error: override '+train.extra=1': drop the '+'; write train.extra=1"),
    (["world_size=2", "world_size=3"], "Error: override 'world_size' is given twice (world_size=2, world_size=3); give it once."),
    # Hydra's multirun idiom would be stored as the string "0.1,0.2" and fail only inside the rank.
    (["train.lr=0.1,0.2"], "Error: override 'train.lr=0.1,0.2' is Hydra's multirun sweep syntax; harness runs one config "
                           "per run: run one per value (harness run DIR train.lr=0.1, then train.lr=0.2, ...), or "
                           "seeds=[...] for a study of seeds. A string that holds a comma is quoted: "
                           "'train.lr=\"0.1,0.2\"'."),
    (["seed=0,1,2"], "Error: override 'seed=0,1,2' is Hydra's multirun sweep syntax; harness runs one config per run: "
                     "for a study of seeds write seeds=[0,1,2] (or --seeds N)."),
    (["train.lr=choice(0.1,0.2)"], "Error: override 'train.lr=choice(0.1,0.2)' is Hydra's multirun sweep syntax"),
    # --name and --tag are checked with the overrides, before anything is recorded.
    (["--tag", "harness.kind=replay"], "Error: --tag harness.kind: the harness. tags are harness's own"),
    (["--tag", "mlflow.runName=x"], "Error: --tag mlflow.runName: the mlflow. tags are mlflow's own"),
    (["--tag", "team"], "Error: --tag 'team' is not KEY=VALUE; e.g. --tag dataset=mnist."),
    (["--tag", "a=1", "--tag", "a=2"], "Error: --tag a is given twice; give it once."),
    (["--tag", "bad\tkey=1"], "Error: --tag 'bad\\tkey': a tag key is up to 250 letters"),
    (["--name", " "], "Error: --name ' ': a run name is 1 to 250 printable characters."),
    (["--tag", "a/../b=1"], "Error: --tag 'a/../b': a tag key is a relative path with no '.', '..' or empty parts"),
]


def test_overrides_harness_writes_itself_read_back_as_their_values() -> None:
    """A backend's option (`--partition gpu,debug`, Slurm's list) and a bisect probe's value hold commas that are no
    sweep: they are written so that parse_overrides reads them back whole, not refused."""
    from omegaconf import OmegaConf

    from harness.commands import api
    from harness.commands.bisect import _override
    from harness.config import parse_overrides

    given = api.Placement(backend={"partition": "gpu,debug", "slurm_nodes": 2}).backend_overrides()
    assert OmegaConf.to_container(parse_overrides(given)) == {"slurm": {"partition": "gpu,debug", "nodes": 2}}
    for value in ["a,b", "a: b, c", "choice(1,2)", [1, 2], {"a": 1, "b": 2}, "it's, \"q\" \\ é", "0.1,0.2"]:
        read = OmegaConf.to_container(parse_overrides([_override("train.k", {"train": {"k": value}})]))
        assert read == {"train": {"k": value}}, value


@pytest.mark.parametrize("value,read", [('"a,b"', "a,b"), ("'a, b'", "a, b"), ("[1,2]", [1, 2]),
                                        ("{a: 1, b: 2}", {"a": 1, "b": 2}), ("${oc.env:NO_SUCH_VAR_38,x}", "x")])
def test_a_comma_inside_quotes_brackets_or_an_interpolation_is_a_value(project: Project, value: str, read) -> None:
    from harness import executors
    from harness.config import load_experiment

    result = project.cli("check", "experiments/linear_ddp", f"train.note={value}", "--json")
    assert result.returncode == 0, result.stderr
    cfg = load_experiment(project.root / "experiments" / "linear_ddp", [f"train.note={value}"],
                          schema=executors.schema())
    assert cfg.config.train["note"] == read  # the typed experiment holds the resolved value


@pytest.mark.parametrize("overrides,message", REFUSED, ids=[r[0][0] for r in REFUSED])
def test_bad_override_is_refused_before_anything_runs(project: Project, overrides: list[str], message: str) -> None:
    before = len(project.all_runs())
    result = project.cli("run", "experiments/linear_ddp", *overrides)
    assert result.returncode == 2 and result.stdout == ""
    assert only_error_line(result).startswith(message)
    assert len(project.all_runs()) == before


@pytest.mark.parametrize("where", ["override", "yaml"])
def test_determinism_level_off_is_the_word_not_yaml_false(fresh_project: Project, where: str) -> None:
    """YAML 1.1 reads a bare `off` as false; harness's own advice says `determinism.level=off`, so it must work."""
    project = fresh_project
    args = ["determinism.level=off"] if where == "override" else []
    if where == "yaml":
        path = project.root / "experiments" / "linear_ddp" / "experiment.yaml"
        path.write_text(path.read_text().replace("level: strict", "level: off"))
    result = project.cli("check", "experiments/linear_ddp", *args)
    assert result.returncode == 0, result.stderr
    wrong = project.cli("check", "experiments/linear_ddp", "determinism.level=true")
    assert wrong.returncode == 2 and "expected one of strict, warn, off" in wrong.stderr


def test_file_passed_as_experiment_and_missing_image(fresh_project: Project) -> None:
    project = fresh_project  # its own repository: the experiment it writes is never committed
    result = project.cli("run", "experiments/linear_ddp/train.py")
    assert result.returncode == 2
    assert only_error_line(result) == "Error: 'experiments/linear_ddp/train.py' is a file; pass the experiment's folder, experiments/linear_ddp"
    exp = project.root / "experiments" / "imageless"
    exp.mkdir(exist_ok=True)
    (exp / "experiment.yaml").write_text("entry: train.py:train\n")
    (exp / "train.py").write_text("def train(ctx):\n    pass\n")
    result = project.cli("check", "experiments/imageless")
    assert result.returncode == 2
    assert "or to `image: none` for an experiment that only runs locally" in only_error_line(result)
    (exp / "experiment.yaml").write_text("image: none\nentry: train.py:train\nworld_size: 64\n")
    result = project.cli("check", "experiments/imageless")
    assert result.returncode == 0, result.stderr
    cores = len(os.sched_getaffinity(0))
    assert f"Warning: world_size 64 x threads_per_rank 1 = 64 threads on {cores} CPU cores" in result.stderr
    assert result.stdout.startswith("ok: experiments/imageless (world_size 64")
    import shutil

    shutil.rmtree(exp)


def test_validating_an_invariant_config_does_not_import_torch(tmp_path: Path) -> None:
    exp = tmp_path / "an experiment"
    exp.mkdir()
    (exp / "experiment.yaml").write_text(
        "image: none\nentry: train.py:train\nworld_size: 2\ndeterminism:\n  world_size_invariant: true\n  shards: 4\n"
    )
    (exp / "train.py").write_text("def train(ctx):\n    pass\n")
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from harness.config import load_experiment\n"
        "from harness.errors import ConfigError\n"
        "from harness.executors import schema\n"
        "load_experiment(Path(sys.argv[1]), schema=schema())\n"
        "try:\n    load_experiment(Path(sys.argv[1]), ['determinism.shards=3'], schema=schema())\n"
        "except ConfigError as err:\n    print(err)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    )
    out = subprocess.run([sys.executable, "-c", code, str(exp)], capture_output=True, text=True, check=True).stdout
    assert "invariant shards=3 is not a power of two" in out
    assert out.strip().endswith("[]")

# -- fuzz: experiment.yaml contents and overrides never make harness print a traceback -------------------

_KEYS = ["image", "entry", "world_size", "backend", "device", "seed", "threads_per_rank", "determinism",
         "determinism.level", "determinism.shards", "determinism.world_size_invariant", "flush_interval_s",
         "fingerprint_every", "checkpoint_every", "executor", "heartbeat_s", "timeout_s", "record.max_untracked_mib",
         "slurm", "slurm.nodes", "slurm.gpus_per_node", "slurm.poll_s", "rendezvous_timeout_s",
         "replay.tolerance.default.rtol", "replay.tolerance.metrics", "train", "train.lr", "lr", "nope", "a.b"]
_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.sampled_from(["auto", "cpu", "cuda", "gloo", "nccl", "strict", "off", "local", "docker", "slurm", "none", "train.py:train",
                     "[1,", "{a: 1}", "${oops}", "???", "null", "", "'x'", "1e400", "-0"]),
)
_VALUES = st.one_of(_SCALARS, st.lists(_SCALARS, max_size=3), st.dictionaries(st.sampled_from(_KEYS), _SCALARS, max_size=3))


def _nested(flat: dict[str, object]) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in flat.items():
        node = out
        *parents, last = key.split(".")
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                break
            node = child
        else:
            node[last] = value
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    yaml_fields=st.dictionaries(st.sampled_from(_KEYS), _VALUES, max_size=6),
    raw_yaml=st.one_of(st.none(), st.text(max_size=40)),
    overrides=st.lists(
        st.one_of(st.tuples(st.sampled_from(_KEYS), st.text(max_size=10)).map(lambda kv: f"{kv[0]}={kv[1]}"),
                  st.text(max_size=12)),
        max_size=3,
    ),
)
def test_fuzzed_config_never_prints_a_traceback(fuzz_repo: Path, yaml_fields, raw_yaml, overrides) -> None:
    import yaml
    from click.testing import CliRunner

    from harness.cli.main import main

    base = {"image": "none", "entry": "train.py:train"}
    content = raw_yaml if raw_yaml is not None else yaml.safe_dump({**base, **_nested(yaml_fields)})
    (fuzz_repo / "exp" / "experiment.yaml").write_text(content)
    result = CliRunner().invoke(main, ["check", str(fuzz_repo / "exp"), *overrides], catch_exceptions=True)
    assert result.exception is None or isinstance(result.exception, SystemExit), (content, overrides, result.output)
    assert result.exit_code in (0, 2), (content, overrides, result.output)
    if result.exit_code == 2:
        errors = [line for line in result.output.splitlines() if line.startswith("Error: ")]
        assert len(errors) == 1, (content, overrides, result.output)


@pytest.fixture(scope="module")
def fuzz_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fuzz")
    (root / "exp").mkdir()
    (root / "exp" / "train.py").write_text("def train(ctx):\n    pass\n")
    (root / "exp" / "experiment.yaml").write_text("image: none\nentry: train.py:train\n")
    git(root, "init", "-q", "-b", "main")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "fuzz")
    return root


def test_a_store_inside_the_repository_is_not_recorded_as_code(project: Project, tmp_path: Path) -> None:
    # The README's default store is ./mlruns: in a repository that does not ignore it, the database and
    # the artifacts of earlier runs must not become the next run's "uncommitted changes".
    store = project.root / "inside-store"
    (store / "artifacts" / "1").mkdir(parents=True)
    (store / "mlflow.db").write_bytes(b"SQLite format 3\x00" + b"\x00" * 100)
    (store / "artifacts" / "1" / "metrics.npz").write_bytes(b"\x01" * 10)
    try:
        result = project.cli("check", "experiments/linear_ddp", "--require-clean",
                                 "--tracking-uri", f"sqlite:///{store / 'mlflow.db'}")
        assert result.returncode == 0, result.stderr
        assert "clean)" in result.stdout
        assert ("Warning: the tracking store's files (inside-store/mlflow.db, inside-store/artifacts) lie inside the "
                "repository and are not ignored; they are left out of the code record.") in result.stderr
    finally:
        import shutil

        shutil.rmtree(store)


def test_malformed_uri_long_values_and_escapes_are_said_plainly(project: Project) -> None:
    """A malformed IPv6 store URI is one line (without the URI, which may hold a password); a config value longer
    than MLflow's params is recorded as length and sha256, never cut silently; names are printed escaped."""
    from harness.fmt import printable
    from harness.record.newrun import PARAM_LIMIT, fit_params

    bad = project.cli("runs", "--tracking-uri", "http://user:pw@[::1")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "pw" not in bad.stderr
    assert bad.stderr.strip().splitlines() == [
        "Error: the tracking URI (--tracking-uri or MLFLOW_TRACKING_URI) is not a valid URI (Invalid IPv6 URL). "
        "Correct it, e.g. http://[::1]:5000 or sqlite:////abs/path/mlflow.db."]
    params, long = fit_params({"train.blob": "x" * (PARAM_LIMIT + 1), "train.lr": 0.1})
    assert long == ["train.blob"] and params["train.lr"] == 0.1
    assert params["train.blob"].startswith(f"<{PARAM_LIMIT + 1} characters, sha256:") and len(params["train.blob"]) < 100
    checked = project.cli("check", "experiments/linear_ddp", "train.blob=" + "y" * (PARAM_LIMIT + 10))
    assert checked.returncode == 0 and "longer than MLflow's 6000-character params (train.blob)" in checked.stderr
    assert printable("exp\x1b[2Jname") == "exp\\x1b[2Jname" and printable("plain") == "plain"


def test_many_plain_keys_load_and_an_alias_bomb_is_one_line(project: Project, tmp_path: Path) -> None:
    import shutil

    exp = project.add_experiment("many_keys", commit=False)
    try:  # uncommitted: removed after, so the session's repository stays clean for the tests that follow
        text = (exp / "experiment.yaml").read_text()
        (exp / "experiment.yaml").write_text(text + "".join(f"  k{i}: {i}\n" for i in range(20000)))
        assert project.harness("check", str(exp)).returncode == 0
        bomb = 'a: &a ["x","x","x","x","x","x","x","x","x","x"]\n' + "".join(
            f"{n}: &{n} [{', '.join([f'*{p}'] * 10)}]\n" for p, n in zip("abcd", "bcde"))
        (exp / "experiment.yaml").write_text(text + bomb)
        refused = project.harness("check", str(exp))
        assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1
        assert "its YAML aliases expand to far more nodes than the file has lines" in refused.stderr
    finally:
        shutil.rmtree(exp)


def test_a_worktree_left_by_a_killed_process_is_pruned_by_the_next(fresh_project: Project) -> None:
    """A replay SIGKILLed inside its worktree leaves it registered in the user's repository; the next command
    that checks out code removes it (and its folder), and leaves live ones alone."""
    project = fresh_project  # its own repository: a failure here must not leave a worktree in the shared one
    from harness.systems import gitworktree

    commit = git(project.root, "rev-parse", "HEAD")
    code = ("import os, signal, sys\nfrom pathlib import Path\nfrom harness.systems import gitworktree\n"
            f"with gitworktree.worktree(Path({str(project.root)!r}), {commit!r}, None) as tree:\n"
            "    print(tree, flush=True)\n    os.kill(os.getpid(), signal.SIGKILL)\n")
    killed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    left = Path(killed.stdout.strip())
    assert killed.returncode == -signal.SIGKILL and left.is_dir()
    assert str(left) in git(project.root, "worktree", "list")
    with gitworktree.worktree(project.root, commit, None) as mine:
        listed = git(project.root, "worktree", "list")
        assert str(left) not in listed and str(mine) in listed
    assert not left.exists() and not left.parent.exists()
    assert len(git(project.root, "worktree", "list").splitlines()) == 1
