"""Runs calibrated on this x86 machine, replayed on another architecture: an arm64 Debian userland under qemu-user.

    python benchmarks/arm64_bench.py [--root /var/tmp/harness-arm64] [--experiments linear_ddp digits_cnn]
        [--only TEXT...] [--jsonl FILE] [--setup-only] [--keep-binfmt]
    python benchmarks/arm64_bench.py --table FILE...   # only print the table of earlier --jsonl files
    python benchmarks/arm64_bench.py --teardown         # unmount whatever is mounted under ROOT, undo binfmt

Every "other machine" the rest of the benchmarks measure is this x86 CPU told to act older. This one is another
instruction set and another BLAS: torch's aarch64 wheel from PyPI (NVIDIA's NVPL as its BLAS, the library of a
Grace-Hopper node's CPU), run on an emulated Arm core. Needs root and the Debian and PyPI mirrors; nothing else is
downloaded. Not run in CI, not a test: it registers a binfmt handler, which tests must never do.

The steps, each one a subprocess with a timeout, each skipped (and said so) when its result is already there:

1. Host tools: `apt-get install qemu-user-static debootstrap binfmt-support`.
2. binfmt: mount `binfmt_misc` on /proc/sys/fs/binfmt_misc and `update-binfmts --enable qemu-aarch64` (its flags
   include F: the interpreter is opened at registration, so it works inside a chroot that does not hold it). What
   this step did, it undoes at the end (`--keep-binfmt` keeps it for a second invocation).
3. The userland: `debootstrap --arch=arm64 --variant=minbase --include=python3,python3-venv,python3-pip,
   ca-certificates,git bookworm ROOT.partial MIRROR` (MIRROR: the Debian mirror this machine's apt sources name),
   renamed to ROOT when it completes, so a ROOT that exists is a whole one (about 5 minutes under emulation).
4. This machine's /etc/resolv.conf and CA bundle copied in (pip checks PyPI's certificate against it); /proc and
   /dev mounted into ROOT. /sys is not: with it, `import torch` crashes under qemu-user.
5. A venv, /opt/v in ROOT (`python3 -m venv`, run there), with torch==2.13.0 and the project's dependencies at the
   versions this machine has. Their aarch64 wheels are fetched from PyPI by this machine's pip (`pip download
   --platform manylinux_2_X_aarch64 --only-binary=:all:` into ROOT/var/cache/harness-wheels: about 3 GB, torch's CUDA
   libraries included) and installed from there into the venv's site-packages (`pip install --no-index --platform ...
   --target`), natively: pip under emulation downloads at about 2 MB/s and takes half an hour to unpack them. Without
   PIP_FIND_LINKS, which names this machine's x86 wheels. Then the userland's Python imports them.
   ROOT/opt/v/harness-requirements.txt records what was installed; a venv whose file matches is reused. harness itself is not
   installed there: the checkout is bind-mounted at its own path and put on PYTHONPATH, so the replay runs this
   tree's code.
6. Every command in ROOT runs with `QEMU_CPU=neoverse-n1` (an Arm Neoverse N1 core, a Graviton2's: Armv8.2, NEON,
   no SVE) and an environment built from nothing but what it needs. With qemu's default CPU model (`max`, SVE
   advertised) small float32 matmuls of this torch come out wrong (a 10x10 by 10x5 product off by 8.1) and a replay
   is rightly DIVERGED at step 0: that machine computes wrong. A probe prints the emulated machine, torch's CPU
   capability there and a 256x256 matmul's sum, beside this machine's.
7. On x86, in a throwaway git repository and SQLite store (benchmarks/benchrepo.py) under /var/tmp, bind-mounted
   into ROOT at the same path so the store's paths (artifacts, the repository the replay checks out) resolve there:
   `harness run experiments/X` as bundled (full length), then `harness calibrate RUN` with the defaults.
8. Per experiment and change: `harness replay RUN --json` on x86 (its wall time, the ratio's denominator, and its
   verdict), then the same replay in ROOT. Honest: the replay as recorded (another ISA, another BLAS: it must be
   `WITHIN_ROUNDING`). Planted (must be `DIVERGED`): lr x1.02, and for digits_cnn momentum +0.01 and dropout p +0.01,
   taken from benchmarks/verdict_e2e_bench.py's changes (`--allow-changes`).
9. Prints a markdown table: experiment, change, the verdict and exit code on x86 and on arm64, how far the arm64
   replay came from the original relative to the envelope's half-width (comparison.json's `rounding`: the widest
   inside the measured window, the widest inside the envelope carried forward past it, or the first value outside:
   distance / half-width at its step), and wall times with the arm64/x86 ratio.

Everything it mounted is unmounted when it ends, however it ends (a finally); the store and repository are removed
unless `--work DIR` keeps them (a second invocation then reuses the runs and calibrations, and `--jsonl FILE` the rows
measured: a long measurement can be resumed; `--runs-only` makes the x86 runs while the userland is being set up).
Replays run per launch (no kept rank server), so neither side is spared its torch import.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchrepo import project  # benchmarks/, on sys.path when run as a script
from verdict_e2e_bench import Change, changes, override, steps_of

CHECKOUT = Path(__file__).resolve().parents[1]
DEFAULT_ROOT = Path("/var/tmp/harness-arm64")
EXPERIMENTS = ("linear_ddp", "digits_cnn")
# The changes that show only in the training first: lr x1.02 is decided by harness.lr at step 0 whatever the machine.
PLANTED = {"momentum +0.01": ("digits_cnn",), "dropout p +0.01": ("digits_cnn",), "lr x1.02": EXPERIMENTS}
HONEST = Change("as recorded (arm64, NVPL)", True)
QEMU_CPU = "neoverse-n1"
TORCH = "torch==2.13.0"
# The project's runtime dependencies (pyproject.toml) and digits_cnn's scikit-learn, at this machine's versions.
DEPS = ("numpy", "mlflow", "omegaconf", "gitpython", "click", "tqdm", "matplotlib", "scipy", "psutil",
        "scikit-learn", "pyyaml")
BINFMT = Path("/proc/sys/fs/binfmt_misc")
WHEELS = Path("/var/cache/harness-wheels")  # in ROOT: the aarch64 wheels, downloaded on this machine
PROBE = ("import platform, torch; torch.manual_seed(0); a = torch.randn(256, 256); "
         "print(platform.machine(), torch.__version__, torch.backends.cpu.get_cpu_capability(), "
         "repr((a @ a).sum().item()))")


def sh(cmd: list[str], timeout: float, check: bool = True, **kw: object) -> subprocess.CompletedProcess:
    print(f"$ {' '.join(shlex.quote(c) for c in cmd)}", file=sys.stderr, flush=True)
    return subprocess.run(cmd, timeout=timeout, check=check, text=True, **kw)  # type: ignore[call-overload]


def say(text: str) -> None:
    print(f"[arm64] {text}", file=sys.stderr, flush=True)


# --- the userland ------------------------------------------------------------------------------------------------
class Userland:
    """ROOT and what this process mounted or registered for it, undone in reverse by close()."""

    def __init__(self, root: Path, keep_binfmt: bool = False) -> None:
        self.root = root
        self.keep_binfmt = keep_binfmt
        self.mounted: list[Path] = []
        self.enabled_binfmt = False
        self.mounted_binfmt = False

    def inside(self, path: Path) -> Path:
        return self.root / str(path).lstrip("/")

    def host_tools(self) -> None:
        if shutil.which("qemu-aarch64-static") and shutil.which("debootstrap") and shutil.which("update-binfmts"):
            say("host tools present: qemu-user-static, debootstrap, binfmt-support")
            return
        sh(["apt-get", "install", "-y", "--no-install-recommends", "qemu-user-static", "debootstrap",
            "binfmt-support"], timeout=600)

    def binfmt(self) -> None:
        if not os.path.ismount(BINFMT):
            sh(["mount", "-t", "binfmt_misc", "binfmt_misc", str(BINFMT)], timeout=30)
            self.mounted_binfmt = True
        entry = BINFMT / "qemu-aarch64"
        if entry.exists() and entry.read_text().startswith("enabled"):
            say("binfmt handler qemu-aarch64 already enabled")
        else:
            sh(["update-binfmts", "--enable", "qemu-aarch64"], timeout=60)
            self.enabled_binfmt = True
        flags = next((x for x in entry.read_text().splitlines() if x.startswith("flags:")), "flags: ?")
        say(f"binfmt qemu-aarch64 {flags}")

    def bootstrap(self) -> None:
        if (self.root / "usr/bin/python3").exists() and not (self.root / "debootstrap").exists():
            say(f"reusing the arm64 userland at {self.root}")
            return
        partial = self.root.with_name(self.root.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        sh(["debootstrap", "--arch=arm64", "--variant=minbase",
            "--include=python3,python3-venv,python3-pip,ca-certificates,git", "bookworm", str(partial), mirror()],
           timeout=3600)
        partial.rename(self.root)

    def mount(self, source: str, target: Path, *options: str) -> None:
        if os.path.ismount(target):
            say(f"{target} already mounted (not by this run: left as it is)")
            return
        target.mkdir(parents=True, exist_ok=True)
        sh(["mount", *options, source, str(target)], timeout=60)
        self.mounted.append(target)

    def prepare(self) -> None:
        shutil.copyfile("/etc/resolv.conf", self.root / "etc/resolv.conf")
        shutil.copyfile("/etc/ssl/certs/ca-certificates.crt", self.root / "etc/ssl/certs/ca-certificates.crt")
        self.mount("proc", self.root / "proc", "-t", "proc")
        self.mount("/dev", self.root / "dev", "--bind")

    def bind(self, path: Path) -> None:
        """`path` at the same path inside ROOT."""
        self.mount(str(path), self.inside(path), "--bind")

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """The whole environment of a command in ROOT: nothing of this machine's (PIP_FIND_LINKS names x86 wheels)."""
        out = {"PATH": "/opt/v/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root",
               "LANG": "C.UTF-8", "QEMU_CPU": QEMU_CPU, "PIP_DISABLE_PIP_VERSION_CHECK": "1",
               "PIP_DEFAULT_TIMEOUT": "180", "PIP_CERT": "/etc/ssl/certs/ca-certificates.crt"}
        return {**out, **(extra or {})}

    def run(self, argv: list[str], timeout: float, cwd: Path = Path("/"), env: dict[str, str] | None = None,
            check: bool = True, capture: bool = False) -> subprocess.CompletedProcess:
        """`argv` run in ROOT from `cwd` (a path inside it, as inside)."""
        line = f"cd {shlex.quote(str(cwd))} && exec {' '.join(shlex.quote(a) for a in argv)}"
        return sh(["chroot", str(self.root), "/bin/sh", "-c", line], timeout=timeout, check=check, env=self.env(env),
                  capture_output=capture)

    def venv(self) -> None:
        wanted = "\n".join([TORCH, *(f"{name}=={host_version(name)}" for name in DEPS)]) + "\n"
        done = self.root / "opt/v/harness-requirements.txt"
        if done.exists() and done.read_text() == wanted:
            say(f"reusing the venv {self.root}/opt/v ({' '.join(wanted.split())})")
            return
        if not (self.root / "opt/v/bin/python").exists():
            self.run(["python3", "-m", "venv", "/opt/v"], timeout=900)
        python = self.run(["/opt/v/bin/python", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                          timeout=300, capture=True).stdout.strip()
        # pip under emulation downloads at about 2 MB/s and unpacks for half an hour (its TLS, hashing and zlib are
        # emulated too), and torch's aarch64 wheel pulls about 3 GB of CUDA libraries: this machine's pip fetches the
        # aarch64 wheels from PyPI and installs them into the venv natively (nothing is built: every file is a
        # wheel's). The userland's Python then imports them, which checks they are its own.
        tags = [f"manylinux_2_{minor}_aarch64" for minor in range(17, 29)] + ["manylinux2014_aarch64", "linux_aarch64"]
        target = ["--only-binary=:all:", *(a for t in tags for a in ("--platform", t)), "--python-version", python,
                  "--implementation", "cp"]
        host = {k: v for k, v in os.environ.items() if k != "PIP_FIND_LINKS"}  # x86 wheels
        wheels = self.inside(WHEELS)
        sh([sys.executable, "-m", "pip", "download", *target, "-d", str(wheels), *wanted.split()], timeout=3600,
           env=host)
        # --no-warn-conflicts: pip would hold the userland's packages against this machine's own environment.
        sh([sys.executable, "-m", "pip", "install", "--no-index", "--find-links", str(wheels), *target, "--upgrade",
            "--no-warn-conflicts",
            "--target", str(self.inside(Path(f"/opt/v/lib/python{python}/site-packages"))), *wanted.split()],
           timeout=3600, env=host)
        self.run(["/opt/v/bin/python", "-c", "import torch, mlflow, omegaconf, git, click, scipy, sklearn, matplotlib"],
                 timeout=900)
        done.write_text(wanted)

    def close(self) -> None:
        for target in reversed(self.mounted):
            sh(["umount", str(target)], timeout=120, check=False)
        self.mounted.clear()
        if self.keep_binfmt:
            return
        if self.enabled_binfmt:
            sh(["update-binfmts", "--disable", "qemu-aarch64"], timeout=60, check=False)
        if self.mounted_binfmt:
            sh(["umount", str(BINFMT)], timeout=60, check=False)


def teardown(root: Path) -> None:
    """Unmounts everything mounted under `root` (deepest first) and the qemu-aarch64 binfmt handler, then
    binfmt_misc itself where no other handler is registered."""
    mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
    for target in sorted((m for m in mounts if m == str(root) or m.startswith(f"{root}/")), key=len, reverse=True):
        sh(["umount", target], timeout=120, check=False)
    if os.path.ismount(BINFMT):
        if (BINFMT / "qemu-aarch64").exists():
            sh(["update-binfmts", "--disable", "qemu-aarch64"], timeout=60, check=False)
        if not [p for p in BINFMT.iterdir() if p.name not in ("register", "status")]:
            sh(["umount", str(BINFMT)], timeout=60, check=False)
    say(f"teardown done; mounts left under {root}: "
        f"{[m for m in Path('/proc/mounts').read_text().split() if m.startswith(str(root))] or 'none'}")


def mirror() -> str:
    for path in sorted(Path("/etc/apt").rglob("*.list")) + sorted(Path("/etc/apt").rglob("*.sources")):
        found = re.search(r"https?://\S+/debian(?=[\s/]|$)", path.read_text())
        if found:
            return found.group(0)
    return "http://deb.debian.org/debian"


def host_version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


# --- the commands ------------------------------------------------------------------------------------------------
@dataclass
class Done:
    rc: int
    doc: dict
    seconds: float
    stderr: str


def harness(args: list[str], repo: Path, store: Path, userland: Userland | None, timeout: float,
            env: dict[str, str] | None = None) -> Done:
    """`python -m harness ARGS` from this checkout, here (userland None) or in the arm64 userland."""
    mine = {"MLFLOW_TRACKING_URI": f"sqlite:///{store / 'mlflow.db'}", "PYTHONPATH": str(CHECKOUT),
            "PYTHONUNBUFFERED": "1", **(env or {})}
    start = time.perf_counter()
    try:
        if userland is None:
            full = {k: v for k, v in os.environ.items() if k not in ("HARNESS_RANK_SERVER_IDLE_S", "PYTHONPATH")}
            done = sh([sys.executable, "-m", "harness", *args], timeout=timeout, check=False, cwd=repo,
                      env={**full, **mine}, capture_output=True)
        else:
            done = userland.run(["/opt/v/bin/python", "-m", "harness", *args], timeout=timeout, cwd=repo, env=mine,
                                check=False, capture=True)
    except subprocess.TimeoutExpired:
        return Done(124, {}, time.perf_counter() - start, f"timed out after {timeout} s")
    seconds = time.perf_counter() - start
    try:
        doc = json.loads(done.stdout) if "--json" in args else {"last": done.stdout.strip().splitlines()[-1]}
    except (ValueError, IndexError):
        doc = {}
    return Done(done.returncode, doc, seconds, done.stderr)


def must(done: Done, what: str) -> str:
    if done.rc != 0:
        raise SystemExit(f"{what} failed ({done.rc}):\n{done.stderr[-3000:]}")
    return str(done.doc["last"])


def how_far(doc: dict) -> str:
    """Distance / half-width from a replay document's comparison (the rounding judgement)."""
    rounding = (doc.get("comparison") or {}).get("rounding")
    if not rounding:
        # Decided before any envelope was asked: a value no rounding moves (harness.lr), the run's shape, bitwise.
        said = re.match(r"DIVERGED at step \d+: ([^(;]+)", doc.get("summary") or "")
        return f"not asked: {said.group(1).strip()}" if said else "-"
    outside = rounding.get("outside") or []
    if outside:
        first = min(outside, key=lambda o: (o["step"], o["metric"]))
        return (f"{first['metric']} step {first['step']}: {ratio(first['distance'], first['half_width'])}x "
                f"(abs {first['distance']:.3g} vs ±{first['half_width']:.3g})")
    weights = rounding.get("weights")
    if weights and weights["distance"] > weights["half_width"]:
        return f"weights after step {weights['step']}: {ratio(weights['distance'], weights['half_width'])}x"
    text = f"{rounding['widest']:.2g}x (steps 0-{rounding['steps'] - 1})"
    carried = [c for c in (rounding.get("carried") or {}).values() if c.get("judged")]
    if carried:
        text += f", {max(c['widest'] for c in carried):.2g}x carried"
    if weights:
        text += f", weights {ratio(weights['distance'], weights['half_width'])}x"
    return text


def ratio(a: float, b: float) -> str:
    return f"{a / b:.3g}" if b else "inf"


def replay(repo: Path, store: Path, run_id: str, change: Change, experiment: str, userland: Userland | None,
           timeout: float) -> dict:
    sets = override(change, experiment)
    args = ["replay", run_id, "--json", *(["--allow-changes", *sets] if sets else [])]
    done = harness(args, repo, store, userland, timeout)
    verdict = done.doc.get("verdict") or f"ERROR(rc {done.rc})"
    if not done.doc.get("verdict"):
        say(f"{experiment} {change.name}: no verdict (rc {done.rc}): {done.stderr[-2000:]}")
    return {"verdict": verdict, "rc": done.rc, "seconds": round(done.seconds, 1),
            "summary": done.doc.get("summary") or "", "far": how_far(done.doc), "replay_id": done.doc.get("run_id")}


def todo(experiments: list[str], only: list[str] | None) -> list[tuple[str, Change]]:
    planted = {c.name: c for c in changes("")}
    out = []
    for experiment in experiments:
        for change in [HONEST, *(planted[n] for n, where in PLANTED.items() if experiment in where)]:
            if not only or any(t in change.name for t in only):
                out.append((experiment, change))
    return out


def probe(userland: Userland) -> str:
    here = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300,
                          check=True).stdout.strip()
    there = userland.run(["/opt/v/bin/python", "-c", PROBE], timeout=600, capture=True).stdout.strip()
    qemu = subprocess.run(["qemu-aarch64-static", "--version"], capture_output=True, text=True,
                          timeout=60).stdout.splitlines()[0]
    return (f"x86 ({platform.processor() or platform.machine()}): {here}\narm64 ({qemu}, QEMU_CPU={QEMU_CPU}): {there}")


