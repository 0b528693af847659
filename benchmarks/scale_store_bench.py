"""How harness's cost grows with the size of the tracking store and of a bundled run, against what a user would do
without harness, at three sizes each; one table of medians with the growth exponents (benchmarks/scaling.py).

usage: python benchmarks/scale_store_bench.py [--quick] [--rounds N] [--axes store,bundle] [--cache DIR]

Store axis: SQLite stores of 100 / 1,000 / 10,000 runs of 1,000 metric rows each (10M rows in the largest).
One real run (`harness run experiments/linear_ddp train.epochs=200`: 1,000 steps, one `loss` point each) is
made in a throwaway git repository (benchrepo.project), then each store is a copy of that store with the run
cloned N-1 times by SQL inside the file (`runs`, `tags`, `params`, `latest_metrics`, `metrics` rows copied
under new run ids, each clone started a second before the last). A clone is the original under another id:
the same tags, params, metric rows and artifact location (its `metrics/series.npz`, config and seal are the
original's files), so `harness compare` reads it and its seal holds. Timed as whole processes, medians of
interleaved rounds, against:
  - `harness runs` (20 runs, its default)   vs MlflowClient.search_runs(max_results=20) in a subprocess;
  - `harness compare A B` (original, clone) vs MlflowClient.get_metric_history of `loss` for both runs;
  - `harness ui` until the link it prints answers HTTP 200, vs `mlflow ui --backend-store-uri` until / does;
  - `harness replay A` until rank 0's first line (`epoch 1/200 ...`) vs `harness run` of the same experiment on
    the same store until its first rank line: both are then stopped with SIGTERM and the run they made is
    deleted from the store (SQL) with its artifact folder, so the store keeps its size.
Bundle axis: a real run of experiments/sized_log (written into the throwaway repository: a Linear(4, 1) beside
a frozen random parameter whose size sets the checkpoint bytes, logging 10 metrics per step) with 10k / 100k /
1M metric points and 1 / 10 / 100 MB of checkpoints (4 checkpoints); `harness export RUN -o F
--with-checkpoints` vs `tar czf` of the run's artifact folder (series, checkpoints, everything), and `harness
import F` into a fresh store (a copy of an empty one MLflow made) vs `tar xzf` of that archive.

Built stores and runs are cached under --cache (default /tmp/harness-scale-stores: seed/, repo/, <N>/,
bundle-<points>/) and reused by the next invocation; the time each took to build is printed with the table.
--quick: stores of 10 / 30 / 100 runs, bundles of 1k / 3k / 10k points and 0.1 / 0.3 / 1 MB, 1 round.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from urllib.parse import unquote, urlsplit

import psutil
from benchrepo import git, project  # benchmarks/, on sys.path when run as a script
from scaling import LINEAR_SLACK, Axis, exponent, interleaved, table

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path("/tmp/harness-scale-stores")
SEED_EPOCHS = 200  # linear_ddp: 5 steps an epoch, one `loss` point each: 1,000 metric rows per run
STORE_SIZES = (100, 1_000, 10_000)
QUICK_STORE_SIZES = (10, 30, 100)
MB = 1_000_000
BUNDLE_SIZES = ((10_000, 1 * MB), (100_000, 10 * MB), (1_000_000, 100 * MB))  # (metric points, checkpoint bytes)
QUICK_BUNDLE_SIZES = ((1_000, MB // 10), (3_000, 3 * MB // 10), (10_000, MB))
PER_STEP = 10  # metrics sized_log logs at each step
CHECKPOINTS = 4  # sized_log saves at step 0 and every steps/4
CHECKPOINT_OVERHEAD = 17_000  # bytes of a checkpoint besides the parameter (measured: RNG states, optimizer, ...)
LIST = 20  # `harness runs` lists 20 runs unless -n
FIRST_RANK_LINE = re.compile(r"^epoch \d+/\d+")  # linear_ddp's rank 0 prints it after its first epoch
TIMEOUT_S = 3600.0  # one command (an import of 1M points into MLflow takes minutes); a hang is killed and named
STOP_S = 120.0

SIZED_YAML = """\
# A run of a chosen size (benchmarks/scale_store_bench.py): `points` metric points, `per_step` metrics a step, and
# checkpoints (at step 0 and every steps/4) holding a frozen random parameter of `ballast` floats.
image: localhost:5000/harness-cpu:0.1
entry: train.py:train
world_size: 1
seed: 0
threads_per_rank: 1
determinism:
  level: strict
