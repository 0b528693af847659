"""`harness bisect GOOD BAD` on planted histories, as a user runs it: a repository of 17 commits where one changes
the result, and a config delta of 6 keys where one matters (real git, real store, real ranks)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from conftest import Project, git, make_project

TRAIN = '''"""linear_ddp with a learning-rate scale kept in a module of its own (knob.py), and keys it never reads."""

import torch
from torch import nn

from knob import SCALE


def train(ctx):
    cfg = ctx.cfg
    data = torch.randn(cfg.samples, 10, generator=torch.Generator().manual_seed(ctx.seed))
    loader = ctx.loader(data, batch_size=cfg.batch_size)
    model = ctx.ddp(nn.Linear(10, 5))
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr * SCALE)
    for _ in ctx.epochs(cfg.epochs):
        for batch in loader:
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(batch), torch.zeros(len(batch), 5))
            loss.backward()
            optimizer.step()
            ctx.log({"loss": loss}, ctx.step)
'''
YAML = """image: none
entry: train.py:train
world_size: 1
seed: 0
threads_per_rank: 1
determinism:
  level: strict
train:
  lr: 0.01
  epochs: 2
  batch_size: 10
  samples: 40
  note_a: 0
  note_b: 0
  note_c: 0
  note_d: 0
  note_e: 0
