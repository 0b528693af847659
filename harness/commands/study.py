"""Seed ensembles: one study (a parent MLflow run) holding N ordinary runs that differ only in their seed."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import events, executors, scratch, tags as T
from harness.commands.options import RunOptions
from harness.config import MAX_SEED, check_seeds
from harness.errors import EXIT_FAILED, EXIT_OK, SecretRefused, UsageError
from harness.executors import Job, JobInputs
from harness.executors.base import Outcome, signals_to
from harness.fmt import text_table
from harness.judge.metricdiff import as_series
from harness.judge.noise import MIN_SEEDS, final_values, spread
from harness.judge.report import plot_file_name
from harness.record import closing, unchanged
from harness.record.checkout import checkout
from harness.record.newrun import Labels, create_record, data_paths as paths_of
from harness.record.rerun import git_code_id
from harness.store.tracking import RunRecord, Tracker

# -- running a study ---------------------------------------------------------------------------------

SUMMARY_FORMAT = 1
NOT_STARTED = "NOT_STARTED"  # a member's status in the summary when the study stopped before its seed
FEW_SEEDS_WARNING = f"too few seeds to judge a replay against the noise (need >= {MIN_SEEDS})"


def check_counts(seeds_n: int | None, parallel: int | None) -> None:
    """--seeds N and --parallel J: refused before the store or the config is read."""
    if parallel is not None and parallel < 1:
        raise UsageError(f"--parallel must be >= 1, got {parallel}.")
    if seeds_n is not None and seeds_n < 1:
        raise UsageError(f"--seeds must be >= 1, got {seeds_n}.")


def resolve_seeds(cfg_seeds: Sequence[int] | None, base: int, n: int | None) -> list[int]:
    """The study's seeds: `--seeds N` (base, base+1, ..., base+N-1) or the config's `seeds`, never both."""
    if n is not None and cfg_seeds is not None:
        raise UsageError(
            f"--seeds {n} and `seeds: {list(cfg_seeds)}` in the config both choose the seeds. Give one: drop --seeds, "
            "or set seeds=null."
        )
    if n is None:
        if cfg_seeds is None:
            raise UsageError("--parallel runs a study's members at once: give --seeds N or `seeds: [...]` in the config.")
        seeds = [int(s) for s in cfg_seeds]
    else:
        if n < 1:
            raise UsageError(f"--seeds must be >= 1, got {n}.")
        if base + n - 1 > MAX_SEED:
            raise UsageError(
                f"--seeds {n} from seed {base} goes past the largest seed 2**63-1 ({MAX_SEED}). Lower seed or N."
            )
        seeds = list(range(base, base + n))
    check_seeds(seeds)
    return seeds


def parallel_warning(parallel: int, world_size: int, threads_per_rank: int, device: str) -> str | None:
    """More rank threads at once than CPU cores: results are the same, the study is slower than it looks."""
    if device != "cpu" or parallel < 2:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = parallel * world_size * threads_per_rank
    if threads <= cores:
        return None
    return (f"--parallel {parallel} x world_size {world_size} x threads_per_rank {threads_per_rank} = {threads} "
            f"threads on {cores} CPU core{'s' if cores != 1 else ''}: members will share cores (results are "
            "unaffected, speed is not).")


@dataclass
class Member:
    """One seed of a running study: its run once recorded, its handle once started, how it ended."""

    seed: int
    run_id: str = ""
    handle: Any = None
    outcome: Outcome | None = None
    error: str = ""  # a failure before the ranks ran (recording, the executor refusing)
    started: float = 0.0
    ended: float = 0.0

    @property
    def status(self) -> str:
        if self.outcome is not None:
            return self.outcome.status
        return T.FAILED if self.error else NOT_STARTED


@dataclass
class StudyOutcome:
    run_id: str
    status: str  # FINISHED | FAILED | KILLED
    exit_code: int
    members: list[Member]
    message: str = ""
    table: str = ""  # the per-metric spread, for the terminal


class _Study:
    """Members run in worker threads of this process; the main thread only waits and takes the signals.

    Threads, not a subprocess per member: the tracker, torch and the code checkout are set up once. A
    member's launcher polls its handle for cancellation (launch(cancelled=...)), so SIGINT/SIGTERM here
    reach every running member; each member's ranks are its own mp.spawn children with their own
    rendezvous store on a free port.
    """

    def __init__(self, parallel: int, make_job: Callable[[int], Any] | None, executor: str) -> None:
        self.parallel = parallel
        self.make_job = make_job
        self.executor = executor
        # Reentrant: the signal handler runs in the main thread, which may hold it at that moment.
        self.lock = threading.RLock()
        self.signum: int | None = None  # the signal that stopped the members
        self.late: int | None = None  # a signal after every member had ended: the study is recorded in full first
        self.members_done = False
        self.running: dict[int, Member] = {}
        self.done: queue.Queue[Member] = queue.Queue()

    def on_signal(self, signum: int, frame: Any) -> None:
        with self.lock:
            if self.members_done:
                self.late = self.late or signum
                return
            if self.signum is None:
                self.signum = signum
            handles = [m.handle for m in self.running.values() if m.handle is not None]
        for handle in handles:
            handle.cancel(signum)

    def _member(self, member: Member) -> None:
        def on_start(handle: Any) -> None:
            assert job is not None  # on_start is called by run_job, after the job is made
            with self.lock:
                member.handle, member.run_id, signum = handle, job.run_id, self.signum
            _say(f"seed {member.seed}: run {member.run_id} started")
            if signum is not None:  # the signal came while this member was being recorded
                handle.cancel(signum)

        job = None
        try:
            assert self.make_job is not None  # set before any member runs
            job = self.make_job(member.seed)
            member.outcome = executors.run_job(executors.get(self.executor), job, on_start=on_start)
            member.run_id = member.outcome.run_id
        except Exception as err:  # recorded and closed FAILED by the executor, or never recorded
            member.error = str(err) or type(err).__name__
            member.run_id = member.run_id or (job.run_id if job is not None else "")
        finally:
            member.ended = time.monotonic()
            self.done.put(member)

    def run(self, seeds: list[int]) -> list[Member]:
        members = [Member(s) for s in seeds]
        waiting = list(members)
        failed = False
        try:
            while True:
                with self.lock:
                    stop = failed or self.signum is not None
                    while waiting and not stop and len(self.running) < self.parallel:
                        member = waiting.pop(0)
                        member.started = time.monotonic()
                        self.running[member.seed] = member
                        # In the command's context: the member speaks through its listener.
                        threading.Thread(target=events.carry(self._member), args=(member,),
                                         name=f"harness-seed-{member.seed}", daemon=True).start()
                    if not self.running:
                        break
                try:
                    member = self.done.get(timeout=0.5)  # wakes for signals too
                except queue.Empty:
                    continue
                with self.lock:
                    del self.running[member.seed]
                took = f" in {member.ended - member.started:.1f} s"
                if member.outcome is not None:
                    why = f": {member.outcome.message}" if member.outcome.status != T.FINISHED and member.outcome.message else ""
                    _say(f"seed {member.seed}: run {member.run_id} {member.status}{took}{why}")
                else:
                    _say(f"seed {member.seed}: {('run ' + member.run_id + ' ') if member.run_id else ''}FAILED: {member.error}")
                if member.status != T.FINISHED and self.signum is None and not failed:
                    failed = True
                    if self.running:  # started members finish: each is a complete, ordinary run
                        _say(f"a member failed: {len(self.running)} running member(s) finish, no further seed starts")
        finally:
            with self.lock:
                self.members_done = True
        return members


def run_study(
    options: RunOptions,
    *,
    checked: Any,  # commands/run.py's Preflight (a verb's type: not imported here)
    named: Labels | None = None,
) -> StudyOutcome:
    """Record the study, run one ordinary run per seed from one checkout of the recorded code.

    Bad input raises HarnessError before anything is recorded. `checked`: the experiment as `harness run` checked it
    (commands/run.py `check`: the store probed, the config loaded and validated once), by the API, which decides that
    this is a study (--seeds, or `seeds:` in the config).
    """
    exp_dir, seeds_n, parallel, tracking_uri = options.experiment_dir, options.seeds, options.parallel, \
        options.tracking_uri
    check_counts(seeds_n, parallel)
    seeds, jobs_at_once = _planned(checked, seeds_n, parallel)
    tracker = Tracker(tracking_uri)
    study_id = _record_study(tracker, Path(exp_dir), checked, seeds, jobs_at_once, named)
    heartbeat = None
    status, code, message = T.FAILED, EXIT_FAILED, ""
    members: list[Member] = []
    table = ""
    study = _Study(jobs_at_once, None, str(checked.cfg.executor))
    stack = contextlib.ExitStack()
    try:
        stack.enter_context(signals_to(study.on_signal))
        heartbeat = tracker.heartbeat(study_id, float(checked.cfg.heartbeat_s))
        # Every member runs the code recorded with the study, from one worktree: editing the working tree
        # while an hours-long study runs cannot change its later members.
        with checkout(tracker, tracker.get_run(study_id), checked.git.root) as (tree, tree_exp):
            study.make_job = _member_jobs(tracker, study_id, Path(exp_dir), checked, JobInputs(tree, tree_exp),
                                          quiet=jobs_at_once > 1, named=named,
                                          options={"allow_unpinned": options.allow_unpinned,
                                                   **options.placement.job_options()})
            members = study.run(seeds)
        table = record_summary(tracker, study_id, seeds, members)
        status, code, message = _how_it_ended(study, members)
        tracker.set_tags(study_id, {T.STATUS_REASON: closing.cut(message)} if message else {})
    except BaseException as err:
        with contextlib.suppress(Exception):
            tracker.set_tags(study_id, {T.STATUS_REASON: closing.error_reason(err)})
        raise
    finally:
        with stack:  # the signal handlers are restored last, once the study is closed
            if heartbeat is not None:
                heartbeat.close()
            for m in members:  # a member whose launcher died without closing its run
                if m.run_id and m.outcome is None:
                    with contextlib.suppress(Exception):
                        if tracker.get_run(m.run_id).status == T.RUNNING:
                            closing.close(tracker, m.run_id, T.FAILED)
            closing.close(tracker, study_id, status)
    return StudyOutcome(study_id, status, code, members, message, table)


def _planned(checked: Any, seeds_n: int | None, parallel: int | None) -> tuple[list[int], int]:
    """The study's seeds and how many members run at once, refused where the study cannot run; its warnings said."""
    cfg, git = checked.cfg, checked.git
    if git.redacted:
        raise SecretRefused(
            "a study runs its members from a checkout of the recorded code, and --allow-secret-in-diff cut "
            f"secrets from that record ({', '.join(git.redacted)}): the members would not run your code. Move the "
            "secrets to environment variables, or run single runs."
        )
    seeds = resolve_seeds(None if cfg.seeds is None else list(cfg.seeds), int(cfg.seed), seeds_n)
    jobs_at_once = min(parallel or 1, len(seeds))
    backend = str(cfg.executor)
    if jobs_at_once > 1 and not executors.backend(backend).parallel_members:
        able = " or ".join(n for n, b in executors.backends().items() if b.parallel_members)  # Backend.parallel_members
        raise UsageError(f"--parallel {parallel} needs the {able} executor (this study runs on {backend}); drop --parallel.")
    warnings = list(checked.warnings)
    if len(seeds) < MIN_SEEDS:
        warnings.append(f"{len(seeds)} seed{'s' if len(seeds) != 1 else ''}: {FEW_SEEDS_WARNING}.")
    device = checked.here.device  # decided by the backend when the experiment was checked; None: its ranks run elsewhere
    warning = parallel_warning(jobs_at_once, cfg.world_size, cfg.threads_per_rank, device) if device else None
    if warning:
        warnings.append(warning)
    for warning in warnings:
        _say(f"Warning: {warning}")
    if checked.data_stats is not None:
        _say(checked.data_stats.summary())
    return seeds, jobs_at_once


