"""`harness run` end to end: real git repo, real SQLite MLflow store, real 2-rank gloo workers."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT, Project, git, pid_alive
from snippets import crash_experiment

GOLDEN = ROOT / "tests" / "golden"
# Invariant mode needs shards dividing the data: 2 shards of 5 samples per step.
INVARIANT = ["determinism.world_size_invariant=true", "determinism.shards=2", "train.batch_size=5"]


def artifact_paths(client, run_id: str, path: str | None = None) -> set[str]:
    out: set[str] = set()
    for f in client.list_artifacts(run_id, path):
        out |= artifact_paths(client, run_id, f.path) if f.is_dir else {f.path}
    return out


def read_artifact(client, run_id: str, path: str, tmp: Path) -> str:
    return Path(client.download_artifacts(run_id, path, str(tmp))).read_text()


def losses(client, run_id: str, key: str = "loss") -> list[float]:
    return [m.value for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]


@pytest.fixture(scope="module")
def linear_run(project: Project):
    result = project.harness("run", "experiments/linear_ddp")
    assert result.returncode == 0, result.stderr
    return result


def test_help_answers_without_torch_or_mlflow() -> None:
    code = (
        "import sys\n"
        "from harness.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'mlflow')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "Usage:" in out and out.strip().endswith("[]")


def test_every_command_has_help() -> None:
    from harness.cli.main import main

    for name, command in main.commands.items():
        assert command.help and len(command.help.strip()) > 20, f"`harness {name}` has no help text"


def test_run_prints_run_id_last_and_finishes(project: Project, linear_run) -> None:
    run_id = linear_run.last_line
    run = project.client().get_run(run_id)
    assert run.info.status == "FINISHED"
    assert len(run_id) == 32
    assert "harness ui" in linear_run.stderr and run_id in linear_run.stderr
    # Feedback first: a line before torch, MLflow and the store load, long before the run id is known.
    assert linear_run.stderr.splitlines()[0] == "harness: recording linear_ddp, starting 2 ranks"
    # Rank 0's output, drawn by the CLI from the library's events as it printed it (no bar: stderr is no terminal).
    printed = [line for line in linear_run.stderr.splitlines() if line.startswith("epoch ")]
    assert printed == [f"epoch {n}/{len(printed)} loss {line.rsplit(' ', 1)[1]}" for n, line in enumerate(printed, 1)]
    assert len(printed) > 1 and "step/s" not in linear_run.stderr
    assert project.client().get_experiment(run.info.experiment_id).name == "linear_ddp"


def test_run_records_provenance(project: Project, linear_run, tmp_path: Path) -> None:
    client = project.client()
    run_id = linear_run.last_line
    run = client.get_run(run_id)
    tags, params = run.data.tags, run.data.params
    head = git(project.root, "rev-parse", "HEAD")
    assert tags["harness.git.commit"] == tags["mlflow.source.git.commit"] == head
    assert tags["harness.git.branch"] == "main" and tags["harness.git.dirty"] == "false"
    # Credentials never reach the store.
    assert tags["mlflow.source.git.repoURL"] == "https://example.invalid/lab/project.git"
    assert tags["mlflow.source.name"] == "experiments/linear_ddp/train.py"
    assert tags["harness.experiment.path"] == "experiments/linear_ddp"
    assert tags["harness.image"] == "localhost:5000/harness-cpu:0.1"
    # The ranks ran on the host, in no image: the record says so, and `harness runs` with it (not "unknown"). The
    # pinned image's digest, where this machine's engine knows it, is what its tag resolved to (else why not).
    assert tags["harness.image.digest"] == "host" and tags["harness.in_image"] == "false"
    assert tags.get("harness.image.tag_digest", "").startswith("sha256:") or tags["harness.image.digest_reason"]
    [listed] = [r for r in json.loads(project.cli("runs", "--json").stdout)["runs"] if r["run_id"] == run_id]
    assert listed["image_digest"] == "host"
    from harness.seeds import derive_rank_seeds

    assert tags["harness.seed"] == "0"
    assert tags["harness.seed.ranks"] == ",".join(map(str, derive_rank_seeds(0, 2)))
    assert (tags["harness.world_size"], tags["harness.backend"], tags["harness.device"]) == ("2", "gloo", "cpu")
    assert tags["harness.threads_per_rank"] == "1"
    assert tags["harness.env.torch"] == torch.__version__
    assert tags["harness.env.python"] == ".".join(map(str, sys.version_info[:3]))
    for key in ("cuda", "cudnn", "nccl", "gpu", "gpu_driver", "cpu", "hostname", "os"):
        assert tags[f"harness.env.{key}"], key
    # Determinism as read back inside rank 0.
    assert tags["harness.determinism.level"] == "strict"
    assert tags["harness.determinism.deterministic_algorithms"] == "True"
    assert tags["harness.determinism.cudnn_benchmark"] == "False"
    assert tags["harness.determinism.cuda_matmul_tf32"] == "False"
    assert tags["harness.determinism.cublas_workspace_config"] == ":4096:8"
    assert tags["harness.var.OMP_NUM_THREADS"] == "1"
    # Strict pins NVLink SHARP off (the user set nothing), recorded with the variables.
    assert tags["harness.var.NCCL_NVLS_ENABLE"] == "0"
    # The device rank 0 trained on, measured inside rank 0; the host's GPU list stays a fact of its own.
    assert {k: v for k, v in tags.items() if k.startswith("harness.env.device.")} == {
        "harness.env.device.name": "cpu", "harness.env.device.capability": "none",
        "harness.env.device.sm_count": "none", "harness.env.device.memory": "none"}
    # NCCL's configuration files as rank 0 found them (none on this machine: absent, never an error).
    for which, path in (("system", "/etc/nccl.conf"), ("user", str(Path.home() / ".nccl.conf"))):
        conf = tags[f"harness.nccl_conf.{which}"]
        assert conf == "absent" or conf.startswith(f"{path} sha256:"), conf
    # Params: the flattened resolved config.
    assert params["train.lr"] == "0.01" and params["world_size"] == "2"
    assert params["determinism.level"] == "strict" and params["entry"] == "train.py:train"
    arts = artifact_paths(client, run_id)
    assert {"config.yaml", "environment/requirements.lock", "logs/rank0.log", "logs/rank1.log",
            "fingerprints.json", "metrics/series.npz"} <= arts
    assert "git/uncommitted.patch" not in arts
    lock = read_artifact(client, run_id, "environment/requirements.lock", tmp_path)
    assert f"torch=={torch.__version__}" in lock.splitlines()
    config = read_artifact(client, run_id, "config.yaml", tmp_path)
    assert "lr: 0.01" in config and "world_size: 2" in config
    assert "epoch 5/5" in read_artifact(client, run_id, "logs/rank0.log", tmp_path)


def test_fingerprints_series_and_final_tag(project: Project, linear_run, tmp_path: Path) -> None:
    client = project.client()
    run_id = linear_run.last_line
    doc = json.loads(read_artifact(client, run_id, "fingerprints.json", tmp_path))
    assert sorted(int(s) for s in doc["steps"]) == [0, 5, 10, 15, 20]  # fingerprint_every: 5
    assert client.get_run(run_id).data.tags["harness.fingerprint"] == doc["final"]
    assert len(set(doc["steps"].values())) == 5  # the weights changed between them


@pytest.mark.parametrize("mode", ["standard", "invariant"])
def test_losses_match_golden_file_bit_for_bit(project: Project, linear_run, mode: str) -> None:
    if mode == "standard":
        run_id, path, steps = linear_run.last_line, GOLDEN / "linear_ddp_losses.json", 25
    else:
        result = project.harness("run", "experiments/linear_ddp", *INVARIANT)
        assert result.returncode == 0, result.stderr
        run_id, path, steps = result.last_line, GOLDEN / "linear_ddp_invariant_losses.json", 50
    values = [v.hex() for v in losses(project.client(), run_id)]
    assert len(values) == steps
    golden = json.loads(path.read_text())
    here = cpu_signature()
    if os.environ.get("HARNESS_UPDATE_GOLDEN") == "1":
        golden = {"torch": torch.__version__, "by_cpu": {**golden.get("by_cpu", {}), here: values}}
        path.write_text(json.dumps(golden, indent=1))
    assert golden["torch"] == torch.__version__, "golden file made with another torch; regenerate it"
    # One sequence per kind of CPU it was recorded on: the kernels torch picks by instruction set round differently
    # (the same torch gives other last bits on an AMX-capable Xeon). A change that breaks determinism gives a
    # sequence none of them holds; a CPU recorded before fails on any other.
    known = golden["by_cpu"]
    if here in known:
        assert values == known[here], f"losses differ from those recorded on this CPU ({here})"
    else:
        assert values in known.values(), (f"losses match none recorded ({', '.join(known)}); this CPU ({here}) is "
                                          "not among them: if the code is right, add it with HARNESS_UPDATE_GOLDEN=1")


def cpu_signature() -> str:
    """The instruction sets torch's CPU kernels choose among, as this machine offers them."""
    flags: set[str] = set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    isa = [f for f in ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16")
           if f in flags]
    return f"{torch.backends.cpu.get_cpu_capability()}: {' '.join(isa) or 'none'}"


