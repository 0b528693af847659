"""Training loops shaped unlike the examples: batches of their own (get_batch), a prefetch before the optimizer
step, gradient accumulation, their own seeding and TF32 switch, no ctx.ddp, copies of the model (EMA) and saves of
it, updates written by hand. Each is recorded, resumed and judged right, or refused in one line (real gloo ranks,
real store, real SIGKILL)."""

from __future__ import annotations

import copy
import io
import json
import multiprocessing as mp
import os
import pickle

import pytest

from conftest import Project

# A char-level GPT-like model on generated text, converted from a nanoGPT-style script: batches drawn with
# torch.randint, the next batch optionally fetched between forward and backward (nanoGPT's prefetch),
# micro-steps with require_backward_grad_sync, its own torch.manual_seed and TF32 switches.
GPT = '''"""A tiny char-level GPT-like model on generated text, in the shape of a nanoGPT training loop."""

import os
import signal
import time

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F


def make_text(n):
    rng = np.random.default_rng(0)
    words = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran", "far"]
    return " ".join(rng.choice(words, n))


class TinyGPT(nn.Module):
    def __init__(self, vocab, block, dim):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(block, dim)
        self.attn = nn.MultiheadAttention(dim, 2, batch_first=True, dropout=0.1)
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)
        self.register_buffer("mask", torch.triu(torch.ones(block, block, dtype=torch.bool), 1))

    def forward(self, idx, targets):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t))
        a, _ = self.attn(x, x, x, attn_mask=self.mask[:t, :t], need_weights=False)
        logits = self.head(self.ln(x + a))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def train(ctx):
    cfg = ctx.cfg
    torch.manual_seed(1337 + ctx.rank)  # its own seeding, as nanoGPT's seed_offset
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    text = make_text(3000)
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)

    def get_batch():
        ix = torch.randint(len(data) - cfg.block, (cfg.batch,))
        x = torch.stack([data[i:i + cfg.block] for i in ix])
        y = torch.stack([data[i + 1:i + 1 + cfg.block] for i in ix])
        return x, y

    model = ctx.ddp(TinyGPT(len(chars), cfg.block, 16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ctx.track(optimizer)
    iters = ctx.steps(cfg.max_iters) if cfg.use_steps else range(cfg.max_iters)
    X, Y = get_batch()
    for it in iters:
        for micro in range(cfg.accum):
            if not cfg.prefetch:
                X, Y = get_batch()
            model.require_backward_grad_sync = micro == cfg.accum - 1
            _, loss = model(X, Y)
            loss = loss / cfg.accum
            if cfg.prefetch:
                X, Y = get_batch()  # the next batch, fetched before the optimizer step
            loss.backward()
            if cfg.log_micro:
                ctx.log({"micro_loss": loss.item()}, ctx.step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ctx.log({"loss": loss.item() * cfg.accum}, ctx.step)
        if ctx.rank == 1 and ctx.step == int(os.environ.get("KILL_AT", "-1")):
            os.kill(os.getpid(), signal.SIGKILL)  # a real crash
        time.sleep(cfg.sleep)
    if ctx.rank == 0:
        import mlflow

        mlflow.log_metric("tokens_per_sec", 123.0, step=0)  # its own MLflow call: lands in the harness run
    torch.distributed.destroy_process_group()  # as scripts written for torchrun end
'''

GPT_YAML = """
train:
  block: 8
  batch: 4
  max_iters: 12
  accum: 2
  prefetch: false
  use_steps: true
  log_micro: false
  sleep: 0.0
"""

# ImageNet-style: the model is wrapped in DDP by the script itself, or not at all (its CPU branch).
UNREGISTERED = '''"""A loop that never gives its model to ctx.ddp."""

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def train(ctx):
    model = nn.Linear(4, 1)
    if ctx.cfg.wrap:
        model = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(ctx.rank)
    for _ in range(6):
        x = torch.randn(8, 4, generator=generator)
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        ctx.log({"loss": loss.item()}, ctx.step)
'''

