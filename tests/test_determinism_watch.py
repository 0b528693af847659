"""Determinism settings read back during training (issue 20): user code that undoes strict's settings is
recorded with the step and its own line, warned about once under strict, and shown in the replay's delta."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, Project

# Line numbers matter: the record names them. TF32 is turned on in train() as nanoGPT does; cuDNN benchmarking
# after two steps (seen by the checkpoint at step 4); a lower matmul precision after the loop (seen at the end).
# On CPU these change nothing in the arithmetic, but torch reports them, so the record must too.
TF32_TRAIN = '''"""Linear(10, 5) that turns TF32 on, benchmarks cuDNN and lowers matmul precision."""
import torch
from torch import nn


def train(ctx):
    torch.backends.cuda.matmul.allow_tf32 = True
    data = torch.randn(100, 10, generator=torch.Generator().manual_seed(ctx.seed))
    loader = ctx.loader(data, batch_size=10)
    model = ctx.ddp(nn.Linear(10, 5))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    ctx.track(optimizer)
    for epoch in ctx.epochs(2):
        for batch in loader:
            optimizer.zero_grad()
            if ctx.step == 2:
                torch.backends.cudnn.benchmark = True
            loss = ctx.backward(batch, lambda b: ((model(b) - 1) ** 2).mean())
            optimizer.step()
            ctx.log({"loss": loss}, ctx.step)
    torch.set_float32_matmul_precision("medium")
'''
# The same loop touching no setting: nothing may be recorded as changed.
PLAIN_TRAIN = "\n".join(line for line in TF32_TRAIN.splitlines()
                        if "allow_tf32" not in line and "benchmark" not in line and "ctx.step == 2" not in line
                        and "precision" not in line) + "\n"
CONFIG = ["checkpoint_every=4"]

# torch >= 2.9 (its fp32_precision API): the same calls also move the new API's leaves, read back as their own keys.
NEW_API = hasattr(torch._C, "_get_fp32_precision_getter")
EXPECTED_CHANGES = [
    "cuda_matmul_tf32: False -> True at step 0 (first step) by train.py:7",
    "float32_matmul_precision: highest -> high at step 0 (first step) by train.py:7",
    *(["cuda_matmul_fp32_precision: ieee -> tf32 at step 0 (first step) by train.py:7"] if NEW_API else []),
    "cudnn_benchmark: False -> True at step 4 (checkpoint) by train.py:17",
    "float32_matmul_precision: high -> medium at step 10 (end) by train.py:21",
    *(["mkldnn_matmul_fp32_precision: ieee -> bf16 at step 10 (end) by train.py:21"] if NEW_API else []),
]


def tags_of(project: Project, run_id: str) -> dict[str, str]:
    return project.client().get_run(run_id).data.tags


@pytest.fixture(scope="module")
def tf32_run(project: Project):
    project.add_experiment("tf32_linear", train_py=TF32_TRAIN)
    result = project.harness("run", "experiments/tf32_linear", *CONFIG)
    assert result.returncode == 0, result.stderr
    return result


@pytest.fixture(scope="module")
def plain_run(project: Project):
    project.add_experiment("plain_linear", train_py=PLAIN_TRAIN)
    result = project.harness("run", "experiments/plain_linear", *CONFIG)
    assert result.returncode == 0, result.stderr
    return result


def test_changes_are_recorded_with_step_point_and_line(project: Project, tf32_run, tmp_path: Path) -> None:
    tags = tags_of(project, tf32_run.last_line)
    assert tags["harness.determinism.changes"].splitlines() == EXPECTED_CHANGES
    # The settings tags are the last reading: what was in force when training ended, not what harness set.
    assert tags["harness.determinism.cuda_matmul_tf32"] == "True"
    assert tags["harness.determinism.float32_matmul_precision"] == "medium"
    assert tags["harness.determinism.cudnn_benchmark"] == "True"
    assert tags["harness.determinism.deterministic_algorithms"] == "True"  # untouched
    doc = json.loads(Path(project.client().download_artifacts(
        tf32_run.last_line, "environment/determinism.json", str(tmp_path))).read_text())
    assert doc["start"]["cuda_matmul_tf32"] == "False" and doc["start"]["float32_matmul_precision"] == "highest"
    assert doc["in_force"]["float32_matmul_precision"] == "medium"
    tf32, medium = "torch.backends.cuda.matmul.allow_tf32 = True", "torch.set_float32_matmul_precision('medium')"
    assert [c["call"] for c in doc["changes"]] == [
        *[tf32] * (3 if NEW_API else 2), "torch.backends.cudnn.benchmark = True", *[medium] * (2 if NEW_API else 1),
    ]


def test_strict_warns_once_per_line_that_broke_bitwise(tf32_run) -> None:
    warnings = [line for line in tf32_run.stderr.splitlines() if line.startswith("Warning: train.py:")]
    # One call changed two settings (TF32 and the matmul precision read back as one switch): one warning.
    assert warnings == [
        "Warning: train.py:7 set torch.backends.cuda.matmul.allow_tf32 = True under determinism.level=strict: TF32 "
        "matmuls round their inputs to 10 mantissa bits: results may differ between GPUs. Recorded in "
        "harness.determinism.changes; remove that line to keep strict's guarantee, or set determinism.level=off.",
        "Warning: train.py:17 set torch.backends.cudnn.benchmark = True under determinism.level=strict: cuDNN picks "
        "convolution algorithms by timing them: results may differ between runs. Recorded in "
        "harness.determinism.changes; remove that line to keep strict's guarantee, or set determinism.level=off.",
        "Warning: train.py:21 set torch.set_float32_matmul_precision('medium') under determinism.level=strict: "
        "float32 matmuls at precision 'medium' may use TF32 or bf16: results may differ between GPUs. Recorded in "
        "harness.determinism.changes; remove that line to keep strict's guarantee, or set determinism.level=off.",
    ], tf32_run.stderr


def test_a_run_that_changes_nothing_records_no_change(project: Project, plain_run, tmp_path: Path) -> None:
    tags = tags_of(project, plain_run.last_line)
    assert tags["harness.determinism.changes"] == "none"
    assert tags["harness.determinism.cuda_matmul_tf32"] == "False"
    assert tags["harness.determinism.float32_matmul_precision"] == "highest"
    assert "Warning: train.py" not in plain_run.stderr
    doc = json.loads(Path(project.client().download_artifacts(
        plain_run.last_line, "environment/determinism.json", str(tmp_path))).read_text())
    assert doc["changes"] == [] and doc["start"] == doc["in_force"]


def test_compare_shows_a_change_made_in_one_run_only_and_rules_bitwise_out(project: Project, plain_run, tf32_run) -> None:
    result = project.harness("compare", plain_run.last_line, tf32_run.last_line)
    out = result.stdout
    assert " ! changed in training:cuda_matmul_tf32: None -> True at step 0 (first step) by train.py:7  (the " \
           "training code changed it in one run only: TF32 matmuls round their inputs to 10 mantissa bits: results " \
           "may differ between GPUs)" in out, out
    assert " ! changed in training:cudnn_benchmark: None -> True at step 4 (checkpoint) by train.py:17" in out
    assert " ! harness.determinism.cuda_matmul_tf32: False -> True" in out  # the settings in force differ too
    # On CPU TF32 changes no bit, so the two runs are bit-identical: BITWISE, with the change listed among what
    # usually rules it out (a GPU run would read "A bitwise match is impossible" with the same list).
    assert "Bitwise despite" in out and "changed in training:cuda_matmul_tf32" in out.split(
        "Bitwise despite")[1].splitlines()[0]


def test_replay_delta_shows_the_same_change_without_ruling_bitwise_out(project: Project, tf32_run) -> None:
    result = project.harness("replay", tf32_run.last_line)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    # The replay ran the same code, which made the same changes at the same steps by the same lines: no difference,
    # so nothing in the delta (the environment delta lists what differs), and a bit-identical replay is BITWISE.
    assert "changed in training:" not in out, out
    assert "A bitwise match is impossible" not in out
    assert "BITWISE" in out


def test_watched_setters_behave_as_torch_s_own() -> None:
    # In a fresh interpreter: wrapping torch's setters must not leak into this test process's torch.
    code = '''
import torch
from harness.configschema import Level
from harness.runtime import determinism as d
w = d.start_watch(Level.off, d.set_determinism(Level.off))
d.start_watch(Level.off, d.read_determinism(Level.off))  # twice: wrapped once
try:
    torch.backends.cuda.matmul.bogus = 1
except AttributeError as err:
    print("matmul:", err)
with torch.backends.cudnn.flags(enabled=True, benchmark=True, deterministic=False, allow_tf32=False):
    print("inside flags:", torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32)
print("after flags:", torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32)
print("returns:", torch.use_deterministic_algorithms(True, warn_only=True), torch.is_deterministic_algorithms_warn_only_enabled())
print("name:", torch.set_float32_matmul_precision.__name__)
print([c.line() for c in d.observe(3, d.END).changes])
'''
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.splitlines() == [
        "matmul: Unknown attribute bogus",
        "inside flags: True False",
        "after flags: False True",
        "returns: None True",
        "name: set_float32_matmul_precision",
        "['deterministic_algorithms: False -> True at step 3 (end) by <string>:14', "
        "'deterministic_warn_only: False -> True at step 3 (end) by <string>:14']",
    ], out


def test_delta_rules_for_changes_made_in_training() -> None:
    # Records made by hand: the rules are about tag values, and each case below would need a run of its own.
    from records import clone, make_record

    from harness import tags
    from harness.judge.delta import environment_delta

    tf32 = "cuda_matmul_tf32: False -> True at step 0 (first step) by train.py:7"
    a = make_record(facts={tags.DETERMINISM_CHANGES: tf32})

    def delta(**facts: str) -> dict:
        b = clone(a)
        b.facts.update(facts)
        return {d.name: d for d in environment_delta(a, b) if d.name.startswith("changed in training:")}

    moved = delta(**{tags.DETERMINISM_CHANGES: tf32.replace("train.py:7", "train.py:9")})["changed in training:cuda_matmul_tf32"]
    assert (moved.breaks_bitwise, moved.note) == (False, "the same change in both runs, made by another line")
    later = delta(**{tags.DETERMINISM_CHANGES: tf32.replace("step 0 (first step)", "step 4 (checkpoint)")})
    assert later["changed in training:cuda_matmul_tf32"].breaks_bitwise is True
    # A record from before the read-back has no changes tag: it proves nothing either way, so nothing is said.
    old = make_record()
    new = clone(old)
    new.facts[tags.DETERMINISM_CHANGES] = "none"
    assert [d.name for d in environment_delta(old, new)] == []


# torch's fp32_precision API (torch >= 2.9): TF32 turned on for matmuls in the loop (seen by the checkpoint at
# step 4) and for cuDNN convolutions after it (seen at the end). Line numbers matter, as above.
NEW_API_TRAIN = '''"""Linear(10, 5) that turns TF32 on through torch's fp32_precision API."""
import torch
from torch import nn