def test_two_runs_of_one_config_are_identical(project: Project, linear_run) -> None:
    again = project.harness("--quiet", "run", "experiments/linear_ddp")
    assert again.returncode == 0, again.stderr
    # --quiet: warnings and errors only; neither the launcher's notices nor rank 0's output.
    assert "harness: recording" not in again.stderr and "epoch " not in again.stderr, again.stderr
    client = project.client()
    a, b = linear_run.last_line, again.last_line
    assert [v.hex() for v in losses(client, a)] == [v.hex() for v in losses(client, b)]
    assert client.get_run(a).data.tags["harness.fingerprint"] == client.get_run(b).data.tags["harness.fingerprint"]


def test_override_is_recorded(project: Project) -> None:
    never_built = "localhost:5000/harness-never-built:1"
    result = project.harness("run", "experiments/linear_ddp", "train.lr=0.05", "train.epochs=1", f"image={never_built}")
    assert result.returncode == 0, result.stderr
    run = project.client().get_run(result.last_line)
    assert run.data.params["train.lr"] == "0.05" and run.data.params["train.epochs"] == "1"
    # It ran on the host, and no engine here knows its pinned image: no image to replay it in, said before anything.
    assert run.data.tags["harness.image.digest"] == "host" and "harness.image.tag_digest" not in run.data.tags
    refused = project.cli("replay", result.last_line, "--executor", "docker")
    assert refused.returncode == 2 and refused.stderr.startswith(
        f"Error: run {result.last_line} ran on the host and recorded no digest of its pinned image ("), refused.stderr
    assert refused.stderr.rstrip().endswith("so there is no exact image to run it in. Use --executor local.")


