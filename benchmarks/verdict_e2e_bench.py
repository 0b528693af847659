"""The rounding envelope end to end: false alarms and power of `WITHIN_ROUNDING` through the real CLI.

    python benchmarks/verdict_e2e_bench.py [--trials 3] [--experiments linear_ddp digits_cnn] [--members 8]
        [--docker IMAGE | --no-docker] [--only TEXT...]

benchmarks/verdict_bench.py --rounding measures the envelope (harness/judge/rounding.py) on models trained in its own
process. This is the same question asked as a user asks it, of the bundled experiments: each trial, in a throwaway
git repository and SQLite store, `harness run experiments/X seed=S train.epochs=E` (another seed per trial, a run
of 23-25 steps), `harness calibrate RUN --members K --steps <all the run's steps>`, then `harness replay RUN` once
per change below; the verdict is the replay's `verdict:` line.

Honest changes alter the arithmetic, not the training - what another machine does - and must be `BITWISE` or
`WITHIN_ROUNDING` (anything else is a false alarm): another CPU's ATen kernels (`ATEN_CPU_CAPABILITY=default`, and
`avx2` where this CPU has AVX-512), its BLAS (`MKL_ENABLE_INSTRUCTIONS=AVX2`) and oneDNN (`DNNL_MAX_CPU_ISA=AVX2`: torch
has no variable that turns oneDNN off, so its kernels are limited to an AVX2 CPU's instead), 2 threads per rank
instead of 1 (`--allow-changes threads_per_rank=2`), for linear_ddp a run in world-size-invariant mode
(`determinism.world_size_invariant=true determinism.shards=2`, run and calibrated on its own) replayed on 1 rank, and
the Docker CPU image against the host: the run, recorded and calibrated on this machine (local executor) with the
experiment pinned to IMAGE, replayed in that image (`harness replay RUN --executor docker`: the recorded digest, its
own Python and packages, the same torch). That row needs a Docker engine that has IMAGE with a registry digest
(scripts/docker-up.sh, then docker/build-cpu-image.sh --push IMAGE from this checkout) and an image holding this
checkout's harness; otherwise the bench says why it is not measured and leaves it out (`--no-docker`: never).
Planted changes alter the training and must be `DIVERGED` (anything else is a miss): the learning rate x1.02 and x1.1,
one sample more (linear_ddp), and for digits_cnn dropout p +0.01, momentum +0.01, the augmentation's pixel noise x1.1
or its shift 1 -> 2, 1% of the training images moved to validation (`val_fraction` +0.01), and another draw of the
augmentation (2 loader workers instead of 1: each worker draws from its own seed). Neither experiment has a weight
decay to turn off.

Rates are alarms (honest) or catches (planted) per trial with Clopper-Pearson 95% intervals, then the verdicts
seen and how close to the envelope's edge the honest replays came. The commands run under the kept rank server
(HARNESS_RANK_SERVER_IDLE_S=120: one torch import per environment, not per launch), stopped at the end. The replays
of one change follow each other across experiments, so a change's environment starts one server, not two.
`--jsonl FILE` appends every verdict to FILE; `--table FILE...` prints the table of such files (runs with
different `--first-seed` pool into one table); `--only TEXT...` runs only the changes whose name holds one of them
(`--only Docker`: the originals and their calibrations, then the Docker row alone).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchrepo import project  # benchmarks/, on sys.path when run as a script
from scipy.stats import binomtest

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = ("linear_ddp", "digits_cnn")
# A run of 23-25 steps: linear_ddp 100 samples / (2 ranks x 10) = 5 steps an epoch; digits_cnn 1438 training images
# / (2 ranks x 32) = 23 steps an epoch.
EPOCHS = {"linear_ddp": 5, "digits_cnn": 1}
INVARIANT = ["determinism.world_size_invariant=true", "determinism.shards=2"]
IMAGE = "localhost:5000/harness-cpu:0.1"  # what the experiments pin, and the tests build (docker/README.md)
RUN_TIMEOUT_S = 1200
REPLAY_TIMEOUT_S = 1200
IDLE_S = "120"


@dataclass(frozen=True)
class Change:
    name: str
    honest: bool
    env: dict[str, str] = field(default_factory=dict)
    args: tuple[str, ...] = ()
    # Config key -> new value as a function of the recorded one (a planted change of the experiment's config).
    overrides: dict[str, Callable[[Any], Any]] = field(default_factory=dict)
    only: tuple[str, ...] = EXPERIMENTS
    invariant: bool = False  # replays the trial's world-size-invariant run instead of the plain one
    docker: bool = False  # replays in the pinned image: needs the engine


def changes(capability: str, docker: bool = False) -> list[Change]:
    found = [Change("ATEN_CPU_CAPABILITY=default", True, env={"ATEN_CPU_CAPABILITY": "default"})]
    if capability.startswith("AVX512"):
        found.append(Change("ATEN_CPU_CAPABILITY=avx2", True, env={"ATEN_CPU_CAPABILITY": "avx2"}))
    found += [
        Change("MKL_ENABLE_INSTRUCTIONS=AVX2 (BLAS)", True, env={"MKL_ENABLE_INSTRUCTIONS": "AVX2"}),
        Change("DNNL_MAX_CPU_ISA=AVX2 (oneDNN)", True, env={"DNNL_MAX_CPU_ISA": "AVX2"}),
        Change("threads per rank 1 -> 2", True, overrides={"threads_per_rank": lambda v: 2}),
        Change("world size 2 -> 1 (invariant mode, shards=2)", True, args=("--world-size", "1"), only=("linear_ddp",),
               invariant=True),
        *([Change("Docker CPU image vs the host (replay --executor docker)", True, args=("--executor", "docker"),
                  docker=True)] if docker else []),
        Change("lr x1.02", False, overrides={"train.lr": lambda v: v * 1.02}),
        Change("lr x1.1", False, overrides={"train.lr": lambda v: v * 1.1}),
        Change("one sample more (100 -> 101)", False, overrides={"train.samples": lambda v: v + 1},
               only=("linear_ddp",)),
        Change("dropout p +0.01", False, overrides={"train.dropout": lambda v: v + 0.01}, only=("digits_cnn",)),
        Change("momentum +0.01", False, overrides={"train.momentum": lambda v: v + 0.01}, only=("digits_cnn",)),
        Change("augmentation noise x1.1", False, overrides={"train.noise": lambda v: v * 1.1}, only=("digits_cnn",)),
        Change("augmentation shift 1 -> 2", False, overrides={"train.max_shift": lambda v: v + 1},
               only=("digits_cnn",)),
        Change("1% of training images to validation", False, overrides={"train.val_fraction": lambda v: v + 0.01},
               only=("digits_cnn",)),
        Change("another augmentation draw (2 loader workers)", False, overrides={"train.num_workers": lambda v: 2},
               only=("digits_cnn",)),
    ]
    return found


def recorded(experiment: str) -> dict:
    import yaml

    return yaml.safe_load((ROOT / "experiments" / experiment / "experiment.yaml").read_text())


def value_of(cfg: dict, dotted: str) -> Any:
    found: Any = cfg
    for part in dotted.split("."):
        found = found[part]
    return found


def override(change: Change, experiment: str) -> list[str]:
    cfg = recorded(experiment)
    out = []
    for key, new in change.overrides.items():
        value = new(value_of(cfg, key))
        out.append(f"{key}={round(value, 12) if isinstance(value, float) else value}")
    return out


# --- the CLI ---------------------------------------------------------------------------------------------------------
@dataclass
class Done:
    rc: int
    stdout: str
    stderr: str
    seconds: float


def harness(repo: Path, store: Path, args: list[str], env: dict[str, str] | None = None,
            timeout: float = REPLAY_TIMEOUT_S) -> Done:
    full = {**os.environ, **(env or {}), "MLFLOW_TRACKING_URI": f"sqlite:///{store / 'mlflow.db'}",
            "HARNESS_RANK_SERVER_IDLE_S": IDLE_S,
            "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "harness", *args], cwd=repo, env=full, capture_output=True,
                              text=True, timeout=timeout)
        return Done(proc.returncode, proc.stdout, proc.stderr, time.perf_counter() - start)
    except subprocess.TimeoutExpired as err:
        out = err.stdout.decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        return Done(124, out, f"timed out after {timeout} s", time.perf_counter() - start)


def last_lines(done: Done, n: int) -> list[str]:
    return done.stdout.strip().splitlines()[-n:]


def must(done: Done, what: str) -> str:
    if done.rc != 0:
        raise SystemExit(f"{what} failed ({done.rc}):\n{done.stderr[-3000:]}")
    return last_lines(done, 1)[0].strip()


def steps_of(store: Path, run_id: str) -> int:
    from harness.judge.compare import original_steps
    from harness.store.tracking import Tracker

    tracker = Tracker(f"sqlite:///{store / 'mlflow.db'}")
    return original_steps(tracker.load_record(run_id))


def original(repo: Path, store: Path, experiment: str, seed: int, members: int, extra: list[str]) -> str:
    run_id = must(harness(repo, store, ["run", f"experiments/{experiment}", f"seed={seed}",
                                        f"train.epochs={EPOCHS[experiment]}", *extra], timeout=RUN_TIMEOUT_S),
                  f"harness run {experiment} seed={seed}")
    steps = steps_of(store, run_id)
    cal_id = must(harness(repo, store, ["calibrate", run_id, "--members", str(members), "--steps", str(steps)],
                          timeout=RUN_TIMEOUT_S + members * REPLAY_TIMEOUT_S), f"harness calibrate {run_id}")
    print(f"  seed {seed} {experiment} {' '.join(extra)} calibrated, members' kernels as their records read them "
          f"back: {kernels_ran(store, cal_id)}", file=sys.stderr, flush=True)
    return run_id


def kernels_ran(store: Path, cal_id: str) -> str:
    """How many of calibration `cal_id`'s members ran on which kernels, as each member's record read them back in its
    ranks (torch.backends.mkldnn.enabled, torch.get_num_threads()), not as they were asked for."""
    from collections import Counter

    from harness import tags as T
    from harness.store.tracking import Tracker

    members = Tracker(f"sqlite:///{store / 'mlflow.db'}").children(cal_id)
    seen = Counter((m.tags.get(T.CALIBRATION_KERNELS, "?"), m.tags.get(f"{T.DETERMINISM_PREFIX}onednn_enabled", "?"),
                    m.tags.get(f"{T.DETERMINISM_PREFIX}intra_op_threads", "?")) for m in members)
    return "; ".join(f"{n} x {kind} (read back: oneDNN enabled {on}, threads {threads})"
                     for (kind, on, threads), n in sorted(seen.items()))


VERDICT = re.compile(r"verdict: ([A-Z_]+)")
HALF_WIDTH = re.compile(r"at most ([0-9.e+-]+)x its half-width")
AT_STEP = re.compile(r"DIVERGED at step (\d+)")


def replay(repo: Path, store: Path, run_id: str, change: Change, experiment: str) -> dict:
    args = ["replay", run_id, *change.args]
    sets = override(change, experiment)
    if sets:
        args += ["--allow-changes", *sets]
    done = harness(repo, store, args, env=change.env)
    line = next((x for x in reversed(done.stdout.splitlines()) if x.startswith("verdict:")), "")
    found = VERDICT.match(line)
    verdict = found.group(1) if found else f"ERROR(rc {done.rc})"
    error = "" if found else (done.stderr.strip().splitlines() or [""])[-1]
    if not found:
        print(f"  {experiment} {change.name}: no verdict (rc {done.rc}): {done.stderr[-1500:]}", file=sys.stderr)
    width, step = HALF_WIDTH.search(line), AT_STEP.search(line)
    return {"experiment": experiment, "change": change.name, "honest": change.honest, "verdict": verdict,
            "error": error,
            "half_width": float(width.group(1)) if width else None, "step": int(step.group(1)) if step else None,
            "seconds": round(done.seconds, 1), "line": line, "overrides": sets, "env": change.env}


def alarm(row: dict) -> bool:
    """An honest replay not called the same training, or a planted one caught."""
    return row["verdict"] not in ("BITWISE", "WITHIN_ROUNDING") if row["honest"] else row["verdict"] == "DIVERGED"


# --- the table -------------------------------------------------------------------------------------------------------
def rate(hits: int, n: int) -> str:
    if not n:
        return "-"
    ci = binomtest(hits, n).proportion_ci(0.95, method="exact")
    return f"{hits}/{n} = {hits / n:.1%} [{ci.low:.1%}, {ci.high:.1%}]"


def table(rows: list[dict], experiments: list[str]) -> str:
    names = list(dict.fromkeys(r["change"] for r in rows))
    honest = {r["change"]: r["honest"] for r in rows}
    out = ["| change | kind | " + " | ".join(experiments) + " |", ("| --- | --- | " + "--- | " * len(experiments)).rstrip()]
    detail = ["| change | " + " | ".join(experiments) + " |", ("| --- | " + "--- | " * len(experiments)).rstrip()]
    for name in sorted(names, key=lambda n: not honest[n]):  # honest first, in their order
        cells, seen = [], []
        for experiment in experiments:
            mine = [r for r in rows if r["change"] == name and r["experiment"] == experiment]
            cells.append(rate(sum(alarm(r) for r in mine), len(mine)))
            counts = {v: sum(r["verdict"] == v for r in mine) for v in dict.fromkeys(r["verdict"] for r in mine)}
            text = ", ".join(f"{v} {n}" for v, n in counts.items()) or "-"
            widths = [r["half_width"] for r in mine if r["half_width"] is not None]
            at = sorted(r["step"] for r in mine if r["step"] is not None)
            if honest[name] and widths:
                text += f"; at most {max(widths):.3g}x the half-width"
            if not honest[name] and at:
                text += f"; first step outside {at[0]}-{at[-1]}"
            seen.append(text)
        kind = "honest: false alarm" if honest[name] else "planted: power"
        out.append(f"| {name} | {kind} | " + " | ".join(cells) + " |")
        detail.append(f"| {name} | " + " | ".join(seen) + " |")
    return "\n".join(out) + "\n\nVerdicts seen:\n\n" + "\n".join(detail)


def stop_servers() -> None:
    subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; from harness.executors import "
                    "rankserver; rankserver.stop_all(Path(sys.argv[1]))", str(ROOT / "harness")],
                   env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120, check=False)


def capability() -> str:
    return subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                          capture_output=True, text=True, timeout=300, check=True).stdout.strip()


# The digest of the harness package's Python source where it is installed, run here and inside the image.
SOURCE_DIGEST = (
    "import hashlib, importlib.util, pathlib; "
    "root = pathlib.Path(importlib.util.find_spec('harness').submodule_search_locations[0]); h = hashlib.sha256(); "
    "[h.update(str(p.relative_to(root)).encode() + b'\\0' + p.read_bytes()) for p in sorted(root.rglob('*.py'))]; "
    "print(h.hexdigest())"
)


def not_in_image(store: Path, run_id: str) -> str:
    """Why run `run_id` cannot be replayed in its image now ("" when it can): the engine is down, or it was as the
    run was recorded, which then recorded no image digest (harness refuses such a replay, exit 2)."""
    from harness import tags as T
    from harness.store.tracking import Tracker
    from harness.systems import docker

    up, why = docker.engine_available()
    if not up:
        return f"the Docker engine stopped answering ({why})"
    tags = Tracker(f"sqlite:///{store / 'mlflow.db'}").get_run(run_id).tags
    if not tags.get(T.IMAGE_DIGEST, "").startswith("sha256:"):
        return f"the run recorded no image digest ({tags.get(T.IMAGE_DIGEST_REASON, 'unknown')})"
    return ""


def docker_image(image: str) -> tuple[str | None, str]:
    """(digest, "") when the Docker row can be measured with `image`; else (None, why not)."""
    sys.path.insert(0, str(ROOT))
    from harness.systems import docker

    up, why = docker.engine_available()
    if not up:
        return None, f"no Docker engine answers ({why}); start one with scripts/docker-up.sh STATE_DIR"
    digest, _, reason = docker.local_digest_or_reason(image)
    if digest is None:
        return None, (f"{image}: {reason}; build and push it from this checkout: docker/build-cpu-image.sh --push "
                      f"{image}")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    here = subprocess.run([sys.executable, "-c", SOURCE_DIGEST], capture_output=True, text=True, env=env,
                          timeout=120, check=True).stdout.strip()
    inside = subprocess.run(["docker", "run", "--rm", image, "python", "-c", SOURCE_DIGEST],
                            capture_output=True, text=True, timeout=600, check=False)
    if inside.returncode != 0 or inside.stdout.strip() != here:
        found = inside.stderr.strip()[-200:] or "its source differs"
        return None, f"{image} holds another harness than this checkout ({found}); rebuild it: " \
                     f"docker/build-cpu-image.sh --push {image}"
    return digest, ""


def trial(seed: int, experiments: list[str], members: int, todo: list[Change], jsonl: Path | None,
          pin: list[str]) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="verdict-e2e-") as tmp:
        store = Path(tmp) / "store"
        store.mkdir()
        repo = project(Path(tmp), tuple(experiments))
        runs = {(e, False): original(repo, store, e, seed, members, pin) for e in experiments}
        if any(c.invariant for c in todo):
            runs.update({(e, True): original(repo, store, e, seed, members, [*pin, *INVARIANT]) for e in experiments
                         if any(c.invariant and e in c.only for c in todo)})
        for change in todo:
            for experiment in experiments:
                if experiment not in change.only:
                    continue
                why = change.docker and not_in_image(store, runs[experiment, change.invariant])
                if why:
                    # Not a verdict of harness's to count: the engine went away (stopped by whoever started it).
                    print(f"  seed {seed} {experiment} {change.name}: NOT MEASURED, {why}", file=sys.stderr,
                          flush=True)
                    continue
                row = replay(repo, store, runs[experiment, change.invariant], change, experiment)
                row["seed"] = seed
                rows.append(row)
                print(f"  seed {seed} {experiment} {change.name}: {row['line'] or row['verdict']} "
                      f"({row['seconds']} s)", file=sys.stderr, flush=True)
                if jsonl is not None:
                    with jsonl.open("a") as f:
                        f.write(json.dumps(row) + "\n")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=3, help="runs per experiment, each with its own seed")
    parser.add_argument("--experiments", nargs="+", choices=EXPERIMENTS, default=list(EXPERIMENTS))
    parser.add_argument("--members", type=int, default=8, help="calibration members (harness calibrate --members)")
    parser.add_argument("--first-seed", type=int, default=1000, help="trial t runs seed first-seed + t")
    parser.add_argument("--jsonl", type=Path, help="append every replay's verdict to this file")
    parser.add_argument("--table", type=Path, nargs="+", help="only print the table of these --jsonl files")
    parser.add_argument("--docker", metavar="IMAGE", default=IMAGE,
                        help=f"the image of the Docker row: the runs pin it, one replay runs in it (default {IMAGE})")
    parser.add_argument("--no-docker", action="store_true", help="leave the Docker row out")
    parser.add_argument("--only", nargs="+", metavar="TEXT", help="only the changes whose name holds one of these")
    args = parser.parse_args(argv)
    if args.table:
        rows = [json.loads(line) for path in args.table for line in path.read_text().splitlines() if line.strip()]
        seeds = sorted({r["seed"] for r in rows})
        print(f"{len(seeds)} trials (seeds {seeds[0]}-{seeds[-1]})\n\n" + table(rows, args.experiments))
        return 0
    cap = capability()
    digest, why = (None, "--no-docker") if args.no_docker else docker_image(args.docker)
    docker_note = (f"Docker row: {args.docker} ({digest}), the runs pin it" if digest else
                   f"Docker row NOT MEASURED: {why}")
    print(docker_note, file=sys.stderr, flush=True)
    todo = [c for c in changes(cap, docker=digest is not None) if not args.only or any(t in c.name for t in args.only)]
    if not todo:
        parser.error(f"--only {' '.join(args.only)}: no change's name holds any of these")
    pin = [f"image={args.docker}"] if digest else []
    start, rows = time.perf_counter(), []
    try:
        for t in range(args.trials):
            seed = args.first_seed + t
            rows += trial(seed, args.experiments, args.members, todo, args.jsonl, pin)
            print(f"trial {t + 1}/{args.trials} (seed {seed}) done at {time.perf_counter() - start:.0f} s",
                  file=sys.stderr, flush=True)
    finally:
        stop_servers()
    wall = time.perf_counter() - start
    print(f"\n{args.trials} trials (seeds {args.first_seed}-{args.first_seed + args.trials - 1}), {args.members} "
          f"members calibrated over every step of each run, through `harness run/calibrate/replay`; CPU {cap}, "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end; wall time {wall / 60:.1f} min\n"
          f"{docker_note}\n")
    print(table(rows, args.experiments))
    return 0


if __name__ == "__main__":
    sys.exit(main())
