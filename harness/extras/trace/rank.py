"""The trace extra inside a rank: the op tracer of the traced step (runtime/tracing.py calls it through the
registry's STEP_TRACER point), and the bytes of the trace file it writes."""

from __future__ import annotations

from typing import Any

import torch

from harness.extras.trace.optrace import tracefile
from harness.extras.trace.optrace.tracer import OpTracer


class StepTracer(OpTracer):
    """An OpTracer of one training step that writes its own file's bytes."""

    def dumps(self) -> bytes:
        return tracefile.dumps(self.result())


def step_tracer(code_dir: str, model: torch.nn.Module | None, meta: dict[str, Any], device: torch.device) -> StepTracer:
    # The optimizer's steps are told by the runtime (optimizer_event), not hooked here.
    return StepTracer(code_dir, model=model, meta=meta, optimizer_hooks=False, device=device)