def originals(work: Path, experiments: list[str], timeout: float) -> tuple[Path, Path, dict[str, str]]:
    """(repo, store, experiment -> run id): each experiment run as bundled and calibrated with the defaults, on x86,
    in `work`; runs already recorded there (work/runs.json) are reused."""
    store, repo, known = work / "store", work / "repo", work / "runs.json"
    if not repo.exists():
        store.mkdir(parents=True, exist_ok=True)
        project(work, tuple(EXPERIMENTS))
    runs = json.loads(known.read_text()) if known.exists() else {}
    for experiment in experiments:
        if experiment in runs:
            say(f"{experiment}: reusing run {runs[experiment]} and its calibration ({known})")
            continue
        run = harness(["run", f"experiments/{experiment}"], repo, store, None, timeout)
        run_id = must(run, f"harness run {experiment}")
        cal = harness(["calibrate", run_id], repo, store, None, 10 * timeout)
        must(cal, f"harness calibrate {run_id}")
        say(f"{experiment}: run {run_id} ({steps_of(store, run_id)} steps, {run.seconds:.0f} s), calibrated in "
            f"{cal.seconds:.0f} s ({cal.seconds / run.seconds:.1f}x the run)")
        runs[experiment] = run_id
        known.write_text(json.dumps(runs))
    return repo, store, runs


