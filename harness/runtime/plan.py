"""What a launch tells its ranks about checkpoints: a plain record, built by the launcher (which does not import torch)
and pickled into every rank's LaunchSpec."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from harness import tags as T


@dataclass(frozen=True)
class Steering:
    """What a launch does besides training as recorded - the same on every backend, so every rank must learn it.

    The submitting side puts it on the run when it creates it (`tags()`); a container's or batch job's launcher,
    which has only the record, reads it back from there (`from_tags`); checkpoint_plan hands it to the ranks."""

    stop_at: int | None = None  # replay --steps K: every rank stops when step K would begin (harness.replay.steps)
    perturb_seed: int | None = None  # a calibration member: the weights start nudged (harness.calibration.perturb_seed)
    sketch_at: int | None = None  # rank 0 sketches the weights after this many steps (harness.weights.sketch_at)

    _TAGS = (("stop_at", T.REPLAY_STEPS), ("perturb_seed", T.PERTURB_SEED), ("sketch_at", T.SKETCH_AT))

    def __bool__(self) -> bool:
        return any(getattr(self, name) is not None for name, _ in self._TAGS)

    def tags(self) -> dict[str, str]:
        return {tag: str(getattr(self, name)) for name, tag in self._TAGS if getattr(self, name) is not None}

    @classmethod
    def from_tags(cls, tags: Mapping[str, str]) -> Steering:
        return cls(**{name: int(tags[tag]) for name, tag in cls._TAGS if tags.get(tag)})


UNSTEERED = Steering()  # a launch that only trains (run, resume)


@dataclass
class CheckpointPlan:
    """Where and how often ranks checkpoint, and what this launch resumes from or stops at."""

    directory: str
    every: int  # 0: never save (a resume or audit may still load)
    resume_step: int | None = None  # load the checkpoint of this step before the first epoch
    stop_at: int | None = None  # an audit segment ends when this many steps are done
    # resume's proof: the segment reports its tensors (a SegmentEnd) when this many steps are done, and goes on
    digest_at: int | None = None
    # harness calibrate: every floating-point parameter of the registered model is nudged by a few hundred ulps, up
    # or down as a generator of this seed draws it, before training starts (harness/runtime/perturb.py).
    perturb_seed: int | None = None
    # harness calibrate: rank 0 sends a sketch of the weights (harness/runtime/sketch.py) after this many steps - the
    # calibration's members, and a replay of a calibrated run, which is held to the members' distance.
    sketch_at: int | None = None
    # harness trace: an op-level trace (optrace.OpTracer) around this step, on these ranks, written to
    # trace_dir/rank<R>.jsonl.gz when the step ends.
    trace_step: int | None = None
    trace_ranks: tuple[int, ...] = ()
    trace_dir: str = ""


@dataclass
class ProfilePlan:
    """What a launch tells its ranks about timing (experiment.yaml's `profile:`): torch.profiler over `steps` on
    `ranks`, each step's files written into `directory` (the recorder uploads them under profile/)."""

    directory: str = ""
    steps: tuple[int, ...] = ()
    ranks: tuple[int, ...] = (0,)
    samples_per_step: int = 0  # 0: counted from the training ctx.loader's batches
