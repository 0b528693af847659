"""What rank 0 sends to the launcher over its pipe: one frozen dataclass per message kind."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

_CHANGE_LINE = re.compile(r"(\S+): (.*?) -> (.*?) at step (-?\d+) \(([^)]*)\)(?: by (.+))?$")


@dataclass(frozen=True)
class Metrics:
    """Rank 0's logged values at `step`, with the wall-clock time they were logged."""

    step: int
    values: dict[str, float]
    unix_ms: int


@dataclass(frozen=True, eq=False)
class MetricsBatch:
    """Many of rank 0's logged points at once, in the order they were logged: point i is
    (keys[key_index[i]], steps[i], values[i], unix_ms[i]).

    Four numpy arrays (int32, int64, float64, int64) and a short key table pickle as a few buffers, where
    one Metrics per ctx.log call costs a pickle and a pipe write each; float64 keeps every value's bits.
    """

    keys: tuple[str, ...]
    key_index: Any  # np.ndarray[int32]
    steps: Any  # np.ndarray[int64]
    values: Any  # np.ndarray[float64]
    unix_ms: Any  # np.ndarray[int64]

    def __len__(self) -> int:
        return len(self.steps)

    def points(self) -> Iterator[tuple[str, int, float, int]]:
        """(key, step, value, unix_ms) per point, in logged order, as Python numbers (exact: float64 -> float)."""
        keys = self.keys
        for k, step, value, ms in zip(self.key_index.tolist(), self.steps.tolist(), self.values.tolist(),
                                      self.unix_ms.tolist()):
            yield keys[k], step, value, ms


@dataclass(frozen=True)
class Fingerprint:
    """The sha256 of the model's weights at `step`."""

    step: int
    sha256: str


@dataclass(frozen=True)
class Final:
    """Training ended: the final weights' sha256 (None without a model), the training steps done, and what was
    hashed: "model" (given to ctx.ddp), "optimizer" (the parameters the optimizer stepped) or None."""

    sha256: str | None
    steps: int
    of: str | None = "model"


@dataclass(frozen=True)
class Notice:
    """Something the run's record must say: a one-line warning for the launcher to print and record."""

    key: str
    text: str


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
class RankFacts:
    """What rank 0 measured where it runs: its device (runtime/rank/facts.py: device_facts) and NCCL's configuration files
    (nccl_conf)."""

    device: dict[str, str]
    nccl_conf: dict[str, str]


@dataclass(frozen=True)
class SettingChange:
    """One determinism setting that user code changed during training, as read back at `step`.

    `when` is the reading that saw it (determinism.FIRST_STEP, CHECKPOINT or END); `where` is the user's
    file:line of the last call that set it, and `call` that call as written ("torch.backends.cudnn.benchmark =
    True"), both None when the setting changed without passing a watched setter (torch._C, a flags() block).
    """

    setting: str  # a key of determinism.read_determinism: cuda_matmul_tf32, float32_matmul_precision, ...
    before: str
    after: str
    step: int
    when: str
    where: str | None = None
    call: str | None = None

    def line(self) -> str:
        """'cuda_matmul_tf32: False -> True at step 0 (first step) by train.py:12': one line of the changes tag."""
        by = f" by {self.where}" if self.where else ""
        return f"{self.setting}: {self.before} -> {self.after} at step {self.step} ({self.when}){by}"

    @classmethod
    def from_line(cls, line: str) -> SettingChange | None:
        """The change a line() wrote (its `call` is not in the line); None for a line in no such form."""
        m = _CHANGE_LINE.match(line.strip())
        if m is None:
            return None
        setting, before, after, step, when, where = m.groups()
        return cls(setting, before, after, int(step), when, where)


@dataclass(frozen=True)
class DeterminismChanged:
    """A reading during training found settings other than the previous reading's (rank 0)."""

    changes: tuple[SettingChange, ...]


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


@dataclass(frozen=True)
class WeightsSketch:
    """Rank 0's weights after `step` steps, folded small (harness/runtime/sketch.py): per floating-point tensor of
    the state dict, by name, its element count, its norm and its float64 sketch of `widths` sums (`values`: the
    sketches one after another, as raw float64 bytes). Sent where the launch's plan asks for it (harness calibrate)."""

    step: int
    names: tuple[str, ...]
    counts: tuple[int, ...]
    norms: tuple[float, ...]
    widths: tuple[int, ...]
    values: bytes


@dataclass(frozen=True)
class UserSeed:
    """One seeding call of the training code's own: where ("train.py:12"), which function, the value (its repr)."""

    where: str
    function: str
    value: str


@dataclass(frozen=True)
class UserSeeds:
    """The global RNG seeds rank 0's training code set itself (harness/runtime/userseed.py), sent once at the end."""

    calls: tuple[UserSeed, ...]


@dataclass(frozen=True)
class DataOrder:
    """Per training step fed by ctx.loader: a digest of the sample indices every rank's batches held (one digest
    over the ranks' own, in rank order), sent once at the end by rank 0."""

    steps: tuple[int, ...]
    digests: tuple[str, ...]


@dataclass(frozen=True)
class Evaluation:
    """The metric keys rank 0 logged from an evaluation (a framework's validation or test) and never from training:
    key -> what its steps count, tags.EVAL_AT_STEP (the training step the evaluation ran at) or an index of its own
    ("validation batch"). The whole map, sent again whenever it changes."""

    keys: dict[str, str]


@dataclass(frozen=True)
class Loop:
    """What drove the training steps (harness/runtime/boundaries.py: "ctx.loader", "lightning", ...), sent at the
    first step."""

    name: str


@dataclass(frozen=True)
class Optimization:
    """What trains the model, as rank 0 saw it (harness/runtime/optimization.py), as plain values: the counted
    optimizer ({"class", "groups": [settings per param group, without the parameters]}, None when none stepped),
    the LR schedulers bound to it and the GradScaler that stepped it ({"class", "settings"}), and the autocast
    regions entered ({"device_type", "dtype", "first_step"}). Sent at the optimizer's first step and at the end."""

    optimizer: dict[str, Any] | None
    schedulers: tuple[dict[str, Any], ...] = ()
    grad_scaler: dict[str, Any] | None = None
    autocast: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True)
class Performance:
    """The run's step times (harness/runtime/perf.py), sent once at the end by rank 0: per timed step (profiled steps
    left out) rank 0's wall seconds, the slowest rank's, rank 0's seconds waiting for ctx.loader and the samples the
    step consumed over all ranks (0: unknown); and each profiled step's summary (rank, step, step_s, comm_share,
    peak_memory_mb, ...), by step then rank. Wall-clock values: recorded, never judged."""

    steps: tuple[int, ...]
    seconds: tuple[float, ...]
    slowest: tuple[float, ...]
    waits: tuple[float, ...]
    samples: tuple[int, ...]
    profiled: tuple[dict[str, Any], ...] = ()


Message = (
    Metrics | MetricsBatch | Fingerprint | Final | Initial | Determinism | RankFacts | DeterminismChanged | Total
    | Checkpoint | SegmentStart | SegmentEnd | WeightsSketch | Notice | UserSeeds | DataOrder | Evaluation | Loop | Optimization
    | Performance
)
