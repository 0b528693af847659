"""How harness's cost grows with the number of ranks and with the size of declared data, against a baseline at each size.

Ranks (world size 1 / 2 / 4 / 8, whatever the machine's cores): `harness run experiments/linear_ddp
world_size=N threads_per_rank=1` in a throwaway git repository (benchrepo.project) with its own SQLite
store, against the same job as a bare `mp.spawn` script (benchmarks/bare/linear_ddp.py 5 N, one torch
thread per rank, OMP_NUM_THREADS=1 as harness sets). Whole-process wall time of both. Beyond the cores
(N x threads_per_rank > cores) `harness run` only warns (executors/launch.py: capacity_warning) and runs;
the second table says where it warned. One untimed run of each comes first (it creates the MLflow store).
Overhead = harness - bare, paired per round, median; "per rank" is that divided by N.

Declared data (1,000 / 10,000 / 100,000 files of 4 KiB, 1,000 to a folder, generated once under
/tmp/harness-scale-data/N and reused; the page cache is warmed before the first round, so both sides
read memory, not the disk):
- first hash: `harness.record.data.resolve_and_hash`, what `harness run` calls on a declared folder,
  with an empty hash cache (a fresh $HARNESS_CACHE_DIR each round, so it also writes every hash into the
  SQLite cache, as a first run does) against `find DIR -type f -print0 | xargs -0 sha256sum`. harness
  hashes on min(8, cores) threads, sha256sum on one.
- re-check of the unchanged tree: the same call with the cache filled (every file a cache hit, checked:
  nothing read) against `find DIR -type f -newer STAMP` (STAMP written after the tree, so it prints
  nothing). The baseline is chosen as the least work any correct re-check must do: list every folder and
  stat every file (a change shows only in the stat), in one C process, comparing against a single time
  instead of a stored row per file. `stat` of every file via xargs would add process start-ups and
  formatting per batch, and a Python os.walk/os.stat loop would measure Python rather than the work.

Sizes are measured in one interleaved set of rounds per axis (every variant at every size once per round,
rotating order), medians. The table's growth exponent is the log-log slope of cost against size
(benchmarks/scaling.py); a harness exponent clearly above its baseline's means harness grows faster than
the work.

Usage: python benchmarks/scale_ranks_data_bench.py [--quick] [--rounds N] [--axes ranks,data]
       --quick: world sizes 1, 2 and 300 / 1,000 files, one round (checks the script works)
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # harness from this checkout, not an installed copy

from benchrepo import project  # benchmarks/, on sys.path when run as a script
from scaling import Axis, interleaved, table

from harness.record import data as D

ROOT = Path(__file__).resolve().parents[1]
BARE = Path(__file__).resolve().parent / "bare" / "linear_ddp.py"
DATA_ROOT = Path("/tmp/harness-scale-data")
FILE_BYTES = 4096
PER_FOLDER = 1000
EPOCHS = 5  # experiments/linear_ddp's train.epochs, and the bare script's default
TIMEOUT_S = 600.0  # one process on a loaded 2-core machine (an 8-rank run takes well under a minute)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


# ---------------------------------------------------------------------------------------------
# Ranks


def _run(cmd: list[str], cwd: Path, env: dict[str, str]) -> str:
    """Run to the end; its stderr. A process past TIMEOUT_S is killed with its ranks (its own session)."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise SystemExit(f"{' '.join(cmd)} ran past {TIMEOUT_S:g} s; killed with its ranks") from None
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{err[-3000:]}")
    return err