fingerprint_every: 1000000000
checkpoint_every: 250
train:
  points: 10000
  per_step: 10
  ballast: 62500
  lr: 0.01
"""

SIZED_TRAIN = '''\
"""Logs `points` metric points (`per_step` a step) while training a Linear(4, 1) beside a frozen random
parameter of `ballast` floats that every checkpoint holds: a run of chosen points and checkpoint bytes."""

import torch
from torch import nn


class Ballasted(nn.Module):
    def __init__(self, floats, generator):
        super().__init__()
        self.linear = nn.Linear(4, 1)
        # Random, so that neither a bundle nor tar czf compresses the checkpoints away.
        self.ballast = nn.Parameter(torch.randn(floats, generator=generator), requires_grad=False)

    def forward(self, x):
        return self.linear(x)


def train(ctx):
    cfg = ctx.cfg
    gen = torch.Generator().manual_seed(ctx.seed)
    model = ctx.ddp(Ballasted(cfg.ballast, gen))
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=cfg.lr)
    ctx.track(optimizer)
    x, y = torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)
    for step in ctx.steps(cfg.points // cfg.per_step):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        value = loss.item()
        ctx.log({f"m{k}": value + k for k in range(cfg.per_step)}, step)
'''

BASE_RUNS = """\
import sys
from mlflow import MlflowClient
client = MlflowClient(sys.argv[1])
ids = [e.experiment_id for e in client.search_experiments()]
for r in client.search_runs(ids, max_results=int(sys.argv[2]), order_by=["attributes.start_time DESC"]):
    print(r.info.run_id, r.info.status, r.data.tags.get("harness.kind", "-"), r.data.tags.get("harness.git.commit", "-"))
"""

BASE_HISTORY = """\
import sys
from mlflow import MlflowClient
client = MlflowClient(sys.argv[1])
for run in sys.argv[3:]:
    print(run, len(client.get_metric_history(run, sys.argv[2])))
