"""Lightning's Trainer and Fabric as harness experiments (issue 25): real Lightning, real ranks on gloo, the real CLI.

Each script is what a Lightning user writes, plus the one documented line (`**harness.lightning.trainer_kwargs(ctx)`,
or `harness.lightning.fabric(ctx, ...)` and `ctx.register(model)`)."""

from __future__ import annotations

import os
import re
import subprocess

import pytest
from conftest import Project, make_project

from harness import tags as T

try:
    import lightning  # noqa: F401  (only whether it is there)
except ImportError:  # pragma: no cover - CI installs it with the test extra
    if os.environ.get("CI") == "true":
        pytest.fail("lightning is required in CI (pip install -e '.[test]' installs it)", pytrace=False)
    pytest.skip("lightning is not installed (pip install -e '.[test]')", allow_module_level=True)

TRAINER = '''"""An MLP regression as a LightningModule, trained by L.Trainer (dropout, momentum, validation)."""

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import harness.lightning


class Model(L.LightningModule):
    def __init__(self, lr):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 1))
        self.lr = lr

    def training_step(self, batch, idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def validation_step(self, batch, idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def train(ctx):
    if ctx.cfg.fixed_seed is not None:
        L.seed_everything(ctx.cfg.fixed_seed)
    x = torch.randn(128, 8, generator=torch.Generator().manual_seed(0))
    y = x.sum(1, keepdim=True)
    data = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
    val = DataLoader(TensorDataset(x[:32], y[:32]), batch_size=16)
    devices = ctx.world_size if ctx.cfg.devices is None else ctx.cfg.devices
    trainer = L.Trainer(max_epochs=ctx.cfg.epochs, accelerator="cpu", devices=devices, log_every_n_steps=1,
                        enable_progress_bar=False, enable_model_summary=False, deterministic=ctx.cfg.deterministic,
                        **harness.lightning.trainer_kwargs(ctx))
    trainer.fit(Model(ctx.cfg.lr), data, val)
'''

TRAINER_CFG = "  devices: null\n  fixed_seed: null\n  deterministic: null\n"

FABRIC = '''"""The same MLP in a Fabric loop of its own."""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import harness.lightning


def train(ctx):
    fabric = harness.lightning.fabric(ctx, accelerator="cpu", devices=ctx.world_size)
    fabric.launch()
    x = torch.randn(128, 8, generator=torch.Generator().manual_seed(0))
    data = fabric.setup_dataloaders(DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=16, shuffle=True))
    model = ctx.register(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=ctx.cfg.lr)
    model, optimizer = fabric.setup(model, optimizer)
    step = 0
    for epoch in range(ctx.cfg.epochs):
        data.sampler.set_epoch(epoch)
        for xb, yb in data:
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(xb), yb)
            fabric.backward(loss)
            optimizer.step()
            fabric.log("loss", loss, step=step)
            step += 1
'''


@pytest.fixture(scope="module")
def lit(tmp_path_factory: pytest.TempPathFactory) -> Project:
    project = make_project(tmp_path_factory.mktemp("lightning"))
    project.add_experiment("lit", train_py=TRAINER, yaml_extra=TRAINER_CFG)
    project.add_experiment("fab", train_py=FABRIC)
    return project


@pytest.fixture(scope="module")
def trainer_run(lit: Project) -> str:
    result = lit.harness("run", "experiments/lit", "train.epochs=2")
    assert result.returncode == 0, result.stderr
    return result.last_line


def test_trainer_run_records_lightnings_metrics_and_the_model(lit: Project, trainer_run: str) -> None:
    run = lit.client().get_run(trainer_run)
    assert run.info.status == "FINISHED"
    tags = run.data.tags
    assert tags[T.FINGERPRINT_OF] == "model" and len(tags[T.FINGERPRINT]) == 64
    history = {key: lit.client().get_metric_history(trainer_run, key) for key in ("loss", "val_loss")}
    # 128 samples / 2 ranks / batch 16 = 4 steps an epoch, every one logged; validation once an epoch.
    assert [m.step for m in history["loss"]] == list(range(8))
    assert len(history["val_loss"]) == 2
    # Lightning's own files went to the run's outputs, not into the experiment folder (code).
    assert not (lit.root / "experiments" / "lit" / "lightning_logs").exists()
    status = subprocess.run(["git", "status", "--porcelain"], cwd=lit.root, capture_output=True, text=True).stdout
    assert status == "", status
    # Lightning re-seeds every rank at fit's start with PL_GLOBAL_SEED, which harness set to the recorded seed.
    assert "Trainer.fit) torch.manual_seed(0)" in tags[T.USER_SEEDS]