def train(ctx):
    data = torch.randn(100, 10, generator=torch.Generator().manual_seed(ctx.seed))
    loader = ctx.loader(data, batch_size=10)
    model = ctx.ddp(nn.Linear(10, 5))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    ctx.track(optimizer)
    for epoch in ctx.epochs(2):
        for batch in loader:
            optimizer.zero_grad()
            if ctx.step == 2:
                torch.backends.cuda.matmul.fp32_precision = "tf32"
            loss = ctx.backward(batch, lambda b: ((model(b) - 1) ** 2).mean())
            optimizer.step()
            ctx.log({"loss": loss}, ctx.step)
    torch.backends.cudnn.conv.fp32_precision = "tf32"
'''
needs_new_api = pytest.mark.skipif(not NEW_API, reason="torch < 2.9 has no fp32_precision API")


@needs_new_api
def test_strict_records_the_new_tf32_api_read_back(project: Project, plain_run) -> None:
    tags = tags_of(project, plain_run.last_line)
    for key in ("cuda_matmul", "cudnn_conv", "cudnn_rnn", "mkldnn_matmul", "mkldnn_conv", "mkldnn_rnn"):
        assert tags[f"harness.determinism.{key}_fp32_precision"] == "ieee", key
    # The legacy keys stay, derived from the same values.
    assert (tags["harness.determinism.cuda_matmul_tf32"], tags["harness.determinism.cudnn_tf32"]) == ("False", "False")


@needs_new_api
def test_the_new_tf32_api_in_the_loop_is_recorded_and_warned_with_its_line(project: Project) -> None:
    project.add_experiment("fp32_precision_linear", train_py=NEW_API_TRAIN)
    result = project.harness("run", "experiments/fp32_precision_linear", *CONFIG)
    assert result.returncode == 0, result.stderr
    tags = tags_of(project, result.last_line)
    assert tags["harness.determinism.changes"].splitlines() == [
        "cuda_matmul_tf32: False -> True at step 4 (checkpoint) by train.py:16",
        "float32_matmul_precision: highest -> high at step 4 (checkpoint) by train.py:16",
        "cuda_matmul_fp32_precision: ieee -> tf32 at step 4 (checkpoint) by train.py:16",
        "cudnn_tf32: False -> True at step 10 (end) by train.py:20",
        "cudnn_conv_fp32_precision: ieee -> tf32 at step 10 (end) by train.py:20",
    ]
    assert tags["harness.determinism.cuda_matmul_fp32_precision"] == "tf32"
    warnings = [line for line in result.stderr.splitlines() if line.startswith("Warning: train.py:")]
    tail = ("Recorded in harness.determinism.changes; remove that line to keep strict's guarantee, or set "
            "determinism.level=off.")
    assert warnings == [
        "Warning: train.py:16 set torch.backends.cuda.matmul.fp32_precision = 'tf32' under determinism.level=strict: "
        "TF32 matmuls round their inputs to 10 mantissa bits: results may differ between GPUs. " + tail,
        "Warning: train.py:20 set torch.backends.cudnn.conv.fp32_precision = 'tf32' under determinism.level=strict: "
        "TF32 convolutions round their inputs to 10 mantissa bits: results may differ between GPUs. " + tail,
    ], result.stderr


def test_settings_read_back_without_torch_s_legacy_getters() -> None:
    # In a fresh interpreter (the settings are process-wide). With the new API torch's legacy getters raise once
    # the two APIs disagree; the read-back derives the legacy keys instead. Without it (torch < 2.9, forced here
    # by the flag) the legacy API is set and read as before, and no new key is recorded.
    code = '''
