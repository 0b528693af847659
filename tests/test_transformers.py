"""transformers' Trainer inside train(ctx): a fine-tune written for the Trainer (TrainingArguments with
`report_to: [mlflow]`, checkpoints by `save_strategy`, a final trainer.evaluate()) converted with one line,
harness.transformers.Trainer(ctx, ...); and the same script unconverted, whose MLflow calls must still land in
the one run. Real transformers (a 2-layer BERT built from a config: no download), real `harness run`/`replay`
subprocesses on gloo, a real store."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import Project, Result
from infra import in_ci

try:
    import transformers  # noqa: F401
except ImportError as err:  # the test extra installs it: CI must run these, a laptop may lack it
    if in_ci():
        pytest.fail(f"transformers is required in CI (pip install -e '.[test]'): {err}", pytrace=False)
    pytest.skip(f"transformers is not installed: {err}", allow_module_level=True)

# Rank 0 logs params of its own at the end, one of them under harness's name `seed` with another value.
TRAIN = '''"""A 2-layer BERT classifier fine-tuned by transformers' Trainer."""

import importlib
import os
import signal

import mlflow
import torch
import transformers


class Crash(transformers.TrainerCallback):
    """Rank 1 dies at the start of step KILL_AT, as a crash would: no cleanup."""

    def on_step_begin(self, args, state, control, **kwargs):
        if args.process_index == 1 and str(state.global_step) == os.environ.get("KILL_AT"):
            os.kill(os.getpid(), signal.SIGKILL)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, 32, (n, 8), generator=g)
        self.labels = (self.ids[:, 0] > 16).long()

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(8, dtype=torch.long), "labels": self.labels[i]}


def train(ctx):
    cfg = ctx.cfg
    config = transformers.BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16, num_labels=2)
    model = transformers.BertForSequenceClassification(config)
    args = transformers.TrainingArguments(
        output_dir="out", per_device_train_batch_size=4, per_device_eval_batch_size=8, max_steps=cfg.steps,
        learning_rate=1e-3, logging_steps=cfg.logging_steps, save_strategy="steps", save_steps=2, eval_strategy="no",
        report_to=["mlflow"], dataloader_num_workers=0, disable_tqdm=True, use_cpu=not cfg.converted)
    data = {"train_dataset": Tokens(32, 0), "eval_dataset": Tokens(16, 1)}
    if cfg.converted:
        trainer = importlib.import_module("harness.transformers").Trainer(ctx, model=model, args=args,
                                                                           callbacks=[Crash()], **data)
    else:  # output_dir is then the experiment folder's: under ctx.output_dir, as harness.transformers places it
        args.output_dir = str(ctx.output_dir / "out")
        trainer = transformers.Trainer(model=model, args=args, **data)
    trainer.train()
    trainer.evaluate()
    if ctx.rank == 0:
        mlflow.log_params({"seed": 42, "mine": 1})