def _record_study(tracker: Tracker, exp_dir: Path, checked: Any, seeds: list[int], jobs_at_once: int,
                  named: Labels | None) -> str:
    """The study's run (the parent of its members), once the executor has said it can run the config."""
    from omegaconf import OmegaConf

    cfg, git = checked.cfg, checked.git
    study_exp = checked.experiment.with_changes([("study", OmegaConf.create({"seeds": seeds}))], executors.schema(),
                                                check=False)
    name = exp_dir.resolve().name
    # The executor refuses what cannot run (no GPU, no engine) before the study is recorded.
    inputs = JobInputs(git.root, exp_dir, data=paths_of(checked.data))
    placement = executors.get(str(cfg.executor)).prepare(Job(tracker, study_exp.config, inputs, here=checked.here))
    study_tags = {
        **(dict(named.tags) if named is not None else {}), T.KIND: T.KIND_STUDY,
        T.STUDY_SEEDS: ",".join(map(str, seeds)), T.STUDY_SIZE: str(len(seeds)), T.STUDY_PARALLEL: str(jobs_at_once),
    }
    given = named.name if named is not None else None
    study_id = create_record(tracker, study_exp, exp_dir, git, image=placement, extra_tags=study_tags,
                             run_name=given or f"{name}-study{len(seeds)}", data=checked.data)
    _say(f"study {study_id}: {len(seeds)} seeds ({_seed_list(seeds)}), {jobs_at_once} at once")
    return study_id


