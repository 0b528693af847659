"""The planted hangs of tests/test_stalls.py and tests/test_leftovers.py: the training code, and what its processes
leave to find (every rank, DataLoader worker, subprocess and grandchild writes its pid into PID_DIR)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from conftest import Project, pid_alive

# Every rank, DataLoader worker, subprocess and grandchild writes its pid into PID_DIR as <what>-<pid>.
HANGS = '''
import os, pathlib, signal, subprocess, time
import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

PIDS = pathlib.Path(os.environ["PID_DIR"])


def mark(what):
    (PIDS / f"{what}-{os.getpid()}").touch()


class Worker:
    def __init__(self, stuck):
        self.stuck = stuck

    def __call__(self, worker_id):
        mark("worker")
        if self.stuck:
            time.sleep(100000)  # WORKER_LINE


def train(ctx):
    mode = ctx.cfg.mode
    mark(f"rank{ctx.rank}")
    data = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    stuck_worker = mode == "worker" and ctx.rank == 1
    loader = ctx.loader(data, 2, num_workers=1, worker_init_fn=Worker(stuck_worker), persistent_workers=True)
    # A subprocess that never returns, whose child (the grandchild) never returns either.
    subprocess.Popen(["sh", "-c", f"sleep 100000 & echo $! > {PIDS}/grandchild-$$; wait"])
    model = ctx.ddp(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    group = dist.new_group([0, 1]) if mode == "collective" else None
    for epoch in ctx.epochs(2):
        for x, y in loader:
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            if ctx.step == 2 and ctx.rank == 1:
                if mode == "sleep":
                    time.sleep(100000)  # SLEEP_LINE
                if mode == "subprocess":
                    subprocess.run(["sleep", "100000"])  # SUBPROCESS_LINE
                if mode == "raise":
                    raise RuntimeError("planted failure")
                if mode == "busy":  # an evaluation outside the step loop: no progress, but a CPU at work
                    end = time.monotonic() + 8
                    while time.monotonic() < end:
                        sum(i * i for i in range(1000))
                if mode == "self-kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if mode == "wait":  # the test ends the job from outside
                    mark("ready")
                    time.sleep(100000)
            if mode == "collective" and ctx.step == 2 and ctx.rank == 0:
                dist.all_reduce(torch.ones(1), group=group)  # COLLECTIVE_LINE
            loss.backward()  # BACKWARD_LINE
            opt.step()
            ctx.log({"loss": loss}, ctx.step)
    iter(loader)  # the persistent workers stay up after train returns
'''


# The fork deadlock itself (CPython gh-112275, in 3.10 and 3.11): rank 1 has a thread that makes and frees thread states
# without the GIL around each epoch's start, as a C++ thread does when it enters Python (a gloo worker freeing a
# Python object: seen with gdb in a rank, pybind11's gil_scoped_acquire), while the epoch forks its DataLoader workers.
# Each fork then has a chance (measured: 26 in 300 forks) to leave a worker that never gets back from the fork.
FORKLOCK = '''
import ctypes, threading, time
import torch
from torch.utils.data import TensorDataset


def enter_python_from_c(go):
    lib = ctypes.CDLL(None)  # a CDLL call releases the GIL
    lib.PyThreadState_New.restype = ctypes.c_void_p
    lib.PyThreadState_New.argtypes = [ctypes.c_void_p]
    lib.PyThreadState_Delete.argtypes = [ctypes.c_void_p]
    main = ctypes.pythonapi.PyInterpreterState_Main
    main.restype = ctypes.c_void_p
    interp = main()
    while True:
        go.wait()
        end = time.monotonic() + 0.2
        while time.monotonic() < end:
            lib.PyThreadState_Delete(lib.PyThreadState_New(interp))
        go.clear()


def train(ctx):
    go = threading.Event()
    if ctx.rank == 1:
        threading.Thread(target=enter_python_from_c, args=(go,), daemon=True).start()
    data = TensorDataset(torch.randn(8, 4), torch.randn(8, 1))
    loader = ctx.loader(data, 2, num_workers=2)
    model = ctx.ddp(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for epoch in ctx.epochs(400):
        go.set()
        for x, y in loader:  # FORK_LINE: each epoch forks two workers
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
'''


def line(tag: str) -> int:
    return next(i for i, text in enumerate(HANGS.splitlines(), 1) if tag in text)


def fork_line() -> int:
    return next(i for i, text in enumerate(FORKLOCK.splitlines(), 1) if "FORK_LINE" in text)


def session_left(session: int) -> list[int]:
    """Living processes of a session (a command started in a session of its own, and everything under it)."""
    left = []
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        try:
            if os.getsid(pid) == session and pid_alive(pid):
                left.append(pid)
        except OSError:
            continue
    return left


def pids(folder: Path) -> dict[str, list[int]]:
    found: dict[str, list[int]] = {}
    for path in folder.iterdir():
        what, _, pid = path.name.rpartition("-")
        if what == "grandchild":  # the shell wrote the grandchild's pid into the file
            pid = path.read_text().strip() or "0"
        if pid.isdigit():
            found.setdefault(what, []).append(int(pid))
    return found


def all_gone(folder: Path, wait_s: float = 15.0) -> list[str]:
    """The processes the job started that are still alive after `wait_s` (empty: none)."""
    deadline = time.monotonic() + wait_s
    while True:
        alive = [f"{what} {pid}" for what, pids in pids(folder).items() for pid in pids if pid and pid_alive(pid)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)



def add(project: Project) -> Project:
    project.add_experiment("hangs", train_py=HANGS)
    project.add_experiment("forklock", train_py=FORKLOCK)
    return project


def start(project: Project, mode: str, pid_dir: Path, *extra: str) -> subprocess.Popen:
    """`harness run` of the planted hang `mode` (forklock: the interpreter's fork deadlock), in a session of its own."""
    pid_dir.mkdir()
    if mode == "forklock":
        return project.popen("run", "experiments/forklock", *extra, env={"PID_DIR": str(pid_dir)})
    return project.popen("run", "experiments/hangs", f"train.mode={mode}", *extra, env={"PID_DIR": str(pid_dir)})