# ctx.loader with gradient accumulation: two batches per optimizer step.
LOADER_ACCUM = '''"""linear_ddp with two micro-batches per optimizer step."""

import os
import signal

import torch
from torch import nn


def train(ctx):
    data = torch.randn(320, 10, generator=torch.Generator().manual_seed(ctx.seed))
    loader = ctx.loader(data, batch_size=10)
    model = ctx.ddp(nn.Linear(10, 5))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ctx.track(optimizer)
    for epoch in ctx.epochs(3):
        for i, batch in enumerate(loader):
            loss = nn.functional.mse_loss(model(batch), torch.randn(10, 5)) / 2
            loss.backward()
            if i % 2 == 1:
                optimizer.step()
                optimizer.zero_grad()
                ctx.log({"loss": loss.item()}, ctx.step)
                if ctx.rank == 1 and ctx.step == int(os.environ.get("KILL_AT", "-1")):
                    os.kill(os.getpid(), signal.SIGKILL)
'''


# A model copied, averaged and saved as public recipes do: torchvision's EMA and timm's ModelEma (a deepcopy updated
# by hand), torch.optim.swa_utils.AveragedModel, a DDP wrapper deep-copied, word_language_model's torch.save(model)
# and load; its update by an optimizer or by hand (word_language_model's default), in a loop of its own or ctx.steps.
COPIES = '''"""A model registered with ctx.ddp, copied, averaged, saved and loaded back."""

import copy
import os

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn


def descriptors():
    return {fd: os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
            if os.path.exists(f"/proc/self/fd/{fd}")}


def train(ctx):
    cfg = ctx.cfg
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
    model = ctx.ddp(net)
    before = descriptors()
    frozen = copy.deepcopy(model)
    averaged = AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    teacher = copy.deepcopy(net)
    assert descriptors() == before, (before, descriptors())
    if cfg.by_hand:
        optimizer = None
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        ctx.track(optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 2))
    generator = torch.Generator().manual_seed(ctx.rank)
    for _ in ctx.steps(cfg.steps) if cfg.use_steps else range(cfg.steps):
        x = torch.randn(8, 4, generator=generator)
        loss = model(x).pow(2).mean()
        model.zero_grad()
        loss.backward()
        if optimizer is None:
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-0.05)
        else:
            optimizer.step()
        averaged.update_parameters(net)
        with torch.no_grad():
            for t, p in zip(teacher.parameters(), net.parameters()):
                t.mul_(0.9).add_(p, alpha=0.1)
        # The copy's training-mode forward with gradients, between the update and the log: not a step of the model.
        teacher_loss = teacher(x).pow(2).mean()
        with torch.no_grad():
            averaged_loss = averaged(x).pow(2).mean()
        ctx.log({"loss": loss.item(), "teacher_loss": teacher_loss.item(), "averaged_loss": averaged_loss.item()},
                ctx.step)
    path = ctx.output_dir / f"model{ctx.rank}.pt"
    torch.save(net, path)
    back = torch.load(path, weights_only=False)
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), net.state_dict().values()))
    assert not any(torch.equal(a, b) for a, b in zip(frozen.module.parameters(), net.parameters()))
    ctx.log({"loaded_loss": back.eval()(x).pow(2).mean().item()}, ctx.step)
'''

COPIES_YAML = """
train:
  steps: 6
  by_hand: false
  use_steps: false
"""

BASE_YAML = """image: none
entry: train.py:train
world_size: 2
seed: 0
threads_per_rank: 1
determinism:
  level: strict
fingerprint_every: 5
"""


@pytest.fixture(scope="module")
def shapes(project: Project) -> dict[str, str]:
    from conftest import git

    made = {}
    for name, code, train in (("gpt_shape", GPT, GPT_YAML), ("unregistered", UNREGISTERED, "train:\n  wrap: true\n"),
                              ("loader_accum", LOADER_ACCUM, "train: {}\n"), ("copies", COPIES, COPIES_YAML)):
        exp = project.add_experiment(name, train_py=code, commit=False)
        (exp / "experiment.yaml").write_text(BASE_YAML + train.lstrip("\n"))
        made[name] = f"experiments/{name}"
    git(project.root, "add", "-A")
    git(project.root, "commit", "-qm", "loop shapes")
    return {"gpt": made["gpt_shape"], "unregistered": made["unregistered"], "accum": made["loader_accum"],
            "copies": made["copies"]}


