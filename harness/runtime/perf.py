"""How long a rank's training steps take: per-step wall time and data-loader wait, and torch.profiler over chosen steps.

The clock costs two `time.perf_counter()` reads and a few list appends per step (benchmarks/perf_bench.py): no
collective and no device sync per step. The slowest rank's times are gathered once, at the end of training, with the
end-of-run checks (Context._wrap_up calls StepTimer.gathered). A profiled step (experiment.yaml's `profile.steps`)
runs under torch.profiler on `profile.ranks`; it computes what it would have computed (the profiler only observes),
and its wall time, inflated by the profiler, is left out of the step times.
"""

from __future__ import annotations

import json
import os
import re
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from harness.messages import Performance
from harness.runtime.plan import ProfilePlan

# The first steps a process times pay for warm-up (allocator growth, DDP's bucket rebuild, lazy kernels): their times
# are recorded, and left out of the statistics.
WARMUP_STEPS = 2
# Profiler events that are communication: collectives and point-to-point, as gloo (gloo:all_reduce, on its own
# thread), c10d (c10d::allreduce_) and NCCL (ncclDevKernel_AllReduce...) name them.
_COMMUNICATION = re.compile(
    r"all_?reduce|all_?gather|reduce_?scatter|broadcast|all_?to_?all|barrier|\bsend\b|\brecv\b|c10d::|gloo:|nccl",
    re.IGNORECASE,
)
_TABLE_ROWS = 40


def is_communication(name: str) -> bool:
    """A profiler event name that is a collective or point-to-point transfer."""
    return _COMMUNICATION.search(name) is not None