"""

BLANK_STORE = """\
import sys
from mlflow import MlflowClient
MlflowClient(sys.argv[1]).search_experiments()
"""


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def env() -> dict[str, str]:
    """This tree's harness, unbuffered output, no store from the caller's shell (every command names its own)."""
    out = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "PYTHONPATH")}
    return {**out, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}


HARNESS = [sys.executable, "-m", "harness"]


def uri_of(db: Path) -> str:
    return f"sqlite:///{db}"


def check(done: subprocess.CompletedProcess, what: str) -> subprocess.CompletedProcess:
    if done.returncode != 0:
        sys.exit(f"scale_store_bench: {what} exited {done.returncode}:\n{(done.stderr or '')[-3000:]}")
    return done


def call(cmd: list[str], cwd: Path, what: str, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    return check(subprocess.run(cmd, cwd=cwd, env=env(), capture_output=True, text=True, timeout=timeout), what)


def timed(cmd: list[str], cwd: Path, what: str) -> float:
    start = time.perf_counter()
    call(cmd, cwd, what)
    return time.perf_counter() - start


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- stopping what was started, by its PID ------------------------------------------------------------
def _tree(proc: subprocess.Popen) -> list[psutil.Process]:
    try:
        return psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        return []


def stop(proc: subprocess.Popen, group: bool) -> None:
    """SIGTERM to the process (group=True: to its process group, which it leads), then SIGKILL to it and to every
    descendant seen before the signal that is still alive after STOP_S."""
    kids = _tree(proc)
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM) if group else proc.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=STOP_S)
    except subprocess.TimeoutExpired:
        say(f"  pid {proc.pid} still running {STOP_S:.0f} s after SIGTERM: killed")
        proc.kill()
        proc.wait(timeout=30)
    for kid in kids:  # a server's workers, a run's ranks: none outlives its command
        try:
            kid.wait(timeout=10)
        except psutil.TimeoutExpired:
            kid.kill()
        except psutil.Error:
            pass


class Lines:
    """A started process whose stdout and stderr are read line by line in threads; waits for a line that matches."""

    def __init__(self, cmd: list[str], cwd: Path) -> None:
        self.start = time.perf_counter()
        self.proc = subprocess.Popen(cmd, cwd=cwd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, errors="replace", start_new_session=True)
        self.seen: dict[str, list[tuple[float, str]]] = {"out": [], "err": []}
        self._cond = threading.Condition()
        self._readers = [threading.Thread(target=self._read, args=(name, stream), daemon=True)
                         for name, stream in (("out", self.proc.stdout), ("err", self.proc.stderr))]
        for reader in self._readers:
            reader.start()

    def _read(self, name: str, stream) -> None:
        for line in stream:
            with self._cond:
                self.seen[name].append((time.perf_counter(), line.rstrip("\n")))
                self._cond.notify_all()

    def _find(self, stream: str, pattern: re.Pattern[str]) -> tuple[float, str] | None:
        return next(((when, line) for when, line in self.seen[stream] if pattern.search(line)), None)

    def wait_for(self, stream: str, pattern: re.Pattern[str], what: str) -> tuple[float, str]:
        """(perf_counter when it came, the line) of the first line of `stream` matching `pattern`."""
        deadline = self.start + TIMEOUT_S
        while True:
            with self._cond:
                found = self._find(stream, pattern)
                if found is None:
                    self._cond.wait(timeout=0.5)
                    found = self._find(stream, pattern)
            if found is not None:
                return found
            if self.proc.poll() is not None:
                for reader in self._readers:  # its last lines
                    reader.join(timeout=5)
                found = self._find(stream, pattern)
                if found is not None:
                    return found
                tail = "\n".join(line for _, line in self.seen["err"][-30:])
                sys.exit(f"scale_store_bench: {what} exited {self.proc.returncode} before printing "
                         f"{pattern.pattern!r}:\n{tail}")
            if time.perf_counter() > deadline:
                stop(self.proc, group=True)
                sys.exit(f"scale_store_bench: {what} printed no {pattern.pattern!r} within {TIMEOUT_S:.0f} s")


# --- the throwaway repository, the seed run ---------------------------------------------------------
def repository(cache: Path) -> Path:
    """cache/repo: linear_ddp and sized_log, committed (made once)."""
    repo = cache / "repo"
    if (repo / "experiments" / "sized_log" / "train.py").is_file():
        return repo
    if repo.exists():
        shutil.rmtree(repo)
    project(cache)
    sized = repo / "experiments" / "sized_log"
    sized.mkdir(parents=True)
    (sized / "experiment.yaml").write_text(SIZED_YAML)
    (sized / "train.py").write_text(SIZED_TRAIN)
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "sized_log")
    return repo


def run_id_of(done: subprocess.CompletedProcess) -> str:
    return done.stdout.strip().splitlines()[-1].strip()


def seed(cache: Path, repo: Path) -> dict:
    """cache/seed: a store holding one real linear_ddp run of SEED_EPOCHS epochs (made once)."""
    folder = cache / "seed"
    info_file = folder / "seed.json"
    if info_file.is_file():
        return json.loads(info_file.read_text())
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    say(f"seed: harness run experiments/linear_ddp train.epochs={SEED_EPOCHS} ...")
    start = time.perf_counter()
    done = call([*HARNESS, "run", "experiments/linear_ddp", f"train.epochs={SEED_EPOCHS}",
                 "--tracking-uri", uri_of(folder / "mlflow.db")], repo, "harness run (seed)")
    info = {"run_id": run_id_of(done), "build_s": time.perf_counter() - start}
    with sqlite3.connect(folder / "mlflow.db") as db:
        info["start_time"], info["rows"] = db.execute(
            "SELECT r.start_time, (SELECT count(*) FROM metrics m WHERE m.run_uuid = r.run_uuid) FROM runs r "
            "WHERE r.run_uuid = ?", (info["run_id"],)).fetchone()
    info_file.write_text(json.dumps(info))
    return info


# --- a store of N runs, cloned in SQL ----------------------------------------------------------------
RUN_COLUMNS = ("name, source_type, source_name, entry_point_name, user_id, status, start_time, end_time, "
               "source_version, lifecycle_stage, artifact_uri, experiment_id, deleted_time")
CHILD_TABLES = {  # table -> its columns other than run_uuid
    "tags": "key, value",
    "params": "key, value",
    "latest_metrics": "key, value, timestamp, step, is_nan",
    "metrics": "key, value, timestamp, step, is_nan",
}
CLONE_BATCH = 250


def store(cache: Path, n: int, seeded: dict) -> dict:
    """cache/<n>/mlflow.db: the seed's store with its run cloned n-1 times (made once; kept while seed.json is)."""
    folder = cache / str(n)
    info_file = folder / "store.json"
    if info_file.is_file():
        info = json.loads(info_file.read_text())
        if info.get("seed") == seeded["run_id"]:
            return info
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    building = folder / "mlflow.db.building"
    start = time.perf_counter()
    shutil.copyfile(cache / "seed" / "mlflow.db", building)
    original = seeded["run_id"]
    db = sqlite3.connect(building)
    try:
        # A benchmark's copy: no journal, no fsync (a build cut short is thrown away and made again).
        db.execute("PRAGMA journal_mode=OFF")
        db.execute("PRAGMA synchronous=OFF")
        db.execute("PRAGMA cache_size=-262144")  # 256 MiB
        clones = [uuid.uuid4().hex for _ in range(n - 1)]
        first = clones[:1]
        for at in range(0, len(clones), CLONE_BATCH):
            batch = clones[at:at + CLONE_BATCH]
            # Each clone a second older than the one before: the original stays the newest run.
            rows = [(new, -(at + i + 1) * 1000, original) for i, new in enumerate(batch)]
            with db:
                db.executemany(
                    f"INSERT INTO runs (run_uuid, {RUN_COLUMNS}) SELECT :new, name, source_type, source_name, "
                    "entry_point_name, user_id, status, start_time + :shift, end_time + :shift, source_version, "
                    "lifecycle_stage, artifact_uri, experiment_id, deleted_time FROM runs WHERE run_uuid = :old",
                    [{"new": new, "shift": shift, "old": old} for new, shift, old in rows])
                for name, columns in CHILD_TABLES.items():
                    db.executemany(f"INSERT INTO {name} ({columns}, run_uuid) SELECT {columns}, ? FROM {name} "
                                   "WHERE run_uuid = ?", [(new, original) for new in batch])
            if (at // CLONE_BATCH) % 8 == 7 or at + CLONE_BATCH >= len(clones):
                say(f"  store {n}: {min(at + CLONE_BATCH, len(clones)) + 1:,} runs "
                    f"({time.perf_counter() - start:.0f} s)")
        rows = db.execute("SELECT count(*) FROM metrics").fetchone()[0]
        runs = db.execute("SELECT count(*) FROM runs").fetchone()[0]
    finally:
        db.close()
    os.replace(building, folder / "mlflow.db")
    info = {"seed": original, "runs": runs, "rows": rows, "clone": first[0] if first else original,
            "build_s": time.perf_counter() - start, "bytes": (folder / "mlflow.db").stat().st_size}
    info_file.write_text(json.dumps(info))
    return info


def local_path(artifact_uri: str) -> Path | None:
    parts = urlsplit(artifact_uri)
    return Path(unquote(parts.path)) if parts.scheme == "file" else None


def prune(db_file: Path, newest: int, cache: Path) -> int:
    """Delete every run started after `newest` (what a timed replay or run made) from the store, rows and artifact
    folder: the store keeps the size it is measured at. Returns how many."""
    db = sqlite3.connect(db_file, timeout=60)
    try:
        made = db.execute("SELECT run_uuid, artifact_uri FROM runs WHERE start_time > ?", (newest,)).fetchall()
        if not made:
            return 0
        ids = [(run,) for run, _ in made]
        with db:
            for name in CHILD_TABLES:
                db.executemany(f"DELETE FROM {name} WHERE run_uuid = ?", ids)
            db.executemany("DELETE FROM runs WHERE run_uuid = ?", ids)
    finally:
        db.close()
    for run, artifact_uri in made:
        path = local_path(artifact_uri or "")
        if path is not None and path.name == "artifacts" and path.parent.name == run and cache in path.parents:
            shutil.rmtree(path.parent, ignore_errors=True)
    return len(made)


# --- the store axis's measurements --------------------------------------------------------------------
def ui_harness(db: Path, cwd: Path) -> float:
    """`harness ui` until the link it prints answers HTTP 200; then stopped by its PID (it stops its server)."""
    port = free_port()
    ui = Lines([*HARNESS, "ui", "--port", str(port), "--tracking-uri", uri_of(db)], cwd)
    try:
        _, link = ui.wait_for("out", re.compile(r"^https?://"), "harness ui")
        answered = poll(link.strip(), ui.start, ui.proc, "harness ui")
    finally:
        stop(ui.proc, group=False)  # SIGTERM: harness ui stops its server's process group itself
    return answered


def ui_mlflow(db: Path, cwd: Path) -> float:
    """`mlflow ui --backend-store-uri` until / answers HTTP 200; then its process group is stopped."""
    port = free_port()
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri_of(db),
                             "--port", str(port)], cwd=cwd, env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        return poll(f"http://127.0.0.1:{port}/", start, proc, "mlflow ui")
    finally:
        stop(proc, group=True)