import warnings
import torch
from harness.configschema import Level
from harness.runtime import determinism as d
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    s = d.set_determinism(Level.strict)
print("strict:", torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32, len(seen))
torch.backends.cuda.matmul.fp32_precision = "tf32"
try:
    torch.backends.cuda.matmul.allow_tf32
except RuntimeError:
    print("legacy getter raises")
s = d.read_determinism(Level.strict)
print("read:", s["cuda_matmul_tf32"], s["float32_matmul_precision"], s["cuda_matmul_fp32_precision"])
d.NEW_TF32_API = False
torch.backends.cuda.matmul.allow_tf32 = True
s = d.set_determinism(Level.strict)
print("legacy:", s["cuda_matmul_tf32"], s["cudnn_tf32"], s["float32_matmul_precision"],
      [k for k in s if k.endswith("fp32_precision")])
'''
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    expected = ["strict: False False 0"]
    if NEW_API:
        expected += ["legacy getter raises", "read: True high tf32"]
    expected += ["legacy: False False highest []"]
    assert out.splitlines() == expected, out


@pytest.mark.parametrize("users", [None, "1"])
def test_strict_pins_nvls_off_unless_the_user_set_it(users: str | None) -> None:
    # NVLink SHARP is not deterministic between calls (NVIDIA/nccl#1497); the user's own choice stays.
    code = '''
import os
from harness.configschema import Level
from harness.runtime import determinism as d
d.set_determinism(Level.off)
print(os.environ.get("NCCL_NVLS_ENABLE"))
d.set_determinism(Level.strict)
print(os.environ.get("NCCL_NVLS_ENABLE"))
'''
    env = {k: v for k, v in os.environ.items() if k != "NCCL_NVLS_ENABLE"}
    if users is not None:
        env["NCCL_NVLS_ENABLE"] = users
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT,
                         env=env).stdout
    assert out.splitlines() == ([str(None), "0"] if users is None else [users, users]), out
