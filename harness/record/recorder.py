"""The recorder: rank 0's messages, from the ranks' start to their end, turned into the job's one MLflow run.

Every backend that runs ranks feeds one `Recorder`: `start` once the run exists (runtime facts, the
package lock, the heartbeat, checkpoint uploads, the metric writer), `feed` with each message rank 0
sends, `ranks_done` when they ended well, and `end` with how they ended (`Failed`, `Killed`, or the
launcher's own error); `end` closes and seals the run, or keeps its outcome on disk when the store
would not take it. The recorder starts no process
and prints nothing: what the person watching should see goes to its `view` callback as `Total` (the
progress bar's length) and `Line` (a warning) events, and the caller decides where they are drawn.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness import events, tags as T
from harness.config import flatten, to_container
from harness.configschema import ExperimentConfig
from harness.errors import EXIT_FAILED, EXIT_OK, HarnessError
from harness.judge.delta import setting_risk
from harness.messages import (
    Checkpoint,
    DataOrder,
    Determinism,
    DeterminismChanged,
    Evaluation,
    Final,
    Fingerprint,
    Initial,
    Loop,
    Message,
    Metrics,
    MetricsBatch,
    Notice,
    Optimization,
    Performance,
    RankFacts,
    SegmentEnd,
    SettingChange,
    Total,
    UserSeeds,
    WeightsSketch,
)
from harness.record import closing, wholeness
from harness.record.provenance import package_lock, runtime_facts
from harness.record.results import record_performance, record_results
from harness.rundata import own_metric
from harness.runtime import usermlflow, userseed
from harness.runtime.plan import UNSTEERED, LaunchPlan
from harness.secrets import known_values, scrub
from harness.store.outages import Outages, Patient
from harness.store.seriesfile import save_series
from harness.store.tracking import Tracker
from harness.store.uris import absolute_uri

if TYPE_CHECKING:
    from harness.rundata import RunRecord
    from harness.store.writers import Heartbeat, MetricWriter

ENV_DIGEST = "HARNESS_IMAGE_DIGEST"  # a container cannot learn its own digest: the docker backend tells it


@dataclass(frozen=True)
class Line:
    """A line for the person watching the run: a warning while the ranks run, or once they ended."""

    text: str


Shown = Total | Line  # what the recorder has to show; `Total` is rank 0's own message, passed on


@dataclass(frozen=True)
class Failed:
    """The ranks failed (or the record refused how they ended): the job's one line, and what the record keeps."""

    message: str
    rank: int | None  # the failing rank; None when no rank is to blame
    traceback: str  # the failing rank's traceback (its one line when that says it all)
    expected: bool = True  # the one line says it all: no traceback for the terminal
    signal: str | None = None  # the failing rank was killed by this signal, from outside (SIGKILL: OOM, kill -9)


@dataclass(frozen=True)
class Killed:
    """The ranks were stopped by a signal (Ctrl-C, SIGTERM, a scheduler's cancel)."""

    message: str
    exit_code: int


@dataclass(frozen=True)
class Closed:
    """How the recorder closed the run."""

    status: str  # FINISHED | FAILED | KILLED
    exit_code: int
    message: str
    fingerprints: dict[int, str]


def open_checkpoints(tracker: Tracker, run_id: str, cfg: ExperimentConfig, resume_step: int | None) -> Any:
    """The run's checkpoints (checkpoints.CheckpointStore), None when it neither saves nor loads any."""
    if cfg.checkpoint_every <= 0 and resume_step is None:
        return None
    # Here, not at the top: the checkpoint store loads torch, and the backends that import this module are
    # loaded by every command that names one (config validation) - `harness check` and refusals stay light.
    from harness.record import checkpoints as checkpoint_store

    return checkpoint_store.open_for(tracker, run_id)


