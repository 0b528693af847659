"""What drove a run's training steps, and so whether harness had a step boundary to checkpoint at, and the way out
where it had none: said by a rank's notice as it happens, and by resume's and audit's refusals from the record.

A checkpoint is saved where nothing of the next step has run yet: before a training `ctx.loader` fetch or a
`ctx.steps()` iteration. transformers' Trainer saves its own, which are the run's (harness.transformers). A loop of
the user's own, Lightning's Trainer and Accelerate over a DataLoader of its own give harness no such boundary; each
has its own way out. Plain text only (no torch): the CLI's refusals import it.
"""

from __future__ import annotations

# The loops (tags.LOOP): what drove the training steps.
LOADER = "ctx.loader"
STEPS = "ctx.steps"
OWN = "own"  # a loop of the user's own: only optimizer steps are seen
LIGHTNING = "lightning"  # Lightning's Trainer runs the loop (harness.lightning)
ACCELERATE = "accelerate"  # Accelerate's loop over a DataLoader of its own (harness.accelerate)
TRANSFORMERS = "transformers"  # transformers' Trainer runs the loop (harness.transformers)

# Why such a loop gives no step boundary, and what to do instead.
_WHY: dict[str, tuple[str, str]] = {
    OWN: (
        "the loop is driven by neither a training ctx.loader nor ctx.steps()",
        "Write the loop as `for it in ctx.steps(max_iters):` drawing each step's batches inside it, or iterate a "
        "training ctx.loader inside ctx.epochs(n).",
    ),
    LIGHTNING: (
        "Lightning's Trainer runs the loop, which harness cannot stop and restart mid-fit",
        "Set checkpoint_every: 0 and checkpoint with Lightning itself: its ModelCheckpoint (on by default) saves under "
        "ctx.output_dir, kept as the run's artifacts but not proven by harness, and trainer.fit(..., ckpt_path=...) "
        "continues from one in a new run.",
    ),
    ACCELERATE: (
        "Accelerate's loop iterates a DataLoader of its own, not a ctx.loader",
        "Pass a ctx.loader(...) to accelerator.prepare and iterate it inside ctx.epochs(n): its batches are harness's "
        "step boundaries (checkpoints, resume, audit), and it comes back unsharded.",
    ),
}
PREFETCH = (
    "a step's first batch was drawn before the previous optimizer step (a prefetch)",
    "Draw each step's batches at the top of the step (`for it in ctx.steps(max_iters):`), after the previous "
    "optimizer step.",
)


def has_boundaries(loop: str | None) -> bool:
    """The loop's steps have checkpoints a resume continues from: harness's own boundaries, or the Trainer's saves."""
    return loop in (LOADER, STEPS, TRANSFORMERS)


def why(loop: str) -> tuple[str, str]:
    """(why the loop gave no step boundary, the way out) for a loop without boundaries (see has_boundaries)."""
    return _WHY.get(loop, _WHY[OWN])


def no_checkpoint(every: int, loop: str | None, notices: str) -> tuple[str, str]:
    """Why a run has no complete checkpoint, read from its record - checkpoint_every, what drove its steps
    (tags.LOOP; None for a run recorded without it), its notices (tags.NOTICES) - and the way to a run that has one."""
    again = "Run it again with checkpoint_every=N to make it resumable (and auditable)."
    if every <= 0:
        if loop is None or has_boundaries(loop):
            return "it ran with checkpoint_every=0, so none was saved", again
        cause, fix = why(loop)
        return f"it ran with checkpoint_every=0, and with it none could have been saved: {cause}", fix
    if loop is not None and not has_boundaries(loop):
        cause, fix = why(loop)
        return f"checkpoint_every was {every}, but {cause}: harness had no step boundary to save at", fix
    if loop == TRANSFORMERS:
        return (f"checkpoint_every was {every}, but it stopped before the Trainer saved its first checkpoint, or the "
                "Trainer saved only its model (see the run's harness.notices)"), again
    if f"checkpoint_every={every}:" in notices:  # the rank's notice: a step began where it could not save
        return f"checkpoint_every was {every}, but {PREFETCH[0]}", PREFETCH[1]
    if loop is None:
        return (f"checkpoint_every was {every}, but its loop gave harness no step boundary to save at (see the run's "
                "harness.notices) or it stopped before the first was complete"), again
    return f"checkpoint_every was {every}, but it stopped before its first checkpoint was complete", again