def measure(userland: Userland, work: Path, experiments: list[str], only: list[str] | None, jsonl: Path | None,
            timeout: float) -> list[dict]:
    """Step 8: every (experiment, change) replayed on x86, then in the userland; rows already in `jsonl` are kept."""
    rows = [json.loads(x) for x in jsonl.read_text().splitlines() if x.strip()] if jsonl and jsonl.exists() else []
    done = {(r["experiment"], r["change"]) for r in rows}
    repo, store, runs = originals(work, experiments, timeout)
    userland.bind(CHECKOUT)
    userland.bind(work)
    for experiment, change in todo(experiments, only):
        if (experiment, change.name) in done:
            say(f"{experiment} {change.name}: measured already ({jsonl})")
            continue
        x86 = replay(repo, store, runs[experiment], change, experiment, None, timeout)
        say(f"{experiment} {change.name} x86: {x86['summary'][:300]} ({x86['seconds']} s)")
        arm = replay(repo, store, runs[experiment], change, experiment, userland, timeout)
        say(f"{experiment} {change.name} arm64: {arm['summary'][:600]} ({arm['seconds']} s)")
        row = {"experiment": experiment, "change": change.name, "honest": change.honest,
               "steps": steps_of(store, runs[experiment]), "x86": x86, "arm64": arm}
        rows.append(row)
        if jsonl is not None:
            with jsonl.open("a") as f:
                f.write(json.dumps(row) + "\n")
    return rows