def test_dirty_tree_is_recorded_as_patch(fresh_project: Project, tmp_path: Path) -> None:
    p = fresh_project
    train = p.root / "experiments/linear_ddp/train.py"
    train.write_text(train.read_text().replace("loss_fn = nn.MSELoss()", "loss_fn = nn.MSELoss()  # edited"))
    (p.root / "experiments/linear_ddp/notes.txt").write_text("untracked note\n")
    refused = p.harness("run", "experiments/linear_ddp", "--require-clean")
    assert refused.returncode == 2
    assert refused.stderr.strip().startswith("Error:") and "--require-clean" in refused.stderr
    assert p.all_runs() == []
    result = p.harness("run", "experiments/linear_ddp", "train.epochs=1")
    assert result.returncode == 0, result.stderr
    assert "uncommitted changes" in result.stderr
    client = p.client()
    run = client.get_run(result.last_line)
    assert run.data.tags["harness.git.dirty"] == "true"
    patch = read_artifact(client, result.last_line, "git/uncommitted.patch", tmp_path)
    assert "+    loss_fn = nn.MSELoss()  # edited" in patch
    assert "+untracked note" in patch
    # The user's index was not touched: the untracked file is still untracked.
    assert git(p.root, "status", "--porcelain").splitlines() == [
        " M experiments/linear_ddp/train.py", "?? experiments/linear_ddp/notes.txt"]


BAD = [
    (["foo=1"], "unknown key 'foo'"),
    (["determinism.bogus=1"], "unknown key 'determinism.bogus'. Valid keys here: level"),
    (["world_size=two"], "invalid value 'two' for 'world_size'; expected an integer"),
    (["world_size=0"], "world_size must be >= 1"),
    (["determinism.level=sometimes"], "expected one of strict, warn, off"),
    (["backend=mpi"], "expected one of auto, gloo, nccl"),
    (["entry=missing.py:train"], "entry file"),
    (["entry=train.py:nope"], "entry function 'nope' not found"),
    (["entry=train"], "must be FILE.py:FUNCTION"),
    (["lr"], "is not KEY=VALUE"),
    # What a rank would have failed on after the run was recorded, said before anything is.
    (["train.x=${train.x}"], "train.x: an interpolation cannot be resolved (Recursive interpolation"),
    (["train.y=${oc.env:HARNESS_TEST_UNSET_VAR}"], "Environment variable 'HARNESS_TEST_UNSET_VAR' not found"),
    (["train.k\x01ey=1"], "its key holds a control character"),
    # YAML would fold it into a space: recorded and run as another string than the one typed.
    (["train.note=line one\nline two"], "override 'train.note=line one\\nline two': its value holds a line break"),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[b[0][0].encode("unicode_escape").decode() for b in BAD])