def bench_ranks(sizes: list[int], rounds: int, base: Path) -> tuple[Axis, list[str]]:
    repo = project(base, ("linear_ddp",))
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "PYTHONPATH", "OMP_NUM_THREADS")}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    store = repo / "stores" / "harness"
    store.mkdir(parents=True)
    henv = {**env, "PYTHONPATH": str(ROOT), "MLFLOW_TRACKING_URI": f"sqlite:///{store / 'mlflow.db'}"}
    warned: dict[int, bool] = {}

    def harness(n: int):
        def go() -> None:
            t0 = time.perf_counter()
            err = _run([sys.executable, "-m", "harness", "run", "experiments/linear_ddp", f"world_size={n}",
                        "threads_per_rank=1"], repo, henv)
            warned[n] = "threads on" in err and "share cores" in err
            print(f"  ranks {n}: harness {time.perf_counter() - t0:6.2f} s", file=sys.stderr, flush=True)
        return go

    def bare(n: int):
        def go() -> None:
            t0 = time.perf_counter()
            _run([sys.executable, str(BARE), str(EPOCHS), str(n)], repo, env)
            print(f"  ranks {n}: bare    {time.perf_counter() - t0:6.2f} s", file=sys.stderr, flush=True)
        return go

    # Untimed, once: the first `harness run` creates the MLflow store (its schema migrations take seconds), and
    # both sides' first start reads torch from disk. Neither is a per-rank cost.
    print("  warm-up (untimed): creating the store", file=sys.stderr, flush=True)
    _run([sys.executable, "-m", "harness", "run", "experiments/linear_ddp", "world_size=1", "train.epochs=1"], repo, henv)
    _run([sys.executable, str(BARE), "1", "1"], repo, env)
    variants = {}
    for n in sizes:
        variants[f"harness {n}"] = harness(n)
        variants[f"bare {n}"] = bare(n)
    times = interleaved(variants, rounds)
    axis = Axis("ranks", "whole-process wall s, linear_ddp", "bare mp.spawn script (benchmarks/bare/linear_ddp.py)")
    lines = ["| world size | threads (x1 per rank) on cores | capacity warning | harness wall s | bare wall s "
             "| overhead s | overhead per rank s |", "| --- | --- | --- | --- | --- | --- | --- |"]
    cores = _cores()
    for n in sizes:
        h, b = times[f"harness {n}"], times[f"bare {n}"]
        axis.add(n, str(n), statistics.median(h), statistics.median(b))
        over = statistics.median(x - y for x, y in zip(h, b))  # paired per round: load swings cancel
        lines.append(f"| {n} | {n} on {cores} | {'yes' if warned.get(n) else 'no'} | {statistics.median(h):.2f} "
                     f"| {statistics.median(b):.2f} | {over:.2f} | {over / n:.3f} |")
    return axis, lines


# ---------------------------------------------------------------------------------------------
# Declared data


def data_tree(n: int) -> tuple[Path, Path]:
    """DATA_ROOT/n: n files of FILE_BYTES, PER_FOLDER to a folder (made once, reused); and its stamp file."""
    folder, stamp, done = DATA_ROOT / str(n), DATA_ROOT / f"{n}.stamp", DATA_ROOT / f"{n}.done"
    if done.exists() and done.read_text() == f"{n} {FILE_BYTES}\n":
        return folder, stamp
    shutil.rmtree(folder, ignore_errors=True)
    block = bytearray(os.urandom(FILE_BYTES))
    print(f"  generating {n:,} files under {folder}", file=sys.stderr, flush=True)
    for i in range(n):
        sub = folder / f"d{i // PER_FOLDER:03d}"
        if i % PER_FOLDER == 0:
            sub.mkdir(parents=True)
        block[:8] = i.to_bytes(8, "little")  # every file differs
        (sub / f"f{i:06d}.bin").write_bytes(block)
    time.sleep(max(D.RACY_S * 2, 0.05))  # the stamp is newer than every file; files are past harness's racy window
    stamp.write_text("")
    done.write_text(f"{n} {FILE_BYTES}\n")
    return folder, stamp


def _sh(command: str) -> None:
    subprocess.run(["bash", "-o", "pipefail", "-c", command], check=True, stdout=subprocess.DEVNULL, timeout=TIMEOUT_S)