def poll(url: str, start: float, proc: subprocess.Popen, what: str) -> float:
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as answer:
                if answer.status == 200:
                    return time.perf_counter() - start
        except (OSError, urllib.error.URLError):
            pass
        if proc.poll() is not None:
            sys.exit(f"scale_store_bench: {what} exited {proc.returncode} before {url} answered")
        if time.perf_counter() - start > TIMEOUT_S:
            sys.exit(f"scale_store_bench: {what} did not answer at {url} within {TIMEOUT_S:.0f} s")
        time.sleep(0.05)


def first_rank_line(cmd: list[str], repo: Path, what: str) -> float:
    """Seconds from the start of `cmd` to rank 0's first line on its stderr; then it is stopped (SIGTERM)."""
    job = Lines(cmd, repo)
    try:
        when, _ = job.wait_for("err", FIRST_RANK_LINE, what)
    finally:
        stop(job.proc, group=False)  # harness stops its ranks and closes the run KILLED
    return when - job.start


def store_variants(db: Path, a: str, b: str, repo: Path, work: Path, cache: Path, newest: int) -> dict:
    """Each measurement on one store, harness's and its baseline's (key "<name> base")."""
    uri = uri_of(db)

    def start_of(cmd: list[str], what: str) -> float:
        try:
            return first_rank_line(cmd, repo, what)
        finally:
            prune(db, newest, cache)

    return {
        "runs": lambda: timed([*HARNESS, "runs", "--tracking-uri", uri], work, "harness runs"),
        "runs base": lambda: timed([sys.executable, "-c", BASE_RUNS, uri, str(LIST)], work, "search_runs"),
        "compare": lambda: timed([*HARNESS, "compare", a, b, "--tracking-uri", uri], work, "harness compare"),
        "compare base": lambda: timed([sys.executable, "-c", BASE_HISTORY, uri, "loss", a, b], work,
                                      "get_metric_history"),
        "ui": lambda: ui_harness(db, work),
        "ui base": lambda: ui_mlflow(db, work),
        "replay": lambda: start_of([*HARNESS, "replay", a, "--tracking-uri", uri], "harness replay"),
        "replay base": lambda: start_of([*HARNESS, "run", "experiments/linear_ddp", f"train.epochs={SEED_EPOCHS}",
                                         "--tracking-uri", uri], "harness run"),
    }


