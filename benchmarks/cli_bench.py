"""Whole-process wall time of `harness --help`, `runs`, `compare A B` and `ui` (to its first HTTP 200),
this tree against a baseline tree (default: the `main` branch), in interleaved rounds on one store.

usage: python benchmarks/cli_bench.py [--rounds N] [--store DIR] [--baseline REF]

The store holds two real linear_ddp runs (made once, with this tree, unless --store names a folder
that has them). The baseline is `git archive REF` unpacked in a temporary folder and run with
PYTHONPATH pointing at it; this tree runs with PYTHONPATH at the checkout. Prints a markdown table of
medians and ratios (this tree / baseline) with the goal of each command, and the load average.
"""

from __future__ import annotations

import argparse
import io
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOALS = {"--help": 0.3, "runs": 1.5, "compare": 1.5, "ui": 10.0}  # seconds, issue 12
UI_DEADLINE_S = 180.0  # a server that never answers is a failure of the benchmark, not a hang
RUN_TIMEOUT_S = 600.0


def harness(tree: Path, *args: str, cwd: Path, uri: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(tree), "MLFLOW_TRACKING_URI": uri}
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def make_store(store: Path) -> list[str]:
    """Two linear_ddp runs (1 epoch) in a throwaway git repo; their ids, newest first."""
    uri = f"sqlite:///{store / 'mlflow.db'}"
    ids_file = store / "runs.txt"
    if ids_file.exists():
        return ids_file.read_text().split()
    project = store / "project"
    (project / "experiments").mkdir(parents=True)
    subprocess.run(["cp", "-r", str(ROOT / "experiments" / "linear_ddp"), str(project / "experiments")], check=True)
    (project / ".gitignore").write_text("__pycache__/\n")
    git = ["git", "-C", str(project), "-c", "user.name=bench", "-c", "user.email=bench@localhost"]
    for args in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-qm", "linear_ddp"]):
        subprocess.run([*git, *args], check=True, timeout=60)
    ids = []
    for _ in range(2):
        done = harness(ROOT, "run", "experiments/linear_ddp", "train.epochs=1", cwd=project, uri=uri,
                       timeout=RUN_TIMEOUT_S)
        if done.returncode != 0:
            sys.exit(f"cli_bench: harness run failed:\n{done.stderr[-2000:]}")
        ids.append(done.stdout.strip().splitlines()[-1])
    ids_file.write_text("\n".join(ids))
    return ids


def baseline_tree(ref: str, dest: Path) -> Path:
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "harness"], check=True, capture_output=True,
                             timeout=60).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")
    return dest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds() -> float:
    """user + sys seconds of every finished, waited-for descendant: what a command costs whatever the load."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def time_ui(tree: Path, cwd: Path, uri: str) -> float:
    """Seconds from starting `harness ui` to the first HTTP 200 of its page; then it is stopped by its PID."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(tree), "MLFLOW_TRACKING_URI": uri}
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "harness", "ui", "--port", str(port)], cwd=cwd, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as answer:
                    if answer.status == 200:
                        return time.perf_counter() - start
            except (OSError, urllib.error.URLError):
                pass
            if proc.poll() is not None:
                sys.exit(f"cli_bench: harness ui ({tree}) exited with {proc.returncode} before answering")
            if time.perf_counter() - start > UI_DEADLINE_S:
                sys.exit(f"cli_bench: harness ui ({tree}) did not answer within {UI_DEADLINE_S:.0f} s")
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGTERM)  # harness ui stops its server (its own process group) on SIGTERM
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def time_command(tree: Path, args: list[str], cwd: Path, uri: str) -> float:
    start = time.perf_counter()
    done = harness(tree, *args, cwd=cwd, uri=uri)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"cli_bench: harness {' '.join(args)} ({tree}) exited {done.returncode}:\n{done.stderr[-2000:]}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--store", type=Path, default=None, help="reuse (or fill) this folder's store")
    parser.add_argument("--baseline", default="main", help="git ref of the baseline (default: main)")
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="cli-bench-") as tmp:
        store = (opts.store or Path(tmp, "store")).resolve()
        store.mkdir(parents=True, exist_ok=True)
        uri = f"sqlite:///{store / 'mlflow.db'}"
        run_a, run_b = make_store(store)
        base = baseline_tree(opts.baseline, Path(tmp, "baseline"))
        trees = {"baseline": base, "this tree": ROOT}
        commands: dict[str, list[str]] = {"--help": ["--help"], "runs": ["runs"], "compare": ["compare", run_a, run_b]}
        times: dict[tuple[str, str], list[float]] = {}
        cpu: dict[tuple[str, str], list[float]] = {}
        loads = []
        for round_ in range(opts.rounds):
            order = list(trees.items()) if round_ % 2 == 0 else list(reversed(trees.items()))
            for name, args in [*commands.items(), ("ui", [])]:
                for label, tree in order:
                    before = cpu_seconds()
                    seconds = time_ui(tree, store, uri) if name == "ui" else time_command(tree, args, store, uri)
                    times.setdefault((name, label), []).append(seconds)
                    cpu.setdefault((name, label), []).append(cpu_seconds() - before)
            loads.append(os.getloadavg()[0])
            print(f"round {round_ + 1}/{opts.rounds} done (load {loads[-1]:.1f})", file=sys.stderr)
    print(f"`python benchmarks/cli_bench.py --rounds {opts.rounds}`; baseline `{opts.baseline}`; store of 2 "
          f"linear_ddp runs; load average (1 min) {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} cores\n")
    # Wall time is what a user waits; on an oversubscribed machine it is mostly waiting for a core. The
    # CPU seconds (user + sys of the command and its server) are what it costs on an idle one.
    print("| command | baseline median s | this tree median s | ratio | CPU s baseline / this tree | CPU ratio "
          "| goal | met (wall / CPU) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in [*commands, "ui"]:
        before = statistics.median(times[(name, "baseline")])
        after = statistics.median(times[(name, "this tree")])
        goal = GOALS[name]
        shown = "harness ui (first HTTP 200)" if name == "ui" else f"harness {' '.join(commands[name][:1])}"
        if name == "compare":
            shown = "harness compare A B"
        cpu_before = statistics.median(cpu[(name, "baseline")])
        cpu_after = statistics.median(cpu[(name, "this tree")])
        print(f"| `{shown}` | {before:.2f} | {after:.2f} | {after / before:.2f} | {cpu_before:.2f} / {cpu_after:.2f} | "
              f"{cpu_after / cpu_before:.2f} | < {goal:g} s | {'yes' if after < goal else 'no'} / "
              f"{'yes' if cpu_after < goal else 'no'} |")


if __name__ == "__main__":
    main()