'''

YAML = """image: none
entry: train.py:train
world_size: 2
seed: 0
threads_per_rank: 1
determinism:
  level: strict
fingerprint_every: 2
checkpoint_every: 2
replay:
  tolerance:
    metrics:  # the Trainer's wall-clock values
      train_runtime: {atol: .inf}
      train_samples_per_second: {atol: .inf}
      train_steps_per_second: {atol: .inf}
      eval_runtime: {atol: .inf}
      eval_samples_per_second: {atol: .inf}
      eval_steps_per_second: {atol: .inf}
train:
  steps: 7
  logging_steps: 3
  converted: true
"""

STEPS = 7


@pytest.fixture(scope="module")
def experiment(project: Project) -> str:
    from conftest import git

    exp = project.add_experiment("trainer_bert", train_py=TRAIN, commit=False)
    (exp / "experiment.yaml").write_text(YAML)
    git(project.root, "add", "-A")
    git(project.root, "commit", "-qm", "a Trainer fine-tune")
    return "experiments/trainer_bert"


@pytest.fixture(scope="module")
def original(project: Project, experiment: str) -> Result:
    return project.harness("run", experiment)


def history(project: Project, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in project.client().get_metric_history(run_id, key))


def test_a_converted_trainer_keeps_every_value_in_one_run(project: Project, original: Result) -> None:
    """Steps are the Trainer's optimizer steps; its training logs, its summary and the final evaluate() are in the
    run at harness's steps (the Trainer's global_step - 1), each once; its params under `transformers.`, the user's
    colliding `seed` as `user.seed`; its checkpoints are the run's artifacts; the model is fingerprinted."""
    assert original.returncode == 0, original.stderr
    run_id = original.last_line
    client = project.client()
    run = client.get_run(run_id)
    tags, params = run.data.tags, run.data.params
    assert run.info.status == "FINISHED"
    # Logged every 3 steps: after steps 3 and 6 of the Trainer (harness's 2 and 5).
    assert [s for s, _ in history(project, run_id, "loss")] == [2, 5]
    assert [s for s, _ in history(project, run_id, "eval_loss")] == [STEPS - 1]  # once, not again at global_step
    assert [s for s, _ in history(project, run_id, "train_loss")] == [STEPS - 1]
    assert [s for s, _ in history(project, run_id, "epoch")] == [2, 5, STEPS - 1]
    assert "eval_loss" in tags["harness.metrics.evaluation"]
    assert tags["harness.loop"] == "transformers" and tags["harness.optimizer"] == "torch.optim.adamw.AdamW"
    assert tags["harness.fingerprint.initial"] != tags["harness.fingerprint"]
    assert params["transformers.seed"] == "42" and params["seed"] == "0"
    # The Trainer's set_seed(args.seed), made through harness.transformers, is the user's Trainer(...) line's.
    assert "(transformers." in tags["harness.user.seeds"] and "torch.manual_seed(42)" in tags["harness.user.seeds"]
    assert params["transformers.max_steps"] == str(STEPS) and params["transformers.hidden_size"] == "16"
    assert params["user.seed"] == "42" and params["mine"] == "1"
    assert "'seed' is the run's param already ('0'); your value '42' is kept as 'user.seed'" in original.stderr
    assert "logged no metrics" not in original.stderr
    saved = {a.path for a in client.list_artifacts(run_id, "outputs/out")}
    assert {"outputs/out/checkpoint-2", "outputs/out/checkpoint-4", "outputs/out/checkpoint-6"} <= saved
    # No run beside it: the Trainer's MLflow callback made none, and ended none (the record is FINISHED above).
    strays = [r for r in project.all_runs() if "eval_loss" in r.data.metrics and "harness.loop" not in r.data.tags]
    assert strays == []


def test_a_converted_trainer_replays_its_values(project: Project, original: Result) -> None:
    """The replay re-runs the fine-tune and exits 0: every value the training determines is bit-identical. (The
    Trainer's clock values, train_runtime and the *_per_second rates, differ run to run: the experiment gives them an
    unbounded tolerance.)"""
    assert original.returncode == 0, original.stderr
    replay = project.harness("replay", original.last_line)
    assert replay.returncode == 0, replay.stdout + replay.stderr
    verdict = replay.stdout.strip().splitlines()[-2]
    assert verdict.startswith(("verdict: BITWISE", "verdict: WITHIN_TOLERANCE")), verdict
    for key in ("loss", "grad_norm", "learning_rate", "train_loss", "eval_loss", "epoch"):
        assert history(project, replay.last_line, key) == history(project, original.last_line, key), key
    run = project.client().get_run(replay.last_line)
    assert run.data.tags["harness.fingerprint"] == project.client().get_run(original.last_line).data.tags["harness.fingerprint"]


def test_an_unconverted_trainer_logs_into_the_one_run(project: Project, experiment: str) -> None:
    """A plain Trainer with report_to mlflow: transformers probes for mlflow with find_spec before importing it, and
    its on_train_end calls mlflow.end_run(). Its final evaluate() still lands in the harness run, its params that
    collide with harness's (`seed`) are kept as `user.<name>` without losing the rest of their batch, and the run
    is not said to have logged no metrics."""
    result = project.harness("run", experiment, "train.converted=false", "world_size=1", "train.steps=2",
                             "train.logging_steps=1", "checkpoint_every=0")
    assert result.returncode == 0, result.stderr
    run = project.client().get_run(result.last_line)
    assert run.info.status == "FINISHED"
    assert {"loss", "eval_loss", "train_loss"} <= set(run.data.metrics)
    params = run.data.params
    assert params["seed"] == "0" and params["user.seed"] == "42"  # the Trainer's own seed
    assert len([k for k in params if k.startswith("transformers.")]) == 0 and "save_steps" in params  # 2nd batch kept
    assert "logged no metrics" not in result.stderr
    strays = [r for r in project.all_runs() if "eval_loss" in r.data.metrics and "harness.loop" not in r.data.tags]
    assert [r.info.run_id for r in strays] == []


def test_a_trainer_run_resumes_through_its_own_checkpoints(project: Project, experiment: str, original: Result) -> None:
    """Rank 1 is SIGKILLed at step 5, after the Trainer's checkpoint of step 4: `harness resume` proves that
    checkpoint (a re-execution from the one of step 2 lands on its weights and optimizer state, and logs what the run
    logged) and continues through the Trainer's resume_from_checkpoint. The record equals an uninterrupted run's:
    every value the training determines, at the same steps, and the final weights; and `harness audit` re-executes
    a segment between its checkpoints.

    First, with the optimizer state in the Trainer's checkpoint of step 2 changed (as a file left from another run
    would be), the resume is refused naming the file - the Trainer's files are sealed with the run's record - and
    the run stays as it was."""
    # The running loss is logged every 3 steps and checkpointed every 2: the loss logged after the resume averages
    # steps from before it, which the Trainer's own checkpoint does not hold (harness's does).
    crashed = project.harness("run", experiment, env={"KILL_AT": "5"})
    assert crashed.returncode == 1 and "was killed by SIGKILL" in crashed.stderr, crashed.stderr
    run_id = crashed.last_line
    client = project.client()
    saved = {a.path for a in client.list_artifacts(run_id, "checkpoints")}
    assert {"checkpoints/step-00000002", "checkpoints/step-00000004"} <= saved, saved

    folder = Path(client.get_run(run_id).info.artifact_uri.removeprefix("file://"))
    optimizer = folder / "checkpoints/step-00000002/framework/optimizer.pt"
    intact = optimizer.read_bytes()
    state = torch.load(optimizer, weights_only=True)
    next(iter(state["state"].values()))["exp_avg"].add_(1.0)
    optimizer.unlink()  # a hard link to the Trainer's own file: replaced, not written through
    torch.save(state, optimizer)
    refused = project.harness("resume", run_id)
    assert refused.returncode == 2, refused.stderr
    assert "changed after it was sealed: artifact checkpoints/step-00000002/framework/optimizer.pt" in refused.stderr
    assert client.get_run(run_id).info.status == "FAILED"
    optimizer.unlink()
    optimizer.write_bytes(intact)

    resumed = project.harness("resume", run_id)
    assert resumed.returncode == 0, resumed.stderr
    assert "Proved: steps 2-" in resumed.stderr, resumed.stderr
    clean = original  # the uninterrupted run
    assert clean.returncode == 0, clean.stderr
    a, b = client.get_run(run_id), client.get_run(clean.last_line)
    assert a.info.status == "FINISHED" and a.data.tags["harness.resumed_from"] == "4"
    assert a.data.tags["harness.fingerprint"] == b.data.tags["harness.fingerprint"]
    for key in ("loss", "grad_norm", "learning_rate", "train_loss", "eval_loss", "epoch", "harness.lr"):
        assert history(project, run_id, key) == history(project, clean.last_line, key), key
    assert [s for s, _ in history(project, run_id, "loss")] == [2, 5]
    # The Trainer's checkpoints are audit's segment starts too: one segment re-executed lands on its end's digests.
    audit = project.harness("audit", run_id, "--segments", "1", "--seed", "0")
    assert audit.returncode == 0 and "verdict: BITWISE: 1 of 3 segments" in audit.stdout, audit.stdout + audit.stderr