def bench_data(sizes: list[int], rounds: int, base: Path) -> tuple[Axis, Axis]:
    trees = {n: data_tree(n) for n in sizes}
    for folder, _ in trees.values():  # warm the page cache: both sides read memory
        _sh(f"find '{folder}' -type f -print0 | xargs -0 cat")
    caches = {n: base / f"cache-{n}" for n in sizes}
    fresh_count = [0]

    def harness_hash(n: int, cache: Path, expect_hashed: int) -> float:
        os.environ[D.ENV_CACHE_DIR] = str(cache)
        stats = D.HashStats()
        t0 = time.perf_counter()
        D.resolve_and_hash({"files": str(trees[n][0])}, base, None, stats)
        took = time.perf_counter() - t0
        assert stats.files == n and stats.hashed == expect_hashed, (n, stats.files, stats.hashed)
        return took

    def first(n: int):
        def go() -> float:
            fresh_count[0] += 1
            cache = base / f"fresh-{fresh_count[0]}"
            try:
                return harness_hash(n, cache, n)
            finally:
                shutil.rmtree(cache, ignore_errors=True)
        return go

    def recheck(n: int):
        return lambda: harness_hash(n, caches[n], 0)

    def sha256sum(n: int):
        return lambda: _sh(f"find '{trees[n][0]}' -type f -print0 | xargs -0 sha256sum")

    def newer(n: int):
        folder, stamp = trees[n]
        return lambda: _sh(f"find '{folder}' -type f -newer '{stamp}'")

    for n in sizes:  # fill each size's cache once (and warm Python's side: imports, sqlite)
        harness_hash(n, caches[n], n)
    variants = {}
    for n in sizes:
        variants[f"first {n}"] = first(n)
        variants[f"sha256sum {n}"] = sha256sum(n)
        variants[f"recheck {n}"] = recheck(n)
        variants[f"newer {n}"] = newer(n)
    times = interleaved(variants, rounds)
    med = {k: statistics.median(v) for k, v in times.items()}
    for n in sizes:
        print(f"  data {n:>7,}: first {med[f'first {n}']:.3f} s, sha256sum {med[f'sha256sum {n}']:.3f} s, "
              f"re-check {med[f'recheck {n}']:.3f} s, find -newer {med[f'newer {n}']:.3f} s", file=sys.stderr, flush=True)
    hashing = Axis("data: first hash", f"hash a folder of {FILE_BYTES // 1024} KiB files, cache empty, s",
                   "`find -type f -print0 | xargs -0 sha256sum`")
    check = Axis("data: re-check", "the same folder unchanged, every file a cache hit, s",
                 "`find -type f -newer STAMP` (list + stat every file)")
    for n in sizes:
        hashing.add(n, f"{n:,} files", med[f"first {n}"], med[f"sha256sum {n}"])
        check.add(n, f"{n:,} files", med[f"recheck {n}"], med[f"newer {n}"])
    return hashing, check


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, one round: check the script works")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--axes", default="ranks,data", help="ranks, data, or both (the default)")
    args = ap.parse_args()
    rounds = 1 if args.quick else args.rounds
    rank_sizes = [1, 2] if args.quick else [1, 2, 4, 8]
    data_sizes = [300, 1000] if args.quick else [1000, 10_000, 100_000]
    axes_wanted = set(args.axes.split(","))
    base = Path(tempfile.mkdtemp(prefix="scale-ranks-data-"))
    saved_cache = os.environ.get(D.ENV_CACHE_DIR)
    try:
        axes: list[Axis] = []
        rank_lines: list[str] = []
        if "ranks" in axes_wanted:
            axis, rank_lines = bench_ranks(rank_sizes, rounds, base / "ranks")
            axes.append(axis)
        if "data" in axes_wanted:
            (base / "data").mkdir()
            axes.extend(bench_data(data_sizes, rounds, base / "data"))
        print(table(axes, f"{rounds} interleaved round{'s' if rounds != 1 else ''}, medians, {_cores()} cores\n"))
        if rank_lines:
            print("\nRanks: harness's overhead over the bare script (paired per round, median)\n")
            print("\n".join(rank_lines))
    finally:
        if saved_cache is None:
            os.environ.pop(D.ENV_CACHE_DIR, None)
        else:
            os.environ[D.ENV_CACHE_DIR] = saved_cache
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
