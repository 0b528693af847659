"""scripts/gpu-check.sh and its parts, where no GPU is: the dry run (exit 2, one line, nothing left behind), the
probes' CPU mode and their verdict logic on crafted digests, the wheel list held to what harness imports, and the
strict-tags rule on crafted tags."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"
sys.path.insert(0, str(SCRIPTS))
sys.path.insert(0, str(SCRIPTS / "gpu_check"))

import gpu_probes  # noqa: E402
import gpu_wheels  # noqa: E402
import runs as check_runs  # noqa: E402

from harness import tags as T  # noqa: E402


def _gpu_listed() -> bool:
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return any(line.startswith("GPU ") for line in listed.splitlines())


def _scratch() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("*gpu-check*")}


@pytest.mark.skipif(_gpu_listed(), reason="a GPU is visible: the check runs for real there, not as a dry run")
def test_without_a_gpu_it_exits_2_in_one_line_and_leaves_nothing(tmp_path: Path) -> None:
    before = _scratch()
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(SCRIPTS / "gpu-check.sh"), str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("gpu-check: no GPU visible"), proc.stderr
    assert not out.exists()  # nothing written, not even the output folder
    assert _scratch() == before  # no work folder left in the temporary directory


def test_probes_on_cpu_pass_and_say_what_they_checked(tmp_path: Path) -> None:
    """The probes' CPU mode: two fresh processes per level, digests of CPU tensors, the RNG round trip."""
    report = tmp_path / "probes.json"
    proc = subprocess.run([sys.executable, str(SCRIPTS / "gpu_probes.py"), "--cpu", "--json", str(report)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = {r["probe"]: r for r in json.loads(report.read_text())}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("probe ")]
    assert len(lines) == len(results)
    for name in gpu_probes.DETERMINISTIC_OPS:
        assert results[f"strict.{name}"]["status"] == "ok", results[f"strict.{name}"]
        assert results[f"strict.{name}"]["detail"].startswith("identical bytes in two processes")
        assert results[f"off.{name}"]["status"] == "info"
    for name in gpu_probes.REFUSED_OPS:  # no refusal on CPU: each of them has a deterministic CPU kernel
        assert results[f"strict.refuses.{name}"]["status"] == "ok"
    for name in ("tf32_off.matmul", "tf32_off.conv", "digest.float32", "digest.bfloat16", "digest.transposed",
                 "digest.sliced", "digest.model", "rng.cpu"):
        assert results[name]["status"] == "ok", results[name]
    assert not any(r["status"] == "FAIL" for r in results.values())


def _digests(**changed: str) -> dict[str, str]:
    names = [*gpu_probes.DETERMINISTIC_OPS, *gpu_probes.REFUSED_OPS]
    return {**{n: f"{i:064x}" for i, n in enumerate(names)}, **changed}


def _judged(runs: dict[str, list[dict[str, str]]], cpu: bool = False) -> dict[str, tuple[str, str]]:
    p = gpu_probes.Probes()
    gpu_probes.judge_processes(p, runs, cpu)
    return {r["probe"]: (r["status"], r["detail"]) for r in p.results}


def test_the_probes_fail_when_strict_differs_or_refuses_in_one_process_only(capsys: pytest.CaptureFixture) -> None:
    raised = gpu_probes.RAISED + "adaptive_avg_pool2d_backward_cuda does not have a deterministic implementation"
    honest = _judged({"strict": [_digests(adaptive_avg_pool_backward=raised)] * 2,
                      "off": [_digests(), _digests(index_add="f" * 64)]})
    assert not [k for k, (status, _) in honest.items() if status == "FAIL"], honest
    assert honest["strict.refuses.adaptive_avg_pool_backward"] == ("ok", raised)
    assert honest["off.index_add"] == ("info", "differs between two processes")
    assert honest["off.matmul"] == ("info", "identical in two processes")

    broken = _judged({"strict": [_digests(), _digests(scatter_add="e" * 64, nll_loss2d=raised)],
                      "off": [_digests(conv=gpu_probes.RAISED + "x")] * 2})
    assert broken["strict.scatter_add"] == ("FAIL", "two processes differ")
    assert broken["strict.refuses.nll_loss2d"][0] == "FAIL"  # refused in one process, ran in the other
    assert broken["off.conv"][0] == "FAIL"  # off must never refuse
    assert broken["strict.refuses"][0] == "FAIL"  # on a GPU, no refusal at all means strict was not applied
    assert "strict.refuses" not in _judged({"strict": [_digests()] * 2, "off": [_digests()] * 2}, cpu=True)
    # An op that failed for another cause than a determinism refusal (out of memory under load) says so, in both
    # lists, and is never taken for a refusal or for identical bytes.
    oom = gpu_probes.ERROR + "DefaultCPUAllocator: can't allocate memory"
    failing = _judged({"strict": [_digests(grid_sample_backward=oom, conv=oom)] * 2, "off": [_digests()] * 2})
    assert failing["strict.refuses.grid_sample_backward"] == (
        "FAIL", "failed, not refused: DefaultCPUAllocator: can't allocate memory")
    assert failing["strict.conv"] == ("FAIL", oom)
    capsys.readouterr()


def test_allreduce_probe_on_gloo_gives_identical_sums() -> None:
    """Stage 3's repeated all-reduce, on its gloo path (two CPU ranks)."""
    proc = subprocess.run([sys.executable, str(SCRIPTS / "gpu_probes.py"), "allreduce", "--cpu"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 ranks, 5 all-reduces of 64 MiB" in proc.stdout and "identical sums" in proc.stdout


# The framework integrations: imported only by training code that uses the framework, never by harness's core
# (an import contract) or the GPU check, whose device needs no Lightning or Accelerate wheel.
OPTIONAL = (ROOT / "harness" / "lightning.py", ROOT / "harness" / "accelerate.py", ROOT / "harness" / "transformers.py")


def _third_party_imports(*roots: Path) -> set[str]:
    found = set()
    for root in roots:
        for path in root.rglob("*.py"):
            if path in OPTIONAL:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    found.update(a.name.split(".")[0] for a in node.names)
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    found.add(node.module.split(".")[0])
    return {m for m in found if m not in sys.stdlib_module_names and m != "harness"}


def test_the_wheel_list_covers_every_module_harness_imports() -> None:
    """A new third-party import without a wheel (or a device package) fails here, not on the GPU machine."""
    assert all(path.is_file() for path in OPTIONAL)  # a moved integration must not slip out of the scan unseen
    imported = _third_party_imports(ROOT / "harness", ROOT / "experiments", SCRIPTS / "gpu_check",
                                    SCRIPTS / "gpu_probes.py")
    assert imported == set(gpu_wheels.MODULES)
    wanted = gpu_wheels.requirements()
    assert {gpu_wheels.distribution(r) for r in wanted} == {
        gpu_wheels.distribution(d) for d in gpu_wheels.MODULES.values()} - gpu_wheels.DEVICE_HAS
    assert "mlflow-skinny>=3,<4" in wanted and not any(r.startswith("torch") for r in wanted)
    listed = subprocess.run([sys.executable, str(SCRIPTS / "gpu_wheels.py"), "--list"], capture_output=True,
                            text=True, timeout=60)
    assert listed.returncode == 0 and listed.stdout.split() == wanted


def test_the_strict_tags_rule_on_crafted_tags() -> None:
    strict = {T.DETERMINISM_PREFIX + k: v for k, v in check_runs.STRICT.items()}
    assert check_runs.wrong_settings({**strict, T.DETERMINISM_CHANGES: "none"}) == []
    assert check_runs.wrong_settings({**strict, T.DETERMINISM_PREFIX + "cuda_matmul_fp32_precision": "ieee"}) == []
    wrong = check_runs.wrong_settings({**strict, T.DETERMINISM_PREFIX + "cudnn_tf32": "True",
                                       T.DETERMINISM_PREFIX + "cuda_matmul_fp32_precision": "tf32"})
    assert wrong == ["cudnn_tf32='True' (want 'False')", "cuda_matmul_fp32_precision='tf32' (want full fp32)"]
    assert check_runs.wrong_settings({**strict, T.DETERMINISM_CHANGES: "x"}) == [f"{T.DETERMINISM_CHANGES}='x'"]


def test_the_tf32_control_switches_tf32_on_and_restores_what_was_set() -> None:
    """The probes' positive control sets TF32 through the API this torch has (no GPU needed to set it)."""
    import torch

    b = torch.backends
    new_api = hasattr(b.cuda.matmul, "fp32_precision")

    def state() -> tuple:
        return (b.cuda.matmul.fp32_precision, b.cudnn.conv.fp32_precision) if new_api else \
            (b.cuda.matmul.allow_tf32, b.cudnn.allow_tf32)

    before = state()
    with gpu_probes._tf32_allowed():
        assert state() == (("tf32", "tf32") if new_api else (True, True))
    assert state() == before
