"""What a script converted to harness keeps as it was: its own init_process_group (answered with harness's group when it
asks for that group, refused in one line when it asks for another), an optimizer it never gave to ctx.track (tracked
when it is the one over the registered model; otherwise the checkpoint says so and resume refuses naming the line)."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest
from conftest import Project

# A torchrun-shaped script (llm.c's train_gpt2.py, minGPT-ddp, pytorch/examples' FSDP2): its own rendezvous from the
# environment at the top, its own destroy at the end, an optimizer it steps and never tracks.
OWN_GROUP = '''
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import destroy_process_group, init_process_group


def train(ctx):
    init_process_group(backend="gloo", world_size=int(ctx.cfg.get("ranks", os.environ["WORLD_SIZE"])))
    rank, world = dist.get_rank(), dist.get_world_size()
    model = ctx.ddp(nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = torch.randn(64, 4, generator=torch.Generator().manual_seed(1))
    for step in ctx.steps(4):
        opt.zero_grad()
        x = data[(step * world + rank) * 2 % 64:][:2]
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        ctx.log({"loss": loss.item()}, ctx.step)
    destroy_process_group()
'''


@pytest.fixture(scope="module")
def own_group(project: Project) -> Path:
    return project.add_experiment("own_group", train_py=OWN_GROUP)


def test_a_scripts_own_init_process_group_gets_harnesss_group_and_its_optimizer_is_checkpointed(
        project: Project, own_group: Path) -> None:
    import torch

    from harness.runtime import checkpoint as ckpt

    result = project.harness("run", "experiments/own_group", "checkpoint_every=2")
    assert result.returncode == 0, result.stderr
    run = project.client().get_run(result.last_line)
    assert run.info.status == "FINISHED"
    assert "optimizer" not in run.data.tags.get("harness.notices", ""), run.data.tags.get("harness.notices")
    artifacts = Path(run.info.artifact_uri.removeprefix("file://"))
    state = ckpt.load(ckpt.path_for(artifacts / "checkpoints", 2, 1))
    # The untracked SGD is the one optimizer over the model: its momentum is in the checkpoint.
    assert state["optimizer"] is not None and state["optimizer"]["state"], state.get("optimizer")
    assert all(torch.is_tensor(s["momentum_buffer"]) for s in state["optimizer"]["state"].values())


def test_a_scripts_own_init_process_group_of_another_world_size_is_refused_in_one_line(
        project: Project, own_group: Path) -> None:
    result = project.harness("run", "experiments/own_group", "train.ranks=3")
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if "FAILED: rank" in line]
    assert len(errors) == 1 and errors[0].strip().startswith(
        "FAILED: rank 0: init_process_group(world_size=3): the job has 2 ranks, in a process group harness already "
        "initialised. Fix: delete the call (harness initialised the group before train(ctx)), or call it as "
        'dist.init_process_group("gloo") or pass world_size=ctx.world_size'), result.stderr


def test_init_process_group_asking_for_another_group_is_refused_naming_the_fix() -> None:
    from harness.errors import ExperimentError
    from harness.runtime.groupkeep import check_init

    check_init("gloo", 2, 1)
    check_init("gloo", 2, 1, "gloo", "env://", world_size=2, rank=1)
    with pytest.raises(ExperimentError, match=r"^init_process_group\(backend='nccl'\): the job's process group, "
                                              r"already initialised by harness, is 'gloo'\. Fix: delete the call"):
        check_init("gloo", 2, 1, "nccl")
    with pytest.raises(ExperimentError, match=r"^init_process_group\(rank=0\) in the job's rank 1"):
        check_init("gloo", 2, 1, rank=0)
    check_init("gloo", 2, 1, "gloo", "tcp://224.66.41.62:23456", world_size=2, rank=1)  # ImageNet's main.py
    with pytest.raises(ExperimentError, match=r"^init_process_group\(world_size=3\): the job has 2 ranks"):
        check_init("gloo", 2, 1, init_method="tcp://h:1?rank=1&world_size=3")


def _context(tmp_path: Path, monkeypatch, resume_step: int | None = None):
    import torch

    from harness.runtime import optimization
    from harness.runtime.context import Context
    from harness.runtime.plan import LaunchPlan

    # Rank 0's watch of schedulers and autocast is not what these tests look at: its wrappers of torch's classes stay
    # out of this process (a class whose __new__ was patched and deleted again makes no LR scheduler afterwards).
    monkeypatch.setattr(optimization.Watch, "start", lambda watch: watch)

    reader, writer = mp.Pipe(duplex=False)
    plan = LaunchPlan(str(tmp_path / "checkpoints"), every=2, resume_step=resume_step)
    ctx = Context(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), cfg={}, seed=0, rank_seed=0,
                  fingerprint_every=5, channel=writer, checkpoints=plan, output_dir=str(tmp_path / "out"))
    return ctx, reader


def _train(ctx, split: bool):
    """Four SGD steps with momentum, no ctx.track; `split`: two optimizers, one for the weight, one for the bias."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    net = ctx.register(nn.Linear(3, 1))
    opt_w = torch.optim.SGD([net.weight] if split else net.parameters(), lr=0.1, momentum=0.9)
    opt_b = torch.optim.SGD([net.bias], lr=0.1, momentum=0.9) if split else None
    for step in ctx.steps(4):
        for opt in (opt_w, opt_b):
            if opt is not None:
                opt.zero_grad()
        net(torch.full((2, 3), float(step + 1))).pow(2).mean().backward()
        for opt in (opt_w, opt_b):
            if opt is not None:
                opt.step()
    return [p.detach().clone() for p in net.parameters()]


