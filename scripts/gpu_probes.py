"""Stage 1 of scripts/gpu-check.sh: what strict determinism promises on this GPU, probed with torch alone (no MLflow,
no run): fresh processes give identical bytes in strict (and `off`, the negative control, says whether it did not),
ops without a deterministic kernel refuse, TF32 is really off, a CUDA tensor's digest equals its CPU copy's, and the
RNG states harness checkpoints restore exactly.

usage: python scripts/gpu_probes.py [--cpu] [--json FILE]
  --cpu  the same probes on CPU tensors (the parts that mean something without a GPU; the tests run this)
Prints one line per probe, `probe NAME STATUS DETAIL` (STATUS ok, FAIL or info); exit 0 all ok, 1 a probe failed.
(`python scripts/gpu_probes.py digest --level strict|off [--cpu]` is one fresh process's digests, as JSON;
`python scripts/gpu_probes.py allreduce [--cpu]` all-reduces the same 64 MiB several times over every GPU (gloo with
--cpu) and says whether the sums had the same bits: stage 3 runs it with NCCL_NVLS_ENABLE=0 and =1.)
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere: harness is this checkout's
    sys.path.insert(0, str(ROOT))

from harness.configschema import Level  # noqa: E402  (after the path above)
from harness.runtime import checkpoint, determinism  # noqa: E402
from harness.runtime.fingerprint import fingerprint, tensor_sha256  # noqa: E402

# A fp32 product of K=1024 terms lands within ~1e-6 (relative, Frobenius) of the fp64 one; TF32's 10-bit mantissa
# puts it near 1e-4 to 1e-3. A bound between the two tells them apart on any GPU generation.
TF32_BOUND = 1e-5
SEED = 20260


def _inputs(device: str, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The same values in every process and on every device: drawn on CPU from a fixed seed, then moved."""
    gen = torch.Generator().manual_seed(SEED + sum(shape))
    return torch.randn(*shape, generator=gen).to(dtype).to(device)


def _grad(device: str, *shape: int) -> torch.Tensor:
    return _inputs(device, *shape).requires_grad_(True)


def _indices(device: str, n: int, high: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(SEED + n)
    return torch.randint(0, high, (n,), generator=gen).to(device)  # many repeats: atomics collide


def op_matmul(device: str) -> list[torch.Tensor]:
    a, b = _inputs(device, 1024, 1024), _inputs(device, 1024, 512)
    return [a @ b]


def op_conv(device: str) -> list[torch.Tensor]:
    x, w = _grad(device, 16, 32, 28, 28), _grad(device, 64, 32, 3, 3)
    y = torch.nn.functional.conv2d(x, w, padding=1)
    y.square().sum().backward()
    return [y, x.grad, w.grad]  # type: ignore[list-item]


def op_sdpa(device: str) -> list[torch.Tensor]:
    # bf16 on CUDA so that the fused (flash / memory-efficient) kernels are eligible; fp32 on CPU.
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v = (_inputs(device, 4, 8, 256, 64, dtype=dtype).requires_grad_(True) for _ in range(3))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.float().square().sum().backward()
    return [out, q.grad, k.grad, v.grad]  # type: ignore[list-item]


def op_embedding_backward(device: str) -> list[torch.Tensor]:
    weight = _grad(device, 1000, 64)
    out = torch.nn.functional.embedding(_indices(device, 65536, 1000), weight)
    out.sum().backward()
    return [weight.grad]  # type: ignore[list-item]


def op_index_add(device: str) -> list[torch.Tensor]:
    src = _inputs(device, 65536, 32)
    return [torch.zeros(100, 32, device=device).index_add_(0, _indices(device, 65536, 100), src)]


def op_scatter_add(device: str) -> list[torch.Tensor]:
    src = _inputs(device, 65536)
    return [torch.zeros(100, device=device).scatter_add_(0, _indices(device, 65536, 100), src)]


# Ops with no deterministic CUDA kernel (torch.use_deterministic_algorithms' documentation): strict must refuse them
# (RuntimeError) or, where a torch version has since made one deterministic, give identical bytes like the rest.
def op_interpolate_bilinear_backward(device: str) -> list[torch.Tensor]:
    x = _grad(device, 8, 16, 32, 32)
    y = torch.nn.functional.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False)
    y.square().sum().backward()
    return [x.grad]  # type: ignore[list-item]


