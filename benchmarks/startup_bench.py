"""`harness run` against the same job written as a bare mp.spawn script: start-up, feedback and memory.

Each round runs every variant of a job one after another, in a rotating order (interleaved, so a change in
the machine's load hits them alike): the bare script (benchmarks/bare/JOB.py), `harness run
experiments/JOB` from this tree, and with --before TREE the same command from another checkout of harness
(e.g. main) for a before/after. Every `harness run` runs in one throwaway git repository holding copies
of the experiments, with a SQLite store per variant. Measured per process: whole-process wall time, the
time to its first line on stderr, and the peak resident memory of the launcher, of each rank and of the
rest of its process tree (sampled from /proc every 0.1 s). Prints two markdown tables (medians and ratios
to the bare script) and the load average.

Usage: python benchmarks/startup_bench.py [--rounds N] [--jobs linear_ddp,digits_cnn] [--before /work/main] [--fork-workers]
                                         [--kept-server]

--kept-server: also `harness run` with its rank server kept warm between commands (HARNESS_RANK_SERVER_IDLE_S): its
first round starts the server, the later ones find it warm (the medians are over every round). Its ranks are not the
command's descendants then, so their memory is not in its table.

--fork-workers: the bare digits_cnn's loader workers fork as ctx.loader's do; without it they are spawned (the ranks'
start method, inherited) and re-import torch every epoch, which makes the bare script several times slower
"""

from __future__ import annotations

import argparse
import contextlib
import builtins
import functools
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from benchrepo import project  # benchmarks/, on sys.path when run as a script

ROOT = Path(__file__).resolve().parents[1]
BARE = Path(__file__).resolve().parent / "bare"
MiB = 1024 * 1024
TIMEOUT_S = 1200.0
KEPT = "HARNESS_RANK_SERVER_IDLE_S"  # one process, on a loaded 2-core machine


@dataclass
class Sample:
    wall_s: float
    first_err_s: float | None  # the first line on stderr, from the start of the process
    first_out_s: float | None
    rss: dict[str, float] = field(default_factory=dict)  # kind -> peak MiB (rank: the largest rank)




def _kind(proc: psutil.Process, root: int) -> str:
    """launcher (the command itself), rank (a process spawned by mp.spawn, or forked by harness's rank server),
    rank server, other (helpers, loader workers)."""
    if proc.pid == root:
        return "launcher"
    try:
        cmd = " ".join(proc.cmdline())
        parent = proc.ppid()
    except psutil.Error:
        return "other"
    if parent == root and "spawn_main" in cmd:
        return "rank"
    if "multiprocessing.forkserver" in cmd:  # harness's warm rank server, and the ranks it forks
        return "rank server" if parent == root else "rank"
    return "other"