def checkpoint_plan(store: Any, cfg: ExperimentConfig, resume_step: int | None,
                    steering: LaunchPlan = UNSTEERED) -> LaunchPlan | None:
    """The launch's plan for its ranks: `steering` (its recorded part) with the run's checkpoint store. Checkpoints
    live in the run's own artifacts (through a staging folder for a server's), so the MLflow UI lists them with the
    run. The recorded part travels whether or not the run checkpoints: its `stop_at` (replay --steps K) stops the
    ranks where step K would begin, at the same boundary an audit segment ends at."""
    if store is None and not steering.steered:
        return None
    if store is None:
        return steering.with_store("", 0, None)
    return steering.with_store(str(store.directory), cfg.checkpoint_every, resume_step)


class Recorder:
    """One job's record, written from rank 0's messages; it knows nothing of how the ranks were started.

    `work` is the job's work folder: the ranks' logs in `work/logs`, their outputs in `work/outputs`; what
    the store does not take is moved from there to ~/.cache/harness/unsent/<run id>.
    """

    def __init__(self, tracker: Tracker, run_id: str, cfg: ExperimentConfig, work: Path,
                 view: Callable[[Shown], None], resume_step: int | None = None,
                 steering: LaunchPlan = UNSTEERED) -> None:
        self.tracker, self.run_id, self.cfg, self.work = tracker, run_id, cfg, work
        self.view = view
        self.resume_step = resume_step
        self.steering = steering
        # What is written onto the run after its closing writes and before its seal (executors' Job.judge).
        self.judge: Callable[[str, str, str], None] | None = None
        self.outages = Outages()  # the store going away mid-run: writes are retried, the run records it
        self.writer: MetricWriter | None = None
        self.heartbeat: Heartbeat | None = None
        self.ckpts: Any = None
        self.lock: Future[Any] | None = None
        self.plan: LaunchPlan | None = None  # where the ranks save and load checkpoints (set by start)
        self.fingerprints: dict[int, str] = {}
        self.notices: dict[str, str] = {}  # the ranks' warnings about the record, by kind
        self.final: dict[str, Any] = {"checkpoints": {}, "checkpoint_tensors": {}, "data_order": {}, "notices": self.notices,
                                      "determinism_changes": []}
        self.warned: set[tuple[str | None, str]] = set()  # strict: each call that broke bitwise is warned about once
        # A resumed run continues the record so far: what it holds before the resumed step stays on record.
        self.prior: RunRecord | None = None
        self.prior_direct: set[str] = set()  # the metrics the run it continues logged through MLflow directly
        if resume_step is not None:
            prior = self.prior = tracker.load_record(run_id)
            final = self.final
            self.fingerprints.update({k: v for k, v in prior.fingerprints.items() if k < resume_step})
            final["checkpoints"] = {k: v for k, v in prior.checkpoints.items() if k <= resume_step}
            final["checkpoint_tensors"] = {k: v for k, v in (prior.checkpoint_tensors or {}).items() if k <= resume_step}
            final["data_order"] = {k: v for k, v in prior.data_order.items() if k < resume_step}
            # Changes made before the resumed step stay on record; the resumed ranks' own readings follow them.
            earlier = (SettingChange.from_line(line) for line in prior.facts.get(T.DETERMINISM_CHANGES, "").splitlines())
            final["determinism_changes"] = [c for c in earlier if c is not None and c.step < resume_step]
            self.prior_direct = set(filter(None, prior.facts.get(T.USER_MLFLOW_METRICS, "").split(",")))

    # -- start ------------------------------------------------------------------------------------------
    def start(self, device: str, backend: str, measured: Mapping[str, str] | None = None,
              lock: Future[list[str]] | None = None) -> None:
        """The ranks are about to start on `device` with `backend`: record where, and open the run's writers.
        `measured`: the torch facts a rank took (provenance.torch_facts), if one did; `lock`: the package lock
        another run of the same launch is reading (`lock_lines`), else read here."""
        tracker, run_id, cfg, resume_step = self.tracker, self.run_id, self.cfg, self.resume_step
        facts = {T.ENV_PREFIX + k: v for k, v in runtime_facts(measured).items()}
        facts.update({T.DEVICE: device, T.BACKEND: backend})
        # Where the ranks run: inside the pinned image only if the docker backend said so.
        in_image = bool(os.environ.get(ENV_DIGEST))
        facts[T.IN_IMAGE] = str(in_image).lower()
        if in_image:
            facts[T.IMAGE_NOTE] = f"ran inside the pinned image {os.environ[ENV_DIGEST]}"
        tracker.set_tags(run_id, facts)
        # The params say what the ranks run on: an "auto" of the config (as asked, in config.yaml) is resolved only
        # here, so its param was left for now (record/newrun.py). A replay, a resume, pins the recorded values.
        asked = flatten(cfg)
        resolved = {k: v for k, v in {"device": device, "backend": backend}.items() if asked.get(k) == "auto"}
        if resolved:
            tracker.log_params(run_id, resolved)
        # Where the ranks run: every installed distribution (seconds to read), written while they start.
        lines = lock or lock_lines()
        self.lock = _in_thread(lambda: tracker.log_text(run_id, "\n".join(lines.result()) + "\n", T.ARTIFACT_LOCK))

        self.heartbeat = tracker.heartbeat(run_id, cfg.heartbeat_s, self.outages)
        self.ckpts = open_checkpoints(tracker, run_id, cfg, resume_step)
        if self.ckpts is not None:
            if resume_step is not None and not self.ckpts.fetch(resume_step, cfg.world_size):
                raise HarnessError(f"run {run_id} has no complete checkpoint of step {resume_step} in its artifacts.")
            self.ckpts.start_uploads(self.outages)
        self.plan = checkpoint_plan(self.ckpts, cfg, resume_step, self.steering)
        self.writer = tracker.metric_writer(run_id, cfg.flush_interval_s, self.outages)
        if self.prior is not None:
            # Not the values the training code logged through MLflow itself: they are MLflow's history, not the writer's.
            self.writer.prime({k: v for k, v in self.prior.metrics.items() if k not in self.prior_direct})

    def rank_env(self) -> dict[str, str]:
        """The environment rank 0 needs so that the user's own mlflow calls land in this run, never in a store
        of the code folder."""
        run = self.tracker.get_run(self.run_id)
        return usermlflow.run_env(absolute_uri(self.tracker.client_uri), self.run_id, run.experiment_id, run.experiment)

    # -- while the ranks run ------------------------------------------------------------------------------
    def feed(self, msg: Message) -> None:
        """One message from rank 0 (called from the launcher's message thread)."""
        final, writer = self.final, self.writer
        assert writer is not None, "Recorder.feed before start"
        match msg:
            case Metrics(step, values, unix_ms):
                writer.add(step, values, unix_ms)
            case MetricsBatch():
                writer.add_batch(msg)
            case Fingerprint(step, sha256):
                self.fingerprints[step] = sha256
            case Final(sha256, steps, of):
                final["fingerprint"], final["steps_total"], final["of"] = sha256, steps, of
            case SegmentEnd(step, sha256, _) if self.steering.stop_at is not None:
                # replay --steps K stopped every rank where step K would begin: its weights there are the ones it
                # ends with, which the judge holds to the original's checkpoint of step K where there is one.
                final["fingerprint"], final["steps_total"] = sha256, step
            case WeightsSketch():
                final["sketch"] = msg
            case DataOrder(steps, digests):
                final["data_order"].update(zip(steps, digests))
            case Evaluation(keys):
                final["evaluation"] = dict(keys)
            case Loop(name):
                final["loop"] = name
            case Performance():
                final["performance"] = msg
            case Optimization() if self.prior is None or T.OPTIMIZER not in self.prior.facts:
                # A resumed run keeps the set-up its run recorded at the first step (its own first step is later).
                final["optimization"] = msg
            case Notice(key, text):
                self.notices.setdefault(key, text)
                self.view(Line(f"Warning: {text}"))
            case Initial(sha256):
                final["initial"] = sha256
            case Determinism(settings, env):
                final["determinism"], final["vars"] = dict(settings), env
                final["determinism_start"] = dict(settings)
            case RankFacts(device, conf):
                final["rank_facts"] = {**{T.DEVICE_PREFIX + k: v for k, v in device.items()},
                                       **{T.NCCL_CONF_PREFIX + k: v for k, v in conf.items()}}
            case DeterminismChanged(changes):
                # The tags say what was in force: the last reading (the start values stay in the changes).
                final["determinism"].update({c.setting: c.after for c in changes})
                if self.prior is not None:
                    # A resumed process runs train()'s own switches again: the same transition by the same
                    # line before the resume step is the change already recorded, not a second one.
                    known = {(c.setting, c.before, c.after, c.where) for c in final["determinism_changes"]}
                    changes = tuple(c for c in changes if (c.setting, c.before, c.after, c.where) not in known)
                final["determinism_changes"].extend(changes)
                for line in strict_warnings(self.cfg.determinism.level.value, changes, self.warned):
                    self.view(Line(line))
            case UserSeeds(calls):
                final["user_seeds"] = calls
                fixed = userseed.foreign(calls, self.cfg.seed, self.cfg.rank_seeds)
                if fixed and "user-seeds" not in self.notices:
                    text = userseed.foreign_warning(fixed, self.cfg.seed)
                    self.notices["user-seeds"] = text
                    self.view(Line(f"Warning: {text}"))
            case Total():
                self.view(msg)
            case Checkpoint(step, sha256, tensors, ranks):
                final["checkpoints"][step] = sha256
                final["checkpoint_tensors"][step] = {"tensors": tensors, "ranks": list(ranks)}
                self.ckpts.completed(step)

    def note(self, key: str, text: str) -> None:
        """A warning about the record of the launcher's own (not a rank's), kept with the ranks' notices."""
        self.notices.setdefault(key, text)

    def ranks_done(self) -> Failed | None:
        """The ranks ended well: the run is whole once its package lock is written (its error raised here); a
        resumed run that logged other values than the run it continues is not its continuation (Failed)."""
        assert self.lock is not None and self.writer is not None, "Recorder.ranks_done before start"
        self.lock.result()
        if self.writer.conflict is None:
            return self._hole()
        key, at, was, now = self.writer.conflict
        line = (f"the resumed run logged {key}={now!r} at step {at}, where the run it continues had logged {was!r}: "
                "it is not the uninterrupted run's continuation (both values are kept in MLflow's history). "
                f"Replay the run from its start instead: harness replay {self.run_id} --allow-incomplete.")
        return Failed(line, None, line)

    def _hole(self) -> Failed | None:
        """A step that ran but that no series of the record holds (wholeness.holes): the record is not what ran."""
        found = wholeness.holes(self.writer.series if self.writer is not None else {}, self.final.get("evaluation") or {})
        if not found:
            return None
        where = wholeness.shown(found[0])
        if self.resume_step is not None and found[0][1] < self.resume_step:
            line = (f"the record of run {self.run_id} holds no value at {where}, before step {self.resume_step} this "
                    f"resume continued from (its launcher was killed before it recorded them): it is not the whole run. "
                    f"Resume it again (harness resume {self.run_id} re-executes from the last checkpoint at or before "
                    f"step {found[0][0]}).")
        else:
            line = (f"the record of run {self.run_id} holds no value at {where} ({T.METRIC_LR}, logged at every "
                    f"optimizer step, included), though its ranks ran them: it is not the whole run. Rerun it: "
                    f"harness replay {self.run_id} --allow-incomplete.")
        return Failed(line, None, line)

    # -- the end --------------------------------------------------------------------------------------
    def end(self, ended: Failed | Killed | BaseException | None = None,
            collect: Callable[[], None] | None = None) -> Closed:
        """Close the run: FINISHED when `ended` is None, else FAILED or KILLED as it says. Any other error (the
        launcher's own) is recorded as the reason the run FAILED and raised again once the run is closed.

        `collect()`, when given, runs among the closing writes before the logs are recorded (other nodes' rank
        logs into work/logs); its failure leaves the record incomplete, as a failed write does."""
        tracker, run_id = self.tracker, self.run_id
        status, code, message = T.FAILED, EXIT_FAILED, ""
        failure_text = ""  # the failing rank's traceback, shown once the ranks have ended
        try:
            match ended:
                case None:
                    status, code = T.FINISHED, EXIT_OK
                case Failed(line, rank, tb, expected, killed):
                    line, tb = scrub(line), scrub(tb)  # an exception's text: a URL's password goes no further
                    failure_text = "" if expected else tb
                    message = line
                    tracker.log_text(run_id, f"rank: {rank}\n\n{tb}", T.ARTIFACT_FAILURE)
                    tracker.set_tags(run_id, {**({T.FAILED_RANK: str(rank)} if rank is not None else {}),
                                              T.STATUS_REASON: message,
                                              **({T.FAILED_SIGNAL: killed} if killed else {})})
                case Killed(line, exit_code):
                    status, code, message = T.KILLED, exit_code, line
                    tracker.set_tags(run_id, {T.STATUS_REASON: message})
                case BaseException():
                    raise ended
        except BaseException as err:
            message = str(err)
            tracker.set_tags(run_id, {T.STATUS_REASON: closing.cut(message)})
            raise
        finally:
            if self.lock is not None:  # the lock's write ends before the run is closed, whatever happened
                from concurrent.futures import wait

                wait([self.lock])
            if failure_text:
                self.view(Line(failure_text.rstrip()))
            self._close(status, message, collect)
        return Closed(status, code, message, self.fingerprints)

    def _close(self, status: str, message: str, collect: Callable[[], None] | None) -> None:
        """The closing writes, then the run ended as `status` (see _close_run)."""
        # End-of-run writes wait for a store that is briefly away (HARNESS_STORE_OUTAGE_S); past that,
        # the outcome is kept on disk and the error says where.
        run_id, writer, ckpts, outages = self.run_id, self.writer, self.ckpts, self.outages
        patient = Patient(self.tracker, outages)
        outages.closing()
        failed_write: Exception | None = None
        try:
            if self.heartbeat is not None:
                self.heartbeat.close()
            if writer is not None:
                # The exact series is written (compressed: ~1 s a million points) while the store takes the last
                # points: both release the GIL for most of their time. The ranks are done: the series is final.
                with ThreadPoolExecutor(1, thread_name_prefix="harness-series") as pool:
                    saved = pool.submit(save_series, writer.series, self.work / "series.npz")
                    try:
                        writer.close()
                    finally:
                        saved.result()
            if ckpts is not None:
                self._record_unannounced_checkpoints()
                ckpts.close()
            if collect is not None:
                collect()
            resume_step = self.resume_step
            logs = T.ARTIFACT_LOGS_DIR if resume_step is None else f"{T.ARTIFACT_LOGS_DIR}/resume-from-{resume_step}"
            hidden = known_values(to_container(self.cfg), os.environ)
            record_results(patient, run_id, self.fingerprints, self.final, self.work, logs, hidden)
            record_performance(patient, run_id, self.final.get("performance"), self.work)
            direct = self._note_direct_metrics(patient, set(writer.series)) if writer is not None else []
            if status == T.FINISHED:
                self._warn_if_vacuous(patient, direct)
            patient.set_tags(run_id, outages.tags())
            if ckpts is not None:
                ckpts.cleanup()
            if self.judge is not None:  # the record complete: judged now, so that the seal holds the verdict
                self.judge(run_id, status, message)
        except Exception as err:  # the record is incomplete: whatever ran, the run cannot be FINISHED
            failed_write = err
        closing.close_or_keep(patient, self.run_id, status, message, failed_write, outages=outages, keep=self._keep_outcome)

    def _record_unannounced_checkpoints(self) -> None:
        """Steps complete on disk whose Checkpoint message never came (rank 0 was killed after writing the marker,
        before the message left): recorded from their markers, as the message would have been, and uploaded."""
        for step, digests in sorted(self.ckpts.saved(self.cfg.world_size).items()):
            if step not in self.final["checkpoints"]:
                self.feed(Checkpoint(step, digests["sha256"], digests["tensors"], tuple(digests["ranks"])))

    def _keep_outcome(self, status: str, message: str) -> Path:
        """What the store could not take, moved out of the work folder (which is removed) to a lasting one."""
        work, writer = self.work, self.writer
        if writer is not None:
            save_series(writer.series, work / "series.npz")
        doc = {
            "run_id": self.run_id, "status": status, "status_reason": message, "tags": self.outages.tags(),
            "metrics_not_written": writer.pending if writer is not None else 0,
            "fingerprints": {str(k): v for k, v in sorted(self.fingerprints.items())},
            "final": self.final,  # fingerprints, checkpoints, determinism settings and variables: the tags not written
        }
        (work / "outcome.json").write_text(json.dumps(doc, indent=2, default=str))
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "harness" / "unsent"
        base.mkdir(parents=True, exist_ok=True)
        kept = base / self.run_id
        shutil.rmtree(kept, ignore_errors=True)
        shutil.move(str(work), str(kept))
        return kept

    def _note_direct_metrics(self, tracker: Tracker | Patient, ctx_keys: set[str]) -> list[str]:
        """Metrics the training code logged through MLflow itself, named in a tag: series.npz holds ctx.log's values,
        and the record reads these back from MLflow's history by that tag (Tracker.load_record), so that a replay
        judges them too. Returns their keys."""
        keys = usermlflow.direct_keys(tracker.get_run(self.run_id).metric_keys, ctx_keys)
        if keys:
            tracker.set_tags(self.run_id, {T.USER_MLFLOW_METRICS: ",".join(keys)})
        return keys

    def _warn_if_vacuous(self, tracker: Tracker | Patient, direct: list[str]) -> None:
        """A finished run that logged nothing (through ctx.log or MLflow's own calls, `direct`), or whose model never
        changed, proves nothing: say so, and record it."""
        writer, final = self.writer, self.final
        initial, last = final.get("initial"), final.get("fingerprint")
        if writer is not None and not direct and all(own_metric(key) for key in writer.series):  # harness's own values prove nothing
            if initial or last:
                self.view(Line("Warning: the run logged no metrics (call ctx.log(...) in train); a replay can only "
                               "compare the model's fingerprints."))
            else:
                self.view(Line("Warning: the run logged no metrics and registered no model (ctx.log(...), "
                               "ctx.ddp(model)): a replay will have nothing to compare."))
        if initial and last:
            changed = initial != last
            tracker.set_tags(self.run_id, {T.INITIAL_FINGERPRINT: initial, T.WEIGHTS_CHANGED: str(changed).lower()})
            if not changed:
                self.view(Line("Warning: the model's weights never changed (its fingerprint at the end equals the one "
                               "at ctx.ddp): nothing was trained. Check the loss, the learning rate and "
                               "optimizer.step()."))