def test_bad_config_is_one_line_exit_2_and_records_nothing(project: Project, overrides, message) -> None:
    before = len(project.all_runs())
    result = project.cli("run", "experiments/linear_ddp", *overrides)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and message in lines[0], result.stderr
    assert result.stdout == ""
    assert len(project.all_runs()) == before


def test_a_line_break_written_as_its_escape_is_kept_exactly() -> None:
    from harness.config import as_override, parse_overrides

    assert parse_overrides(['train.note="line one\\nline two"']).train.note == "line one\nline two"
    text = 'a\nb "c"\r\n'  # as bisect and the backends write a value back: read back to the byte
    assert parse_overrides([as_override("train.note", text)]).train.note == text


def test_unknown_key_in_yaml_and_missing_folder(project: Project, tmp_path: Path) -> None:
    import shutil

    exp = project.add_experiment("typo", yaml_extra="wrld_size: 2\n", commit=False)
    try:  # uncommitted: removed after, so the session's repository stays clean for the tests that follow
        result = project.cli("run", str(exp))
        assert result.returncode == 2 and "unknown key 'wrld_size'" in result.stderr
        assert "world_size" in result.stderr  # the valid keys are listed
        missing = project.cli("run", "experiments/nope")
        assert missing.returncode == 2 and "does not exist" in missing.stderr
    finally:
        shutil.rmtree(exp)


def test_outside_git_repository_is_refused(project: Project, tmp_path: Path) -> None:
    import shutil

    shutil.copytree(ROOT / "experiments" / "linear_ddp", tmp_path / "exp")
    result = project.cli("run", str(tmp_path / "exp"), cwd=tmp_path)
    assert result.returncode == 2 and "not inside a git repository" in result.stderr


def test_rank_that_raises_fails_the_run_fast_and_leaves_nothing(project: Project, tmp_path: Path) -> None:
    exp, train = crash_experiment(project, "crashing", steps=1000, fail_rank=1, fail_step=3, sleep=0.05)
    start = time.monotonic()
    result = project.harness("run", exp, train, env={"PID_DIR": str(tmp_path)})
    elapsed = time.monotonic() - start
    assert result.returncode == 1, result.stderr
    assert "rank 1 raised: RuntimeError: boom at step 3" in result.stderr
    # Without the fail-fast path rank 0 would wait in the all-reduce until gloo's 30-minute timeout.
    assert elapsed < 120
    client = project.client()
    run = client.get_run(result.last_line)
    assert run.info.status == "FAILED"
    assert run.data.tags["harness.failed_rank"] == "1"
    failure = read_artifact(client, result.last_line, "failure.txt", tmp_path / "dl")
    assert failure.startswith("rank: 1") and "RuntimeError: boom at step 3" in failure and "Traceback" in failure
    # What rank 0 logged before the failure is kept.
    assert [m.step for m in sorted(client.get_metric_history(result.last_line, "loss"), key=lambda m: m.step)] == [0, 1, 2]
    for rank in (0, 1):
        assert not pid_alive(int((tmp_path / f"rank{rank}").read_text())), f"rank {rank} left behind"


@pytest.mark.parametrize("signum,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_signal_kills_run_and_every_rank(project: Project, tmp_path: Path, signum: int, code: int) -> None:
    exp, train = crash_experiment(project, "crashing", steps=100000, fail_rank=-1, fail_step=-1, sleep=0.05)
    proc = project.popen("run", exp, train, env={"PID_DIR": str(tmp_path)})
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"rank{r}").exists() for r in (0, 1)):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "ranks never started"
        time.sleep(0.2)
    time.sleep(3)  # let it log some steps
    if signum == signal.SIGINT:
        os.killpg(proc.pid, signum)  # what a terminal's Ctrl-C does: the whole foreground group
    else:
        proc.send_signal(signum)  # what a scheduler does: the launcher only
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    run_id = out.strip().splitlines()[-1]
    client = project.client()
    assert client.get_run(run_id).info.status == "KILLED"
    assert len(client.get_metric_history(run_id, "loss")) > 0
    for rank in (0, 1):
        assert not pid_alive(int((tmp_path / f"rank{rank}").read_text())), f"rank {rank} left behind"


