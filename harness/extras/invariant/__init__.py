"""World-size-invariant mode: training whose results are bit-identical for any world size dividing a fixed number of
shards (docs/world-size-invariant.md). Inside a rank, ctx.ddp, ctx.backward and ctx.loader reach it through the
registry's INVARIANT point; the mode's keys (determinism.world_size_invariant, determinism.shards) stay in the
core's experiment schema, which every run is validated against."""

from harness.extensions import INVARIANT, Extra

EXTRA = Extra("invariant", hooks={INVARIANT: "harness.extras.invariant.rank:mode"})