def _member_jobs(tracker: Tracker, study_id: str, exp_dir: Path, checked: Any, tree: JobInputs, *, quiet: bool,
                 named: Labels | None, options: Mapping[str, Any]) -> Callable[[int], Job]:
    """What makes each seed's job: the study's config with its seed, run from the study's checkout (`tree`)."""
    from omegaconf import OmegaConf

    cfg, git = checked.cfg, checked.git
    name = exp_dir.resolve().name
    given = named.name if named is not None else None
    user_tags = dict(named.tags) if named is not None else {}
    inputs = JobInputs(tree.root, tree.exp_dir, code_id=git_code_id(git), data=paths_of(checked.data))
    job_options = executors.options_for(str(cfg.executor), **{**options, "quiet": quiet})

    def make_job(seed: int) -> Job:
        member = checked.experiment.with_changes(
            [("member", OmegaConf.create({"seed": seed, "seeds": None}))], executors.schema(),
            source="study config", check=False)
        extra = {**user_tags, T.STUDY: study_id, T.MLFLOW_PARENT_RUN_ID: study_id}

        def record(tags: dict[str, str]) -> str:
            return create_record(tracker, member, exp_dir, git, image=tags, extra_tags=extra,
                                 run_name=f"{given or name}-seed{seed}", data=checked.data)

        # The members run the checkout, which nobody edits; the data they read is the live one.
        return Job(tracker, member.config, inputs, record=record, options=job_options, here=checked.here,
                   verify=lambda: unchanged.changes(None, checked.data, checked.read_ns))

    return make_job


