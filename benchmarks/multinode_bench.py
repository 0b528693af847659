"""Two-node step time vs one node, and Slurm start-up overhead vs a local run. Prints tables.

    python benchmarks/multinode_bench.py [--rounds 3] [--skip-multinode] [--skip-slurm]

Needs root (network namespaces). Both parts run the real CLI on a temporary git repository and a
temporary SQLite store, in interleaved rounds (A, B, A, B, ...) so machine noise hits both alike.

Part 1: digits_cnn (train.epochs=3, 69 steps, world size 2) as (A) one `harness run` with 2 ranks,
and (B) a two-node job: one `harness run --nnodes 2 --node-rank R` launcher in namespace hn1 (node 0,
198.51.100.1) and one in hn2 (node 1), gloo over the bridge between them. Step time is read from the
run's record: the interval between the MLflow timestamps (ms, taken by rank 0 at ctx.log) of
consecutive `train_loss` steps, per run the median, and the mean over the intervals inside an epoch
(sub-ms resolution; the epoch-end evaluation is left out).

Part 2: whole-process wall time of `harness run experiments/linear_ddp train.epochs=1` locally (A)
vs `--executor slurm --nodes 1` (B), with the scheduler's own start delay (StartTime - SubmitTime
of `scontrol show job`, 1 s resolution) split out.

The namespace hosts (scripts/hosts-up.sh) and the Slurm cluster (scripts/slurm-up.sh) are brought
up if absent and taken down at the end only if this script brought them up.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from harness import tags as T  # noqa: E402

HOSTS_STATE = Path("/tmp/harness-hosts")
SLURM_STATE = Path("/tmp/harness-slurm")
NAMESPACES = ("hn1", "hn2")
MASTER = "198.51.100.1"  # hn1's address: node 0
PORT_BASE = 29700  # one master port per two-node round: no TIME_WAIT clash with the round before
DIGITS = ["experiments/digits_cnn", "train.epochs=3"]
LINEAR = ["experiments/linear_ddp", "train.epochs=1"]
RUN_TIMEOUT_S = 300


# --- infrastructure -------------------------------------------------------------------------------


def hosts_present() -> bool:
    return all(Path(f"/run/netns/{ns}").exists() for ns in (*NAMESPACES, "hnsw"))


def slurm_running() -> bool:
    try:
        os.kill(int((SLURM_STATE / "slurmctld.pid").read_text()), 0)
    except (OSError, ValueError):
        return False
    return True


def script(name: str, state: Path) -> None:
    proc = subprocess.run(["bash", str(ROOT / "scripts" / name), str(state)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"scripts/{name} {state} failed ({proc.returncode}): {(proc.stderr + proc.stdout)[-2000:]}")


# --- the project ----------------------------------------------------------------------------------


def make_project(base: Path) -> tuple[Path, dict[str, str]]:
    """A throwaway git repository holding a copy of experiments/, and the env pointing at a fresh store."""
    repo = base / "repo"
    shutil.copytree(ROOT / "experiments", repo / "experiments", ignore=shutil.ignore_patterns("__pycache__"))
    (repo / ".gitignore").write_text("mlruns/\n__pycache__/\n")
    git_env = {**os.environ, "GIT_AUTHOR_NAME": "b", "GIT_AUTHOR_EMAIL": "b@example.invalid",
               "GIT_COMMITTER_NAME": "b", "GIT_COMMITTER_EMAIL": "b@example.invalid"}
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "bench"]):
        subprocess.run(["git", *cmd], cwd=repo, env=git_env, check=True)
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{base / 'mlflow.db'}", "PYTHONUNBUFFERED": "1"}
    return repo, env


def harness_argv(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "harness", *args]


def finished(proc: subprocess.Popen, what: str) -> str:
    """The run id a launcher printed last; exits the benchmark if it failed."""
    try:
        out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise SystemExit(f"{what} did not end within {RUN_TIMEOUT_S} s: {err[-2000:]}") from None
    if proc.returncode != 0:
        raise SystemExit(f"{what} failed ({proc.returncode}): {err[-2000:]}")
    return out.strip().splitlines()[-1]


def run_local(args: list[str], repo: Path, env: dict[str, str]) -> tuple[str, float, float, float]:
    """(run id, wall s, unix start, unix end) of one `harness ARGS...` in the root namespace."""
    start_unix, start = time.time(), time.monotonic()
    proc = subprocess.Popen(harness_argv(args), cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    run_id = finished(proc, "harness " + " ".join(args))
    return run_id, time.monotonic() - start, start_unix, time.time()


def run_two_nodes(args: list[str], port: int, repo: Path, env: dict[str, str]) -> tuple[str, float]:
    """(run id, wall s) of a two-node job: one launcher per namespace, started together."""
    start = time.monotonic()
    procs = []
    for rank, ns in enumerate(NAMESPACES):
        argv = harness_argv(["run", *args, "--nnodes", "2", "--node-rank", str(rank), "--master-addr", MASTER,
                             "--master-port", str(port)])
        # nsenter, not `ip netns exec`: that also remounts /sys in a new mount namespace.
        procs.append(subprocess.Popen(["nsenter", f"--net=/run/netns/{ns}", *argv], cwd=repo, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    ids = [finished(p, f"node {rank} (namespace {NAMESPACES[rank]})") for rank, p in enumerate(procs)]
    if ids[0] != ids[1]:
        raise SystemExit(f"the two nodes reported different runs: {ids}")
    return ids[0], time.monotonic() - start


# --- part 1: two nodes vs one ---------------------------------------------------------------------


def step_times(client, run_id: str) -> tuple[float, float, int]:
    """(median interval ms, mean interval ms inside epochs, steps) between consecutive train_loss logs."""
    history = sorted(client.get_metric_history(run_id, "train_loss"), key=lambda m: m.step)
    epoch_ends = {m.step for m in client.get_metric_history(run_id, "val_acc")}
    pairs = list(zip(history, history[1:]))
    intervals = [b.timestamp - a.timestamp for a, b in pairs]
    inside = [b.timestamp - a.timestamp for a, b in pairs if a.step not in epoch_ends]
    return statistics.median(intervals), statistics.mean(inside), len(history)


def part1(rounds: int, repo: Path, env: dict[str, str]) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    rows: dict[str, list[tuple[float, float, float]]] = {"one": [], "two": []}
    steps = 0
    for r in range(rounds):
        run_id, wall, _, _ = run_local(["run", *DIGITS], repo, env)
        median, mean, steps = step_times(client, run_id)
        rows["one"].append((median, mean, wall))
        run_id, wall = run_two_nodes(DIGITS, PORT_BASE + r, repo, env)
        if client.get_run(run_id).data.tags.get(T.NNODES) != "2":
            raise SystemExit(f"run {run_id} is not tagged {T.NNODES}=2")
        median, mean, _ = step_times(client, run_id)
        rows["two"].append((median, mean, wall))
        print(f"  round {r + 1}/{rounds}: 1 node {rows['one'][-1][0]:.0f} ms/step,"
              f" 2 nodes {rows['two'][-1][0]:.0f} ms/step", file=sys.stderr)

    def med(key: str, i: int) -> float:
        return statistics.median(row[i] for row in rows[key])

    print(f"\n2-node step time vs 1 node: digits_cnn train.epochs=3 ({steps} steps), world size 2, gloo on CPU,"
          f" {rounds} interleaved rounds (medians over rounds)\n")
    print("| layout | median step interval | ratio | mean step inside epochs | ratio | median wall |")
    print("| --- | --- | --- | --- | --- | --- |")
    labels = {"one": "1 node x 2 ranks (baseline)", "two": "2 nodes x 1 rank (hn1 + hn2, veth bridge)"}
    for key in ("one", "two"):
        print(f"| {labels[key]} | {med(key, 0):.1f} ms | {med(key, 0) / med('one', 0):.2f} |"
              f" {med(key, 1):.2f} ms | {med(key, 1) / med('one', 1):.2f} | {med(key, 2):.1f} s |")
    per_round = [two[1] / one[1] for one, two in zip(rows["one"], rows["two"])]
    print(f"\nPer-round ratio of the in-epoch means: {', '.join(f'{x:.2f}' for x in per_round)}."
          " Step intervals are MLflow timestamps (1 ms resolution) of rank 0's ctx.log calls.")


# --- part 2: Slurm vs local -----------------------------------------------------------------------


def scontrol_times(job_id: str, env: dict[str, str]) -> dict[str, float]:
    """SubmitTime, StartTime, EndTime of a job as unix seconds (Slurm prints local time, 1 s resolution)."""
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=env, capture_output=True, text=True,
                         check=True).stdout
    fields = dict(token.partition("=")[::2] for token in out.split() if "=" in token)
    return {key: dt.datetime.fromisoformat(fields[key]).timestamp() for key in ("SubmitTime", "StartTime", "EndTime")}


def part2(rounds: int, repo: Path, env: dict[str, str], slurm_env: dict[str, str]) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    local, slurm, pending, in_job, after = [], [], [], [], []
    for r in range(rounds):
        local.append(run_local(["run", *LINEAR], repo, env)[1])
        run_id, wall, _, end_unix = run_local(["run", *LINEAR, "--executor", "slurm", "--nodes", "1"], repo,
                                              slurm_env)
        slurm.append(wall)
        job_id = client.get_run(run_id).data.tags[T.SLURM_JOB_ID]
        times = scontrol_times(job_id, slurm_env)
        pending.append(times["StartTime"] - times["SubmitTime"])
        in_job.append(times["EndTime"] - times["StartTime"])
        after.append(end_unix - times["EndTime"])
        print(f"  round {r + 1}/{rounds}: local {local[-1]:.1f} s, slurm {slurm[-1]:.1f} s"
              f" (job {job_id}: pending {pending[-1]:.0f} s, running {in_job[-1]:.0f} s)", file=sys.stderr)
    a, b = statistics.median(local), statistics.median(slurm)
    print(f"\nSlurm start-up overhead: harness run {' '.join(LINEAR)}, whole-process wall,"
          f" {rounds} interleaved rounds (medians)\n")
    print("| executor | median wall | difference | ratio |")
    print("| --- | --- | --- | --- |")
    print(f"| local (baseline) | {a:.1f} s | 0 | 1.00 |")
    print(f"| slurm --nodes 1 | {b:.1f} s | +{b - a:.1f} s | {b / a:.2f} |")
    pend, run, tail = statistics.median(pending), statistics.median(in_job), statistics.median(after)
    print(f"\nOf the +{b - a:.1f} s (scontrol times, 1 s resolution, medians): the scheduler's PENDING->RUNNING"
          f" {pend:.0f} s (rounds: {', '.join(f'{x:.0f}' for x in pending)}); the job itself ran {run:.0f} s"
          f" against the local run's whole {a:.1f} s; from the job's end to the submitting harness exiting"
          f" {tail:.1f} s (it polls scontrol every slurm.poll_s=2 s, then waits for node 0 to close the run);"
          f" the remaining {b - pend - run - tail:.1f} s is the submitting process before and at sbatch.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-multinode", action="store_true", help="only part 2 (Slurm)")
    parser.add_argument("--skip-slurm", action="store_true", help="only part 1 (two nodes)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root: network namespaces (scripts/hosts-up.sh) and Slurm daemons")

    made_hosts = not hosts_present()
    started_slurm = False
    base = Path(tempfile.mkdtemp(prefix="harness-multinode-bench-"))
    try:
        if made_hosts:
            script("hosts-up.sh", HOSTS_STATE)
        repo, env = make_project(base)
        if not args.skip_multinode:
            part1(args.rounds, repo, env)
        if not args.skip_slurm:
            started_slurm = not slurm_running()
            script("slurm-up.sh", SLURM_STATE)  # idempotent; waits for both nodes idle
            slurm_env = {**env, "SLURM_CONF": str(SLURM_STATE / "slurm.conf"),
                         "HARNESS_SLURM_DIR": str(base / "slurm-jobs")}
            part2(args.rounds, repo, env, slurm_env)
    finally:
        if started_slurm and made_hosts:
            script("slurm-down.sh", SLURM_STATE)  # also removes the hosts (hosts-down.sh)
        elif started_slurm:
            # slurm-down.sh would also remove the namespace hosts, which were here before us.
            print(f"Slurm left running (the hosts were up before): bash scripts/slurm-down.sh {SLURM_STATE}",
                  file=sys.stderr)
        elif made_hosts:
            script("hosts-down.sh", HOSTS_STATE)
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
