"""`harness trace`, `harness compare` of two traces and `harness replay --localize`: planted causes of a
divergence, each localised end to end (real CLI, real ranks, real store) to its op and the user's line."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import Project, Result

# One experiment, every planted cause behind a train: key, so one honest run serves several tests.
PLANTED = '''"""Linear(8, 4) regressing a fixed map, with planted causes of divergence behind train: keys."""

import time

import torch
from torch import nn


def train(ctx):
    cfg = ctx.cfg
    torch.set_flush_denormal(cfg.precision == "ftz")  # a precision setting: denormals count as zero
    data = torch.randn(cfg.samples, 8, generator=torch.Generator().manual_seed(ctx.seed))
    teacher = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    loader = ctx.loader(data, batch_size=cfg.batch_size)
    model = ctx.ddp(nn.Linear(8, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    ctx.track(optimizer)
    # Per-slot statistics gathered rank by rank, each rank's share of the rows after the other's: the order of
    # the contributions follows the world size. (1e8 + 1) - 1e8 = 0 but (1e8 - 1e8) + 1 = 1 in float32.
    rows, slots = torch.tensor([[1e8], [1.0], [-1e8], [1e8], [1.0], [-1e8]]), torch.tensor([0, 0, 0, 1, 1, 1])
    order = torch.cat([torch.arange(r, 6, ctx.world_size) for r in range(ctx.world_size)])
    index, source = slots[order], rows[order]
    tiny = torch.full((1, 8), 1 << 20, dtype=torch.int32).view(torch.float32)  # denormal floats, made from bits

    def batch_loss(batch, extra):
        out = model(batch)
        target = batch @ teacher
        if cfg.unseeded and ctx.step >= 3:
            noise = torch.rand(target.shape, generator=torch.Generator().manual_seed(time.time_ns()))  # PLANTED: unseeded
            target = target + noise
        return nn.functional.mse_loss(out, target) + extra

    for _ in ctx.epochs(cfg.epochs):
        for batch in loader:
            stats = torch.zeros(2, 1).index_add_(0, index, source)  # PLANTED: order
            probe = tiny @ teacher  # PLANTED: precision
            extra = 0.1 * stats.sum() + 1e38 * probe.sum()
            optimizer.zero_grad()
            loss = ctx.backward(batch, lambda b: batch_loss(b, extra))
            optimizer.step()
            ctx.log({"loss": loss}, ctx.step)
'''
YAML = "  unseeded: false\n  precision: ieee\n  weight_decay: 0.01\n"
# World-size-invariant mode, 2 shards of 4 samples a step: 6 steps, a checkpoint every 2.
CONFIG = ["determinism.world_size_invariant=true", "determinism.shards=2", "train.batch_size=4", "train.samples=48",
          "train.epochs=1", "checkpoint_every=2", "train.lr=0.05"]


def line_of(tag: str) -> str:
    """'train.py:N' of the planted line marked `# PLANTED: tag`."""
    for n, line in enumerate(PLANTED.splitlines(), 1):
        if line.endswith(f"# PLANTED: {tag}"):
            return f"train.py:{n}"
    raise AssertionError(tag)


@pytest.fixture(scope="module")
def planted(project: Project) -> str:
    project.add_experiment("planted", train_py=PLANTED, yaml_extra=YAML)
    return "experiments/planted"


@pytest.fixture(scope="module")
def honest(project: Project, planted: str) -> str:
    result = project.harness("run", planted, *CONFIG)
    assert result.returncode == 0, result.stderr
    return result.last_line


@pytest.fixture(scope="module")
def traced(project: Project, honest: str) -> str:
    result = project.harness("trace", honest, "--step", "3", "--ranks", "0,1")
    assert result.returncode == 0, result.stdout + result.stderr
    return result.last_line


def test_trace_is_a_nested_run_and_keeps_the_training_bits(project: Project, honest: str, traced: str) -> None:
    from harness.optrace import tracefile as optrace

    client = project.client()
    tags = client.get_run(traced).data.tags
    assert tags["harness.kind"] == "trace" and tags["mlflow.parentRunId"] == honest
    assert tags["harness.trace_of"] == honest and tags["harness.trace.step"] == "3"
    assert tags["harness.trace.ranks"] == "0,1" and tags["harness.trace.from_checkpoint"] == "2"
    # Steps 2 and 3 logged the recorded losses and ended with the weights of the recorded checkpoint 4,
    # bit for bit: the tracer changed nothing.
    assert tags["harness.trace.reproduced"] == "true"
    names = {a.path for a in client.list_artifacts(traced, "trace")}
    assert names == {"trace/rank0.jsonl.gz", "trace/rank1.jsonl.gz", "trace/meta.json"}
    trace = optrace.loads(Path(client.download_artifacts(traced, "trace/rank1.jsonl.gz")).read_bytes())
    assert trace.meta["step"] == 3 and trace.meta["rank"] == 1 and trace.ops
    assert any(op.user_line.startswith(line_of("order")) for op in trace.ops)


@pytest.fixture(scope="module")
def traced_again(project: Project, honest: str) -> str:
    result = project.harness("trace", honest, "--step", "3")
    assert result.returncode == 0, result.stderr
    return result.last_line


def test_an_honest_pair_of_traces_finds_no_difference(project: Project, traced: str, traced_again: str,
                                                      tmp_path: Path) -> None:
    report = tmp_path / "diff.md"
    result = project.harness("compare", traced, traced_again, "--report", str(report))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("IDENTICAL") and "(rank 0)" in result.stdout.splitlines()[0]
    assert report.read_text().strip()


def test_traces_travel_in_a_bundle_and_compare_there(project: Project, honest: str, traced: str, traced_again: str,
                                                     tmp_path: Path) -> None:
    bundle = tmp_path / "run.tar.gz"
    exported = project.harness("export", honest, "-o", str(bundle))
    assert exported.returncode == 0, exported.stderr
    elsewhere = Project(tmp_path / "machine B", tmp_path / "store B")
    elsewhere.store.mkdir(parents=True)
    elsewhere.root.mkdir()
    imported = elsewhere.harness("import", str(bundle))
    assert imported.returncode == 0, imported.stderr
    copies = [r for r in elsewhere.all_runs() if r.data.tags.get("harness.kind") == "trace"]
    assert len(copies) == 2 and all(r.data.tags["harness.trace_of"] == imported.last_line for r in copies)
    result = elsewhere.harness("compare", *(r.info.run_id for r in copies))
    assert result.returncode == 0 and result.stdout.startswith("IDENTICAL"), result.stdout + result.stderr


def test_bad_input_is_one_line_and_records_nothing(project: Project, honest: str, traced: str) -> None:
    from harness.commands.trace import parse_ranks, trace
    from harness.errors import HarnessError

    before = len(project.all_runs())
    # The command line once (one line, exit 2), the library for the other refusals (no start-up each).
    result = project.cli("trace", honest, "--step", "6")
    assert result.returncode == 2 and result.stderr == f"Error: --step 6: run {honest} has steps 0-5. Pass a step in that range.\n"
    mixed = project.cli("compare", traced, honest)
    assert mixed.returncode == 2 and f"run {traced} is a trace and run {honest} is not" in mixed.stderr, mixed.stderr
    cases = [
        ("no-such-run", 0, (0,), "no-such-run"),
        (honest, 1, (0, 2), f"--ranks 0,2: run {honest} ran 2 ranks (0-1)."),
        (traced, 1, (0,), f"run {traced} is a trace; trace the run it traced ({honest})."),
    ]
    for run_id, step, ranks, needle in cases:
        with pytest.raises(HarnessError, match=".") as err:
            trace(run_id, step=step, ranks=ranks, tracking_uri=project.uri)
        assert needle in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(HarnessError, match="--ranks x: give rank numbers"):
        parse_ranks("x")
    assert len(project.all_runs()) == before


def _localized(project: Project, result: Result) -> str:
    assert result.returncode == 1, result.stdout + result.stderr
    assert "verdict: DIVERGED" in result.stdout
    return result.stdout[result.stdout.index("Localization of step"):]


def test_unseeded_op_is_localized_by_a_replay_and_shown_in_the_browser(project: Project, planted: str,
                                                                      tmp_path: Path) -> None:
    from browser import open_page

    run = project.harness("run", planted, *CONFIG, "train.unseeded=true")
    assert run.returncode == 0, run.stderr
    replay = project.harness("replay", run.last_line)  # automatic: the run has checkpoints
    text = _localized(project, replay)
    assert "same-machine nondeterminism" in text and "CULPRIT" in text, text
    assert "aten.rand" in text and line_of("unseeded") in text, text
    client = project.client()
    replay_id = replay.stdout.strip().splitlines()[-1]
    children = [r for r in project.all_runs() if r.data.tags.get("mlflow.parentRunId") == replay_id]
    assert sorted(r.data.tags["harness.trace.purpose"] for r in children) == ["original (nondeterminism check)"] * 2
    report = Path(client.download_artifacts(replay_id, "replay/report.md")).read_text()
    assert "## Where it diverged" in report and line_of("unseeded") in report
    html = Path(client.download_artifacts(replay_id, "replay/localization.html"))
    shown = open_page(html.as_uri(), tmp_path / "localization.png", tmp_path / "chromium").text
    assert "rand" in shown and line_of("unseeded") in shown, shown


def test_world_size_dependent_accumulation_is_localized(project: Project, honest: str) -> None:
    text = _localized(project, project.harness("replay", honest, "--world-size", "1"))
    assert "CULPRIT" in text and "aten.index_add_" in text and line_of("order") in text, text
    assert "accumulated in a different order" in text, text


def test_precision_change_is_localized(project: Project, honest: str) -> None:
    result = project.harness("replay", honest, "--allow-changes", "train.precision=ftz", "--localize")
    text = _localized(project, result)
    assert "CULPRIT" in text and "aten.mm" in text and line_of("precision") in text, text
    assert "flush_denormal False vs True" in text, text


def test_a_learning_rate_change_is_caught_at_its_first_step_and_pinned_on_the_optimizer_step(project: Project,
                                                                                            honest: str) -> None:
    """lr x2: harness's own per-step learning rate differs at step 0, before any loss does; step 0 is traced and
    the optimizer's update is the op, with the arguments that differ."""
    result = project.harness("replay", honest, "--allow-changes", "train.lr=0.1", "--localize")
    assert "DIVERGED at step 0: harness.lr 0.05 vs 0.1" in result.stdout, result.stdout
    text = _localized(project, result)
    assert text.startswith("Localization of step 0:"), text
    assert "phase: optimizer" in text and "alpha=-0.05 vs T, T, alpha=-0.1" in text, text
    (number,) = [n for n, line in enumerate(PLANTED.splitlines(), 1) if line.strip() == "optimizer.step()"]
    assert f"train.py:{number}" in text, text
    assert "the optimizer step ran with other hyper-parameters" in text and "train.lr (0.05 vs 0.1)" in text, text


def test_a_weight_decay_change_is_pinned_on_the_optimizer_step_of_the_step_before(project: Project,
                                                                                  honest: str) -> None:
    """Weight decay x2: the learning rate is the same, so the first step whose loss differs (step 1) reads weights
    that already differ (its first op that reads them is blamed on nothing); the step before is traced too, and
    there the optimizer's update is the op."""
    result = project.harness("replay", honest, "--allow-changes", "train.weight_decay=0.02", "--localize")
    text = _localized(project, result)
    head, first = text.splitlines()[:2]
    step = int(head.split("Localization of step ", 1)[1].split(":", 1)[0])
    assert first.strip().startswith(f"step {step + 1}'s inputs already differed at its first differing op"), text
    assert "INPUTS_DIFFER_FROM_START" in text and "phase: optimizer" in text, text
    (number,) = [n for n, line in enumerate(PLANTED.splitlines(), 1) if line.strip() == "optimizer.step()"]
    assert f"train.py:{number}" in text, text
    assert "the optimizer step ran with other hyper-parameters" in text, text
    assert "train.weight_decay (0.01 vs 0.02)" in text, text