def _how_it_ended(study: _Study, members: list[Member]) -> tuple[str, int, str]:
    """The study's status, exit code and reason, from its members' and the signals that came."""
    status, code, message = T.FAILED, EXIT_FAILED, ""
    failed = [m for m in members if m.status not in (T.FINISHED, NOT_STARTED)]
    if study.signum is not None:
        status, code = T.KILLED, 128 + study.signum
        message = f"interrupted by {signal.Signals(study.signum).name}: every started member was stopped"
    elif failed:
        first = failed[0]
        why = first.outcome.message if first.outcome is not None else first.error
        message = f"member seed {first.seed} (run {first.run_id or 'not recorded'}) failed: {why}"
    else:
        status, code = T.FINISHED, EXIT_OK
    if study.late and code == EXIT_OK:
        _say(f"{signal.Signals(study.late).name} arrived while the study was being recorded; it was recorded in full first.")
        code = 128 + study.late
    return status, code, message


_say_lock = threading.Lock()


def _say(line: str) -> None:
    """One whole line, as a notice (members in threads speak too: one line at a time reaches the listener)."""
    with _say_lock:
        events.emit(events.Notice(line))


def _seed_list(seeds: list[int]) -> str:
    if len(seeds) > 2 and seeds == list(range(seeds[0], seeds[0] + len(seeds))):
        return f"{seeds[0]}..{seeds[-1]}"
    return ", ".join(map(str, seeds))


# -- the summary -------------------------------------------------------------------------------------