def covered(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of (start, end) intervals: overlapping collectives count once."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


@dataclass
class StepTimes:
    """One rank's timed steps, in the order they ended: step index, wall seconds, seconds waiting for ctx.loader,
    samples consumed over all ranks (0: unknown)."""

    steps: list[int]
    seconds: list[float]
    waits: list[float]
    samples: list[int]


class StepTimer:
    """Times the steps of one rank (StepClock's begin and end), and profiles the planned ones."""

    def __init__(self, rank: int, device: torch.device, plan: ProfilePlan | None) -> None:
        self.rank = rank
        self.device = device
        self.plan = plan or ProfilePlan()
        self._profiled = set(self.plan.steps)
        self._profiles_here = rank in self.plan.ranks
        self.times = StepTimes([], [], [], [])
        self._step: int | None = None  # the step being timed
        self._t0 = 0.0
        self._wait = 0.0
        self._samples = 0
        self._pending: tuple[int, float] | None = None  # a step about to fetch its first batch: (step, when)
        self._profiler: Any = None
        self.profiled: list[dict[str, Any]] = []  # the summaries this rank wrote

    # -- the clock -------------------------------------------------------------------------------
    def starting(self, step: int) -> None:
        """Step `step` is about to fetch its first batch (a clean boundary; in a loop of the user's own, the end of
        the step before): its time starts here, before the fetch, and so does its profile."""
        if step in self._profiled and self._profiles_here:
            # Started anew: a boundary seen twice (an epoch's loader ran out before its first fetch, then an evaluation
            # ran) profiles the step from the later one.
            self.close()
            self._start_profile(step)
        self._pending = (step, time.perf_counter())

    def begin(self, step: int) -> None:
        """Step `step`'s work has begun (StepClock.on_begin)."""
        if self._step is not None and self._step != step:
            self._step = None  # the previous step never ended (an optimizer step skipped): it is not timed
        pending, self._pending = self._pending, None
        if self._step == step:
            return
        self._step = step
        self._t0 = pending[1] if pending is not None and pending[0] == step else time.perf_counter()
        if (pending is None or pending[0] != step) and step in self._profiled and self._profiles_here:
            self._start_profile(step)  # (a no-op when one runs already)

    def fetched(self, wait_s: float, samples: int) -> None:
        """A batch of the training loader came after `wait_s` seconds, with `samples` samples over all ranks."""
        self._wait += wait_s
        self._samples += samples

    def end(self, step: int) -> None:
        """The counted optimizer finished step `step` (StepClock.on_end)."""
        if self._step != step:
            return
        seconds = time.perf_counter() - self._t0
        wait, samples = self._wait, self._samples
        self._step, self._wait, self._samples = None, 0.0, 0
        if self._profiler is not None:
            self._stop_profile(step, seconds)
        if step in self._profiled:
            return  # slowed by the profiler (on this rank or the one it waited for): not a step time
        times = self.times
        times.steps.append(step)
        times.seconds.append(seconds)
        times.waits.append(wait)
        times.samples.append(samples or self.plan.samples_per_step)

    def close(self) -> None:
        """Training ended or failed inside a profiled step: the profiler stops, and writes nothing."""
        if self._profiler is not None:
            profiler, self._profiler = self._profiler, None
            profiler.stop()

    def gathered(self, world_size: int, done: int) -> tuple[str | None, Performance | None]:
        """Every rank's step times, gathered once (no per-step collective; a collective itself): for rank 0, a notice
        naming planned profile steps that never ran to their end, and the Performance message - its own times, the
        slowest rank's at each step, its loader wait and samples, and the profiled steps' summaries."""
        times, mine = self.times, dict(zip(self.times.steps, self.times.seconds))
        every: list[Any] = [(mine, self.profiled)]
        if world_size > 1 and torch.distributed.is_initialized():
            every = [None] * world_size
            torch.distributed.all_gather_object(every, (mine, self.profiled))
        if self.rank != 0:
            return None, None
        ranks: list[tuple[dict[int, float], list[dict[str, Any]]]] = [e or ({}, []) for e in every]
        slowest = [max(r[0].get(step, seconds) for r in ranks) for step, seconds in zip(times.steps, times.seconds)]
        profiled = sorted((p for r in ranks for p in r[1]), key=lambda p: (p["step"], p["rank"]))
        missed = sorted(set(self.plan.steps) - {p["step"] for p in profiled})
        notice = None
        if missed:
            notice = (
                f"profile.steps {', '.join(map(str, missed))}: no such step ran to its end (the run did {done} "
                f"steps), so {'it was' if len(missed) == 1 else 'they were'} not profiled. Profile steps below "
                f"{done}, e.g. profile.steps=[{min(3, max(done - 1, 0))}].")
        if not times.steps and not profiled:
            return notice, None
        return notice, Performance(tuple(times.steps), tuple(times.seconds), tuple(slowest), tuple(times.waits),
                                   tuple(times.samples), tuple(profiled))

    # -- the profiler ----------------------------------------------------------------------------
    def _start_profile(self, step: int) -> None:
        from torch.profiler import ProfilerActivity, profile

        if self._profiler is not None:
            return
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
            torch.cuda.reset_peak_memory_stats(self.device)
        self._profiler = profile(activities=activities, record_shapes=True, profile_memory=True)
        self._profiler.start()

    def _stop_profile(self, step: int, seconds: float) -> None:
        profiler, self._profiler = self._profiler, None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        profiler.stop()
        events = [e for e in profiler.events() if e.time_range.end > e.time_range.start]
        window = (max((e.time_range.end for e in events), default=0.0)
                  - min((e.time_range.start for e in events), default=0.0))
        comm = covered([(e.time_range.start, e.time_range.end) for e in events if is_communication(e.name)])
        if self.device.type == "cuda":
            peak, of = torch.cuda.max_memory_allocated(self.device) / 2**20, "cuda allocated"
        else:
            # ru_maxrss: KiB on Linux, bytes on macOS.
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            peak, of = rss / (2**20 if sys.platform == "darwin" else 2**10), "cpu peak rss"
        summary = {
            "rank": self.rank, "step": step, "step_s": seconds,
            "comm_share": min(1.0, comm / window) if window > 0 else 0.0,
            "comm_s": comm / 1e6, "window_s": window / 1e6,
            "communication_events": sorted({e.name for e in events if is_communication(e.name)}),
            "peak_memory_mb": peak, "peak_memory_of": of, "device": self.device.type,
        }
        sort = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        directory = Path(self.plan.directory)
        directory.mkdir(parents=True, exist_ok=True)
        stem = directory / f"rank{self.rank}-step{step}"
        # Each file is whole or absent: written beside, then renamed.
        _write(stem.with_suffix(".table.txt"), profiler.key_averages().table(sort_by=sort, row_limit=_TABLE_ROWS))
        trace = stem.with_suffix(".trace.json")
        tmp = trace.with_suffix(".tmp")
        profiler.export_chrome_trace(str(tmp))
        os.replace(tmp, trace)
        _write(stem.with_suffix(".summary.json"), json.dumps(summary, indent=1))
        self.profiled.append(summary)


def _write(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def summary(steps: list[int], seconds: list[float], slowest: list[float], waits: list[float],
            samples: list[int]) -> dict[str, float]:
    """The run's step-time statistics (medians over the counted steps); empty when no step was timed."""
    if not steps:
        return {}
    skip = min(WARMUP_STEPS, len(steps) - 1)
    mine, worst = seconds[skip:], slowest[skip:]
    out = {"step_median_s": statistics.median(mine), "step_max_median_s": statistics.median(worst),
           "loader_wait_share": sum(waits[skip:]) / sum(mine) if sum(mine) > 0 else 0.0, "steps": float(len(mine))}
    rates = [n / s for n, s in zip(samples[skip:], worst) if n and s > 0]
    if rates:
        out["samples_per_s_median"] = statistics.median(rates)
        out["samples_per_step"] = float(statistics.median([n for n in samples[skip:] if n]))
    return out