def test_trainer_replay_is_bitwise_with_fingerprints(lit: Project, trainer_run: str) -> None:
    replay = lit.harness("replay", trainer_run)
    assert replay.returncode == 0, replay.stderr
    verdict = next(line for line in replay.stdout.splitlines() if line.startswith("verdict: "))
    assert verdict.startswith("verdict: BITWISE") and "fingerprints equal" in verdict, verdict
    assert not re.search(r"\b0 fingerprints", verdict)


def test_trainer_replay_at_world_size_one_trains_on_all_the_data(lit: Project, trainer_run: str) -> None:
    replay = lit.harness("replay", trainer_run, "--world-size", "1")
    assert replay.returncode == 1, replay.stderr  # another world size: other sums, judged as such
    steps = [m.step for m in lit.client().get_metric_history(replay.last_line, "loss")]
    assert steps == list(range(16)), steps  # one rank, all 128 samples: 8 steps an epoch, not the 4 of half the data


def test_trainer_devices_other_than_the_world_size_is_refused_in_one_line(lit: Project) -> None:
    result = lit.harness("run", "experiments/lit", "world_size=1", "train.devices=2", "train.epochs=1")
    assert result.returncode == 1
    assert "harness started 1 rank (world_size: 1)" in result.stderr and "Pass devices=ctx.world_size" in result.stderr, \
        result.stderr


def test_settings_and_seeds_the_framework_puts_in_force_are_recorded_with_the_users_line(lit: Project) -> None:
    result = lit.harness("run", "experiments/lit", "world_size=1", "train.epochs=1", "train.fixed_seed=1234",
                         "train.deterministic=false")
    assert result.returncode == 0, result.stderr
    tags = lit.client().get_run(result.last_line).data.tags
    # Trainer(deterministic=False) switched strict's deterministic algorithms off: the record says so, and where.
    assert tags["harness.determinism.deterministic_algorithms"] == "False"
    trainer_line = "train.py:39 (lightning.pytorch.trainer.trainer.Trainer.__init__)"
    assert f"True -> False at step 0 (first step) by {trainer_line}" in tags[T.DETERMINISM_CHANGES]
    assert f"Warning: {trainer_line} set torch.use_deterministic_algorithms(False)" in result.stderr, result.stderr
    # L.seed_everything(1234): the recorded seed no longer decides the randomness, said once with the call.
    seeded = "train.py:33 (lightning.fabric.utilities.seed.seed_everything) torch.manual_seed(1234)"
    assert seeded in tags[T.USER_SEEDS]
    warning = [line for line in result.stderr.splitlines() if "seeds the RNGs itself" in line]
    assert len(warning) == 1 and seeded in warning[0] and "seed=0" in warning[0], result.stderr


def test_a_study_of_ten_seeds_has_distinct_members_and_every_teardown_finishes(lit: Project) -> None:
    # Ten launches of a Trainer beside harness's process group: each must end FINISHED (no abort, no hang at
    # teardown), and each seed must give other weights (the sampler and the initial weights follow the seed).
    result = lit.harness("run", "experiments/lit", "--seeds", "10", "train.epochs=1", timeout=900)
    assert result.returncode == 0, result.stderr
    members = [r for r in lit.all_runs() if r.data.tags.get(T.STUDY) == result.last_line]
    assert len(members) == 10 and {r.info.status for r in members} == {"FINISHED"}
    assert len({r.data.tags[T.FINGERPRINT] for r in members}) == 10


