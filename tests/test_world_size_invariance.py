"""World-size-invariant mode end to end: digits_cnn (dropout, DataLoader workers) trained on 4 ranks
replays bit for bit on 2 and on 1 (real gloo ranks, real store)."""

from __future__ import annotations

import pytest

from conftest import Project

INVARIANT = ["determinism.world_size_invariant=true", "determinism.shards=8", "train.batch_size=8", "train.epochs=1"]


@pytest.fixture(scope="module")
def four_ranks(project: Project) -> str:
    result = project.harness("run", "experiments/digits_cnn", "world_size=4", *INVARIANT)
    assert result.returncode == 0, result.stderr
    return result.last_line


@pytest.mark.parametrize("world_size", [2, 1])
def test_invariant_run_on_4_ranks_replays_bitwise_on_fewer(project: Project, four_ranks: str, world_size: int) -> None:
    result = project.harness("replay", four_ranks, "--world-size", str(world_size))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().splitlines()[-2].startswith("verdict: BITWISE"), result.stdout
    assert f"harness.world_size: 4 -> {world_size}" in result.stdout
    assert "world-size-invariant mode" in result.stdout
    tags = project.client().get_run(result.last_line).data.tags
    assert tags["harness.world_size"] == str(world_size)
    assert tags["harness.determinism.world_size_invariant"] == "True"


def test_invariant_mode_records_its_settings(project: Project, four_ranks: str) -> None:
    client = project.client()
    tags = client.get_run(four_ranks).data.tags
    assert tags["harness.determinism.world_size_invariant"] == "True"
    assert tags["harness.determinism.shards"] == "8"
    # 1437 training images / (8 shards x 8) = 22 full global batches; the tail is dropped.
    assert len(client.get_metric_history(four_ranks, "train_loss")) == 22


def test_bad_invariant_layout_is_refused(project: Project) -> None:
    result = project.harness("run", "experiments/digits_cnn", "world_size=3", "determinism.world_size_invariant=true")
    assert result.returncode == 2
    assert result.stderr.startswith("Error: ") and "power-of-two world_size" in result.stderr