def _measure(cmd: list[str], cwd: Path, env: dict[str, str]) -> Sample:
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first: dict[str, float] = {}
    texts: dict[str, list[bytes]] = {"out": [], "err": []}

    def read(name: str, stream) -> None:
        for line in stream:
            first.setdefault(name, time.monotonic() - start)
            texts[name].append(line)

    readers = [threading.Thread(target=read, args=(n, s), daemon=True)
               for n, s in (("out", proc.stdout), ("err", proc.stderr))]
    for r in readers:
        r.start()
    peaks: dict[int, tuple[str, float]] = {}
    root = psutil.Process(proc.pid)
    deadline = start + TIMEOUT_S
    while proc.poll() is None:
        if time.monotonic() > deadline:  # nothing waits forever: a hung job is killed and reported
            for p in reversed([root, *root.children(recursive=True)]):
                with contextlib.suppress(psutil.Error):
                    p.kill()
            raise SystemExit(f"{' '.join(cmd)} ran past {TIMEOUT_S:g} s; killed")
        try:
            tree = [root, *root.children(recursive=True)]
        except psutil.Error:
            tree = []
        for p in tree:
            try:
                rss = p.memory_info().rss / MiB
            except psutil.Error:
                continue
            # Once a rank, always one: an exited rank's command line can no longer be read (a zombie).
            kind = "rank" if peaks.get(p.pid, ("",))[0] == "rank" else _kind(p, proc.pid)
            peaks[p.pid] = (kind, max(rss, peaks.get(p.pid, (kind, 0.0))[1]))
        time.sleep(0.1)
    wall = time.monotonic() - start
    for r in readers:
        r.join()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{b''.join(texts['err']).decode()[-3000:]}")
    rss: dict[str, float] = {}
    for kind, value in peaks.values():
        if kind == "other":
            rss[kind] = rss.get(kind, 0.0) + value  # helpers and loader workers: their peaks summed
        else:
            rss[kind] = max(rss.get(kind, 0.0), value)
    return Sample(wall, first.get("err"), first.get("out"), rss)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--jobs", default="linear_ddp,digits_cnn")
    ap.add_argument("--before", type=Path, default=None, help="another harness checkout to time alongside")
    ap.add_argument("--fork-workers", action="store_true",
                    help="the bare scripts' DataLoader workers fork, as ctx.loader's do (BARE_FORK_WORKERS=1)")
    ap.add_argument("--kept-server", action="store_true",
                    help="also time `harness run` with its rank server kept warm between commands")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="startup-bench-"))
    try:
        repo = project(base, ("linear_ddp", "digits_cnn"))
        variants: dict[str, tuple[list[str], str | None]] = {"bare": ([], None), "harness": ([], str(ROOT))}
        if args.before is not None:
            variants["harness (before)"] = ([], str(args.before.resolve()))
        if args.kept_server:
            variants["harness (kept server)"] = ([], str(ROOT))
        results: dict[tuple[str, str], list[Sample]] = {}
        jobs = args.jobs.split(",")
        for rnd in range(args.rounds):
            for job in jobs:
                names = list(variants)
                names = names[rnd % len(names):] + names[:rnd % len(names)]  # rotate who goes first
                for name in names:
                    env = {k: v for k, v in os.environ.items()
                           if k not in ("MLFLOW_TRACKING_URI", "PYTHONPATH", KEPT)}
                    env["PYTHONUNBUFFERED"] = "1"
                    if name == "harness (kept server)":
                        env[KEPT] = "300"
                    if name == "bare":
                        cmd = [sys.executable, str(BARE / f"{job}.py")]
                        if args.fork_workers:
                            env["BARE_FORK_WORKERS"] = "1"
                    else:
                        tree = variants[name][1]
                        env["PYTHONPATH"] = tree
                        store = repo / "stores" / name.replace(" ", "_").strip("()")
                        store.mkdir(parents=True, exist_ok=True)
                        env["MLFLOW_TRACKING_URI"] = f"sqlite:///{store / 'mlflow.db'}"
                        cmd = [sys.executable, "-m", "harness", "run", f"experiments/{job}"]
                    sample = _measure(cmd, repo, env)
                    results.setdefault((job, name), []).append(sample)
                    print(f"round {rnd + 1} {job:<10} {name:<17} {sample.wall_s:6.1f} s  first stderr "
                          f"{sample.first_err_s if sample.first_err_s is None else round(sample.first_err_s, 2)} s",
                          file=sys.stderr, flush=True)
            if rnd + 1 < args.rounds:  # the tables so far, on stderr: a long benchmark stopped early keeps them
                _print_tables(results, jobs, list(variants), rnd + 1, sys.stderr)
        _print_tables(results, jobs, list(variants), args.rounds)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        if args.kept_server:
            sys.path.insert(0, str(ROOT))
            from harness.executors import rankserver

            rankserver.stop_all(ROOT / "harness")


def _median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def _f(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _print_tables(results: dict[tuple[str, str], list[Sample]], jobs: list[str], names: list[str], rounds: int,
                  out=sys.stdout) -> None:
    print = functools.partial(builtins.print, file=out, flush=True)  # noqa: A001 (the tables' one destination)
    print(f"\n{rounds} interleaved rounds, medians; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}\n")
    print("| job | variant | wall s | ratio to bare | overhead s | first stderr line s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for job in jobs:
        bare = _median([s.wall_s for s in results[(job, "bare")]])
        for name in names:
            samples = results[(job, name)]
            wall = _median([s.wall_s for s in samples])
            # Per round against that round's bare run, then the median: paired, so load swings cancel.
            ratios = [s.wall_s / b.wall_s for s, b in zip(samples, results[(job, "bare")])]
            over = [s.wall_s - b.wall_s for s, b in zip(samples, results[(job, "bare")])]
            first = _median([s.first_err_s for s in samples]) if name != "bare" else None
            print(f"| {job} | {name} | {_f(wall, 1)} | {_f(_median(ratios))} | {_f(_median(over), 1)} | {_f(first)} |")
    print("\n| job | variant | process | peak RSS MiB | ratio to the bare script's |")
    print("| --- | --- | --- | --- | --- |")
    for job in jobs:
        bare = {k: _median([s.rss.get(k) for s in results[(job, "bare")]]) for k in ("launcher", "rank", "other")}
        for name in names:
            samples = results[(job, name)]
            for kind in ("launcher", "rank", "rank server", "other"):
                value = _median([s.rss.get(kind) for s in samples])
                if value is None and kind == "rank server":
                    continue
                ratio = value / bare[kind] if value is not None and bare.get(kind) else None
                label = {"launcher": "launcher (the command)", "rank": "one rank (the largest; a forked one shares "
                         "the server's pages)", "rank server": "rank server (harness's forkserver)",
                         "other": "helpers + loader workers (sum)"}[kind]
                print(f"| {job} | {name} | {label} | {_f(value, 0)} | {_f(ratio)} |")


if __name__ == "__main__":
    main()
