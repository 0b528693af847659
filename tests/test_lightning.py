"""Lightning's Trainer and Fabric as harness experiments (issue 25): real Lightning, real ranks on gloo, the real CLI.

Each script is what a Lightning user writes, plus the one documented line (`**harness.lightning.trainer_kwargs(ctx)`,
or `harness.lightning.fabric(ctx, ...)` and `ctx.register(model)`)."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest
from conftest import Project, make_project

from harness import tags as T
from harness.rundata import wall_clock

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


# Validation and test log per batch and per epoch (an autoencoder example's shape), in a run too short for
# log_every_n_steps=50 to log any training value: 2 epochs of 4 steps, 2 validation batches each, 2 test batches.
EVALUATED = '''"""An MLP whose validation and test log per step and per epoch; Lightning's checkpoints left on."""

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import harness.lightning


class Model(L.LightningModule):
    def __init__(self, lr):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.lr = lr

    def training_step(self, batch, idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), on_step=True, on_epoch=True, sync_dist=True)

    def test_step(self, batch, idx):
        x, y = batch
        self.log("test_loss", nn.functional.mse_loss(self.net(x), y), on_step=True, on_epoch=True, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def train(ctx):
    x = torch.randn(128, 8, generator=torch.Generator().manual_seed(0))
    y = x.sum(1, keepdim=True)
    data = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
    held_out = DataLoader(TensorDataset(x[:64], y[:64]), batch_size=16)
    trainer = L.Trainer(max_epochs=2, accelerator="cpu", devices=ctx.world_size, log_every_n_steps=50,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        **harness.lightning.trainer_kwargs(ctx))
    model = Model(ctx.cfg.lr)
    trainer.fit(model, data, held_out)
    trainer.test(model, held_out, verbose=False)
    if ctx.cfg.fail:
        raise RuntimeError("the job died after its test")
'''


@pytest.fixture(scope="module")
def lit(tmp_path_factory: pytest.TempPathFactory) -> Project:
    project = make_project(tmp_path_factory.mktemp("lightning"))
    project.add_experiment("lit", train_py=TRAINER, yaml_extra=TRAINER_CFG)
    project.add_experiment("fab", train_py=FABRIC)
    project.add_experiment("evaluated", train_py=EVALUATED, yaml_extra="  fail: false\ncheckpoint_every: 5\n")
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


@pytest.fixture(scope="module")
def evaluated_run(lit: Project) -> str:
    result = lit.harness("run", "experiments/evaluated")
    assert result.returncode == 0, result.stderr
    return result.last_line


@pytest.fixture(scope="module")
def evaluated_replay(lit: Project, evaluated_run: str):
    return lit.harness("replay", evaluated_run)


def test_evaluation_values_are_recorded_at_the_trainers_step_or_at_an_index_of_their_own(lit: Project,
                                                                                         evaluated_run: str) -> None:
    """An evaluation epoch's values at the trainer's step (validation after steps 3 and 7, the test after all 8);
    an evaluation batch's at Lightning's count of evaluation batches, which the record names as such - no training
    step logged them (log_every_n_steps=50 logged no training value at all)."""
    client = lit.client()
    run = client.get_run(evaluated_run)
    steps = {key: [m.step for m in client.get_metric_history(evaluated_run, key)] for key in run.data.metrics
             if not wall_clock(key)}  # harness's step times (harness.perf.*) are the run's wall clock, not logged values
    # harness's own learning rate is recorded at each of the 8 optimizer steps.
    assert steps == {"val_loss_step": [0, 1, 2, 3], "val_loss_epoch": [3, 7], "test_loss_step": [0, 1],
                     "test_loss_epoch": [8], "epoch": [3, 7, 8], "harness.lr": list(range(8))}, steps
    assert json.loads(run.data.tags[T.EVALUATION_METRICS]) == {
        "epoch": "step", "test_loss_epoch": "step", "test_loss_step": "test batch", "val_loss_epoch": "step",
        "val_loss_step": "validation batch"}
    # checkpoint_every=5: the notice names Lightning's own checkpoints, not a loop harness cannot write here.
    assert run.data.tags[T.LOOP] == "lightning"
    notice = run.data.tags[T.NOTICES]
    assert "checkpoint_every=5: no checkpoint at step 0 or after: Lightning's Trainer runs the loop" in notice, notice
    assert "checkpoint with Lightning itself" in notice and "ctx.steps" not in notice


def test_a_replay_of_evaluation_values_only_says_none_is_a_training_step_value(evaluated_replay) -> None:
    assert evaluated_replay.returncode == 0, evaluated_replay.stderr
    verdict = next(line for line in evaluated_replay.stdout.splitlines() if line.startswith("verdict: "))
    assert verdict.startswith("verdict: BITWISE: 5 metrics (12 values) + harness.lr bit-identical"), verdict
    assert verdict.endswith("; none of the code's values is a training-step value (every metric it logged was logged "
                            "by an evaluation: epoch, test_loss_epoch, test_loss_step, val_loss_epoch and 1 more; only "
                            "harness.lr, harness's own, was compared at training steps)"), verdict
    assert "  val_loss_step: 4 validation batches, " in evaluated_replay.stdout, evaluated_replay.stdout


def test_an_evaluation_that_differs_is_named_at_its_training_step_never_at_a_batch_index(
        lit: Project, evaluated_run: str, evaluated_replay) -> None:
    """What an lr x2 change does to the record, judged: the validation epoch after step 3 differs first, and an
    evaluation batch's value is named by its own index ("test batch 0"), never as training step 0."""
    from harness.judge.compare import compare_runs
    from harness.judge.verdicts import Verdict
    from harness.store.tracking import Tracker

    assert evaluated_replay.returncode == 0, evaluated_replay.stderr
    tracker = Tracker(lit.uri)
    original = tracker.load_record(evaluated_run)

    def changed(keys: tuple[str, ...]):
        replay = tracker.load_record(evaluated_replay.last_line)
        for key in keys:
            steps, values = replay.metrics[key]
            replay.metrics[key] = (steps, values * 1.5)
        return compare_runs(original, replay)

    every = changed(("val_loss_step", "val_loss_epoch", "test_loss_step", "test_loss_epoch"))
    assert every.verdict == Verdict.DIVERGED and every.summary().startswith("DIVERGED at step 3: val_loss_epoch "), every.summary()
    batches = changed(("test_loss_step",))
    assert batches.summary().startswith("DIVERGED at test batch 0: test_loss_step "), batches.summary()
    assert next(m for m in batches.metrics if m.name == "test_loss_step").counts == "test batch"


def test_resume_and_audit_of_a_trainers_run_name_lightnings_checkpoints(lit: Project, evaluated_run: str) -> None:
    """checkpoint_every was 5 (not 0): the refusals read the cause from the record, and name the way out that a
    Lightning loop has - not `for it in ctx.steps(...)`, which cannot be written there."""
    died = lit.harness("run", "experiments/evaluated", "train.fail=true")
    assert died.returncode == 1 and lit.client().get_run(died.last_line).info.status == "FAILED", died.stderr
    resume = lit.cli("resume", died.last_line)
    assert resume.returncode == 2 and len(resume.stderr.strip().splitlines()) == 1, resume.stderr
    assert (f"run {died.last_line} has no complete checkpoint in its artifacts (checkpoint_every was 5, but "
            "Lightning's Trainer runs the loop, which harness cannot stop and restart mid-fit: harness had no step "
            "boundary to save at), so it cannot be resumed.") in resume.stderr, resume.stderr
    assert f"`harness replay {died.last_line} --allow-incomplete`. Set checkpoint_every: 0 and checkpoint with " \
           "Lightning itself" in resume.stderr and "ctx.steps" not in resume.stderr, resume.stderr
    audit = lit.cli("audit", evaluated_run, "--segments", "1")
    assert audit.returncode == 2 and "(checkpoint_every was 5, but Lightning's Trainer runs the loop" in audit.stderr
    assert "checkpoint with Lightning itself" in audit.stderr and "ctx.steps" not in audit.stderr, audit.stderr


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
    assert {k: sorted(v) for k, v in ctx._logged.steps.items()} == {"loss": [3], "epoch": [3], "val_loss": [3]}
    with pytest.raises(ExperimentError, match=r"Lightning logged 'loss' twice at step 3 \(0.5, then 0.25\)"):
        logger.log_metrics({"loss": 0.25}, step=3)


def test_logger_keeps_evaluation_batches_apart_from_training_steps(contexts) -> None:
    """An evaluation batch's value is at an index of its own: it may share a number with a training step, never a
    series (one key is logged at one kind of step)."""
    import harness.lightning
    from harness.errors import ExperimentError

    ctx = contexts()
    logger = harness.lightning.Logger(ctx)
    logger.log_metrics({"loss": 0.5}, step=0)
    logger._evaluation, logger._eval_batch = "validation", True  # as the Callback's hooks set them
    logger.log_metrics({"val_loss": 0.7}, step=0)  # Lightning's first evaluation batch
    logger._eval_batch = True
    with pytest.raises(ExperimentError, match=r"Lightning logged 'val_loss' twice at validation batch 0"):
        logger.log_metrics({"val_loss": 0.8}, step=0)
    logger.log_metrics({"val_acc": 0.9}, step=0)  # the epoch's end, at the trainer's step 0
    assert ctx._logged.evaluation_keys() == {"val_acc": "step", "val_loss": "validation batch"}
    logger._evaluation = None
    with pytest.raises(ExperimentError, match=r"'val_loss' was logged at validation batch indexes, and now at "
                                              r"training steps: one series cannot hold both"):
        logger.log_metrics({"val_loss": 0.8}, step=5)


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
    assert ctx._logged.steps == {"loss": {0}}