def store_axes(cache: Path, repo: Path, sizes: tuple[int, ...], rounds: int) -> tuple[list[Axis], list[str]]:
    seeded = seed(cache, repo)
    axes = {
        "runs": Axis("store: `harness runs`", f"whole process, {LIST} runs listed",
                     f"MlflowClient.search_runs(max_results={LIST}) in a subprocess"),
        "compare": Axis("store: `harness compare A B`", "whole process, 2 runs of 1,000 steps",
                        "MlflowClient.get_metric_history of `loss`, both runs, in a subprocess"),
        "ui": Axis("store: `harness ui`", "start to the printed link's first HTTP 200",
                   "`mlflow ui --backend-store-uri` start to / answering 200"),
        "replay": Axis("store: `harness replay` start", "start to rank 0's first line (then SIGTERM)",
                       "`harness run` of the same experiment on the same store, start to rank 0's first line"),
    }
    notes = [f"seed run: `harness run experiments/linear_ddp train.epochs={SEED_EPOCHS}` ({seeded['rows']:,} metric "
             f"rows) made in {seeded['build_s']:.0f} s"]
    work = cache / "work"
    work.mkdir(exist_ok=True)
    for n in sizes:
        made = store(cache, n, seeded)
        notes.append(f"store of {made['runs']:,} runs / {made['rows']:,} metric rows ({made['bytes'] / 2**30:.2f} GiB): "
                     f"built in {made['build_s']:.0f} s")
        db = cache / str(n) / "mlflow.db"
        a, b = seeded["run_id"], made["clone"]
        prune(db, seeded["start_time"], cache)  # a run left by an earlier, interrupted invocation
        say(f"store of {n:,} runs: {rounds} round(s)")

        got = interleaved(store_variants(db, a, b, repo, work, cache, seeded["start_time"]), rounds)
        label = f"{made['runs']:,} runs / {made['rows'] / 1e6:g}M rows"
        for key, axis in axes.items():
            axis.add(made["runs"], label, statistics.median(got[key]), statistics.median(got[f"{key} base"]))
            say(f"  {key}: harness {statistics.median(got[key]):.2f} s, baseline "
                f"{statistics.median(got[f'{key} base']):.2f} s (rounds: "
                f"{', '.join(f'{x:.2f}' for x in got[key])} / {', '.join(f'{x:.2f}' for x in got[f'{key} base'])})")
    return list(axes.values()), notes