def curve(series: Sequence[tuple[Any, Any]]) -> dict[str, list]:
    """Per step that every member logged: mean, sample sd (ddof=1, nan for one member), min and max."""
    import numpy as np

    if not series:
        return {"steps": [], "mean": [], "std": [], "min": [], "max": []}
    normal = [as_series(steps, values) for steps, values in series]  # ascending; a step logged twice keeps its last value
    common = functools.reduce(np.intersect1d, (steps for steps, _ in normal))
    table = np.vstack([values[np.searchsorted(steps, common)] for steps, values in normal])
    with np.errstate(invalid="ignore"):
        std = table.std(axis=0, ddof=1) if table.shape[0] > 1 else np.full(common.size, math.nan)
    return {"steps": [int(s) for s in common], "mean": table.mean(axis=0).tolist(), "std": std.tolist(),
            "min": table.min(axis=0).tolist(), "max": table.max(axis=0).tolist()}


def summarize(seeds: list[int], members: list[Member], records: dict[str, RunRecord]) -> dict[str, Any]:
    """study/summary.json: the members, and per metric their final values, spread and per-step curve.

    Only FINISHED members enter the statistics; a failed or stopped one is listed with its status.
    """
    finished = [m for m in members if m.status == T.FINISHED and m.run_id in records]
    finals = {m.run_id: final_values(records[m.run_id].metrics) for m in finished}
    names = sorted({k for f in finals.values() for k in f})
    metrics: dict[str, Any] = {}
    for name in names:
        having = [m for m in finished if name in finals[m.run_id]]
        s = spread(finals[m.run_id][name] for m in having)
        metrics[name] = {
            "finals": [{"run_id": m.run_id, "seed": m.seed, "value": finals[m.run_id][name]} for m in having],
            "spread": {"n": s.n, "mean": s.mean, "std": s.std, "min": s.min, "max": s.max,
                       "ci95": list(s.ci95), "pi95": list(s.pi95)},
            "curve": curve([records[m.run_id].metrics[name] for m in having]),
        }
    identical = members_identical([records[m.run_id] for m in finished])
    user_seeds = {m.run_id: records[m.run_id].facts[T.USER_SEEDS] for m in finished
                  if records[m.run_id].facts.get(T.USER_SEEDS)}
    return {
        "format": SUMMARY_FORMAT,
        "seeds": seeds,
        "members": [{"run_id": m.run_id or None, "seed": m.seed, "status": m.status} for m in members],
        "metrics": metrics,
        # true: every finished member logged the same series and ended with the same weights, bit for bit (the
        # code ignores the seed); user_seeds: per member, the RNG seeds its code set itself.
        "members_identical": identical,
        "user_seeds": user_seeds,
    }


def members_identical(records: Sequence[RunRecord]) -> bool:
    """Two or more members whose every logged series (steps and values' bits) and final fingerprint are equal:
    the seed changed nothing, so their spread of 0 says nothing about the noise."""
    if len(records) < 2 or not any(r.metrics or r.final_fingerprint for r in records):
        return False
    first = records[0]
    for other in records[1:]:
        if other.final_fingerprint != first.final_fingerprint or other.metrics.keys() != first.metrics.keys():
            return False
        for key, (steps, values) in first.metrics.items():
            o_steps, o_values = other.metrics[key]
            if steps.tobytes() != o_steps.tobytes() or values.tobytes() != o_values.tobytes():
                return False
    return True


def seed_ignored_warning(summary: dict[str, Any]) -> str:
    n = sum(1 for m in summary["members"] if m["status"] == T.FINISHED)
    seeds = sorted(set(summary["user_seeds"].values()))
    where = f" (it seeds itself: {' | '.join(seeds)})" if seeds else ""
    return (f"Warning: the study's {n} members are bit-identical (every metric and the final weights): the code "
            f"ignores the seed{where}, so their spread says nothing about the noise. Seed from ctx.seed / "
            "ctx.rank_seed, or drop your own seeding (harness seeds every RNG).")