def series(project: Project, run_id: str, key: str) -> list[tuple[int, str]]:
    return sorted((m.step, m.value.hex()) for m in project.client().get_metric_history(run_id, key))


def test_own_batches_longer_than_timeout_log_at_optimizer_steps(project: Project, shapes) -> None:
    """No ctx.loader, no ctx.steps, 2 micro-steps per step, 25.6 s of training against a 24 s timeout: never taken
    for a hang; 16 optimizer steps logged at 0..15; the TF32 its code switched on is in the record. (The timeout
    leaves room for what a loaded machine makes slow between beats: AdamW's first step imports for seconds, and
    the loop's own first MLflow call after its last step imports MLflow and opens the SQL store, which took over
    6 s in CI and over 12 s on a machine at load 6.)"""
    run = project.harness("run", shapes["gpt"], "timeout_s=24", "train.use_steps=false", "train.sleep=1.6",
                          "train.max_iters=16")
    assert run.returncode == 0, run.stderr
    assert "no progress" not in run.stderr
    client = project.client()
    tags = client.get_run(run.last_line).data.tags
    assert [s for s, _ in series(project, run.last_line, "loss")] == list(range(16))
    assert tags["harness.determinism.cuda_matmul_tf32"] == "True"
    assert "tokens_per_sec" in tags["harness.user.mlflow_metrics"]
    assert not list((project.root / shapes["gpt"]).glob("mlruns")) and not list((project.root / shapes["gpt"]).glob("*.db"))
    assert "allow_tf32" in run.stderr and "train.py" in run.stderr  # strict warns with the user's line
    fps = json.loads(open(client.download_artifacts(run.last_line, "fingerprints.json", str(project.store.parent))).read())
    assert fps["steps_total"] == 16
    # A loop harness does not drive: a checkpoint boundary cannot be known, and the run says so.
    ck = project.harness("run", shapes["gpt"], "train.use_steps=false", "checkpoint_every=4", "train.max_iters=6")
    assert ck.returncode == 0, ck.stderr
    assert "no checkpoint at step 0" in ck.stderr and "ctx.steps(max_iters)" in ck.stderr
    assert "ctx.steps" in client.get_run(ck.last_line).data.tags["harness.notices"]
    assert client.get_run(ck.last_line).data.tags["harness.loop"] == "own"
    refused = project.cli("resume", ck.last_line)
    assert refused.returncode == 2
    audit = project.cli("audit", ck.last_line, "--segments", "1")  # the cause from the record, not "was 0"
    assert audit.returncode == 2 and ("(checkpoint_every was 4, but the loop is driven by neither a training "
                                      "ctx.loader nor ctx.steps(): harness had no step boundary") in audit.stderr
    assert "`for it in ctx.steps(max_iters):`" in audit.stderr, audit.stderr


def test_trace_a_loop_of_its_own(project: Project, shapes) -> None:
    run = project.harness("run", shapes["gpt"], "train.use_steps=false", "train.max_iters=5")
    assert run.returncode == 0, run.stderr
    traced = project.harness("trace", run.last_line, "--step", "2")
    assert traced.returncode == 0, traced.stderr
    assert "-1" not in traced.stderr and "0--1" not in traced.stderr
    tags = project.client().get_run(traced.last_line).data.tags
    assert tags["harness.trace.reproduced"] == "true", traced.stderr
    replay = project.harness("replay", run.last_line)
    assert replay.returncode == 0 and "verdict: BITWISE" in replay.stdout, replay.stdout + replay.stderr
    bad = project.cli("trace", run.last_line, "--step", "5")
    assert bad.returncode == 2 and "steps 0-4" in bad.stderr