def op_adaptive_avg_pool_backward(device: str) -> list[torch.Tensor]:
    x = _grad(device, 8, 64, 30, 30)
    torch.nn.functional.adaptive_avg_pool2d(x, 7).square().sum().backward()
    return [x.grad]  # type: ignore[list-item]


def op_nll_loss2d(device: str) -> list[torch.Tensor]:
    logits = _grad(device, 8, 10, 16, 16)
    target = _indices(device, 8 * 16 * 16, 10).view(8, 16, 16)
    loss = torch.nn.functional.nll_loss(logits.log_softmax(1), target)
    loss.backward()
    return [loss, logits.grad]  # type: ignore[list-item]


def op_grid_sample_backward(device: str) -> list[torch.Tensor]:
    x, grid = _grad(device, 4, 8, 32, 32), (_inputs(device, 4, 24, 24, 2).tanh()).requires_grad_(True)
    torch.nn.functional.grid_sample(x, grid, align_corners=False).square().sum().backward()
    return [x.grad, grid.grad]  # type: ignore[list-item]


DETERMINISTIC_OPS: dict[str, Callable[[str], list[torch.Tensor]]] = {
    "matmul": op_matmul, "conv": op_conv, "sdpa": op_sdpa, "embedding_backward": op_embedding_backward,
    "index_add": op_index_add, "scatter_add": op_scatter_add,
}
REFUSED_OPS: dict[str, Callable[[str], list[torch.Tensor]]] = {
    "interpolate_bilinear_backward": op_interpolate_bilinear_backward,
    "adaptive_avg_pool_backward": op_adaptive_avg_pool_backward,
    "nll_loss2d": op_nll_loss2d, "grid_sample_backward": op_grid_sample_backward,
}
RAISED = "raised: "
ERROR = "error: "


def _digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(tensor_sha256(t.detach()).encode())
    return h.hexdigest()


def digests(level: Level, device: str) -> dict[str, str]:
    """Every op's output digest in this process under `level`, or 'raised: ...' for an op the level refused."""
    determinism.set_determinism(level)
    if device == "cpu":
        # One intra-op thread: the CPU mode checks the probes themselves, and a process's result must not depend on
        # how a loaded machine schedules its threads (every op here gave the same bytes with 1-8 threads, at load 9).
        torch.set_num_threads(1)
    out: dict[str, str] = {}
    for name, op in {**DETERMINISTIC_OPS, **REFUSED_OPS}.items():
        try:
            out[name] = _digest(op(device))
        except RuntimeError as exc:
            text = (str(exc).strip().splitlines() or ["?"])[0][:200]
            # Only torch's determinism refusal is a refusal; anything else (out of memory, a broken kernel) is an
            # error of its own, which the judge reports as such rather than as "neither refused nor deterministic".
            out[name] = (RAISED if "deterministic" in text else ERROR) + text
        if device == "cuda":
            torch.cuda.synchronize()
    return out


class Probes:
    """The probe lines, and whether one failed."""

    def __init__(self) -> None:
        self.results: list[dict[str, str]] = []

    def add(self, name: str, status: str, detail: str) -> None:
        self.results.append({"probe": name, "status": status, "detail": detail})
        print(f"probe {name} {status} {detail}", flush=True)

    @property
    def failed(self) -> bool:
        return any(r["status"] == "FAIL" for r in self.results)


