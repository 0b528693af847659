"""The in-process op tracer and the trace diff (harness/extras/trace/optrace/): planted causes, each localised
to the right op, module and user line, in user code written to a folder and imported for real.

No harness runs: every trace here is one step of a tiny model in this process.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from harness.errors import HarnessError
from harness.optrace import diff as diff_module, environment, rules as optrace_rules
from harness.optrace.diff import localize, render_html, render_markdown
from harness.optrace.signatures import order_free_digest, tensor_sig
from harness.optrace.trace import (
    CULPRIT,
    IDENTICAL,
    INPUTS_DIFFER_FROM_START,
    NOT_ALIGNED,
    Localization,
    OpRecord,
    TensorSig,
    Trace,
)
from harness.optrace.tracefile import dumps, loads
from harness.optrace.tracer import OpTracer

USER_CODE = '''\
import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 8)
        self.fc2 = torch.nn.Linear(8, 2)

    def forward(self, x):
        h = torch.tanh(self.fc1(x))  # @fc1
        return self.fc2(h)  # @fc2


def train_step(model, opt, x, y, gen=None):
    out = model(x)
    if gen is not None:
        out = out + torch.randn(out.shape, generator=gen)  # @noise
    loss = torch.nn.functional.mse_loss(out, y)
    opt.zero_grad()
    loss.backward()
    opt.step()  # @step
    return loss


def accumulate(table, index, source):
    out = table.clone()
    out.index_add_(0, index, source)  # @accumulate
    return out.sum()
'''


@pytest.fixture(scope="module")
def user(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModuleType, Path]:
    code_dir = tmp_path_factory.mktemp("optrace") / "user code"
    code_dir.mkdir()
    path = code_dir / "steps.py"
    path.write_text(USER_CODE)
    spec = importlib.util.spec_from_file_location("optrace_user_steps", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module, code_dir
    sys.modules.pop(spec.name, None)


def line_of(marker: str) -> str:
    """The user_line a trace must name for the line carrying `# @marker`."""
    for number, text in enumerate(USER_CODE.splitlines(), start=1):
        if text.endswith(f"# @{marker}"):
            return f"steps.py:{number}  {text.strip()}"
    raise AssertionError(marker)


def trace_step(user: tuple[ModuleType, Path], *, denormal_x: bool = False, seed_x: int = 0,
               gen_seed: int | None = None, zero_bias: bool = False, lr: float = 0.1,
               registered: bool = True) -> Trace:
    steps, code_dir = user
    torch.manual_seed(0)
    model = steps.Net()
    if zero_bias:
        with torch.no_grad():
            model.fc1.bias.zero_()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(seed_x))
    if denormal_x:  # denormal float32 values made from their bits: no arithmetic that FTZ could flush
        bits = torch.randint(1, 1 << 23, (5, 4), generator=torch.Generator().manual_seed(seed_x),
                             dtype=torch.int32)
        x = bits.view(torch.float32)
    y = torch.randn(5, 2, generator=torch.Generator().manual_seed(1))
    gen = None if gen_seed is None else torch.Generator().manual_seed(gen_seed)
    # registered=False: a model the script wrapped itself, never given to ctx.ddp or ctx.register.
    with OpTracer(str(code_dir), model if registered else None, {"step": 3}) as tracer:
        steps.train_step(model, opt, x, y, gen)
    return tracer.result()


@pytest.fixture(scope="module")
def honest(user: tuple[ModuleType, Path]) -> tuple[Trace, Trace]:
    return trace_step(user), trace_step(user)


def test_an_honest_pair_is_identical_and_says_how_much_was_compared(honest: tuple[Trace, Trace]) -> None:
    a, b = honest
    loc = localize(a, b)
    assert loc.status == IDENTICAL and loc.index is None and loc.likely_cause is None
    sigs = [s for r in a.ops for s in r.inputs + r.outputs if s is not None]
    assert all(len(s.sha256) == 64 for s in sigs)  # this step has no unhashed tensor
    assert loc.detail == [f"no difference found: {len(a.ops)} ops compared, with {len(sigs)} "
                          "tensor signatures (shape, dtype, sha256 of the bytes), all identical"]
    assert len(a.ops) > 30


def test_every_phase_module_and_line_is_recorded(honest: tuple[Trace, Trace]) -> None:
    a, _ = honest
    assert a.meta["step"] == 3 and a.meta["rank"] == 0 and a.meta["torch"] == torch.__version__
    assert {"deterministic_algorithms", "float32_matmul_precision", "flush_denormal"} <= set(a.meta)
    forward = [r for r in a.ops if r.phase == "forward" and r.op == "aten.addmm.default"]
    assert [(r.module, r.user_line) for r in forward] == [
        ("fc1", line_of("fc1")), ("fc2", line_of("fc2"))]
    # Backward ops name the module whose forward made their autograd node, and its line.
    backward_mm = [r for r in a.ops if r.phase == "backward" and r.op == "aten.mm.default"]
    assert {r.module for r in backward_mm} == {"fc1", "fc2"}
    assert all(r.user_line in (line_of("fc1"), line_of("fc2")) for r in backward_mm)
    # The optimizer's in-place updates: their outputs are the parameters after the update.
    updates = [r for r in a.ops if r.phase == "optimizer" and r.op.startswith("aten.add_")]
    assert updates and all(r.user_line == line_of("step") for r in updates)
    assert all(r.outputs[0] != r.inputs[0] for r in updates)


def test_an_unseeded_generator_is_the_culprit_at_its_line(user: tuple[ModuleType, Path]) -> None:
    a, b = trace_step(user, gen_seed=1), trace_step(user, gen_seed=2)
    loc = localize(a, b)
    assert loc.status == CULPRIT and loc.a is not None and loc.b is not None
    assert loc.a.op == "aten.randn.generator" and loc.a.user_line == line_of("noise")
    assert loc.a.inputs == loc.b.inputs and loc.a.outputs != loc.b.outputs
    assert loc.likely_cause is not None and "unseeded or seeded differently" in loc.likely_cause
    assert f"{loc.index} ops before it matched exactly" in loc.detail[-1]


def test_world_size_dependent_accumulation_order_is_the_culprit(user: tuple[ModuleType, Path]) -> None:
    steps, code_dir = user
    # Six rows into two slots; one rank adds them in order, two ranks interleave their shards.
    # The values make float32 addition order visible: (1e8 + 1) - 1e8 = 0, (1e8 - 1e8) + 1 = 1.
    rows = [1e8, 1.0, -1e8, 1e8, 1.0, -1e8]
    slots = [0, 0, 0, 1, 1, 1]

    def trace(order: list[int]) -> Trace:
        index = torch.tensor([slots[i] for i in order])
        source = torch.tensor([[rows[i]] for i in order], dtype=torch.float32)
        with OpTracer(str(code_dir)) as tracer:
            steps.accumulate(torch.zeros(2, 1), index, source)
        return tracer.result()

    one_rank, two_ranks = trace([0, 1, 2, 3, 4, 5]), trace([0, 2, 4, 1, 3, 5])
    loc = localize(one_rank, two_ranks)
    assert loc.status == CULPRIT and loc.a is not None
    assert loc.a.op == "aten.index_add_.default" and loc.a.user_line == line_of("accumulate")
    assert loc.order_only and loc.a.inputs != loc.b.inputs
    assert loc.likely_cause is not None and "accumulated in a different order" in loc.likely_cause
    assert "same contributions in a different order" in loc.detail[1]


def test_a_precision_setting_is_the_culprit_matmul(user: tuple[ModuleType, Path]) -> None:
    # On this CPU (AVX2, no bf16 units) torch.set_float32_matmul_precision and the mkldnn bf16
    # switches leave every bit unchanged; flush-to-zero (torch.set_flush_denormal) is the
    # precision switch that changes a float32 matmul: denormal inputs count as zero.
    assert torch.set_flush_denormal(False)
    a = trace_step(user, denormal_x=True, zero_bias=True)
    try:
        assert torch.set_flush_denormal(True)
        b = trace_step(user, denormal_x=True, zero_bias=True)
    finally:
        torch.set_flush_denormal(False)
    loc = localize(a, b)
    assert loc.status == CULPRIT and loc.a is not None
    assert (loc.a.op, loc.a.module, loc.a.phase) == ("aten.addmm.default", "fc1", "forward")
    assert loc.a.user_line == line_of("fc1")
    assert loc.likely_cause == ("a precision setting differs between the traces: "
                                "flush_denormal False vs True")


def test_different_data_going_in_is_not_blamed_on_an_op(user: tuple[ModuleType, Path],
                                                       honest: tuple[Trace, Trace]) -> None:
    loc = localize(honest[0], trace_step(user, seed_x=7))
    assert loc.status == INPUTS_DIFFER_FROM_START and loc.a is not None
    assert loc.a.op == "aten.addmm.default" and loc.a.module == "fc1"
    assert loc.likely_cause is None
    assert "input 1 differs: float32[5, 4]" in "\n".join(loc.detail)


def test_an_op_of_a_model_never_registered_is_not_called_outside_the_model(user: tuple[ModuleType, Path]) -> None:
    """No model given (a script that wraps its model itself): the module is unknown, and the way to name it is said."""
    from harness.commands.trace import describe

    loc = localize(trace_step(user, registered=False), trace_step(user, seed_x=7, registered=False))
    assert loc.status == INPUTS_DIFFER_FROM_START and loc.a is not None and loc.a.module == ""
    assert loc.model_unknown and loc.a.op == "aten.addmm.default" and loc.a.user_line == line_of("fc1")
    assert loc.detail[0] == f"op {loc.index}: aten.addmm.default in a module harness does not know (forward) at {line_of('fc1')}"
    assert loc.detail[-1] == diff_module.UNREGISTERED_MODEL and "ctx.register(model)" in loc.detail[-1]
    assert "outside the model" not in "\n".join(loc.detail)
    assert "  op: aten.addmm.default  module: unknown (no model registered: ctx.register(model))  phase: forward" in describe(loc)


def test_a_learning_rate_change_is_pinned_on_the_optimizer_op(user: tuple[ModuleType, Path],
                                                               honest: tuple[Trace, Trace]) -> None:
    """The step whose update ran with another lr: forward and backward match, the optimizer's update differs only in
    its arguments, and the rule names the hyper-parameter and the config key that differs."""
    hints = {"config": {"train.lr": ("0.1", "0.2")}}
    loc = localize(honest[0], trace_step(user, lr=0.2), hints)
    assert loc.status == INPUTS_DIFFER_FROM_START and loc.arguments_only and loc.a is not None and loc.b is not None
    assert loc.a.phase == "optimizer" and loc.a.user_line == line_of("step")
    assert "alpha=-0.1" in loc.a.params and "alpha=-0.2" in loc.b.params
    assert "its tensor inputs are identical but its non-tensor arguments differ" in loc.detail[1]
    assert loc.likely_cause == (f"the optimizer step ran with other hyper-parameters ({loc.a.params} vs {loc.b.params}): "
                                "a learning rate, momentum or weight decay differs; the configs differ in train.lr "
                                "(0.1 vs 0.2)")
    # Tensors that differ as they come in (data, or weights an earlier step updated) are not pinned on the op.
    data = localize(honest[0], trace_step(user, seed_x=7), hints)
    assert data.status == INPUTS_DIFFER_FROM_START and not data.arguments_only and data.likely_cause is None


def _record(i: int, op: str, out: str = "aa", inp: str = "bb") -> OpRecord:
    return OpRecord(i, op, "fc1", "forward", [TensorSig((2,), "float32", inp)],
                    [TensorSig((2,), "float32", out)], "train.py:1  x")


def test_structural_divergence_is_not_aligned_with_both_ops_named() -> None:
    a = Trace([_record(0, "aten.t.default"), _record(1, "aten.addmm.default")], {})
    b = Trace([_record(0, "aten.t.default"), _record(1, "aten.mm.default")], {})
    loc = localize(a, b)
    assert (loc.status, loc.index) == (NOT_ALIGNED, 1)
    assert loc.detail[0] == "the traces take different paths at op 1: aten.addmm.default vs aten.mm.default"
    shorter = localize(a, Trace(a.ops[:1], {}))
    assert (shorter.status, shorter.index) == (NOT_ALIGNED, 1)
    assert "trace A has 2 ops, trace B 1" in shorter.detail[0]


def test_a_changed_non_tensor_argument_is_an_input_difference() -> None:
    x, y = _record(0, "aten.roll.default"), _record(0, "aten.roll.default", out="cc")
    x.params, y.params = "T, [1]", "T, [2]"
    loc = localize(Trace([x], {}), Trace([y], {}))
    assert loc.status == INPUTS_DIFFER_FROM_START
    assert "non-tensor arguments differ: (T, [1]) vs (T, [2])" in loc.detail


def test_signatures_hash_exact_bytes_of_views_and_odd_dtypes() -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    for view in (base.t(), base[:, ::2], base[1], base.view(torch.int32), base.expand(2, 4, 6)):
        assert tensor_sig(view) == tensor_sig(view.contiguous().clone())
    assert tensor_sig(base.t()).sha256 != tensor_sig(base).sha256  # same bytes, other order
    assert tensor_sig(base.t()).shape == (6, 4)
    for t in (torch.tensor(1.5), torch.zeros(0, 3), torch.ones(3, dtype=torch.bfloat16),
              torch.tensor([True, False]), torch.tensor([1 + 2j]).conj()):
        assert len(tensor_sig(t).sha256) == 64
    assert tensor_sig(torch.tensor([0.0])) != tensor_sig(torch.tensor([-0.0]))


def test_uninitialized_and_overwritten_memory_is_not_compared(user: tuple[ModuleType, Path]) -> None:
    _, code_dir = user
    with OpTracer(str(code_dir)) as tracer:
        torch.empty(3).normal_(generator=torch.Generator().manual_seed(0))
    empty, normal = tracer.result().ops
    assert empty.outputs[0] == TensorSig((3,), "float32", "")
    assert normal.inputs[0] == TensorSig((3,), "float32", "") and normal.outputs[0].sha256
    trace = tracer.result()
    assert localize(trace, trace).detail[1].startswith("2 more tensors were compared by shape and dtype only")


def test_a_collective_is_recorded_with_its_result(user: tuple[ModuleType, Path], tmp_path: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=(tmp_path / "store").as_uri(), rank=0, world_size=1)
    try:
        t = torch.arange(3.0)
        with OpTracer(str(user[1])) as tracer:
            dist.all_reduce(t)
    finally:
        dist.destroy_process_group()
    (op,) = tracer.result().ops
    assert op.op == "c10d.allreduce_.default" and op.outputs[0] == tensor_sig(t)


def test_trace_file_round_trips_byte_for_byte_and_refuses_unknown_versions(honest: tuple[Trace, Trace]) -> None:
    import gzip

    a, _ = honest
    data = dumps(a)
    back = loads(data)
    assert back.ops == a.ops and back.meta == a.meta and dumps(back) == data
    header, rest = gzip.decompress(data).split(b"\n", 1)
    future = gzip.compress(header.replace(b'"version": 1', b'"version": 2') + b"\n" + rest)
    with pytest.raises(HarnessError) as e:
        loads(future)
    assert str(e.value) == ("op trace format version 2 is not supported (this harness reads "
                            "version 1); make the trace again with this harness "
                            "(harness trace RUN_ID --step K)")
    for bad in (b"not gzip", data[: len(data) // 2], gzip.compress(header + b"\n{}\n"),
                gzip.compress(b"\xff\xfe")):
        with pytest.raises(HarnessError) as e:
            loads(bad)
        assert "\n" not in str(e.value)


def test_rules_name_only_what_they_know() -> None:
    addmm = _record(0, "aten.addmm.default")
    loc = Localization(CULPRIT, 0, addmm, addmm, None, [])
    same = Trace([], {"float32_matmul_precision": "highest", "num_threads": 2, "torch": "2.13.0"})
    other = Trace([], {"float32_matmul_precision": "high", "num_threads": 2, "torch": "2.13.0"})
    assert optrace_rules.likely_cause(loc, same, same, None) is None
    assert optrace_rules.precision_setting(loc, same, other, None) == (
        "a precision setting differs between the traces: float32_matmul_precision 'highest' vs 'high'")
    threads = Trace([], {**same.meta, "num_threads": 4})
    assert optrace_rules.determinism_setting(loc, same, threads, None) == (
        "determinism settings differ between the traces: num_threads 2 vs 4")
    hints = {"packages": {"torch": ("2.13.0", "2.14.0")}}
    assert optrace_rules.library_version(loc, same, same, hints) == (
        "a different library version: torch 2.13.0 vs 2.14.0")
    tanh = Localization(CULPRIT, 0, _record(0, "aten.tanh.default"), None, None, [])
    assert optrace_rules.precision_setting(tanh, same, other, None) is None
    assert optrace_rules.random_generator(tanh, same, same, None) is None
    allreduce = Localization(CULPRIT, 0, _record(0, "c10d.allreduce_.default"), None, None, [])
    assert optrace_rules.collective_peer(allreduce, Trace([], {"world_size": 2}),
                                         Trace([], {"world_size": 4}), None).endswith("(2 vs 4)")
    assert optrace_rules.collective_peer(loc, same, same, None) is None
    scatter = Localization(CULPRIT, 0, _record(0, "aten.scatter_add_.default"), None, None, [])
    assert "nondeterministic accumulation" in optrace_rules.accumulation_order(scatter, same, same, None)


def test_a_trace_records_its_device_libraries_and_the_settings_that_pick_kernels(user: tuple[ModuleType, Path]) -> None:
    _, code_dir = user
    b = torch.backends
    q = torch.randn(1, 2, 4, 8, requires_grad=True, generator=torch.Generator().manual_seed(0))
    b.cuda.enable_flash_sdp(False)
    b.cuda.matmul.fp32_precision = "tf32"  # the new TF32 API is a plain setting on a CPU build too
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        with OpTracer(str(code_dir), device="cpu") as tracer:
            torch.nn.functional.scaled_dot_product_attention(q, q, q).sum().backward()
    finally:
        b.cuda.enable_flash_sdp(True)
        b.cuda.matmul.fp32_precision = "none"
        torch.utils.deterministic.fill_uninitialized_memory = True
    trace = tracer.result()
    meta = trace.meta
    assert (meta["device"], meta["device_name"], meta["compute_capability"]) == ("cpu", None, None)
    assert meta["cpu_capability"] == b.cpu.get_cpu_capability() and meta["cpu_capability"]
    # This CPU build of torch has no CUDA, cuDNN, cuBLAS or NCCL: each is recorded, as absent.
    assert {k: meta[k] for k in ("cuda_version", "cudnn_version", "cublas_version", "nccl_version")} == dict.fromkeys(
        ("cuda_version", "cudnn_version", "cublas_version", "nccl_version"))
    assert meta["flash_sdp_enabled"] is False and meta["math_sdp_enabled"] is True
    assert meta["mem_efficient_sdp_enabled"] is True and meta["cudnn_sdp_enabled"] is True
    assert meta["cuda_matmul_fp32_precision"] == "tf32" and meta["fp32_precision"] == b.fp32_precision
    assert meta["cudnn_conv_fp32_precision"] == b.cudnn.conv.fp32_precision
    assert meta["fill_uninitialized_memory"] is False
    assert loads(dumps(trace)).meta == meta
    # The flag is no label: without flash attention this CPU computed attention from plain matmuls and a softmax.
    assert not [r.op for r in trace.ops if "attention" in r.op] and "aten.bmm.default" in {r.op for r in trace.ops}
    with OpTracer(str(code_dir)) as tracer:
        torch.nn.functional.scaled_dot_product_attention(q, q, q).sum().backward()
    default = tracer.result()
    assert default.meta["flash_sdp_enabled"] is True and default.meta["fill_uninitialized_memory"] is True
    assert default.meta["device"] == "cpu"  # no device given, and CUDA not in use in this process
    # The attention kernel and its backward, as this CPU runs them, are matmuls to the precision rule.
    attention = [r.op for r in default.ops if "attention" in r.op]
    assert attention == ["aten._scaled_dot_product_flash_attention_for_cpu.default",
                         "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"]
    assert all(optrace_rules.is_matmul(op) for op in attention)


def test_rules_name_another_gpu_or_library_and_attention_settings() -> None:
    h100 = {"device": "cuda:0", "device_name": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0",
            "cpu_capability": "AVX512", "cudnn_version": 90100, "cuda_version": "12.8", "cublas_version": "12.8.4.1",
            "nccl_version": "2.26.2", "flash_sdp_enabled": True, "cuda_matmul_fp32_precision": "ieee"}
    a = Trace([], h100)
    b = Trace([], {**h100, "device_name": "NVIDIA A100-SXM4-80GB", "compute_capability": "8.0"})
    addmm = Localization(CULPRIT, 0, _record(0, "aten.addmm.default"), None, None, [])
    assert optrace_rules.device_change(addmm, a, b, None) == (
        "the traces ran on different hardware, whose kernels need not give the same bits: device_name "
        "'NVIDIA H100 80GB HBM3' vs 'NVIDIA A100-SXM4-80GB', compute_capability '9.0' vs '8.0'")
    assert optrace_rules.device_change(addmm, a, a, None) is None
    cudnn = Trace([], {**h100, "cudnn_version": 90300})
    assert optrace_rules.library_version(addmm, a, cudnn, None) == "a different library version: cuDNN 90100 vs 90300"
    assert "cuDNN 90100 vs 90300" in optrace_rules.likely_cause(addmm, a, cudnn, None)
    # A trace from a harness that recorded none of these facts is not a different GPU or library.
    old = Trace([], {"torch": None})
    assert optrace_rules.device_change(addmm, a, old, None) is None
    assert optrace_rules.library_version(addmm, Trace([], {}), Trace([], {}), None) is None
    assert optrace_rules.library_version(addmm, a, Trace([], {k: v for k, v in h100.items() if k != "cudnn_version"}),
                                         None) is None
    # The attention kernels and their backward fall under the precision rule, and under their own.
    tf32 = Trace([], {**h100, "cuda_matmul_fp32_precision": "tf32", "flash_sdp_enabled": False})
    for op in ("aten._scaled_dot_product_efficient_attention_backward.default",
               "aten._scaled_dot_product_flash_attention.default", "aten._scaled_dot_product_cudnn_attention.default",
               "aten._efficient_attention_backward.default", "aten._flash_attention_forward.default"):
        loc = Localization(CULPRIT, 0, _record(0, op), None, None, [])
        assert optrace_rules.precision_setting(loc, a, tf32, None) == (
            "a precision setting differs between the traces: cuda_matmul_fp32_precision 'ieee' vs 'tf32'"), op
        assert optrace_rules.attention_backend(loc, a, tf32, None).endswith("flash_sdp_enabled True vs False"), op
    assert optrace_rules.attention_backend(addmm, a, tf32, None) is None
    tanh = Localization(CULPRIT, 0, _record(0, "aten.tanh.default"), None, None, [])
    assert optrace_rules.precision_setting(tanh, a, tf32, None) is None
    assert not optrace_rules.is_matmul("aten.softmax.int") and optrace_rules.is_matmul("aten.mm.default")


def test_reports_name_the_op_module_and_line(user: tuple[ModuleType, Path], tmp_path: Path) -> None:
    a, b = trace_step(user, gen_seed=1), trace_step(user, gen_seed=2)
    loc = localize(a, b)
    md = render_markdown(loc, a, b)
    assert "# Op trace diff: CULPRIT" in md and "aten.randn.generator" in md
    assert line_of("noise").replace("|", "\\|") in md and "Likely cause: a random op" in md
    page = render_html(loc, a, b)
    assert "<script" not in page and "http" not in page.replace("http-equiv", "")
    from browser import open_page

    path = tmp_path / "diff.html"
    path.write_text(page)
    rendered = open_page(path.as_uri(), tmp_path / "diff.png", tmp_path / "chromium")
    assert "CULPRIT" in rendered.text and "aten.randn.generator" in rendered.text
    assert line_of("noise") in rendered.text
    assert rendered.requests == [path.as_uri()]


def test_order_free_digest_ignores_only_the_order_of_contributions() -> None:

    acc = torch.zeros(3, 2)
    index = torch.tensor([[0, 1], [2, 0], [1, 1]])
    src = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    perm = torch.tensor([2, 0, 1])
    base = order_free_digest("scatter_add_", (acc, 0, index, src), {})
    assert len(base) == 64
    assert order_free_digest("scatter_add_", (acc, 0, index[perm], src[perm]), {}) == base
    assert order_free_digest("scatter_add_", (acc, 0, index, src + 1), {}) != base
    rows = torch.tensor([2, 0, 2])
    put = order_free_digest("index_put_", (acc, [rows], src, True), {})
    assert put and order_free_digest("index_put_", (acc, [rows[perm]], src[perm], True), {}) == put
    assert order_free_digest("index_put_", (acc, [rows], src, False), {}) == ""  # a write, not a sum
    grad = torch.arange(8.0).reshape(4, 2)
    tokens = torch.tensor([1, 0, 1, 3])
    emb = order_free_digest("embedding_dense_backward", (grad, tokens, 4, -1, False), {})
    swapped = torch.tensor([3, 1, 0, 2])
    assert order_free_digest("embedding_dense_backward", (grad[swapped], tokens[swapped], 4, -1, False), {}) == emb


def test_a_generator_state_that_differed_before_the_step_is_named(tmp_path: Path) -> None:
    """The tracer records each global generator's state digest at the start of the traced step; a generator
    reseeded (or drawn from more often) before it is named as such, not blamed on the op that drew from it."""
    import random

    torch.manual_seed(5)
    before = environment.generator_states()
    assert set(before) == set(environment.GENERATOR_KEYS) and before["rng_cuda"] is None  # no CUDA in use here
    torch.manual_seed(5)
    assert environment.generator_states() == before  # a digest of the state, not of the time it was read
    torch.rand(1)
    random.random()
    after = environment.generator_states()
    assert after["rng_torch"] != before["rng_torch"] and after["rng_python"] != before["rng_python"]
    assert after["rng_numpy"] == before["rng_numpy"]
    dropout = Localization(CULPRIT, 0, _record(0, "aten.bernoulli_.float"), None, None, [])
    a, b = Trace([], {"step": 5, **before}), Trace([], {"step": 5, **after})
    cause = optrace_rules.likely_cause(dropout, a, b, None)
    assert cause.startswith("torch's default generator, Python's random module already differed at the start of "
                            "step 5 (state digests)"), cause
    assert optrace_rules.generator_state(dropout, a, a, None) is None
    assert optrace_rules.generator_state(dropout, a, Trace([], {"step": 5}), None) is None  # an older trace: unsaid
    with OpTracer(str(tmp_path)) as traced:
        torch.ones(2).sum()
    assert traced.meta["rng_torch"] == environment.generator_states()["rng_torch"]  # read at the step's start
