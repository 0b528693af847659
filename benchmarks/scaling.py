"""Shared by the scaling benchmarks (benchmarks/scale_*_bench.py): interleaved timing, the growth exponent of a cost
against the size of the work, and the one table format every axis prints.

The growth exponent is the slope of log(cost) against log(size), least squares over the sizes measured: 1.0 is
linear, 0 is flat, 2 quadratic. An axis "grows no faster than the work" when harness's exponent is at most the
work's own (1.0 where the work is linear in the size) plus the noise of a 2-core machine (0.15 is allowed).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

LINEAR_SLACK = 0.15  # what the exponent may exceed the work's own by on a shared 2-core machine


def exponent(sizes: Sequence[float], costs: Sequence[float]) -> float:
    """Least-squares slope of log(cost) on log(size); NaN when fewer than two usable points."""
    pts = [(math.log(s), math.log(c)) for s, c in zip(sizes, costs) if s > 0 and c > 0]
    if len(pts) < 2:
        return float("nan")
    mx = statistics.fmean(x for x, _ in pts)
    my = statistics.fmean(y for _, y in pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx else float("nan")


def interleaved(variants: dict[str, Callable[[], float | None]], rounds: int) -> dict[str, list[float]]:
    """Run every variant once per round, in a rotating order, so a change in the machine's load hits all alike.
    A variant returns its own measured seconds (or None: measured here as its wall time)."""
    names = list(variants)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            t0 = time.perf_counter()
            got = variants[name]()
            out[name].append(got if got is not None else time.perf_counter() - t0)
    return out


@dataclass
class Axis:
    """One axis: harness's cost and its baseline's at each size (medians), and the unit of both."""

    name: str
    measure: str  # what is timed, e.g. "`harness runs` wall s"
    baseline: str  # what it is compared with, e.g. "MLflow search_runs"
    unit: str = "s"
    sizes: list[float] = field(default_factory=list)
    size_labels: list[str] = field(default_factory=list)
    harness: list[float] = field(default_factory=list)
    base: list[float] = field(default_factory=list)

    def add(self, size: float, label: str, harness: float, base: float) -> None:
        self.sizes.append(size)
        self.size_labels.append(label)
        self.harness.append(harness)
        self.base.append(base)

    def rows(self) -> list[str]:
        eh, eb = exponent(self.sizes, self.harness), exponent(self.sizes, self.base)
        out = []
        for i, label in enumerate(self.size_labels):
            ratio = self.harness[i] / self.base[i] if self.base[i] else float("nan")
            last = i == len(self.size_labels) - 1
            grow = f"{eh:.2f} / {eb:.2f}" if last else ""
            out.append(f"| {self.name if i == 0 else ''} | {self.measure if i == 0 else ''} | {label} | "
                       f"{fmt(self.harness[i])} {self.unit} | {fmt(self.base[i])} {self.unit} | {ratio:.2f}x | {grow} |")
        return out


HEADER = ("| axis | measured (harness vs baseline) | size | harness | baseline | ratio | growth exponent harness / baseline |\n"
          "| --- | --- | --- | --- | --- | --- | --- |")


def fmt(x: float) -> str:
    if x != x:
        return "-"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    if abs(x) >= 1:
        return f"{x:.2f}"
    return f"{x:.3g}"


def table(axes: Sequence[Axis], title: str = "") -> str:
    load = os.getloadavg()
    lines = [title] if title else []
    lines += [HEADER]
    for axis in axes:
        lines += axis.rows()
    lines.append(f"\nload average at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; baselines: "
                 + "; ".join(f"{a.name}: {a.baseline}" for a in axes))
    return "\n".join(lines)