def _fresh_digests(levels: list[str], cpu: bool) -> list[dict[str, str]]:
    """One fresh process per entry of `levels`, all at once (most of each one's time is importing torch)."""
    procs = [subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "digest", "--level", level]
                              + (["--cpu"] if cpu else []), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for level in levels]
    found = []
    for level, proc in zip(levels, procs):
        try:
            out, err = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            raise
        if proc.returncode != 0:
            raise RuntimeError(f"digest --level {level} exited {proc.returncode}: {err.strip()[-500:]}")
        found.append(json.loads(out.strip().splitlines()[-1]))
    return found


def probe_processes(p: Probes, cpu: bool) -> None:
    """Two fresh processes per level: strict must agree byte for byte (or refuse in both); off says what it did."""
    s1, s2, o1, o2 = _fresh_digests(["strict", "strict", "off", "off"], cpu)
    judge_processes(p, {"strict": [s1, s2], "off": [o1, o2]}, cpu)


def judge_processes(p: Probes, runs: dict[str, list[dict[str, str]]], cpu: bool) -> None:
    """The probe lines for two processes' digests per level (`runs`: level -> [first, second])."""
    (s1, s2), (o1, o2) = runs["strict"], runs["off"]
    for name in DETERMINISTIC_OPS:
        if s1[name].startswith((RAISED, ERROR)) or s1[name] != s2[name]:
            p.add(f"strict.{name}", "FAIL", "two processes differ" if s1[name] != s2[name] else s1[name])
        else:
            p.add(f"strict.{name}", "ok", f"identical bytes in two processes ({s1[name][:12]})")
    refused = []
    for name in REFUSED_OPS:
        failed = next((d for d in (s1[name], s2[name]) if d.startswith(ERROR)), None)
        if failed is not None:
            p.add(f"strict.refuses.{name}", "FAIL", f"failed, not refused: {failed[len(ERROR):]}")
        elif s1[name].startswith(RAISED) and s2[name].startswith(RAISED):
            refused.append(name)
            p.add(f"strict.refuses.{name}", "ok", s1[name])
        elif s1[name] == s2[name]:
            p.add(f"strict.refuses.{name}", "ok", "ran, deterministically (identical bytes in two processes)")
        else:
            p.add(f"strict.refuses.{name}", "FAIL", f"neither refused nor deterministic: {s1[name][:60]} vs {s2[name][:60]}")
    if not cpu and not refused:
        p.add("strict.refuses", "FAIL", "no op without a deterministic CUDA kernel raised: is strict applied?")
    for name in (*DETERMINISTIC_OPS, *REFUSED_OPS):
        if o1[name].startswith(RAISED):
            p.add(f"off.{name}", "FAIL", f"off must not refuse: {o1[name]}")
        else:
            said = "differs between two processes" if o1[name] != o2[name] else "identical in two processes"
            p.add(f"off.{name}", "info", said)


def _relative_error(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref).norm() / ref.norm())


@contextlib.contextmanager
def _tf32_allowed() -> Iterator[None]:
    """TF32 on for fp32 matmuls and convolutions, then back as it was. Through torch's fp32_precision settings where
    they exist (torch >= 2.9 warns on the old switches and refuses a mix of the two that disagrees), else allow_tf32."""
    b = torch.backends
    if hasattr(b.cuda.matmul, "fp32_precision") and hasattr(b.cudnn, "conv"):
        before = (b.cuda.matmul.fp32_precision, b.cudnn.conv.fp32_precision)
        b.cuda.matmul.fp32_precision, b.cudnn.conv.fp32_precision = "tf32", "tf32"
        try:
            yield
        finally:
            b.cuda.matmul.fp32_precision, b.cudnn.conv.fp32_precision = before
    else:
        old = (b.cuda.matmul.allow_tf32, b.cudnn.allow_tf32)
        b.cuda.matmul.allow_tf32, b.cudnn.allow_tf32 = True, True
        try:
            yield
        finally:
            b.cuda.matmul.allow_tf32, b.cudnn.allow_tf32 = old


