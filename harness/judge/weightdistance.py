"""How far two runs' weights lie apart, read from their sketches (harness/runtime/sketch.py folds them in the rank).

A calibration records each member's distance from the run's own weights after its M steps (the rounding envelope's
weights, harness/judge/rounding.py), and a replay of a calibrated run is held to it. Pure: bytes in, a distance out.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np

from harness import npzfile, tags as T
from harness.messages import WeightsSketch


@dataclass(frozen=True)
class Sketch:
    """A recorded sketch: per tensor name, (element count, norm, float64 sums)."""

    step: int
    tensors: dict[str, tuple[int, float, np.ndarray]]

    @classmethod
    def of(cls, msg: WeightsSketch) -> Sketch:
        flat = np.frombuffer(msg.values, dtype=np.float64)
        tensors, at = {}, 0
        for name, count, norm, width in zip(msg.names, msg.counts, msg.norms, msg.widths):
            tensors[name] = (int(count), float(norm), flat[at:at + width])
            at += width
        return cls(msg.step, tensors)

    def dump(self) -> bytes:
        """The sketch as an .npz file's bytes (what is recorded: weights/sketch.npz)."""
        names = sorted(self.tensors)
        buffer = io.BytesIO()
        np.savez(buffer, step=np.int64(self.step), names=np.array(names, dtype=str),
                 counts=np.array([self.tensors[n][0] for n in names], dtype=np.int64),
                 norms=np.array([self.tensors[n][1] for n in names], dtype=np.float64),
                 widths=np.array([self.tensors[n][2].size for n in names], dtype=np.int64),
                 values=np.concatenate([self.tensors[n][2] for n in names]) if names else np.zeros(0))
        return buffer.getvalue()

    @classmethod
    def load(cls, data: bytes) -> Sketch:
        with npzfile.opened(data, T.ARTIFACT_WEIGHTS_SKETCH) as z:
            ends = np.cumsum(z["widths"])
            starts = ends - z["widths"]
            values = z["values"].astype(np.float64)
            tensors = {str(n): (int(c), float(norm), values[s:e])
                       for n, c, norm, s, e in zip(z["names"], z["counts"], z["norms"], starts, ends)}
            return cls(int(z["step"]), tensors)


@dataclass(frozen=True)
class Distance:
    """`relative`: |a - b| / |b| over all the tensors both hold; `widest`: the tensor whose own relative distance is
    largest, and that distance. `shape_differs`: tensors one sketch holds and the other does not, or of other sizes
    (then no distance means anything: inf)."""

    relative: float
    widest: str
    widest_relative: float
    shape_differs: tuple[str, ...] = ()


def distance(a: Sketch, b: Sketch) -> Distance:
    """The relative distance of `a`'s weights from `b`'s (the reference)."""
    differs = tuple(sorted(n for n in set(a.tensors) | set(b.tensors)
                           if n not in a.tensors or n not in b.tensors or a.tensors[n][0] != b.tensors[n][0]))
    if differs:
        return Distance(math.inf, differs[0], math.inf, differs)
    squared = reference = 0.0
    widest, widest_rel = "", 0.0
    for name in sorted(b.tensors):
        _, norm, sb = b.tensors[name]
        d = float(np.sum((a.tensors[name][2] - sb) ** 2))
        squared += d
        reference += norm * norm
        rel = math.sqrt(d) / norm if norm > 0 else (0.0 if d == 0 else math.inf)
        if rel > widest_rel:
            widest, widest_rel = name, rel
    total = math.sqrt(squared) / math.sqrt(reference) if reference > 0 else (0.0 if squared == 0 else math.inf)
    return Distance(total, widest, widest_rel)
