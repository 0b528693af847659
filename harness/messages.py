"""What rank 0 sends to the launcher over its pipe: one frozen dataclass per message kind."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union


@dataclass(frozen=True)
class Metrics:
    """Rank 0's logged values at `step`, with the wall-clock time they were logged."""

    step: int
    values: dict[str, float]
    unix_ms: int


@dataclass(frozen=True)
class Fingerprint:
    """The sha256 of the model's weights at `step`."""

    step: int
    sha256: str


@dataclass(frozen=True)
class Final:
    """Training ended: the final weights' sha256 (None without a model) and the training steps done."""

    sha256: str | None
    steps: int


@dataclass(frozen=True)
class Initial:
    """The sha256 of the weights when the model was registered with ctx.ddp."""

    sha256: str


@dataclass(frozen=True)
class Determinism:
    """The determinism settings and environment variables in force in rank 0."""

    settings: dict[str, str]
    vars: dict[str, str]


@dataclass(frozen=True)
class Total:
    """The expected number of training steps, for the progress bar."""

    steps: int


@dataclass(frozen=True)
class Checkpoint:
    """Every rank saved a checkpoint at `step`; `sha256` is the saved weights' fingerprint.

    `tensors`: rank 0's sha256 per saved tensor (parameters, buffers, optimizer state); `ranks`: every
    rank's sha256 over its parameters' and optimizer state's digests, in rank order (a rank that fell
    out of step shows).
    """

    step: int
    sha256: str
    tensors: dict[str, str] = field(default_factory=dict)
    ranks: tuple[str, ...] = ()


@dataclass(frozen=True)
class SegmentStart:
    """An audit segment is about to run."""

    index: int


@dataclass(frozen=True)
class SegmentEnd:
    """An audit segment stopped at `step` with weights `sha256` (None without a model); `tensors`: sha256 per
    tensor, as a checkpoint at `step` records them (empty without a model)."""

    step: int
    sha256: str | None
    tensors: dict[str, str] = field(default_factory=dict)


Message = Union[Metrics, Fingerprint, Final, Initial, Determinism, Total, Checkpoint, SegmentStart, SegmentEnd]
