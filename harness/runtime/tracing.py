"""`harness trace` inside a rank: the op trace of plan.trace_step, begun and ended at the step's boundaries and written
once, whole (a trace file that exists is a whole trace). The tracer is the trace extra's (harness/extras/trace),
reached through the registry's STEP_TRACER point: the runtime imports no extra."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from harness import extensions
from harness.errors import ExperimentError
from harness.runtime.plan import LaunchPlan


class StepTrace:
    """This rank's trace of plan.trace_step, when the plan asks for one."""

    def __init__(self, plan: LaunchPlan | None, rank: int, world_size: int, shards: int, code_dir: str,
                 device: torch.device) -> None:
        self._plan = plan
        self._rank, self._world_size, self._shards = rank, world_size, shards
        self._code_dir = code_dir  # the experiment folder, fixed at start: the training code may os.chdir() away
        self._device = device
        self.tracer: Any = None  # of plan.trace_step while it runs (the trace extra's StepTracer)
        self._written = False

    def wanted(self, step: int) -> bool:
        plan = self._plan
        return plan is not None and plan.trace_step == step and self._rank in plan.trace_ranks

    def start(self, step: int, model: torch.nn.Module | None) -> None:
        """Trace step `step` from now on (a trace begun earlier for it, e.g. at train()'s start, starts over)."""
        assert self._plan is not None
        if self._written:
            return
        if self.tracer is not None:
            self.tracer.__exit__(None, None, None)
        _refuse_sharded(model)
        meta = {"step": step, "rank": self._rank, "world_size": self._world_size, "invariant_shards": self._shards}
        make = extensions.hook(extensions.STEP_TRACER)
        if make is None:
            raise ExperimentError("a trace of this step was asked for, and no extra registers the step tracer here "
                                  "(harness.extras.trace does); reinstall harness.")
        # The model is the module inside DDP (ctx.ddp keeps it): its submodules' names are the user's.
        self.tracer = make(self._code_dir, model, meta, self._device)
        self.tracer.__enter__()

    def end(self, before: int | None = None) -> None:
        """Stop tracing and write the trace (a file that exists is a whole trace); `before`: only once that step
        is past the traced one."""
        tracer, plan = self.tracer, self._plan
        if tracer is None or plan is None or (before is not None and before <= (plan.trace_step or 0)):
            return
        self.tracer = None
        tracer.__exit__(None, None, None)

        path = Path(plan.trace_dir) / f"rank{self._rank}.jsonl.gz"
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(tracer.dumps())
        tmp.replace(path)
        self._written = True

    def attach(self, model: torch.nn.Module) -> None:
        """The model registered while a trace runs: its modules from now on."""
        if self.tracer is not None:
            _refuse_sharded(model)
            self.tracer.attach(model)

    def optimizer_event(self, phase: str, optimizer: Any) -> None:
        if self.tracer is not None:
            self.tracer.optimizer_event(phase, optimizer)

    def close(self) -> None:
        """An audit stop or a failure inside the traced step: no trace is written."""
        if self.tracer is not None:
            self.tracer.__exit__(None, None, None)
            self.tracer = None


def _refuse_sharded(model: torch.nn.Module | None) -> None:
    """The op tracer (a dispatch mode) and FSDP2's resizing of its parameters' storages do not go together: torch
    raises `Trying to resize storage that is not resizable` inside the traced step. Said in one line instead."""
    from harness.runtime.sharding import holds_sharded

    if holds_sharded(model):
        raise ExperimentError(
            "harness trace cannot trace a step of a sharded (FSDP2/DTensor) model: FSDP2 resizes its parameters' "
            "storages, which the op tracer's dispatch mode refuses. Compare the runs' checkpoint digests instead "
            "(harness compare), or trace the model trained with ctx.ddp."
        )