def test_micro_steps_logging_at_one_step_fail_in_one_line(project: Project, shapes) -> None:
    run = project.harness("run", shapes["gpt"], "train.log_micro=true", "train.max_iters=3")
    assert run.returncode == 1
    assert "'micro_loss' was already logged at step 0" in run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.parametrize(
    "prefetch,every,kill_at",
    [(False, 3, 8), (True, 3, 8), (True, 6, 9)],
    # The last: checkpoints at 0 and 6 only. Re-executed from step 0, nanoGPT's batch drawn before the loop
    # comes out as the original's, so steps 0-6 prove nothing about a start at 6; what the run logged at
    # steps 6-9 before it died does.
    ids=["batch-in-step", "prefetch", "prefetch-two-checkpoints"],
)
def test_killed_and_resumed_bit_identical_or_refused(project: Project, shapes, prefetch: bool, every: int,
                                                     kill_at: int) -> None:
    args = [f"checkpoint_every={every}", "train.max_iters=12", f"train.prefetch={str(prefetch).lower()}"]
    crashed = project.harness("run", shapes["gpt"], *args, env={"KILL_AT": str(kill_at)})
    assert crashed.returncode == 1 and "SIGKILL" in crashed.stderr, crashed.stderr
    resumed = project.harness("resume", crashed.last_line)
    if prefetch:
        # The batch drawn before the optimizer step is not in the checkpoint: refused, nothing continued.
        assert resumed.returncode == 2, resumed.stderr
        line = [l for l in resumed.stderr.splitlines() if l.startswith("Error:")]
        assert len(line) == 1 and "resume refused" in line[0], resumed.stderr
        assert ("differs" in line[0]) if every == 3 else ("logged other values than the run did" in line[0])
        assert "a batch drawn before the optimizer step" in line[0]
        assert project.client().get_run(crashed.last_line).info.status == "FAILED"
        return
    assert resumed.returncode == 0, resumed.stderr
    assert "Proved: steps 3-6 from the checkpoint of step 3 and steps 6-8" in resumed.stderr
    clean = project.harness("run", shapes["gpt"], *args)
    assert clean.returncode == 0, clean.stderr
    a, b = (project.client().get_run(r).data.tags for r in (crashed.last_line, clean.last_line))
    assert a["harness.fingerprint"] == b["harness.fingerprint"]
    assert "harness.status_reason" not in a and "harness.failed_rank" not in a  # the failure is no longer its state
    assert series(project, crashed.last_line, "loss") == series(project, clean.last_line, "loss")
    compared = project.harness("compare", crashed.last_line, clean.last_line)
    assert "verdict: BITWISE" in compared.stdout, compared.stdout  # its TF32 switch ran again, the same change


def test_a_model_never_given_to_ctx_ddp(project: Project, shapes) -> None:
    apart = project.harness("run", shapes["unregistered"], "train.wrap=false", "checkpoint_every=0")
    assert apart.returncode == 1
    assert "ranks ended with different parameters" in apart.stderr and "ctx.ddp" in apart.stderr
    wrapped = project.harness("run", shapes["unregistered"], "train.wrap=true")
    assert wrapped.returncode == 0, wrapped.stderr
    tags = project.client().get_run(wrapped.last_line).data.tags
    assert tags["harness.fingerprint.of"] == "optimizer"
    assert tags["harness.weights_changed"] == "true"
    assert "no model was given to ctx.ddp or ctx.register" in wrapped.stderr
    assert "ctx.register(model) after its DDP(...) line" in wrapped.stderr
    replay = project.harness("replay", wrapped.last_line)
    assert replay.returncode == 0 and "BITWISE" in replay.stdout, replay.stdout + replay.stderr


