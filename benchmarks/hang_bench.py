"""The README's main job, many times in a row on a loaded machine: how many runs hung, how many left a process behind;
and how long a planted stall takes to be named with the default settings.

    python benchmarks/hang_bench.py --runs 50 --load 2 --stalls 3
    python benchmarks/hang_bench.py --runs 0 --stalls 0 --fork-launches 4 --before /tmp/old-tree
    python benchmarks/hang_bench.py --runs 0 --stalls 0 --interpreter-forks 300

`--load N` keeps N processes spinning on a CPU for the whole benchmark (the machine's cores busy, as on a shared
box). A run that has not ended after --deadline seconds counts as a hang: its process group is killed. After every
run the processes that were not there before it (the load and this script excepted) are leftovers. The planted
stall is a DataLoader worker of rank 1 that never gets to its first batch (its init sleeps); the time counted is from
the moment it starts sleeping (the worker writes it) to harness's FAILED line.

`--fork-launches N`: the fork stress, N launches of a job whose two ranks fork two DataLoader workers at each of 1,000
epochs while rank 0's metric sender is busy (64 points a step): a launch that hangs is named by harness (FAILED) or
killed at the deadline. With `--before TREE` (a checkout of another version, run through PYTHONPATH) the same launches
of that version are interleaved with this one's. `--interpreter-forks N`: the interpreter's own hazard on this Python,
without torch or harness: N forks while another thread makes and frees thread states without the GIL (what a C++
thread does as it enters Python), each child given 2 s to exit.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchrepo import git, project

STALL_YAML = """image: none
entry: train.py:train
world_size: 2
seed: 0
train:
  mark: ''
"""
STALL_PY = '''
import time
import torch
from torch.utils.data import TensorDataset


class Stuck:
    def __init__(self, mark):
        self.mark = mark

    def __call__(self, worker_id):
        with open(self.mark, "w") as fh:
            fh.write(repr(time.time()))
        time.sleep(100000)


def train(ctx):
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    stuck = Stuck(ctx.cfg.mark) if ctx.rank == 1 else None
    loader = ctx.loader(data, 4, num_workers=1, worker_init_fn=stuck)
    model = ctx.ddp(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for epoch in ctx.epochs(2):
        for x, y in loader:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
'''


FORKS_YAML = """image: none
entry: train.py:train
world_size: 2
seed: 0
timeout_s: 120
"""
FORKS_PY = '''
import torch
from torch.utils.data import TensorDataset


def train(ctx):
    data = TensorDataset(torch.randn(8, 4), torch.randn(8, 1))
    loader = ctx.loader(data, 2, num_workers=2)
    model = ctx.ddp(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for epoch in ctx.epochs(1000):
        for x, y in loader:
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            ctx.log({f"m{i}": float(i) for i in range(64)}, ctx.step)
'''
INTERPRETER = '''
import ctypes, os, sys, threading, time
lib = ctypes.CDLL(None)
lib.PyThreadState_New.restype = ctypes.c_void_p
lib.PyThreadState_New.argtypes = [ctypes.c_void_p]
lib.PyThreadState_Delete.argtypes = [ctypes.c_void_p]
main = ctypes.pythonapi.PyInterpreterState_Main
main.restype = ctypes.c_void_p
interp = main()
def enter():
    while True:
        lib.PyThreadState_Delete(lib.PyThreadState_New(interp))
threading.Thread(target=enter, daemon=True).start()
hung = 0
for _ in range(int(sys.argv[1])):
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    deadline = time.monotonic() + 2
    while not os.waitpid(pid, os.WNOHANG)[0]:
        if time.monotonic() > deadline:
            hung += 1
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            break
        time.sleep(0.0005)
print(hung)
'''


def _left_by(session: int, before: set[int]) -> list[str]:
    """Living processes of the run's session (it was started in a session of its own: the launcher, its rank server,
    ranks, their workers and subprocesses all stay in it unless they make their own), and the run's guardian (in a
    session of its own, named with the launcher's pid). A zombie is gone already, only not yet reaped (a process
    that outlived its parent by a moment waits there for init, which on some machines reaps it seconds later)."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        if p.info["pid"] in before or p.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        cmd = " ".join(p.info["cmdline"] or [])
        try:
            sid = os.getsid(p.info["pid"])
        except OSError:
            continue
        if sid == session or cmd.endswith(f"harness-guardian {session}"):
            found.append(f"{p.info['pid']} {cmd[:90]}")
    return found


def _pids() -> set[int]:
    return set(psutil.pids())


def _run(cmd: list[str], cwd: Path, deadline_s: float, watch: str | None = None,
         env: dict[str, str] | None = None) -> tuple[str, float, float | None, list[str]]:
    """(how it ended, seconds, when a line containing `watch` appeared: time.time(), the processes it left)."""
    before = _pids()
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=env)
    lines: list[tuple[float, str]] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((time.time(), line))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=deadline_s)
    except subprocess.TimeoutExpired:
        left = _left_by(proc.pid, before)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return "HUNG", time.monotonic() - start, None, left
    reader.join(10)
    time.sleep(1.0)
    seen = next((at for at, line in lines if watch and watch in line), None)
    tail = [line.strip() for _, line in lines if line.strip()]
    status = "FINISHED" if proc.returncode == 0 else f"exit {proc.returncode}: " + (tail[-3] if len(tail) >= 3 else "")[:120]
    return status, time.monotonic() - start, seen, _left_by(proc.pid, before)


