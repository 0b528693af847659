"""A rank's checkpoint steps: when one is due (every plan.every steps, at a clean step boundary), saving it with its
digests and marking it complete once every rank's file is on disk, and loading plan.resume_step's back once.

A framework that runs the loop and checkpoints by itself (transformers' Trainer) saves where harness has no step
boundary of its own: its checkpoint folder becomes the step's (`framework_folder`), beside a small rank file of
harness's bookkeeping and the digests of the live tensors (save_framework), and a resume hands that folder back to
the framework (load_framework), which restores the model, optimizer, scheduler and RNGs itself.

The files themselves (what a checkpoint holds, written atomically, read back) are harness/runtime/checkpoint.py's.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from harness.errors import HarnessError
from harness.messages import Checkpoint
from harness.runtime import checkpoint as ckpt, replicas, sharding, states
from harness.runtime.fingerprint import fingerprint
from harness.runtime.plan import LaunchPlan


class CheckpointSteps:
    """The checkpoints of one rank's plan (None: a run that saves and resumes none)."""

    def __init__(self, plan: LaunchPlan | None, rank: int, world_size: int, device: torch.device) -> None:
        self._plan = plan
        self._rank, self._world_size, self._device = rank, world_size, device
        self._saved: set[int] = set()  # steps checkpointed by this rank
        self._resumed = False  # the checkpoint of plan.resume_step is loaded (by ctx.epochs or ctx.steps)

    def due(self, step: int) -> bool:
        """A checkpoint is to be saved at `step` (not the one resumed from, not one saved already)."""
        plan = self._plan
        return not (plan is None or plan.every <= 0 or step % plan.every or step == plan.resume_step
                    or step in self._saved)

    def save(self, position: ckpt.TrainingPosition, model: torch.nn.Module, loaders: Sequence[DataLoader],
             train_loader: DataLoader | None, extra: dict[str, Any], tracked: dict[str, Any],
             flush: Callable[[], None] | None, untracked: list[dict[str, str]] | None = None) -> Checkpoint | None:
        """Save this rank's checkpoint at `position` (a collective); rank 0 marks it complete and returns the message
        that announces it, after `flush` (what was logged before the step goes first). The marker names the
        `untracked` live copies of the model (states.Copies) that the checkpoint does not hold."""
        plan, step = self._plan, position.step
        assert plan is not None
        generators = {str(i): dl.generator for i, dl in enumerate(loaders) if dl is not train_loader}
        directory = Path(plan.directory)
        sharded = sharding.holds_sharded(model)
        # A sharded model and its optimizer go to DCP (sharding.save); the rank file holds the rest.
        mine = _rank_part(model, tracked) if sharded else (model, tracked)
        state = ckpt.build(
            model=mine[0], position=position, loader_generators=generators, extra=extra, device=self._device,
            copy=False, **mine[1],
        )
        if sharded:
            state[sharding.SHARDED_KEY] = {"format": sharding.DCP_FORMAT, "fingerprint": fingerprint(model),
                                           "param_groups": sharding.param_groups(tracked.get("optimizer"))}
        # Saved and digested before the loop goes on: the live CPU tensors (copy=False) are what the file holds.
        tensors = ckpt.save_with_digests(state, ckpt.path_for(directory, step, self._rank), mine[0],
                                         mine[1].get("optimizer"))
        if sharded:
            optimizer = tracked.get("optimizer")
            tensors.update(sharding.save(model, optimizer, ckpt.step_dir(directory, step)))
            # The gather is also the barrier: every rank's shards are on disk before the step is marked complete.
            tensors, sha, ranks = sharding.whole(
                tensors, state[sharding.SHARDED_KEY]["fingerprint"],
                ckpt.replica_sha256(sharding.replicated(tensors, model), model), self._world_size)
        else:
            sha = state["fingerprint"]
            # The gather is also the barrier: every rank's file is on disk before the step is marked complete.
            ranks = replicas.gather(ckpt.replica_sha256(tensors, model), self._world_size)
        self._saved.add(step)
        if self._rank != 0:
            return None
        if flush is not None:
            # What was logged before the step is in the pipe before the step is complete: a kill from here on
            # costs the record nothing that the resume from this step will not log again.
            flush()
        # The marker carries the digests the message announces: a kill between the two leaves them on disk.
        ckpt.mark_complete(directory, step, self._world_size,
                           {"sha256": sha, "tensors": tensors, "ranks": ranks,
                            **({states.UNTRACKED: untracked} if untracked else {})})
        return Checkpoint(step, sha, tensors, tuple(ranks))

    def load_resume(self, model: Callable[[], torch.nn.Module], loaders: Sequence[DataLoader],
                    train_loader: DataLoader | None, tracked: dict[str, Any]
                    ) -> tuple[dict[str, Any], ckpt.TrainingPosition] | None:
        """Load plan.resume_step's checkpoint into `model()`, `tracked` and the other loaders' generators, once; its
        state and position, or None when there is nothing (more) to resume."""
        plan = self._plan
        if plan is None or plan.resume_step is None or self._resumed:
            return None
        self._resumed = True
        state = ckpt.load(ckpt.path_for(Path(plan.directory), plan.resume_step, self._rank))
        target = model()
        sharded = state.get(sharding.SHARDED_KEY)
        if sharded is None:
            position = ckpt.restore(state, model=target, **tracked)
        else:
            rest, others = _rank_part(target, tracked)
            position = ckpt.restore(state, model=rest, **others)
            sharding.load(target, tracked.get("optimizer"), ckpt.step_dir(Path(plan.directory), plan.resume_step),
                          sharded["param_groups"])
            if fingerprint(target) != sharded["fingerprint"]:
                raise HarnessError(
                    "the restored shards' fingerprint differs from the checkpoint's (a dtype, device or sharding "
                    "change altered them). Resume with the model, dtypes and world size of the checkpointed run.")
        for i, dl in enumerate(loaders):
            key = str(i)
            if dl is not train_loader and key in state["loader_generators"]:
                ckpt.set_generator_state(dl.generator, state["loader_generators"][key])
        return state, position

    def keeps(self, step: int) -> bool:
        """A framework's checkpoint at `step` is kept as the run's (not by a re-execution, whose plan saves none, nor
        at the step resumed from: the run has it)."""
        plan = self._plan
        return not (plan is None or plan.every <= 0 or step == plan.resume_step or step in self._saved)

    def save_framework(self, step: int, model: torch.nn.Module, optimizer: Any, tracked_states: dict[str, Any],
                       extra: dict[str, Any], flush: Callable[[], None] | None) -> Checkpoint | None:
        """The checkpoint of `step` that a framework saved itself, its folder already in framework_folder (a
        collective): this rank's file of harness's bookkeeping and the digests of the live tensors (what a segment
        that stops at `step` reports, so a resume's proof holds it to them); rank 0 marks it complete."""
        plan = self._plan
        assert plan is not None
        directory = Path(plan.directory)
        state = ckpt.build(model=torch.nn.Module(), position=ckpt.TrainingPosition(step, 0, 0, None), extra=extra,
                           device=self._device)
        sha = fingerprint(model)
        state["fingerprint"] = sha  # the weights the step stands for (in the framework's folder), as audit reads it
        ckpt.save_atomic(state, ckpt.path_for(directory, step, self._rank))
        tensors = ckpt.live_tensor_fingerprints(model, optimizer, tracked_states)
        ranks = replicas.gather(ckpt.replica_sha256(tensors, model), self._world_size)  # also the barrier
        self._saved.add(step)
        if self._rank != 0:
            return None
        if flush is not None:
            flush()
        ckpt.mark_complete(directory, step, self._world_size, {"sha256": sha, "tensors": tensors, "ranks": ranks})
        return Checkpoint(step, sha, tensors, tuple(ranks))

    def load_framework(self) -> tuple[dict[str, Any], Path] | None:
        """plan.resume_step's rank file and the framework's checkpoint folder to continue from, once; None when there
        is nothing (more) to resume. A step saved by harness's own loop holds no such folder."""
        plan = self._plan
        if plan is None or plan.resume_step is None or self._resumed:
            return None
        self._resumed = True
        folder = framework_folder(plan.directory, plan.resume_step)
        if not folder.is_dir():
            raise HarnessError(
                f"the checkpoint of step {plan.resume_step} holds no framework checkpoint ({folder} is missing): it was "
                "saved by harness's own loop, not by the framework that runs this one. Resume with the code that ran.")
        return ckpt.load(ckpt.path_for(Path(plan.directory), plan.resume_step, self._rank)), folder


FRAMEWORK_FOLDER = "framework"  # a framework's own checkpoint folder inside the step's


def framework_folder(directory: str | Path, step: int) -> Path:
    """Where the checkpoint of `step` keeps the framework's own checkpoint folder."""
    return ckpt.step_dir(Path(directory), step) / FRAMEWORK_FOLDER


def keep_files(source: Path, target: Path, names: Sequence[str]) -> None:
    """`names` of folder `source` in `target`: hard links where the filesystem allows (no second copy of the weights,
    and the framework's rotation of its own checkpoints deletes its name, not the step's), copies elsewhere."""
    target.mkdir(parents=True, exist_ok=True)
    for name in names:
        src, dst = source / name, target / name
        if src.is_dir():
            shutil.copytree(src, dst, dirs_exist_ok=True)
            continue
        if dst.exists():
            dst.unlink()  # a segment that saved this step before, or a rank that kept the same file
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)


def _rank_part(model: torch.nn.Module, tracked: dict[str, Any]) -> tuple[torch.nn.Module, dict[str, Any]]:
    """What a sharded model's rank file holds: no model or optimizer (DCP holds them), the rest of `tracked`."""
    return torch.nn.Module(), {name: obj for name, obj in tracked.items() if name != "optimizer"}