def probe_tf32(p: Probes, device: str) -> None:
    """fp32 matmul and convolution under strict against fp64: within what full fp32 gives, beyond what TF32 gives."""
    determinism.set_determinism(Level.strict)
    a, b = _inputs(device, 1024, 1024), _inputs(device, 1024, 1024)
    x, w = _inputs(device, 8, 64, 32, 32), _inputs(device, 64, 64, 3, 3)

    def errors() -> tuple[float, float]:
        mm = _relative_error(a @ b, a.double() @ b.double())
        conv = _relative_error(torch.nn.functional.conv2d(x, w, padding=1),
                               torch.nn.functional.conv2d(x.double(), w.double(), padding=1))
        return mm, conv

    mm, conv = errors()
    for name, err in (("matmul", mm), ("conv", conv)):
        status = "ok" if err < TF32_BOUND else "FAIL"
        p.add(f"tf32_off.{name}", status, f"fp32 vs fp64 relative error {err:.2e} (bound {TF32_BOUND:.0e})")
    if device != "cuda":
        return
    # The control: TF32 switched on here must exceed the bound, or the bound proves nothing on this GPU.
    with _tf32_allowed():
        mm_on, conv_on = errors()
    for name, err in (("matmul", mm_on), ("conv", conv_on)):
        status = "ok" if err > TF32_BOUND else "FAIL"
        p.add(f"tf32_on_control.{name}", status, f"with TF32 allowed: relative error {err:.2e}")


def probe_digests(p: Probes, device: str) -> None:
    """harness's tensor digest of a tensor on `device` equals that of its CPU copy (views and dtypes included)."""
    base = _inputs(device, 64, 48)
    cases = {
        "float32": base, "bfloat16": base.to(torch.bfloat16), "float64": base.double(),
        "int64": (base * 100).long(), "bool": base > 0, "transposed": base.t(), "sliced": base[3:17, 5:40],
    }
    for name, t in cases.items():
        same = tensor_sha256(t) == tensor_sha256(t.cpu().contiguous().clone())
        p.add(f"digest.{name}", "ok" if same else "FAIL", f"{device} digest {'equals' if same else 'differs from'} the CPU copy's")
    torch.manual_seed(SEED)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.Flatten(),
                                torch.nn.LazyLinear(4))
    model(torch.zeros(1, 3, 8, 8))
    on_device = fingerprint(model.to(device))
    same = on_device == fingerprint(model.cpu())
    p.add("digest.model", "ok" if same else "FAIL", f"model fingerprint on {device} {'equals' if same else 'differs from'} on cpu")


def probe_rng(p: Probes, device: str) -> None:
    """The RNG state harness checkpoints restores the next draws exactly, on CPU and on every GPU it holds."""
    torch.manual_seed(SEED)
    # The rank's own device: a checkpoint holds the CUDA state of that GPU only (checkpoint.rng_state's docstring).
    on = torch.device(device)
    state = checkpoint.rng_state(on)
    first = [torch.rand(4), torch.rand(4, device=device)] + ([torch.randn(4, device="cuda")] if device == "cuda" else [])
    torch.rand(100, device=device)  # move on, then come back
    checkpoint.set_rng_state(state, on)
    again = [torch.rand(4), torch.rand(4, device=device)] + ([torch.randn(4, device="cuda")] if device == "cuda" else [])
    same = all(torch.equal(a, b) for a, b in zip(first, again))
    p.add(f"rng.{device}", "ok" if same else "FAIL",
          "checkpoint.rng_state round trip repeats the draws" if same else "draws after set_rng_state differ")
    if device == "cuda":
        gen_state = torch.cuda.get_rng_state()
        x = torch.rand(1000, device="cuda")
        torch.cuda.set_rng_state(gen_state)
        same = torch.equal(x, torch.rand(1000, device="cuda"))
        p.add("rng.cuda_generator", "ok" if same else "FAIL", "torch.cuda get/set_rng_state round trip")