def _forks(repo: Path, launches: int, before: str | None, deadline: float) -> None:
    trees = [("this tree", None)] + ([("--before", before)] if before else [])
    results: dict[str, list[str]] = {name: [] for name, _ in trees}
    for i in range(launches):
        for name, tree in trees:
            env = {**os.environ, **({"PYTHONPATH": tree} if tree else {})}
            status, took, _, left = _run(["harness", "run", "experiments/forks"], repo, deadline, env=env)
            results[name].append(status)
            print(f"forks {name} {i + 1}/{launches}: {status[:110]}  {took:.0f} s  leftovers {len(left)}", flush=True)
    print()
    print("| code | launches | DataLoader forks | hung (named or killed) |")
    print("| --- | --- | --- | --- |")
    for name, statuses in results.items():
        print(f"| {name} | {len(statuses)} | {4000 * len(statuses):,} | {sum(s != 'FINISHED' for s in statuses)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--load", type=int, default=2, help="processes spinning on a CPU throughout")
    parser.add_argument("--stalls", type=int, default=3, help="planted stalls timed with the default settings")
    parser.add_argument("--deadline", type=float, default=900.0, help="a run still going after this is a hang")
    parser.add_argument("--fork-launches", type=int, default=0, help="launches of the fork stress (4,000 forks each)")
    parser.add_argument("--before", help="a checkout of another version: its fork-stress launches interleaved")
    parser.add_argument("--interpreter-forks", type=int, default=0, help="forks beside a thread entering Python")
    args = parser.parse_args()
    if args.interpreter_forks:
        hung = subprocess.run([sys.executable, "-c", INTERPRETER, str(args.interpreter_forks)], capture_output=True,
                              text=True, check=True).stdout.strip()
        print(f"| Python {sys.version.split()[0]} | {args.interpreter_forks} forks beside a thread entering Python | "
              f"{hung} children hung in the fork |")

    base = Path(tempfile.mkdtemp(prefix="harness-hang-bench-"))
    repo = project(base, ("digits_cnn",))
    (repo / "experiments" / "stall").mkdir()
    (repo / "experiments" / "stall" / "experiment.yaml").write_text(STALL_YAML)
    (repo / "experiments" / "stall" / "train.py").write_text(STALL_PY)
    (repo / "experiments" / "forks").mkdir()
    (repo / "experiments" / "forks" / "experiment.yaml").write_text(FORKS_YAML)
    (repo / "experiments" / "forks" / "train.py").write_text(FORKS_PY)
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "stall")
    harness = ["harness"]  # the one on PATH, with PYTHONPATH as this process has it
    load = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    results: list[tuple[str, float, list[str]]] = []
    stalls: list[tuple[str, float | None, list[str]]] = []
    try:
        for i in range(args.runs):
            status, took, _, left = _run([*harness, "run", "experiments/digits_cnn"], repo, args.deadline)
            results.append((status, took, left))
            print(f"run {i + 1:2d}/{args.runs}: {status:<10} {took:6.1f} s  leftovers {len(left)} {left[:3]}",
                  flush=True)
        for i in range(args.stalls):
            mark = base / f"stall-{i}.mark"
            status, took, seen, left = _run([*harness, "run", "experiments/stall", f"train.mark={mark}"], repo,
                                            args.deadline, watch="stalled: ")
            named = seen - float(mark.read_text()) if seen and mark.exists() else None
            stalls.append((status, named, left))
            print(f"stall {i + 1}: {status[:100]}  named after {named if named is None else round(named, 1)} s  "
                  f"leftovers {len(left)}", flush=True)
        if args.fork_launches:
            _forks(repo, args.fork_launches, args.before, args.deadline)
    finally:
        for p in load:
            p.kill()
            p.wait()
    if results:
        hung = sum(1 for s, _, _ in results if s == "HUNG")
        failed = sum(1 for s, _, _ in results if s not in ("HUNG", "FINISHED"))
        leftover_runs = sum(1 for _, _, left in results if left)
        times = sorted(t for _, t, _ in results)
        print()
        print("| runs | load | hung | failed | runs that left a process | wall per run (median, max) |")
        print("| --- | --- | --- | --- | --- | --- |")
        print(f"| {len(results)} | {args.load} spinning processes | {hung} | {failed} | {leftover_runs} | "
              f"{times[len(times) // 2]:.1f} s, {times[-1]:.1f} s |")
    if stalls:
        named = [n for _, n, _ in stalls if n is not None]
        print()
        print("| planted stalls | named (FAILED, `stalled:`) | from the stall to its line (each) | left a process |")
        print("| --- | --- | --- | --- |")
        print(f"| {len(stalls)} | {len(named)} | {', '.join(f'{n:.1f} s' for n in named)} | "
              f"{sum(1 for _, _, left in stalls if left)} |")


if __name__ == "__main__":
    main()
