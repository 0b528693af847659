"""What a rank's context does between the training code's calls: at its step boundaries (a step begins, ends, or is
about to fetch its first batch: checkpoints saved and loaded back, audit stops, the traced step, the step timer,
determinism read back), over the training loader's batches, and on its link to the launcher (messages, notices,
signs of life).

Context (harness/runtime/context.py), the training API, is a Stepping: the calls the training code makes are there,
this is what they and the step clock set going.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from harness.errors import ExperimentError
from harness.messages import Fingerprint, Initial, Loop, Message, Notice, SegmentEnd
from harness.runtime import (
    boundaries,
    checkpoint as ckpt,
    determinism,
    loaders,
    optimization,
    optimtrack,
    perf,
    sharding,
    states,
)
from harness.runtime.checkpoint_steps import CheckpointSteps, framework_folder
from harness.runtime.dataorder import SampleOrder
from harness.runtime.fingerprint import fingerprint
from harness.runtime.outbox import Outbox
from harness.runtime.perturb import MemberNudge
from harness.runtime.plan import LaunchPlan
from harness.runtime.steps import StepClock, optimizer_parameters
from harness.runtime.tracing import StepTrace


class StopSegment(BaseException):
    """Raised out of the training loop when an audit segment reaches its end (not an error)."""


class Stepping:
    """The step-boundary half of a rank's context; Context.__init__ sets the state below."""

    rank: int
    world_size: int
    device: torch.device
    clock: StepClock
    _plan: LaunchPlan | None
    _checkpoints: CheckpointSteps
    _trace: StepTrace
    _timer: perf.StepTimer
    _outbox: Outbox | None  # only rank 0 holds one
    _progress: Callable[[int], None] | None  # tells the launcher this rank is alive, and at which step
    _noted: set[str]  # notices already sent
    _optimization: optimization.Watch | None
    _model: torch.nn.Module | None
    _stepped_params: torch.nn.Module | None  # the optimizer's parameters, when no model is registered
    _tracked: dict[str, Any]
    _loaders: list[DataLoader]
    _train_loader: DataLoader | None
    _shards: int  # > 0: world-size-invariant mode
    _data_order: SampleOrder
    _next_fingerprint: int
    _fingerprints: dict[int, str]  # rank 0: the fingerprints sent, by step
    _resume: tuple[ckpt.TrainingPosition, dict] | None  # until the first batch after it
    _epoch: int
    _epoch_start_generator: torch.Tensor | None
    _driver: str | None  # what drives the loop: "loader", "steps" or None (a loop of the user's own)
    _framework: str | None  # the framework whose loop runs the steps or feeds their batches
    _loop_sent: bool
    _sketched: bool  # plan.sketch_at's sketch was sent
    _digested: bool  # plan.digest_at's SegmentEnd was sent
    _copies: states.Copies  # rank 0: the live copies of the registered model seen at checkpoints
    _initial_fingerprint: str | None  # rank 0: the registered model's, when it was registered
    _member: MemberNudge | None  # a calibration member's nudge (harness calibrate); None: not a nudged member

    def _send(self, message: Message | None) -> None:
        if self._outbox is not None and message is not None:
            self._outbox.send(message)

    def _notice(self, key: str, text: str) -> None:
        """A one-line warning for the launcher to print and record, once per context."""
        if key not in self._noted:
            self._noted.add(key)
            self._send(Notice(key, text) if self.rank == 0 else None)

    def _beat(self, step: int) -> None:
        if self._progress is not None:
            self._progress(step)

    def _beat_now(self) -> None:
        self._beat(self.clock.index)

    def _beating(self, batches: Iterator[Any]) -> Iterator[Any]:
        """Another loader's batches (validation): each one is progress too."""
        for batch in batches:
            self._beat(self.clock.index)
            yield batch

    def _fingerprinted(self) -> torch.nn.Module | None:
        """What the fingerprints hash: the registered model, else the parameters the counted optimizer steps."""
        if self._model is not None:
            return self._model
        if self._stepped_params is None and self.clock.counted is not None:
            self._stepped_params = optimizer_parameters(self.clock.counted)
        return self._stepped_params

    def _checkpointed(self) -> torch.nn.Module:
        """What a checkpoint holds as its model: the registered one, else the tracked optimizer's parameters."""
        if self._model is not None:
            return self._model
        optimizer = self._tracked.get("optimizer")
        if optimizer is None:
            raise ExperimentError(
                "checkpoint_every is set but no model is registered: call ctx.ddp(model) (ctx.register(model) where "
                "the script wraps DDP itself), or ctx.track(optimizer), whose parameters are then checkpointed, or set "
                "checkpoint_every: 0."
            )
        if self._stepped_params is None:
            self._stepped_params = optimizer_parameters(optimizer)
        return self._stepped_params

    def _on_first_step(self, optimizer: Any) -> None:
        if self._model is None:
            # No ctx.ddp (a script's own DDP): the weights are the parameters this optimizer steps. A calibration
            # member nudged them when the optimizer was made (perturb.MemberNudge); one made some other way is
            # nudged here, before its first update.
            params = optimizer_parameters(optimizer)
            if self._member is not None:
                self._member.apply(params)
            if self.rank == 0:
                self._send(Initial(fingerprint(params)))

    def _on_optimizer(self, phase: str, optimizer: Any) -> None:
        self._trace.optimizer_event(phase, optimizer)
        if phase == "pre" and self._optimization is not None and self._outbox is not None:
            values, first = self._optimization.on_step(optimizer)
            if first:  # the set-up as the first step found it: a run killed later still has it on record
                self._send(self._optimization.message())
            if values:
                self._outbox.add(self.clock.index, values, int(time.time() * 1000))

    def _coming_step(self) -> int:
        """The step whose work is under way, or comes next once the previous one has ended."""
        clock = self.clock
        return clock.done if clock.pending else clock.index

    def _on_begin(self, step: int, clean: bool) -> None:
        """Step `step`'s work has begun (`clean`: at a fetch or ctx.steps() iteration, nothing of it ran yet)."""
        self._send(determinism.observe(step, determinism.FIRST_STEP))  # determinism read-back: the first step
        self._send_loop()
        self._trace.end(before=step)
        self._check_stop(step)
        if not clean:
            self._note_unsaved(step)
        if self._trace.wanted(step) and (clean or self._trace.tracer is None):
            self._trace.start(step, self._model)
        self._timer.begin(step)

    def _on_end(self, step: int) -> None:
        """The counted optimizer finished step `step`. A loop of the user's own shows no other boundary: its
        step K is traced from the end of step K-1 to the end of step K."""
        self._timer.end(step)
        if self._driver is None:
            # A loop of the user's own shows its next step only at the model's forward or the optimizer's step: the
            # next step is timed (and profiled) from here, its own batch drawing included.
            self._timer.starting(step + 1)
            self._trace.end(before=step + 1)
            if self._trace.wanted(step + 1):
                self._trace.start(step + 1, self._model)

    def _before_step(self, step: int, position: ckpt.TrainingPosition) -> None:
        """A clean boundary: nothing of `step` has run yet (checkpoints are saved here, audits stop here)."""
        self._send(determinism.observe(step, determinism.FIRST_STEP))  # read back before a checkpoint takes it
        self._send_loop()
        self._trace.end(before=step)
        self._maybe_checkpoint(position)
        self._maybe_sketch(step)
        self._check_stop(step)
        self._timer.starting(step)

    def _maybe_sketch(self, step: int) -> None:
        """Rank 0, where the plan asks for it (harness calibrate): the weights after `step` steps, folded small
        (harness/runtime/sketch.py), once - at this boundary, or at the end of a run that took exactly that many."""
        plan = self._plan
        if plan is None or plan.sketch_at != step or self._sketched or self.rank != 0:
            return
        self._sketched = True
        target = self._fingerprinted()
        if target is None:
            return
        from harness.runtime.sketch import sketch

        try:
            self._send(sketch(target, step))
        except Exception as err:  # a measurement, never a reason for the training to fail (a sharded tensor, say)
            self._notice("sketch", f"the weights after step {step} were not sketched ({type(err).__name__}: "
                                   f"{err}): the calibration's weights' distance is not recorded or judged for them")

    def _check_stop(self, step: int) -> None:
        plan = self._plan
        if plan is not None and plan.digest_at == step and not self._digested:
            self._digested = True
            self._send(self._segment_end(step))
        if plan is not None and plan.stop_at is not None and step >= plan.stop_at:
            self._trace.end()
            self._send(self._segment_end(step))
            raise StopSegment()

    def _note_unsaved(self, step: int) -> None:
        """A checkpoint is due but this step began where harness cannot restart a loop."""
        plan = self._plan
        if plan is None or not self._checkpoints.due(step) or self._framework == boundaries.TRANSFORMERS:
            return  # the Trainer's own checkpoints are the run's (harness.transformers)
        loop = self._loop()
        if loop not in (boundaries.LOADER, boundaries.STEPS):
            cause, fix = boundaries.why(loop)
            what = f"no checkpoint at step {step} or after: {cause}"
        else:
            what, fix = f"no checkpoint at step {step}: {boundaries.PREFETCH[0]}", boundaries.PREFETCH[1]
        self._notice(
            "no-checkpoint",
            f"checkpoint_every={plan.every}: {what}, so harness has no step boundary to save at or resume from there. "
            f"{fix}",
        )

    def _loop(self) -> str:
        """What drives the steps (boundaries.LOADER, ...). Lightning's Trainer runs its loop whatever it iterates."""
        if self._framework == boundaries.LIGHTNING:
            return self._framework
        if self._driver is not None:
            return boundaries.LOADER if self._driver == "loader" else boundaries.STEPS
        return self._framework or boundaries.OWN

    def _send_loop(self) -> None:
        if not self._loop_sent:
            self._loop_sent = True
            self._send(Loop(self._loop()))

    def _loop_of(self, framework: str) -> None:
        """The framework (boundaries.LIGHTNING, .ACCELERATE) runs the loop or feeds its batches. For the framework
        integrations."""
        self._framework = framework

    def _train_iter(self, loader: loaders.Loader) -> Iterator[Any]:
        """Hand out the training batches of one epoch; checkpoint before fetching a step's first batch."""
        epoch, first = self._epoch, 0
        if self._driver is None:
            self._driver = "loader"
        loader._harness_raw = True  # iter(loader) inside here must be DataLoader's own
        try:
            if self._resume is not None and self._resume[0].epoch == epoch:
                position, rng = self._resume
                iterator = loaders.resume_iterator(loader, position)  # replays this epoch's first batches
                self._epoch_start_generator = position.epoch_start_generator
                ckpt.set_rng_state(rng, self.device)  # after the replay: it drew from the RNGs as the original did
                self._resume, first = None, position.batch_in_epoch
            else:
                self._epoch_start_generator = ckpt.generator_state(loader.generator)
                iterator = iter(loader)
        finally:
            loader._harness_raw = False
        n = len(loader)
        clock = self.clock
        order = loaders.batch_order(loader)
        for i in range(first, n):
            if clock.would_begin():
                # Before the batch is fetched: fetching draws from the RNGs (workers, augmentation).
                step = clock.done if clock.pending else clock.index
                self._before_step(step, ckpt.TrainingPosition(step, epoch, i, self._epoch_start_generator))
            fetch = time.perf_counter()
            try:
                batch = next(iterator)
            except StopIteration:
                return
            self._timer.fetched(time.perf_counter() - fetch,
                                len(order[i]) * (1 if self._shards else self.world_size) if order is not None and i < len(order) else 0)
            step = clock.begin(clean=True)  # a micro-batch of a step already begun only beats
            if order is not None and i < len(order):
                self._data_order.add(step, order[i])
            yield batch

    def _maybe_checkpoint(self, position: ckpt.TrainingPosition) -> None:
        if not self._checkpoints.due(position.step):
            return
        # The data order so far rides along: a run resumed from here records every step's, not only those after it.
        # So do the fingerprints sent so far: a launcher killed before it wrote them leaves them to the resume.
        extra = {"next_fingerprint": self._next_fingerprint, "data_order": ckpt.pack_digests(self._data_order.own()),
                 "fingerprints": ckpt.pack_digests(self._fingerprints)}
        flush = self._outbox.flush if self._outbox is not None else None
        untracked = self._untracked_copies(position.step) + self._settle_optimizer(position.step)
        self._send(self._checkpoints.save(position, self._checkpointed(), self._loaders, self._train_loader, extra,
                                          self._tracked, flush, untracked))
        self._send(determinism.observe(position.step, determinism.CHECKPOINT))  # determinism read-back: checkpoint saved

    def _untracked_copies(self, step: int) -> list[dict[str, str]]:
        """Rank 0: the live copies of the registered model that ctx.track was not given (states.Copies), said once."""
        if self.rank != 0 or self._model is None:
            return []
        tracked = [obj for name, obj in self._tracked.items() if name != "states"]
        try:
            found = self._copies.untracked(self._model, [*tracked, *self._tracked.get("states", {}).values()],
                                           self._initial_fingerprint)
        except Exception as err:  # a look at the process's objects, never a reason for the training to fail
            self._notice("untracked-scan", f"the checkpoint of step {step} was not checked for untracked live copies "
                                           f"of the model ({type(err).__name__}: {err}): give any EMA or averaged "
                                           "copy to ctx.track(name=obj)")
            return []
        if found:
            self._notice("untracked-copy", (
                f"the checkpoint of step {step} does not hold {states.described(found[0])} that the steps update: a "
                f"resume from it would start it anew, so `harness resume` refuses it. Add "
                f"`{states.track_line(found[0])}` after the line that makes it."))
        return found

    def _settle_optimizer(self, step: int | None) -> list[dict[str, str]]:
        """No optimizer tracked with a model registered: the one over its parameters (optimtrack.find) is tracked, as
        ctx.track(optimizer) would, when it is the optimizer that counts the steps (or none stepped yet: a resume).
        Otherwise rank 0 says at the checkpoint of `step` that it lacks the counted optimizer's state, and returns its
        entry for the checkpoint's marker, by which `harness resume` refuses it naming the line to add."""
        counted = self.clock.counted
        if self._model is None or "optimizer" in self._tracked:
            return []
        found = optimtrack.find(self._model)
        if found is not None and counted in (None, found):
            self._tracked["optimizer"] = found
            self.clock.track(found)
            return []
        if counted is None or self.rank != 0 or step is None:
            return []
        entry = optimtrack.entry(counted, self._model)
        self._notice("untracked-optimizer", (
            f"the checkpoint of step {step} does not hold {states.described(entry)} (an optimizer left out of "
            f"ctx.track is tracked by itself only when it is the one over all of the registered model's parameters): "
            f"a resume from it would start its state anew, so `harness resume` refuses it. Add "
            f"`{states.track_line(entry)}` after the line that makes it."))
        return [entry]

    def _segment_end(self, step: int) -> SegmentEnd:
        self._settle_optimizer(None)  # the run's checkpoint at `step` holds the optimizer found there
        target = self._model if self._model is not None else self._stepped_params
        if target is None:
            return SegmentEnd(step, None)
        # Per tensor too: a segment that ends elsewhere than the run's checkpoint names the tensors that differ.
        optimizer, tracked_states = self._tracked.get("optimizer"), self._tracked.get("states")
        if sharding.holds_sharded(target):  # every rank stops here: the whole's digests, as its checkpoints have them
            mine = {**ckpt.live_tensor_fingerprints(torch.nn.Module(), None, tracked_states),
                    **sharding.digests(target, optimizer)}
            tensors, sha, _ = sharding.whole(mine, fingerprint(target), "", self.world_size)
            return SegmentEnd(step, sha, tensors)
        tensors = ckpt.live_tensor_fingerprints(target, optimizer, tracked_states)
        return SegmentEnd(step, fingerprint(target), tensors)

    def _load_resume_checkpoint(self) -> int:
        """Load plan.resume_step's checkpoint once (ctx.epochs or ctx.steps, whichever comes first); returns the
        epoch (ctx.epochs) or step (ctx.steps) to start at, 0 when there is nothing to resume."""
        if self._plan is not None and self._plan.resume_step is not None:
            self._settle_optimizer(None)  # the optimizer the checkpoint was saved with, found as it was then
        loaded = self._checkpoints.load_resume(self._checkpointed, self._loaders, self._train_loader, self._tracked)
        if loaded is None:
            return 0
        state, position = loaded
        self._resumed_at(state["extra"], position.step)
        self._resume = (position, state["rng"])
        return position.step if self._driver == "steps" else position.epoch

    def _resumed_at(self, extra: dict[str, Any], step: int) -> None:
        """The bookkeeping a checkpoint carries, taken back as the resume starts at `step`."""
        self.clock.set(step)
        self._next_fingerprint = int(extra["next_fingerprint"])
        self._fingerprints = ckpt.unpack_digests(extra.get("fingerprints"))
        for at, sha in sorted(self._fingerprints.items()):  # the record of a killed launcher lacks them
            self._send(Fingerprint(at, sha))
        # Written before data orders rode along: only the steps from the resume on are recorded.
        self._data_order.resumed(ckpt.unpack_digests(extra.get("data_order")), step)

    # -- a framework that checkpoints by itself (harness.transformers) ----------------------------------
    def _framework_checkpoint(self, step: int, keep: Callable[[Path], None], extra: dict[str, Any]) -> bool:
        """The framework saved its checkpoint after `step` steps (every rank calls this, as a collective): `keep`
        puts its folder's files into the folder it is given, and the step is the run's checkpoint - with harness's
        bookkeeping and `extra` (state of the framework's that its own checkpoint lacks) in the rank file. False
        when the launch keeps none (checkpoint_every: 0, or a re-execution)."""
        if not self._checkpoints.keeps(step):
            return False
        assert self._plan is not None
        keep(framework_folder(self._plan.directory, step))
        self._settle_optimizer(step)
        bookkeeping = {"next_fingerprint": self._next_fingerprint, "data_order": ckpt.pack_digests(self._data_order.own()),
                       "fingerprints": ckpt.pack_digests(self._fingerprints), **extra}
        flush = self._outbox.flush if self._outbox is not None else None
        self._send(self._checkpoints.save_framework(step, self._checkpointed(), self._tracked.get("optimizer"),
                                                    self._tracked.get("states") or {}, bookkeeping, flush))
        return True

    def _framework_resume(self) -> tuple[int, dict[str, Any], Path] | None:
        """A resume (or a resume's proof) of a framework's run: (the step, the `extra` saved with it, the framework's
        checkpoint folder to continue from), once; None when the launch resumes nothing."""
        loaded = self._checkpoints.load_framework()
        if loaded is None:
            return None
        state, folder = loaded
        step = int(state["position"]["step"])
        self._resumed_at(state["extra"], step)
        return step, state["extra"], folder