ALLREDUCE_MIB = 64
ALLREDUCE_REPEATS = 5


def _allreduce_rank(rank: int, world: int, cpu: bool, port: int, out: str) -> None:
    import torch.distributed as dist

    device = "cpu" if cpu else f"cuda:{rank}"
    if not cpu:
        torch.cuda.set_device(rank)
    dist.init_process_group("gloo" if cpu else "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        values = torch.randn(ALLREDUCE_MIB * 2**20 // 4, generator=torch.Generator().manual_seed(SEED + rank))
        found = []
        for _ in range(ALLREDUCE_REPEATS):  # the same inputs each time: only the reduction can differ
            t = values.to(device, copy=True)  # a fresh copy: all_reduce sums in place
            dist.all_reduce(t)
            found.append(tensor_sha256(t))
        if rank == 0:
            Path(out).write_text(json.dumps(found))
    finally:
        dist.destroy_process_group()


def allreduce(cpu: bool) -> int:
    """All-reduce the same 64 MiB from every rank several times: are the sums the same bits each time? (One line;
    the caller sets NCCL_NVLS_ENABLE.) Exit 0 identical, 1 not."""
    import os
    import socket
    import tempfile

    import torch.multiprocessing as mp

    world = 2 if cpu else torch.cuda.device_count()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "digests.json")
        mp.spawn(_allreduce_rank, args=(world, cpu, port, out), nprocs=world, join=True)
        found = json.loads(Path(out).read_text())
    nvls = os.environ.get("NCCL_NVLS_ENABLE", "unset")
    same = len(set(found)) == 1
    print(f"{world} ranks, {ALLREDUCE_REPEATS} all-reduces of {ALLREDUCE_MIB} MiB, NCCL_NVLS_ENABLE={nvls}: "
          + ("identical sums" if same else f"{len(set(found))} different sums"))
    return 0 if same else 1


def check(cpu: bool, json_path: Path | None) -> int:
    device = "cpu" if cpu else "cuda"
    if not cpu and not torch.cuda.is_available():
        print("gpu-probes: torch sees no CUDA device (run with --cpu for the CPU probes)", file=sys.stderr)
        return 2
    p = Probes()
    where = "cpu" if cpu else f"{torch.cuda.get_device_name(0)} (sm_{''.join(map(str, torch.cuda.get_device_capability(0)))})"
    p.add("device", "info", f"{where}, torch {torch.__version__}, cuda {torch.version.cuda}")
    probes: dict[str, Callable[[], None]] = {
        "processes": lambda: probe_processes(p, cpu), "tf32": lambda: probe_tf32(p, device),
        "digests": lambda: probe_digests(p, device), "rng": lambda: probe_rng(p, device),
    }
    for name, probe in probes.items():
        try:
            probe()
        except Exception as exc:  # one probe's crash is its failure; the others still run
            p.add(name, "FAIL", f"{type(exc).__name__}: {exc}"[:300])
    if json_path is not None:
        json_path.write_text(json.dumps(p.results, indent=1))
    return 1 if p.failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", nargs="?", default="check", choices=("check", "digest", "allreduce"))
    parser.add_argument("--cpu", action="store_true", help="probe CPU tensors (no GPU needed)")
    parser.add_argument("--level", choices=("strict", "off"), default="strict", help="digest: the level applied")
    parser.add_argument("--json", type=Path, help="check: also write the probe results to this file")
    args = parser.parse_args()
    if args.what == "digest":
        print(json.dumps(digests(Level(args.level), "cpu" if args.cpu else "cuda")))
        return 0
    if args.what == "allreduce":
        return allreduce(args.cpu)
    return check(args.cpu, args.json)


if __name__ == "__main__":
    sys.exit(main())