# --- the bundle axis ----------------------------------------------------------------------------------
def bundle_run(cache: Path, repo: Path, points: int, checkpoint_bytes: int) -> dict:
    """cache/bundle-<points>-<bytes>: a store holding one real sized_log run of that size (made once)."""
    folder = cache / f"bundle-{points}-{checkpoint_bytes}"
    info_file = folder / "run.json"
    if info_file.is_file():
        return json.loads(info_file.read_text())
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    steps = points // PER_STEP
    ballast = max(1, (checkpoint_bytes // CHECKPOINTS - CHECKPOINT_OVERHEAD) // 4)
    say(f"bundle run: {points:,} points, {checkpoint_bytes / MB:g} MB of checkpoints ...")
    start = time.perf_counter()
    done = call([*HARNESS, "run", "experiments/sized_log", f"train.points={points}", f"train.per_step={PER_STEP}",
                 f"train.ballast={ballast}", f"checkpoint_every={max(1, steps // CHECKPOINTS)}",
                 "--tracking-uri", uri_of(folder / "mlflow.db")], repo, "harness run (sized_log)")
    run_id = run_id_of(done)
    with sqlite3.connect(folder / "mlflow.db") as db:
        artifact_uri, = db.execute("SELECT artifact_uri FROM runs WHERE run_uuid = ?", (run_id,)).fetchone()
        rows, = db.execute("SELECT count(*) FROM metrics WHERE run_uuid = ?", (run_id,)).fetchone()
    artifacts = local_path(artifact_uri)
    files = [p for p in artifacts.rglob("*") if p.is_file()]
    info = {"run_id": run_id, "db": str(folder / "mlflow.db"), "artifacts": str(artifacts), "points": rows,
            "build_s": time.perf_counter() - start,
            "checkpoint_bytes": sum(p.stat().st_size for p in files if "checkpoints" in p.relative_to(artifacts).parts),
            "artifact_bytes": sum(p.stat().st_size for p in files)}
    info_file.write_text(json.dumps(info))
    return info


def blank_store(cache: Path) -> Path:
    """cache/blank/mlflow.db: an empty store as MLflow makes it (copied for every import)."""
    db = cache / "blank" / "mlflow.db"
    if not db.is_file():
        db.parent.mkdir(parents=True, exist_ok=True)
        call([sys.executable, "-c", BLANK_STORE, uri_of(db.with_suffix(".making"))], db.parent, "MLflow (blank store)")
        os.replace(db.with_suffix(".making"), db)
    return db


def fresh(folder: Path) -> Path:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return folder


def bundle_variants(made: dict, artifacts: Path, out: Path, tarred: Path, uri: str, repo: Path, work: Path,
                    blank: Path) -> dict:
    """harness export / import of the run, tar czf / xzf of its artifact folder."""

    def harness_export() -> float:
        out.unlink(missing_ok=True)
        return timed([*HARNESS, "export", made["run_id"], "-o", str(out), "--with-checkpoints", "--tracking-uri", uri],
                     repo, "harness export")

    def tar_c() -> float:
        tarred.unlink(missing_ok=True)
        return timed(["tar", "czf", str(tarred), "-C", str(artifacts.parent), artifacts.name], work, "tar czf")

    def harness_import() -> float:
        target = fresh(work / "import")
        shutil.copyfile(blank, target / "mlflow.db")
        try:
            return timed([*HARNESS, "import", str(out), "--tracking-uri", uri_of(target / "mlflow.db")], target,
                         "harness import")
        finally:
            shutil.rmtree(target, ignore_errors=True)

    def tar_x() -> float:
        target = fresh(work / "untar")
        try:
            return timed(["tar", "xzf", str(tarred), "-C", str(target)], target, "tar xzf")
        finally:
            shutil.rmtree(target, ignore_errors=True)

    return {"export": harness_export, "tar czf": tar_c, "import": harness_import, "tar xzf": tar_x}


def bundle_axes(cache: Path, repo: Path, sizes: tuple[tuple[int, int], ...], rounds: int) -> tuple[list[Axis], list[str]]:
    export = Axis("bundle: `harness export`", "`export RUN -o F --with-checkpoints`, whole process",
                  "`tar czf` of the run's artifact folder (series, checkpoints, all)")
    imp = Axis("bundle: `harness import`", "`import F` into an existing empty store, whole process",
               "`tar xzf` of that tar.gz")
    notes = []
    blank = blank_store(cache)
    work = cache / "work"
    for points, checkpoint_bytes in sizes:
        made = bundle_run(cache, repo, points, checkpoint_bytes)
        artifacts = Path(made["artifacts"])
        out = work / "bundle" / "run.tar.gz"
        tarred = work / "bundle" / "artifacts.tar.gz"
        out.parent.mkdir(parents=True, exist_ok=True)
        uri = uri_of(Path(made["db"]))
        say(f"bundle of {points:,} points: {rounds} round(s)")

        variants = bundle_variants(made, artifacts, out, tarred, uri, repo, work, blank)
        got = interleaved({k: variants[k] for k in ("export", "tar czf")}, rounds)
        notes.append(f"bundle run of {made['points']:,} points + {made['checkpoint_bytes'] / MB:.1f} MB checkpoints "
                     f"({made['artifact_bytes'] / MB:.1f} MB of artifacts): made in {made['build_s']:.0f} s; its bundle "
                     f"{out.stat().st_size / MB:.1f} MB, its artifacts' tar.gz {tarred.stat().st_size / MB:.1f} MB")
        got.update(interleaved({k: variants[k] for k in ("import", "tar xzf")}, rounds))
        label = f"{made['points'] / 1000:g}k points + {made['checkpoint_bytes'] / MB:.3g} MB"
        export.add(made["points"], label, statistics.median(got["export"]), statistics.median(got["tar czf"]))
        imp.add(made["points"], label, statistics.median(got["import"]), statistics.median(got["tar xzf"]))
        for key, base in (("export", "tar czf"), ("import", "tar xzf")):
            say(f"  {key}: harness {statistics.median(got[key]):.2f} s, {base} {statistics.median(got[base]):.2f} s "
                f"(rounds: {', '.join(f'{x:.2f}' for x in got[key])} / {', '.join(f'{x:.2f}' for x in got[base])})")
        out.unlink(missing_ok=True)
        tarred.unlink(missing_ok=True)
    return [export, imp], notes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, 1 round: checks that the script works")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds per size (default 3; --quick 1)")
    parser.add_argument("--axes", default="store,bundle", help="which axes: store, bundle or both (default)")
    parser.add_argument("--cache", type=Path, default=CACHE, help=f"built stores and runs (default {CACHE})")
    opts = parser.parse_args()
    rounds = opts.rounds or (1 if opts.quick else 3)
    cache = opts.cache.resolve()
    cache.mkdir(parents=True, exist_ok=True)
    wanted = set(opts.axes.split(","))
    begun = os.getloadavg()
    say(f"load average at the start: {begun[0]:.2f} {begun[1]:.2f} {begun[2]:.2f}")
    repo = repository(cache)
    axes: list[Axis] = []
    notes: list[str] = []
    if "store" in wanted:
        got, said = store_axes(cache, repo, QUICK_STORE_SIZES if opts.quick else STORE_SIZES, rounds)
        axes += got
        notes += said
    if "bundle" in wanted:
        got, said = bundle_axes(cache, repo, QUICK_BUNDLE_SIZES if opts.quick else BUNDLE_SIZES, rounds)
        axes += got
        notes += said
    title = (f"`python benchmarks/scale_store_bench.py{' --quick' if opts.quick else ''} --rounds {rounds}`: medians "
             f"of {rounds} interleaved round(s), wall seconds, {os.cpu_count()} cores; load average at the start "
             f"{begun[0]:.2f} {begun[1]:.2f} {begun[2]:.2f}\n")
    print(table(axes, title))
    print()
    for axis in axes:
        grows = exponent(axis.sizes, axis.harness)
        print(f"- {axis.name}: harness's growth exponent {grows:.2f} "
              f"({'no faster than linear' if grows <= 1 + LINEAR_SLACK else 'FASTER THAN LINEAR'}; "
              f"baseline {exponent(axis.sizes, axis.base):.2f})")
    runs = next((a for a in axes if a.name.startswith("store: `harness runs`")), None)
    if runs is not None:
        print(f"- goal `harness runs` under 1 s at the largest store ({runs.size_labels[-1]}): "
              f"{runs.harness[-1]:.2f} s, {'met' if runs.harness[-1] < 1.0 else 'NOT met'}")
    for note in notes:
        print(f"- {note}")


if __name__ == "__main__":
    main()