def test_accumulating_loader_counts_optimizer_steps_and_resumes(project: Project, shapes) -> None:
    crashed = project.harness("run", shapes["accum"], "checkpoint_every=4", env={"KILL_AT": "13"})
    assert crashed.returncode == 1, crashed.stderr
    resumed = project.harness("resume", crashed.last_line)
    assert resumed.returncode == 0, resumed.stderr
    clean = project.harness("run", shapes["accum"], "checkpoint_every=4")
    assert clean.returncode == 0
    assert [s for s, _ in series(project, clean.last_line, "loss")] == list(range(24))  # 48 batches per rank, 24 steps
    assert series(project, crashed.last_line, "loss") == series(project, clean.last_line, "loss")
    a, b = (project.client().get_run(r).data.tags for r in (crashed.last_line, clean.last_line))
    assert a["harness.fingerprint"] == b["harness.fingerprint"]


def test_a_model_copied_averaged_and_saved_trains_and_replays_bitwise(project: Project, shapes) -> None:
    """deepcopy of the DDP model and of the module ctx.ddp registered, AveragedModel, a teacher updated by hand and run
    in training mode between the update and the log, torch.save(model) and load: the run finishes with no descriptor
    of the rank touched (the script checks), the copies' forwards are no steps, and the replay is bitwise."""
    run = project.harness("run", shapes["copies"])
    assert run.returncode == 0, run.stderr
    for key in ("loss", "teacher_loss", "averaged_loss"):
        assert [s for s, _ in series(project, run.last_line, key)] == list(range(6)), key
    replay = project.harness("replay", run.last_line)
    assert replay.returncode == 0 and "verdict: BITWISE" in replay.stdout, replay.stdout + replay.stderr


def test_an_update_written_by_hand_counts_its_steps_in_ctx_steps(project: Project, shapes) -> None:
    run = project.harness("run", shapes["copies"], "train.by_hand=true", "train.use_steps=true")
    assert run.returncode == 0, run.stderr
    assert [s for s, _ in series(project, run.last_line, "loss")] == list(range(6))
    tags = project.client().get_run(run.last_line).data.tags
    assert tags["harness.fingerprint.of"] == "model" and tags["harness.weights_changed"] == "true"


@pytest.fixture
def rank_context(tmp_path):
    """Rank 0's Context made in this process, with a real pipe to a launcher's end (returned with it); closed after
    the test, since its step clock hooks every optimizer of the process."""
    import torch

    from harness.runtime.context import Context

    made = []

    def make():
        reader, writer = mp.Pipe(duplex=False)
        ctx = Context(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), cfg={}, seed=0, rank_seed=0,
                      fingerprint_every=5, channel=writer, output_dir=str(tmp_path / "out"))
        made.append(ctx)
        return ctx, reader

    yield make
    for ctx in made:
        ctx.close()


def test_copies_and_pickles_of_a_registered_model_leave_the_context_and_its_pipe_alone(rank_context,
                                                                                      monkeypatch) -> None:
    import torch
    from torch import nn

    from harness.errors import ExperimentError
    from harness.runtime import context

    ctx, launcher = rank_context()
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    net.register_forward_hook(_users_hook)
    ctx.register(net)
    copied = copy.deepcopy(net)
    pickled = pickle.dumps(net)
    assert b"harness" not in pickled  # a model saved in a run loads where harness is not installed
    saved = io.BytesIO()
    torch.save(net, saved)
    # word_language_model's load: weights_only, its module classes allowed (a harness name in the file is refused).
    with torch.serialization.safe_globals([nn.Sequential, nn.Linear, nn.ReLU, _users_hook]):
        loaded = torch.load(io.BytesIO(saved.getvalue()))
    for other in (copied, loaded, copy.copy(net)):  # the user's hook is kept, harness's is not there
        assert not other._forward_pre_hooks and list(other._forward_hooks.values()) == [_users_hook]
        assert "__getstate__" not in vars(other)
    for fd in (ctx._channel.fileno(), launcher.fileno()):  # the failed copy used to close the rank's pipe
        os.fstat(fd)
    # After the optimizer step the step that ended stays current until the model's next training forward: the
    # copies' training forwards with gradients are not that.
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    x = torch.ones(2, 3)
    net(x).sum().backward()
    optimizer.step()
    for other in (copied, pickle.loads(pickled), loaded, copy.copy(net)):
        other(x).sum().backward()
        assert ctx.step == 0
    net(x)
    assert ctx.step == 1
    # The context itself copies and pickles as a reference to itself, so what holds it (a Lightning logger, a model
    # that keeps ctx) copies too; in a process without it, one line says why.
    holder = {"ctx": ctx, "weights": [1.0]}
    assert copy.deepcopy(holder)["ctx"] is ctx and pickle.loads(pickle.dumps(holder))["ctx"] is ctx
    ctx.log({"loss": 1.0}, ctx.step)
    monkeypatch.setattr(context, "_LIVE", {})
    with pytest.raises(ExperimentError, match=r"unpickled outside the rank whose context it is.*Keep ctx out of"):
        pickle.loads(pickle.dumps(ctx))
    ctx.close()
    assert not net._forward_pre_hooks and "__getstate__" not in vars(net)
    got = []
    while launcher.poll(5):
        got.append(type(launcher.recv()).__name__)
        if "MetricsBatch" in got:
            break
    assert got[0] == "Initial" and "MetricsBatch" in got, got