def table(rows: list[dict]) -> str:
    out = ["| experiment | change | x86 replay | arm64 replay (exit) | arm64: distance / half-width | wall x86 | "
           "wall arm64 | arm64/x86 |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        x86, arm = r["x86"], r["arm64"]
        expected = ("BITWISE", "WITHIN_ROUNDING") if r["honest"] else ("DIVERGED",)
        mark = "" if arm["verdict"] in expected else " **(false alarm)**" if r["honest"] else " **(missed)**"
        at = re.search(r"DIVERGED at step (\d+)", arm["summary"])
        verdict = f"{arm['verdict']}{f' at step {at.group(1)}' if at else ''} ({arm['rc']}){mark}"
        out.append(f"| {r['experiment']} ({r['steps']} steps) | {r['change']} | {x86['verdict']} ({x86['rc']}) | "
                   f"{verdict} | {arm['far']} | {x86['seconds']:.0f} s | {arm['seconds']:.0f} s | "
                   f"{arm['seconds'] / x86['seconds']:.1f}x |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT, help="the arm64 userland (reused when ready)")
    parser.add_argument("--experiments", nargs="+", choices=EXPERIMENTS, default=list(EXPERIMENTS))
    parser.add_argument("--only", nargs="+", metavar="TEXT", help="only the changes whose name holds one of these")
    parser.add_argument("--jsonl", type=Path, help="append every row to this file as it is measured")
    parser.add_argument("--table", type=Path, nargs="+", help="only print the table of these --jsonl files")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds a run or replay may take")
    parser.add_argument("--work", type=Path, help="keep the repository and store here and reuse the runs recorded "
                        "there (default: a temporary folder under /var/tmp, removed at the end)")
    parser.add_argument("--runs-only", action="store_true", help="only run and calibrate on x86 (step 7) in --work")
    parser.add_argument("--setup-only", action="store_true", help="set the userland up, probe it, and stop")
    parser.add_argument("--keep-binfmt", action="store_true", help="leave the binfmt handler registered at the end")
    parser.add_argument("--teardown", action="store_true", help="unmount what is mounted under ROOT, undo binfmt")
    args = parser.parse_args(argv)
    if args.table:
        print(table([json.loads(x) for p in args.table for x in p.read_text().splitlines() if x.strip()]))
        return 0
    if args.teardown:
        teardown(args.root)
        return 0
    if os.geteuid() != 0:
        parser.error("needs root: it mounts, chroots and registers a binfmt handler")
    work = args.work or Path(tempfile.mkdtemp(prefix="arm64-bench-", dir="/var/tmp"))
    if args.runs_only:
        originals(work, args.experiments, args.timeout)
        return 0
    userland = Userland(args.root, keep_binfmt=args.keep_binfmt)
    start = time.perf_counter()
    try:
        userland.host_tools()
        userland.binfmt()
        userland.bootstrap()
        userland.prepare()
        userland.venv()
        machines = probe(userland)
        say(f"set up in {time.perf_counter() - start:.0f} s\n{machines}")
        if args.setup_only:
            return 0
        rows = measure(userland, work, args.experiments, args.only, args.jsonl, args.timeout)
    finally:
        userland.close()
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\n{machines}\nload average {os.getloadavg()[0]:.1f} at the end, {os.cpu_count()} cores; "
          f"wall time {(time.perf_counter() - start) / 60:.1f} min\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
