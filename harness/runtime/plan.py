"""What a launch tells its ranks besides the experiment - its plan, and how it profiles: plain records, built by the
launcher (which does not import torch) and pickled into every rank's LaunchSpec."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

from harness import tags as T


@dataclass(frozen=True)
class LaunchPlan:
    """What one launch tells its ranks besides the experiment: where and how often they checkpoint, what they resume
    from, and what they do besides training as recorded (stop early, nudge the weights, sketch them, trace a step).

    The recorded part (`stop_at`, `perturb_seed`, `sketch_at`) is the same on every backend, so every rank must learn
    it: the submitting side puts it on the run when it creates it (`tags()`), and a container's or batch job's
    launcher, which has only the record, reads it back from there (`from_tags`). The launcher then adds the run's
    checkpoint store (`with_store`) and hands the whole plan to the ranks in their LaunchSpec."""

    directory: str = ""  # the run's checkpoint folder ("": the launch keeps no checkpoints)
    every: int = 0  # 0: never save (a resume or audit may still load)
    resume_step: int | None = None  # load the checkpoint of this step before the first epoch
    # Every rank stops when step K would begin: replay --steps K (harness.replay.steps), or an audit segment's end.
    stop_at: int | None = None
    # resume's proof: the segment reports its tensors (a SegmentEnd) when this many steps are done, and goes on
    digest_at: int | None = None
    # harness calibrate: every floating-point parameter of the registered model is nudged by a few hundred ulps, up
    # or down as a generator of this seed draws it, before training starts (harness/runtime/perturb.py;
    # harness.calibration.perturb_seed).
    perturb_seed: int | None = None
    # harness calibrate: rank 0 sends a sketch of the weights (harness/runtime/sketch.py) after this many steps - the
    # calibration's members, and a replay of a calibrated run, which is held to the members' distance
    # (harness.weights.sketch_at).
    sketch_at: int | None = None
    # harness trace: an op-level trace (optrace.OpTracer) around this step, on these ranks, written to
    # trace_dir/rank<R>.jsonl.gz when the step ends.
    trace_step: int | None = None
    trace_ranks: tuple[int, ...] = ()
    trace_dir: str = ""

    # The recorded part, and the tag each field is recorded under.
    _TAGS = (("stop_at", T.REPLAY_STEPS), ("perturb_seed", T.PERTURB_SEED), ("sketch_at", T.SKETCH_AT))

    @property
    def steered(self) -> bool:
        """The launch does something besides training as recorded (the recorded part is set)."""
        return any(getattr(self, name) is not None for name, _ in self._TAGS)

    def tags(self) -> dict[str, str]:
        """The recorded part, as the run's tags."""
        return {tag: str(getattr(self, name)) for name, tag in self._TAGS if getattr(self, name) is not None}

    @classmethod
    def from_tags(cls, tags: Mapping[str, str]) -> LaunchPlan:
        """The recorded part, read back from a run's tags (no checkpoint store yet: `with_store` adds it)."""
        read = {name: int(tags[tag]) for name, tag in cls._TAGS if tags.get(tag)}
        return LaunchPlan(stop_at=read.get("stop_at"), perturb_seed=read.get("perturb_seed"),
                          sketch_at=read.get("sketch_at"))

    def with_store(self, directory: str, every: int, resume_step: int | None) -> LaunchPlan:
        """This plan with the run's checkpoint store: its folder, how often the ranks save, the step they resume."""
        return LaunchPlan(**{**{f.name: getattr(self, f.name) for f in fields(LaunchPlan)},
                             "directory": directory, "every": every, "resume_step": resume_step})


UNSTEERED = LaunchPlan()  # a launch that only trains (run, resume)

# The plan by its checkpoint fields' order, `CheckpointPlan(directory, every, resume_step=...)`: the same class.
CheckpointPlan = LaunchPlan


class Steering(LaunchPlan):
    """A plan of the recorded part alone, by that part's order: `Steering(stop_at, perturb_seed, sketch_at)`."""

    def __init__(self, stop_at: int | None = None, perturb_seed: int | None = None,
                 sketch_at: int | None = None) -> None:
        super().__init__(stop_at=stop_at, perturb_seed=perturb_seed, sketch_at=sketch_at)


@dataclass
class ProfilePlan:
    """What a launch tells its ranks about timing (experiment.yaml's `profile:`): torch.profiler over `steps` on
    `ranks`, each step's files written into `directory` (the recorder uploads them under profile/)."""

    directory: str = ""
    steps: tuple[int, ...] = ()
    ranks: tuple[int, ...] = (0,)
    samples_per_step: int = 0  # 0: counted from the training ctx.loader's batches
