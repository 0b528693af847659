"""Training loops shaped unlike the examples: batches of their own (get_batch), a prefetch before the optimizer
step, gradient accumulation, their own seeding and TF32 switch, no ctx.ddp. Each is recorded, resumed and
judged right, or refused in one line (real gloo ranks, real store, real SIGKILL)."""

from __future__ import annotations

import json

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
                              ("loader_accum", LOADER_ACCUM, "train: {}\n")):
        exp = project.add_experiment(name, train_py=code, commit=False)
        (exp / "experiment.yaml").write_text(BASE_YAML + train.lstrip("\n"))
        made[name] = f"experiments/{name}"
    git(project.root, "add", "-A")
    git(project.root, "commit", "-qm", "loop shapes")
    return {"gpt": made["gpt_shape"], "unregistered": made["unregistered"], "accum": made["loader_accum"]}


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
    assert "no model was given to ctx.ddp" in wrapped.stderr
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
