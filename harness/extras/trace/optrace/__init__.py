"""Per-op tracing of a training step: the tracer, the trace file, the diff, the rules that name a
likely cause, and the report."""
