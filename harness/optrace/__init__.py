"""Per-op tracing of a training step: the tracer, the rules that name a likely cause, and the report."""