"""
CULPRIT = 11  # of the 16 commits after the good run's


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Project, str, str, str]:
    """A good run at the first commit, 16 commits (the 11th doubles the scale), a bad run at the last."""
    project = make_project(tmp_path_factory.mktemp("bisect"))
    exp = project.add_experiment("knobbed", train_py=TRAIN, commit=False)
    (exp / "experiment.yaml").write_text(YAML)
    (exp / "knob.py").write_text("SCALE = 1.0\n")
    git(project.root, "add", "-A")
    git(project.root, "commit", "-qm", "add knobbed")
    good = project.harness("run", "experiments/knobbed")
    assert good.returncode == 0, good.stderr
    culprit = ""
    for i in range(1, 17):
        (exp / "NOTES.txt").write_text(f"note {i}\n")
        if i == CULPRIT:
            (exp / "knob.py").write_text("SCALE = 2.0  # a faster schedule\n")
        git(project.root, "add", "-A")
        git(project.root, "commit", "-qm", f"change {i}")
        if i == CULPRIT:
            culprit = git(project.root, "rev-parse", "HEAD")
    bad = project.harness("run", "experiments/knobbed")
    assert bad.returncode == 0, bad.stderr
    return project, good.last_line, bad.last_line, culprit


def _probes(project: Project, bisect_id: str) -> list:
    client = project.client()
    return [r for r in project.all_runs() if r.data.tags.get("harness.bisect.of") == bisect_id
            and r.data.tags.get("mlflow.parentRunId") == bisect_id and r.data.tags.get("harness.kind") == "replay"]


def test_bisect_names_the_commit_that_changed_the_result(planted) -> None:
    project, good, bad, culprit = planted
    result = project.harness("bisect", good, bad)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.strip().splitlines()
    assert f"culprit: commit {culprit[:12]} (change {CULPRIT}): its code flips the result" in lines, result.stdout
    probes = [line for line in lines if line.startswith("probe ")]
    assert len(probes) <= math.ceil(math.log2(16)) + 2, result.stdout
    assert probes[0].startswith("probe 1: GOOD as recorded: BITWISE")
    bisect_id = lines[-1]
    tags = project.client().get_run(bisect_id).data.tags
    assert tags["harness.kind"] == "bisect" and tags["harness.bisect.culprit"] == f"commit {culprit}"
    assert tags["harness.bisect.good"] == good and tags["harness.bisect.bad"] == bad
    assert project.client().get_run(bisect_id).info.status == "FINISHED"
    # Every probe is an ordinary recorded replay of the good run, nested under the bisect run, at its commit.
    recorded = _probes(project, bisect_id)
    assert len(recorded) == len(probes)
    commits = {r.data.tags["harness.git.commit"] for r in recorded}
    assert culprit in commits and all(r.data.tags["harness.replay_of"] == good for r in recorded)
    doc = json.loads(Path(project.client().download_artifacts(bisect_id, "bisect/bisect.json",
                                                              str(project.store.parent))).read_text())
    assert doc["culprit_commit"][0] == culprit and len(doc["probes"]) == len(probes)
    # The bisect run is no training run: it cannot be replayed.
    again = project.cli("replay", bisect_id)
    assert again.returncode == 2 and "a bisection (harness bisect)" in again.stderr


def test_bisect_names_the_config_key_that_matters(planted) -> None:
    project, _, _, _ = planted
    good = project.harness("run", "experiments/knobbed")
    changed = ["train.note_a=1", "train.note_b=2", "train.lr=0.02", "train.note_c=3", "train.note_d=4", "train.note_e=5"]
    bad = project.harness("run", "experiments/knobbed", *changed)
    assert good.returncode == 0 and bad.returncode == 0, good.stderr + bad.stderr
    # Cut short by its budget: GOOD as recorded and all six keys at once; it says how far it got.
    cut = project.harness("bisect", good.last_line, bad.last_line, "--max-probes", "2")
    assert cut.returncode == 1 and "--max-probes 2 spent before the search ended" in cut.stdout, cut.stdout + cut.stderr
    # Taken up where it stopped: its two probes are reused (not replayed again), the budget counts new ones only.
    replays_before = len([r for r in project.all_runs() if r.data.tags.get("harness.kind") == "replay"])
    result = project.harness("bisect", good.last_line, bad.last_line, "--resume", cut.last_line, "--localize")
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.strip().splitlines()
    reused = [line for line in lines if line.startswith("probe ") and f"reused from bisect {cut.last_line}" in line]
    assert [line.split(":")[1].strip() for line in reused] == ["GOOD as recorded", "config train.lr, train.note_a, "
                                                               "train.note_b, train.note_c, train.note_d, train.note_e"]
    probes = [line for line in lines if line.startswith("probe ")]
    new = len([r for r in project.all_runs() if r.data.tags.get("harness.kind") == "replay"]) - replays_before
    assert new == len(probes) - 2, result.stdout
    assert project.client().get_run(lines[-1]).data.tags["harness.bisect.resumed_from"] == cut.last_line
    other = project.cli("bisect", good.last_line, bad.last_line, "--resume", good.last_line)
    assert other.returncode == 2 and "is no bisect" in other.stderr and len(other.stderr.strip().splitlines()) == 1
    assert "culprit: config train.lr: 0.01 -> 0.02 flips the result" in lines, result.stdout
    assert not any(line.startswith("culprit: commit") for line in lines)
    assert len([line for line in lines if line.startswith("probe ")]) <= 2 + 2 * math.ceil(math.log2(6))
    client = project.client()
    assert client.get_run(lines[-1]).data.tags["harness.bisect.culprit"] == "config train.lr"
    # --localize: the probe that carried train.lr alone is traced against GOOD at its first divergent step: 0, where
    # the recorded learning rate (harness.lr) differs, so the trace pins the optimizer's update and its lr.
    where = [line for line in lines if line.startswith("at the culprit (probe replay ")]
    assert where and "Localization of step 0" in where[0], result.stdout
    assert any("INPUTS_DIFFER_FROM_START" in line for line in where) and any("op: aten." in line for line in where)
    assert any("phase: optimizer" in line for line in where) and any("alpha=-0.02) vs" in line for line in where)
    probe_id = where[0].split("probe replay ")[1].split(")")[0]
    assert client.get_run(probe_id).data.tags["harness.localized"] == "INPUTS_DIFFER_FROM_START", result.stdout
    doc = json.loads(Path(client.download_artifacts(lines[-1], "bisect/bisect.json")).read_text())
    assert doc["culprit_probe"] == probe_id and doc["localized"][0].startswith("Localization of step 0")


def test_runs_that_agree_are_refused_in_one_line_and_nothing_is_recorded(planted) -> None:
    project, good, bad, _ = planted
    before = len(project.all_runs())
    same = project.cli("bisect", good, good)
    assert same.returncode == 2 and "there is nothing to bisect" in same.stderr, same.stderr
    assert len(same.stderr.strip().splitlines()) == 1
    none = project.cli("bisect", good, bad, "--max-probes", "0")
    assert none.returncode == 2 and "--max-probes" in none.stderr
    assert len(project.all_runs()) == before
