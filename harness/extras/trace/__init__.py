"""`harness trace` and op-level localisation: a step's every op traced in real ranks, two traces diffed to the first
op that differs, and a DIVERGED replay localised (replay --localize, bisect --localize)."""

from harness.extensions import COMPARE, LOCALIZE, STEP_TRACER, Extra

EXTRA = Extra(
    "trace", cli="harness.extras.trace.cli", api="harness.extras.trace.api",
    names=("TraceOptions", "trace"),
    hooks={LOCALIZE: "harness.extras.trace.command:after_replay", COMPARE: "harness.extras.trace.api:compare_traces",
           STEP_TRACER: "harness.extras.trace.rank:step_tracer"},
)