def test_an_untracked_optimizer_is_tracked_when_it_is_the_one_over_the_model_and_resumes_bit_for_bit(
        tmp_path: Path, monkeypatch) -> None:
    import torch

    from harness.runtime import checkpoint as ckpt

    ctx, _ = _context(tmp_path, monkeypatch)
    try:
        whole = _train(ctx, split=False)
    finally:
        ctx.close()
    assert ckpt.load(ckpt.path_for(tmp_path / "checkpoints", 2, 0))["optimizer"]["state"]
    resumed, _ = _context(tmp_path, monkeypatch, resume_step=2)
    try:
        again = _train(resumed, split=False)  # a fresh optimizer, its momentum loaded from the checkpoint
    finally:
        resumed.close()
    assert all(torch.equal(a, b) for a, b in zip(whole, again, strict=True))


def test_an_untracked_optimizer_that_is_not_the_one_is_said_at_the_checkpoint_and_refused_by_resume(
        tmp_path: Path, monkeypatch) -> None:
    from harness.commands.resume import _refuse_untracked
    from harness.errors import RunRefused
    from harness.messages import Notice
    from harness.runtime import checkpoint as ckpt, states

    ctx, launcher = _context(tmp_path, monkeypatch)
    try:
        _train(ctx, split=True)
    finally:
        ctx.close()
    said = []
    while launcher.poll(1):
        message = launcher.recv()
        said += [message.text] if isinstance(message, Notice) and message.key == "untracked-optimizer" else []
    assert said == [
        "the checkpoint of step 2 does not hold the state of the SGD `opt_w`, the optimizer whose steps are the run's "
        "(an optimizer left out of ctx.track is tracked by itself only when it is the one over all of the registered "
        "model's parameters): a resume from it would start its state anew, so `harness resume` refuses it. Add "
        "`ctx.track(opt_w)` after the line that makes it."], said
    untracked = ckpt.saved_digests(tmp_path / "checkpoints", 2)[states.UNTRACKED]
    with pytest.raises(RunRefused, match=r"does not hold the state of the SGD `opt_w`, the optimizer whose steps "
                                         r"are the run's, which the steps update.*Add `ctx\.track\(opt_w\)` to train\(\)"):
        _refuse_untracked("r1", untracked, 2)


def test_an_override_yes_no_on_off_that_became_a_boolean_is_warned_with_the_quoting_that_keeps_the_word(
        project: Project) -> None:
    """Hugging Face's eval_strategy=no: YAML 1.1 makes it False. The word set through the shell as the warning says
    ('"no"', the shell's quotes around YAML's) reaches the code as the string."""
    import subprocess

    from harness.commands import run as runner
    from harness.commands.options import CheckOptions

    exp = project.root / "experiments" / "linear_ddp"
    typed = subprocess.run(["bash", "-c", """printf '%s\\n' train.eval_strategy='"no"' train.report="no" """],
                           capture_output=True, text=True, check=True).stdout.split()
    checked = runner.preflight(CheckOptions(exp, ("train.eval_strategy=no", "train.push=On", "determinism.level=off",
                                                  *typed[1:], "device=cpu"), tracking_uri=project.uri))
    assert checked.cfg.train["eval_strategy"] is False and checked.cfg.train["push"] is True
    said = [w for w in checked.warnings if w.startswith("override ")]
    assert said == [
        "override train.eval_strategy=no gives train.eval_strategy the boolean False, not the string 'no': YAML reads "
        "a bare yes/no/on/off as true/false. To pass the word, quote it for YAML inside the shell's quotes: "
        "train.eval_strategy='\"no\"' (the shell alone drops the quotes of train.eval_strategy=\"no\"); in "
        "experiment.yaml: eval_strategy: \"no\".",
        "override train.push=On gives train.push the boolean True, not the string 'On': YAML reads a bare "
        "yes/no/on/off as true/false. To pass the word, quote it for YAML inside the shell's quotes: "
        "train.push='\"On\"' (the shell alone drops the quotes of train.push=\"On\"); in experiment.yaml: push: \"On\".",
        "override train.report=no gives train.report the boolean False, not the string 'no': YAML reads a bare "
        "yes/no/on/off as true/false. To pass the word, quote it for YAML inside the shell's quotes: "
        "train.report='\"no\"' (the shell alone drops the quotes of train.report=\"no\"); in experiment.yaml: "
        "report: \"no\".",
    ], said
    quoted = runner.preflight(CheckOptions(exp, (typed[0], "device=cpu"), tracking_uri=project.uri))
    assert quoted.cfg.train["eval_strategy"] == "no" and not [w for w in quoted.warnings if w.startswith("override ")]


def test_the_one_optimizer_over_the_model_is_found_through_a_wrapper_and_not_among_two() -> None:
    import torch
    from torch import nn

    from harness.runtime import optimtrack

    class Wrapped(torch.optim.Optimizer):  # Accelerate's AcceleratedOptimizer: its param_groups are the inner one's
        def __init__(self, optimizer):
            self.optimizer = optimizer

        @property
        def param_groups(self):
            return self.optimizer.param_groups

    net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
    net[0].bias.requires_grad_(False)
    inner = torch.optim.AdamW(net.parameters())  # the frozen bias among its parameters is still the model's
    wrapper = Wrapped(inner)
    assert optimtrack.find(net) is inner
    other = torch.optim.SGD(net.parameters(), lr=0.1)
    assert optimtrack.find(net) is None  # two: which one the checkpoint should hold is the code's to say
    del other
    part = torch.optim.SGD(net[1].parameters(), lr=0.1)  # over part of the model only: not a candidate
    assert optimtrack.find(net) is inner and wrapper.optimizer is inner and part is not None
