"""`harness run` started by the real torchrun: each process is one rank, the job is one MLflow run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from conftest import Project, Result, on_cpu, pid_alive


def torchrun(project: Project, *args: str, env: dict[str, str] | None = None, nproc: int = 2) -> Result:
    """`torchrun --standalone --nproc-per-node N -m harness run ...` in the project, on its store."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               "-m", "harness", *on_cpu(["run", *args])]
    proc = subprocess.run(
        command, cwd=project.root, capture_output=True, text=True, timeout=300,
        # This shell's PYTHONHASHSEED would be the user's choice for torchrun's ranks: a test says it when it means it.
        env={**{k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}, "MLFLOW_TRACKING_URI": project.uri,
             "PYTHONUNBUFFERED": "1", **(env or {})},
    )
    return Result(proc.returncode, proc.stdout, proc.stderr)


def runs_of(project: Project, experiment: str) -> list:
    client = project.client()
    exp = client.get_experiment_by_name(experiment)
    return client.search_runs([exp.experiment_id]) if exp else []


def rank_exit_codes(stderr: str) -> dict[int, int]:
    """Each rank's exit code from torchrun's failure summary."""
    blocks = re.findall(r"rank\s+: (\d+) \(local_rank: \d+\)\n\s+exitcode\s+: (-?\d+)", stderr)
    return {int(rank): int(code) for rank, code in blocks}


def test_two_ranks_under_torchrun_are_one_run_bitwise_equal_to_harness_run(project: Project) -> None:
    project.add_experiment("torchrun_linear")
    result = torchrun(project, "experiments/torchrun_linear", "train.epochs=1")
    assert result.returncode == 0, result.stderr
    runs = runs_of(project, "torchrun_linear")
    assert len(runs) == 1, [r.info.run_id for r in runs]
    run = runs[0]
    assert result.last_line == run.info.run_id
    assert result.stdout.count(run.info.run_id) == 1, result.stdout  # said once, by global rank 0
    assert run.info.status == "FINISHED"
    tags = run.data.tags
    assert tags["harness.launcher"] == "torchrun"
    assert (tags["harness.world_size"], tags["harness.nnodes"], tags["harness.nproc_per_node"]) == ("2", "1", "2")
    # torchrun started the ranks, with no PYTHONHASHSEED: their string hashes were random, recorded so and said.
    assert (tags["harness.seed.hash"], tags["harness.seed.hash.source"]) == ("random", "torchrun")
    assert "Warning: torchrun started the ranks without PYTHONHASHSEED" in result.stderr

    plain = project.harness("run", "experiments/torchrun_linear", "train.epochs=1")
    assert plain.returncode == 0, plain.stderr
    assert project.client().get_run(plain.last_line).data.tags["harness.launcher"] == "spawn"
    compared = project.harness("compare", run.info.run_id, plain.last_line)
    assert compared.returncode == 0, compared.stdout + compared.stderr
    verdict = [line for line in compared.stdout.splitlines() if line.startswith("verdict:")]
    assert verdict and "BITWISE" in verdict[0], compared.stdout
    assert tags["harness.fingerprint"] == project.client().get_run(plain.last_line).data.tags["harness.fingerprint"]


def test_world_size_other_than_torchruns_is_refused_on_every_rank(project: Project) -> None:
    project.add_experiment("torchrun_refused")
    result = torchrun(project, "experiments/torchrun_refused", "world_size=4")
    assert result.returncode != 0
    refusals = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    expected = "Error: torchrun started 2 ranks but world_size is 4: pass world_size=2"
    assert refusals and all(line.startswith(expected) for line in refusals), result.stderr
    # Each rank refuses on its own (exit 2), none hangs waiting for the others. A rank still importing when
    # the first refusal came is stopped by torchrun itself (-15, SIGTERM): on a loaded machine that happens.
    codes = rank_exit_codes(result.stderr)
    assert set(codes) == {0, 1} and 2 in codes.values() and set(codes.values()) <= {2, -15}, result.stderr
    assert len(refusals) == list(codes.values()).count(2), result.stderr
    ranks_said = result.stderr.split("torch/distributed/elastic")[0]  # before torchrun's own report
    assert "Traceback" not in ranks_said, ranks_said
    assert runs_of(project, "torchrun_refused") == []


RAISING = '''
import os, pathlib, time
import torch
from torch import nn


def train(ctx):
    pathlib.Path(os.environ["PID_DIR"], f"rank{ctx.rank}").write_text(str(os.getpid()))
    model = ctx.ddp(nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1000):
        if ctx.rank == 1 and step == 3:
            raise RuntimeError("boom at step %d" % step)
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        ctx.log({"loss": float(step)}, step)
        time.sleep(0.05)
'''


def test_a_rank_that_raises_fails_the_one_run_naming_rank_and_line(project: Project, tmp_path: Path) -> None:
    project.add_experiment("torchrun_raising", train_py=RAISING)
    line = RAISING.splitlines().index('            raise RuntimeError("boom at step %d" % step)') + 1
    result = torchrun(project, "experiments/torchrun_raising", env={"PID_DIR": str(tmp_path)})
    assert result.returncode != 0
    runs = runs_of(project, "torchrun_raising")
    assert len(runs) == 1, [r.info.run_id for r in runs]
    run = runs[0]
    assert run.info.status == "FAILED"
    reason = run.data.tags["harness.status_reason"]
    assert reason == f"rank 1 raised: RuntimeError: boom at step 3 (train.py, line {line})", reason
    assert run.data.tags["harness.failed_rank"] == "1"
    assert result.stdout.count(run.info.run_id) <= 1, result.stdout  # never once per rank
    assert rank_exit_codes(result.stderr).get(1) == 1, result.stderr
    for rank in (0, 1):
        assert not pid_alive(int((tmp_path / f"rank{rank}").read_text())), f"rank {rank} left behind"
    assert not [r for r in runs_of(project, "torchrun_raising") if r.info.status == "RUNNING"]


def test_a_rank_sigkilled_under_torchrun_is_named_killed_by_sigkill(project: Project, tmp_path: Path) -> None:
    # torchrun answers a worker's death by SIGTERMing the others: rank 0, which records, must name the rank that died
    # without a word, not call the run interrupted.
    project.add_experiment("torchrun_sigkill", train_py=RAISING.replace(
        'raise RuntimeError("boom at step %d" % step)', "os.kill(os.getpid(), 9)"))
    result = torchrun(project, "experiments/torchrun_sigkill", env={"PID_DIR": str(tmp_path)})
    assert result.returncode != 0
    (run,) = runs_of(project, "torchrun_sigkill")
    assert run.info.status == "FAILED", run.data.tags
    assert run.data.tags["harness.status_reason"] == (
        "rank 1 was killed by SIGKILL (its process ended without a word; torchrun then stopped the other ranks)")
    assert run.data.tags["harness.failed_rank"] == "1" and run.data.tags["harness.failed_signal"] == "SIGKILL"
    assert rank_exit_codes(result.stderr).get(1) == -9, result.stderr
    for rank in (0, 1):
        assert not pid_alive(int((tmp_path / f"rank{rank}").read_text())), f"rank {rank} left behind"