def test_signal_while_recording_waits_until_the_run_is_closed(project: Project) -> None:
    # The signal is sent from inside the recording step itself, so that it lands in that window every
    # time; everything else is the real launcher, ranks and store.
    script = (
        "import os, signal, sys\n"
        "from pathlib import Path\n"
        "from harness.commands import run as runner\n"
        "from harness.commands.options import RunOptions\n"
        "from harness.record import recorder\n"
        "original = recorder.record_results\n"
        "def record(*args, **kwargs):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    return original(*args, **kwargs)\n"
        "recorder.record_results = record\n"
        "from harness import events\n"
        "if __name__ == '__main__':\n"
        "    with events.listening(lambda event: print(event.line(), file=sys.stderr)):\n"
        "        outcome = runner.run(RunOptions(Path('experiments/linear_ddp'), ('train.epochs=1', 'device=cpu')))\n"
        "    print(outcome.run_id)\n"
        "    sys.exit(outcome.exit_code)\n"
    )
    (project.root.parent / "signal_in_recording.py").write_text(script)
    proc = subprocess.run(
        [sys.executable, str(project.root.parent / "signal_in_recording.py")], cwd=project.root,
        env={**os.environ, "MLFLOW_TRACKING_URI": project.uri}, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 143, proc.stderr
    assert "SIGTERM arrived while the run was being recorded" in proc.stderr
    run_id = proc.stdout.strip().splitlines()[-1]
    client = project.client()
    assert client.get_run(run_id).info.status == "FINISHED"  # training had ended; the record is whole
    assert {"fingerprints.json", "metrics/series.npz", "logs/rank0.log"} <= artifact_paths(client, run_id)


def test_env_vars_record_the_variables_that_change_numerics() -> None:
    from harness.record.provenance import env_vars

    numerics = {"NVIDIA_TF32_OVERRIDE": "0", "CUBLASLT_WORKSPACE_SIZE": "1024", "DISABLE_ADDMM_CUDA_LT": "1",
                "TORCH_BLAS_PREFER_CUBLASLT": "1", "NCCL_BUFFSIZE": "4194304", "NCCL_P2P_LEVEL": "NVL",
                "NCCL_SHM_DISABLE": "1", "NCCL_COLLNET_ENABLE": "0", "NCCL_NVLS_ENABLE": "1",
                "CUDA_VISIBLE_DEVICES": "3,1"}
    assert env_vars({**numerics, "HOME": "/root", "NVIDIA_UNRELATED_TOKEN": "x"}) == numerics


def test_nccl_conf_records_the_files_nccl_reads(tmp_path: Path) -> None:
    import hashlib

    from harness.record.provenance import nccl_conf

    system, home = tmp_path / "etc-nccl.conf", tmp_path / "home"
    home.mkdir()
    # Nothing there: recorded as absent, never an error.
    assert nccl_conf({}, system=str(system), home=str(home)) == {"system": "absent", "user": "absent"}
    # NCCL's parsing: # lines skipped, split at the first =, the value verbatim; a secret's value redacted.
    system.write_text("# site defaults\nNCCL_ALGO=Ring\nNCCL_SOCKET_IFNAME==ens1f0\nnot a setting\n"
                      "NCCL_IB_AUTH_KEY=hunter2\n")
    (home / ".nccl.conf").write_text("NCCL_PROTO=Simple\n")
    digest = hashlib.sha256(system.read_bytes()).hexdigest()
    user = home / ".nccl.conf"
    assert nccl_conf({}, system=str(system), home=str(home)) == {
        "system": f"{system} sha256:{digest}", "system.NCCL_ALGO": "Ring", "system.NCCL_SOCKET_IFNAME": "=ens1f0",
        "system.NCCL_IB_AUTH_KEY": "<redacted>",
        "user": f"{user} sha256:{hashlib.sha256(user.read_bytes()).hexdigest()}", "user.NCCL_PROTO": "Simple"}
    # $NCCL_CONF_FILE replaces ~/.nccl.conf (NCCL reads one or the other), even when it is missing.
    other = tmp_path / "mine.conf"
    assert nccl_conf({"NCCL_CONF_FILE": str(other)}, system=str(system), home=str(home))["user"] == "absent"
    other.write_text("NCCL_MAX_NCHANNELS=4\n")
    facts = nccl_conf({"NCCL_CONF_FILE": str(other)}, system=str(system), home=str(home))
    assert facts["user.NCCL_MAX_NCHANNELS"] == "4" and "user.NCCL_PROTO" not in facts