def render_table(summary: dict[str, Any]) -> str:
    """The terminal's view of the summary: one row per metric."""
    def g(x: float) -> str:
        return f"{x:.6g}"

    header = ["metric", "N", "mean", "sd", "min", "max", "95% prediction interval"]
    rows = [header]
    for name, m in summary["metrics"].items():
        s = m["spread"]
        pi = "-" if any(math.isnan(v) for v in s["pi95"]) else f"[{g(s['pi95'][0])}, {g(s['pi95'][1])}]"
        rows.append([name, str(s["n"]), g(s["mean"]), "-" if math.isnan(s["std"]) else g(s["std"]), g(s["min"]),
                     g(s["max"]), pi])
    if len(rows) == 1:
        return "no member logged a metric"
    return text_table(rows)


def record_summary(tracker: Tracker, study_id: str, seeds: list[int], members: list[Member]) -> str:
    """Write study/summary.json, the per-step mean/std metrics and one spread plot per metric; the table."""
    records = {m.run_id: tracker.load_record(m.run_id) for m in members if m.status == T.FINISHED and m.run_id}
    summary = summarize(seeds, members, records)
    tracker.log_text(study_id, json.dumps(summary, indent=2), T.ARTIFACT_STUDY_SUMMARY)
    if summary["members_identical"]:
        tracker.set_tags(study_id, {T.STUDY_SEED_IGNORED: "true"})
        _say(seed_ignored_warning(summary))
    now = int(time.time() * 1000)
    entries: list[tuple[str, float, int, int]] = []
    for name, m in summary["metrics"].items():
        c = m["curve"]
        for i, step in enumerate(c["steps"]):
            entries.append((f"{name}/mean", c["mean"][i], now, step))
            if m["spread"]["n"] > 1:
                entries.append((f"{name}/std", c["std"][i], now, step))
    if entries:
        tracker.log_metric_entries(study_id, entries)
    if summary["metrics"]:
        with scratch.folder("plots") as tmp:
            plot_spread(summary, records, Path(tmp))
            tracker.log_dir(study_id, Path(tmp), T.ARTIFACT_STUDY_DIR)
    return render_table(summary)


def plot_spread(summary: dict[str, Any], records: dict[str, RunRecord], out_dir: Path) -> list[Path]:
    """Per metric: every member's curve (thin), the mean +- sd band, and the final values against the 95%
    prediction interval a new seed's final value falls in."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    paths: list[Path] = []
    used: set[str] = set()
    for name, m in summary["metrics"].items():
        fig, (ax, ax_final) = plt.subplots(1, 2, figsize=(10, 4.5), gridspec_kw={"width_ratios": [4, 1]}, sharey=True)
        fig.subplots_adjust(left=0.08, right=0.97, top=0.9, bottom=0.12, wspace=0.05)
        try:
            for f in m["finals"]:
                steps, values = records[f["run_id"]].metrics[name]
                ax.plot(steps, values, linewidth=0.7, alpha=0.5, label=f"seed {f['seed']}" if len(m["finals"]) <= 8 else None)
            c = m["curve"]
            steps, mean, std = np.array(c["steps"]), np.array(c["mean"]), np.array(c["std"], dtype=np.float64)
            ax.plot(steps, mean, color="black", linewidth=1.6, label="mean")
            if m["spread"]["n"] > 1:
                ax.fill_between(steps, mean - std, mean + std, color="grey", alpha=0.3, label="mean +- sd")
            ax.set_xlabel("step")
            ax.set_ylabel(name)
            ax.grid(True, alpha=0.3)
            ax.legend(loc="best", fontsize=7)
            s = m["spread"]
            finals = [f["value"] for f in m["finals"]]
            ax_final.scatter(np.zeros(len(finals)), finals, color="tab:blue", zorder=3, label="final values")
            if not any(math.isnan(v) for v in s["pi95"]):
                ax_final.axhspan(s["pi95"][0], s["pi95"][1], color="tab:orange", alpha=0.25, label="95% prediction")
            ax_final.axhline(s["mean"], color="black", linewidth=1.0)
            ax_final.set_xticks([])
            ax_final.set_xlabel("final")
            ax_final.legend(loc="best", fontsize=7)
            sd = "-" if math.isnan(s["std"]) else f"{s['std']:.3g}"
            ax.set_title(f"{name}: {s['n']} seeds, final mean {s['mean']:.6g}, sd {sd}")
            path = out_dir / plot_file_name("spread_", name, used)
            fig.savefig(path, dpi=100)
            paths.append(path)
        finally:
            plt.close(fig)
    return paths