def test_fabric_run_and_replay_are_bitwise_with_fingerprints(lit: Project) -> None:
    run = lit.harness("run", "experiments/fab")
    assert run.returncode == 0, run.stderr
    tags = lit.client().get_run(run.last_line).data.tags
    assert tags[T.FINGERPRINT_OF] == "model"
    assert [m.step for m in lit.client().get_metric_history(run.last_line, "loss")] == list(range(20))
    replay = lit.harness("replay", run.last_line)
    assert replay.returncode == 0, replay.stderr
    verdict = next(line for line in replay.stdout.splitlines() if line.startswith("verdict: "))
    assert verdict.startswith("verdict: BITWISE") and "fingerprints equal" in verdict, verdict


@pytest.fixture
def contexts(tmp_path):
    """A rank's Context made in this process (no ranks, no launcher); closed after the test, since its step clock
    hooks every optimizer of the process."""
    import torch

    from harness.runtime.context import Context

    made = []

    def make(world_size: int = 2, run_id: str = "") -> Context:
        made.append(Context(rank=0, world_size=world_size, local_rank=0, device=torch.device("cpu"), cfg={}, seed=0,
                            rank_seed=0, fingerprint_every=5, channel=None, output_dir=str(tmp_path / "out"),
                            run_id=run_id))
        return made[-1]

    yield make
    for ctx in made:
        ctx.close()


def test_logger_keeps_one_value_per_key_and_step_and_refuses_a_second_one(contexts) -> None:
    import harness.lightning
    from harness.errors import ExperimentError

    ctx = contexts()
    logger = harness.lightning.Logger(ctx)
    logger.log_metrics({"loss": 0.5, "epoch": 0.0}, step=3)
    logger.log_metrics({"val_loss": 0.7, "epoch": 0.0}, step=3)  # the epoch's end, at the same step: one `epoch`
    assert {k: sorted(v) for k, v in ctx._logged.items()} == {"loss": [3], "epoch": [3], "val_loss": [3]}
    with pytest.raises(ExperimentError, match=r"Lightning logged 'loss' twice at step 3 \(0.5, then 0.25\)"):
        logger.log_metrics({"loss": 0.25}, step=3)


def test_environment_refuses_a_layout_that_is_not_the_jobs(contexts) -> None:
    import harness.lightning
    from harness.errors import ExperimentError

    env = harness.lightning.Environment(contexts(world_size=2))
    env.validate_settings(num_devices=2, num_nodes=1)
    with pytest.raises(ExperimentError, match=r"devices=1 x num_nodes=1 make 1 process, but harness started 2 ranks"):
        env.validate_settings(num_devices=1, num_nodes=1)
    with pytest.raises(ExperimentError, match=r"make 4 processes.*Pass devices=ctx.world_size"):
        env.set_world_size(4)


def test_an_mlflow_logger_of_its_own_run_is_refused_and_one_on_the_harness_run_is_not(contexts, tmp_path) -> None:
    from lightning.pytorch.loggers import MLFlowLogger

    import harness.lightning
    from harness.errors import ExperimentError

    ctx = contexts(run_id="a" * 32)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with pytest.raises(ExperimentError, match="MLFlowLogger would log into a run of its own"):
        harness.lightning._check_mlflow_loggers(ctx, [MLFlowLogger(tracking_uri=uri)])
    harness.lightning._check_mlflow_loggers(ctx, [MLFlowLogger(tracking_uri=uri, run_id=ctx.run_id)])


def test_what_trainer_kwargs_returns_deep_copies_and_pickles_as_lightning_cli_needs(contexts) -> None:
    """LightningCLI(trainer_defaults=trainer_kwargs(ctx)) deep-copies the defaults: the copies are harness's objects
    on the same context (which copies as a reference to itself), and they log into it."""
    import copy
    import pickle

    import harness.lightning

    ctx = contexts()
    kwargs = harness.lightning.trainer_kwargs(ctx, max_epochs=2)
    for made in (copy.deepcopy(kwargs), pickle.loads(pickle.dumps(kwargs))):
        assert made.keys() == kwargs.keys() and made["max_epochs"] == 2
        logger, callback, environment = made["logger"][-1], made["callbacks"][-1], made["plugins"][-1]
        assert isinstance(logger, harness.lightning.Logger) and logger is not kwargs["logger"][-1]
        assert logger._ctx is callback._ctx is environment._ctx is ctx
    copy.deepcopy(kwargs)["logger"][-1].log_metrics({"loss": 0.5}, step=0)
    assert ctx._logged == {"loss": {0}}