def lock_lines() -> Future[list[str]]:
    """Every installed distribution (provenance.package_lock), read in a thread: seconds, while the ranks start."""
    return _in_thread(package_lock)


def _in_thread(fn: Callable[[], Any]) -> Future[Any]:
    """A future of fn(), run in a thread of its own (a store write that need not hold up the ranks)."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="harness-lock")
    try:
        return pool.submit(events.carry(fn))
    finally:
        pool.shutdown(wait=False)


def strict_warnings(level: str, changes: tuple[SettingChange, ...], warned: set[tuple[str | None, str]]) -> list[str]:
    """Under strict, one warning per call of the training code that made bitwise results impossible (`warned`:
    the calls already warned about, updated)."""
    if level != "strict":
        return []
    lines = []
    for c in changes:
        risk = setting_risk(c.setting, c.after)
        what = c.call or f"{c.setting} = {c.after}"
        if risk is None or (c.where, what) in warned:
            continue
        warned.add((c.where, what))
        who = c.where or f"the training code (seen at step {c.step}, {c.when})"
        lines.append(f"Warning: {who} set {what} under determinism.level=strict: {risk}. Recorded in "
                     f"{T.DETERMINISM_CHANGES}; remove that line to keep strict's guarantee, or set determinism.level=off.")
    return lines


