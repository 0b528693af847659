"""Per-tensor fingerprints at checkpoints, and the first checkpoint whose tensors differ between two runs.

One run and two replays of a two-layer model with momentum: an honest replay, and one with a planted
change (`train.perturb_at`) that nudges exactly one weight and its momentum right before a checkpoint.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import Project, Result
from harness.judge.tensordiff import diff_checkpoints, first_differing_checkpoint
from harness.store.tracking import RunRecord, Tracker

TRAIN = '''"""Two linear layers with SGD momentum; train.perturb_at=K nudges head.weight and its momentum before step K."""

import torch
from torch import nn


def train(ctx):
    cfg = ctx.cfg
    data = torch.randn(cfg.samples, 10, generator=torch.Generator().manual_seed(ctx.seed))
    loader = ctx.loader(data, batch_size=cfg.batch_size)
    model = ctx.ddp(nn.Sequential(nn.Linear(10, 8), nn.ReLU(), nn.Linear(8, 5)))
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9)
    ctx.track(optimizer)
    head = model.module[2].weight
    for epoch in ctx.epochs(cfg.epochs):
        for batch in loader:
            optimizer.zero_grad()
            out = model(batch)
            loss = nn.functional.mse_loss(out, torch.randn_like(out))
            loss.backward()
            optimizer.step()
            if ctx.step == cfg.perturb_at - 1:  # after the last step before checkpoint perturb_at
                with torch.no_grad():
                    head.add_(1e-3)
                    optimizer.state[head]["momentum_buffer"].add_(1e-3)
            ctx.log({"loss": loss}, ctx.step)
'''

# 100 samples, batch 10, 2 ranks: 5 steps an epoch, 10 in all; checkpoints at steps 0, 4 and 8.
RUN_ARGS = ("checkpoint_every=4", "train.epochs=2")
PLANTED = 8


def _hash(t: torch.Tensor) -> str:
    """Independently of harness: dtype, shape, then the bytes numpy sees."""
    return hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode() + t.contiguous().numpy().tobytes()).hexdigest()


@pytest.fixture(scope="module")
def runs(project: Project) -> dict[str, Any]:
    project.add_experiment("ckfp", train_py=TRAIN, yaml_extra="  perturb_at: -1\n")
    run = project.harness("run", "experiments/ckfp", *RUN_ARGS)
    assert run.returncode == 0, run.stderr
    original = run.last_line
    honest = project.harness("replay", original)
    planted = project.harness("replay", original, "--allow-changes", f"train.perturb_at={PLANTED}")
    assert honest.returncode == 0, honest.stdout + honest.stderr
    assert planted.returncode == 1, planted.stdout + planted.stderr
    return {"original": original, "honest": honest, "planted": planted}


@functools.cache
def _tracker(uri: str) -> Tracker:
    return Tracker(uri)


def _record(project: Project, result_or_id: Result | str) -> RunRecord:
    run_id = result_or_id if isinstance(result_or_id, str) else result_or_id.last_line
    return _tracker(project.uri).load_record(run_id)


def test_checkpoint_records_a_digest_per_tensor_equal_to_the_saved_bytes(project: Project, runs: dict) -> None:
    record = _record(project, runs["original"])
    assert record.checkpoint_tensors is not None and sorted(record.checkpoint_tensors) == [0, 4, 8]
    root = Path(project.client().get_run(runs["original"]).info.artifact_uri.removeprefix("file://")) / "checkpoints"
    saved = torch.load(root / "step-00000004" / "rank0.pt", weights_only=True)
    names = list(saved["model"])  # 0.weight, 0.bias, 2.weight, 2.bias: the optimizer numbers them in this order
    expected = {name: _hash(t) for name, t in saved["model"].items()}
    for index, state in saved["optimizer"]["state"].items():
        expected[f"{names[index]}/momentum_buffer"] = _hash(state["momentum_buffer"])
    entry = record.checkpoint_tensors[4]
    assert entry["tensors"] == expected
    assert len(entry["ranks"]) == 2 and entry["ranks"][0] == entry["ranks"][1]  # DDP replicas: one model


def test_honest_replay_names_no_differing_checkpoint(project: Project, runs: dict) -> None:
    assert "verdict: BITWISE" in runs["honest"].stdout
    assert "checkpoint tensors" not in runs["honest"].stdout  # nothing to say: no line
    a, b = _record(project, runs["original"]), _record(project, runs["honest"])
    assert first_differing_checkpoint(a, b) == (8, None, [])


def test_planted_change_names_the_step_and_only_the_tensors_it_touched(project: Project, runs: dict) -> None:
    out = runs["planted"].stdout
    assert ("checkpoint tensors: first differ at step 8: only 2.weight, 2.weight/momentum_buffer differ (of 8); "
            "last checkpoint with all equal: step 4") in out, out
    a, b = _record(project, runs["original"]), _record(project, runs["planted"])
    assert first_differing_checkpoint(a, b) == (4, PLANTED, ["2.weight", "2.weight/momentum_buffer"])
    report = project.client().download_artifacts(runs["planted"].last_line, "replay/report.md")
    text = Path(report).read_text()
    assert "## Checkpoint tensors" in text and "- First differing: step 8" in text and "`2.weight/momentum_buffer`" in text
    # The JSON `harness compare --json` prints (Comparison.to_dict), as the replay stored it.
    comparison = project.client().download_artifacts(runs["planted"].last_line, "replay/comparison.json")
    ck = json.loads(Path(comparison).read_text())["checkpoints"]
    assert (ck["last_equal_step"], ck["first_diff_step"], ck["differing"]) == (4, 8, ["2.weight", "2.weight/momentum_buffer"])


def _bare(checkpoints: dict[int, str], tensors: dict | None) -> RunRecord:
    return RunRecord("r", "e", "FINISHED", {}, [], {}, {}, None, {}, checkpoints=checkpoints, checkpoint_tensors=tensors)


def test_without_per_tensor_digests_nothing_is_claimed_equal() -> None:
    entry = {"tensors": {"w": "1"}, "ranks": ["x"]}
    new, old, none = _bare({0: "a"}, {0: entry}), _bare({0: "a"}, None), _bare({}, None)
    assert diff_checkpoints(none, none) is None  # no checkpoints: no section, no line
    diff = diff_checkpoints(old, new)
    assert diff is not None and diff.missing_in == ["original"] and diff.last_equal_step is None
    assert "cannot be said" in diff.describe()
    assert first_differing_checkpoint(old, new) == (None, None, [])
    desynced = _bare({0: "a"}, {0: {"tensors": {"w": "1"}, "ranks": ["x", "y"]}})
    assert diff_checkpoints(new, desynced).desynced_ranks == {"replay": {0: [1]}}


def test_digests_name_buffers_and_optimizer_state_and_cover_dtype_and_shape() -> None:
    from harness.runtime import checkpoint as ckpt

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    state = ckpt.build(model=model, optimizer=opt, position=ckpt.TrainingPosition(1, 0, 1))
    tensors = ckpt.tensor_fingerprints(state, model, opt)
    assert {"1.running_mean", "1.num_batches_tracked", "0.weight/exp_avg", "0.weight/exp_avg_sq", "1.bias/step"} <= set(tensors)
    assert tensors == ckpt.live_tensor_fingerprints(model, opt)
    # The same 8 zero bytes as another dtype or shape are another tensor.
    same_bytes = [torch.zeros(2), torch.zeros(1, dtype=torch.float64), torch.zeros(2, 1), torch.zeros(4, dtype=torch.bfloat16)]
    assert len({ckpt.tensor_sha256(t) for t in same_bytes}) == 4
    # BatchNorm statistics may differ between DDP ranks: the replica digest ignores buffers, not parameters.
    moved = dict(tensors, **{"1.running_mean": "0" * 64})
    assert ckpt.replica_sha256(moved, model) == ckpt.replica_sha256(tensors, model)
    assert ckpt.replica_sha256(dict(tensors, **{"0.weight/exp_avg": "0" * 64}), model) != ckpt.replica_sha256(tensors, model)