def _users_hook(module, args, output) -> None:
    """A forward hook of the user's own, which copies keep."""


def _update_by_hand(net) -> float:
    """word_language_model's update: no optimizer."""
    import torch

    loss = net(torch.ones(2, 3)).pow(2).mean()
    net.zero_grad()
    loss.backward()
    for p in net.parameters():
        p.data.add_(p.grad, alpha=-0.1)
    return loss.item()


def test_an_update_by_hand_outside_ctx_steps_is_named_as_the_cause(rank_context) -> None:
    from torch import nn

    from harness.errors import ExperimentError

    ctx, _ = rank_context()
    net = ctx.register(nn.Linear(3, 1))
    ctx.log({"micro_loss": 1.0}, ctx.step)
    with pytest.raises(ExperimentError, match="micro-batches share one") as micro:
        ctx.log({"micro_loss": 1.0}, ctx.step)  # the weights are as registered: micro-batches, not an update
    assert "by hand" not in str(micro.value)
    ctx.log({"train_loss": _update_by_hand(net)}, ctx.step)
    with pytest.raises(ExperimentError) as by_hand:
        ctx.log({"train_loss": _update_by_hand(net)}, ctx.step)
    said = str(by_hand.value)
    assert said.startswith("ctx.log: 'train_loss' was already logged at step 0; a second value would overwrite the "
                           "first. The weights changed but no optimizer has stepped: "), said
    assert "(p.data.add_(p.grad, alpha=-lr)) is neither" in said and "`for step in ctx.steps(n):`" in said
    ctx2, _ = rank_context()
    net2 = ctx2.register(nn.Linear(3, 1))
    for _ in ctx2.steps(3):
        ctx2.log({"train_loss": _update_by_hand(net2)}, ctx2.step)
    assert ctx2._logged.steps["train_loss"] == {0, 1, 2}


def test_track_takes_the_scheduler_and_scaler_by_position_and_refuses_one_in_the_others_place(rank_context) -> None:
    import torch
    from torch import nn

    from harness.errors import ExperimentError

    ctx, _ = rank_context()
    optimizer = torch.optim.SGD(ctx.register(nn.Linear(3, 1)).parameters(), lr=0.1)
    scheduler, scaler = torch.optim.lr_scheduler.StepLR(optimizer, 2), torch.amp.GradScaler("cpu")
    ctx.track(optimizer, scheduler, scaler)
    assert ctx._tracked == {"optimizer": optimizer, "scheduler": scheduler, "scaler": scaler}
    with pytest.raises(ExperimentError, match=r"^ctx.track: a GradScaler \(GradScaler\) was given as the scheduler\. "
                                              r"Pass it by name: ctx.track\(optimizer, scaler=scaler\)\.$"):
        ctx.track(optimizer, scaler)
