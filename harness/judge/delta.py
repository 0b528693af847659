"""What differs between two runs - config, environment, packages, data - and which differences rule out bitwise.

The rules here decide whether a replay can be held to bit-identity: anything that changes which
floating-point operations run, or in what order, breaks it; where the run happened does not.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from harness import tags
from harness.config import flatten
from harness.fmt import the
from harness.messages import SettingChange
from harness.rundata import RunRecord

# Keys that decide how a run is recorded, watched or judged, not what it computes.
_NO_EFFECT_KEYS: frozenset[str] = frozenset(
    {"flush_interval_s", "heartbeat_s", "timeout_s", "stall_s", "executor", "fingerprint_every", "checkpoint_every",
     "rendezvous_timeout_s", "launcher"}
)
# slurm.*: which nodes and resources; the ranks' arithmetic is the same (world_size and backend decide it).
# data.*: where the data was declared to be; its bytes decide, and the data delta below compares them.
# profile.*: which steps run under torch.profiler, which only observes (a profiled run and an unprofiled one are BITWISE).
_NO_EFFECT_PREFIXES: tuple[str, ...] = ("replay.", "record.", "slurm.", "data.", "profile.")

# "auto" in a config is resolved at launch and recorded as a tag; a replay pins it to that value,
# so "auto" -> "cpu" is no change when the original did run on cpu.
_RESOLVED_BY: dict[str, str] = tags.RESOLVED_AT_LAUNCH


@dataclass
class ConfigChange:
    """One dotted config key whose value differs (None: absent from that run's config)."""

    key: str
    a: str | None
    b: str | None
    affects_result: bool


def affects_result(key: str) -> bool:
    return key not in _NO_EFFECT_KEYS and not key.startswith(_NO_EFFECT_PREFIXES)


def _effective(config: Mapping[str, Any], facts: Mapping[str, str]) -> dict[str, str]:
    flat = flatten(config)
    for key, tag in _RESOLVED_BY.items():
        if flat.get(key) == "auto" and tag in facts:
            flat[key] = facts[tag]
    return flat


def config_delta(
    config_a: Mapping[str, Any], config_b: Mapping[str, Any],
    facts_a: Mapping[str, str] | None = None, facts_b: Mapping[str, str] | None = None,
) -> list[ConfigChange]:
    """Every differing key, sorted; empty when either run recorded no config (nothing to hold against)."""
    if not config_a or not config_b:
        return []
    fa, fb = _effective(config_a, facts_a or {}), _effective(config_b, facts_b or {})
    return [
        ConfigChange(key, fa.get(key), fb.get(key), affects_result(key))
        for key in sorted(fa.keys() | fb.keys())
        if fa.get(key) != fb.get(key)
    ]


# ---------------------------------------------------------------------------------------------
# Environment

# Tags that are harness's own bookkeeping (tags.BOOKKEEPING), or describe the run's outcome rather than the
# conditions it ran under; they differ between an original and its replay by construction.
IGNORED_TAGS: frozenset[str] = tags.BOOKKEEPING | frozenset(
    {
        # How many steps' data order a run recorded (a replay --steps K stops early): how far it got, its outcome.
        tags.DATA_ORDER_STEPS,
        # Which metrics the script logged through MLflow itself: what it logged (a replay stopped at step K may not
        # have reached them), which the metric comparison judges, not what the run ran under.
        tags.USER_MLFLOW_METRICS,
        # A replay runs in a detached worktree; the branch name decides nothing, the commit does.
        tags.GIT_BRANCH,
        tags.FINGERPRINT,
        tags.FAILED_RANK,
        tags.STATUS_REASON,
        # Liveness and training outcomes: they describe how the run went, not what it ran under.
        tags.HEARTBEAT,
        tags.HEARTBEAT_S,
        tags.HEARTBEAT_BY,
        tags.STARTED,
        tags.WEIGHTS_CHANGED,
        tags.INITIAL_FINGERPRINT,
        # Which scheduler job and which rendezvous address: where it ran, never what decided it.
        tags.SLURM_JOB_ID,
        tags.MASTER,
        # The warnings the record carries: about the record, never what decided the result.
        tags.NOTICES,
        # What the run's loop and its evaluations were: the code's, whose changes the commit and metrics show.
        tags.LOOP,
        tags.EVALUATION_METRICS,
        # Where the hash seed came from (the seed, PYTHONHASHSEED, the record a rerun reran): its value is compared.
        tags.HASH_SEED_SOURCE,
        # How the tracking store behaved while the run wrote to it.
        tags.STORE_WRITE_FAILURES,
        tags.STORE_METRICS_SPOOLED,
        tags.STORE_LONGEST_OUTAGE_S,
    }
)

# Which fact changes make a bit-identical replay impossible.
# Rule: anything that changes which floating-point operations run, or in what order, breaks
# bitwise: the parallel layout (world size, backend, threads), the hardware (device, CPU and
# GPU model), the numerical libraries (torch, CUDA, cuDNN, NCCL, the image they ship in), the
# determinism switches, the seeds, and the few environment variables that select kernels or
# reduction algorithms. Where the run happened (hostname, OS, GPU driver) and the code
# identity (commit, patch) are reported but do not break bitwise on their own: identical code
# can sit behind different commits, and a real code change shows up in the metrics anyway.
_BREAKING_FACTS: dict[str, str] = {
    tags.WORLD_SIZE: "world size changed: the batch split and the gradients' reduction differ (DDP all-reduce; FSDP shards)",
    tags.BACKEND: "backend changed: collectives reduce in a different order",
    tags.DEVICE: "device changed: different kernels run",
    tags.THREADS_PER_RANK: "threads per rank changed: intra-op reductions are split differently",
    tags.SEED: "seed changed: different random streams",
    tags.RANK_SEEDS: "rank seeds changed: different random streams",
    tags.ENV_PREFIX + "torch": "torch version changed: operator implementations may differ",
    tags.ENV_PREFIX + "cuda": "CUDA version changed: cuBLAS kernels may differ",
    tags.ENV_PREFIX + "cudnn": "cuDNN version changed: convolution algorithms may differ",
    tags.ENV_PREFIX + "nccl": "NCCL version changed: all-reduce algorithms may differ",
    tags.ENV_PREFIX + "cpu": "CPU model changed: vector kernels may round differently",
    tags.ENV_PREFIX + "cpu_capability": "CPU kernel level changed (ATen's dispatch): other vector kernels round differently",
}
# The device rank 0 trained on decides the kernels, on a cuda run only (a cpu run on a GPU host uses none);
# how much memory it has does not.
_BREAKING_DEVICE_FACTS: dict[str, str] = {
    tags.DEVICE_PREFIX + "name": "GPU model changed: different kernels and tensor-core paths",
    tags.DEVICE_PREFIX + "capability": "GPU compute capability changed: different kernels and tensor-core paths",
    tags.DEVICE_PREFIX + "sm_count": "GPU SM count changed: cuBLAS and NCCL choose kernels and splits by it",
}

_OPTIMIZATION_TAGS = frozenset({tags.OPTIMIZER, tags.OPTIMIZER_SETTINGS, tags.LR_SCHEDULER, tags.GRAD_SCALER,
                                tags.AUTOCAST})
_NOTES: dict[str, str] = {
    tags.VERSION: "harness version differs",
    tags.EXPERIMENT_PATH: "experiment folder differs",
    tags.ENTRY: "code differs",
    # Only code whose result follows the order of a set of strings (or hash() itself) sees it.
    tags.HASH_SEED: "string hash seed (PYTHONHASHSEED) differs: sets of strings iterate in another order",
    tags.GIT_COMMIT: "code differs",
    tags.GIT_DIRTY: "code differs",
    tags.GIT_PATCH_SHA256: "code differs",
    tags.GIT_SUBMODULES_SHA256: "code differs",
    tags.GIT_BRANCH: "branch differs",
    tags.GIT_REPO_URL: "repository URL differs",
    tags.IMAGE_ID: "local image id differs (compare digests)",
    tags.IMAGE_DIGEST_REASON: "digest lookup differs",
    tags.IMAGE_TAG_DIGEST: "what the pinned tag resolved to differs (or the engine knew it in one run only)",
    tags.IMAGE_RESOLVED_BY: "image found by its recorded id (loaded from a bundle, no registry digest here)",
    tags.EXECUTOR: "executor differs (see image and library versions)",
    tags.IN_IMAGE: "ran inside the pinned image in one run only",
    tags.NNODES: "number of nodes differs (same world size and backend: the arithmetic is the same)",
    tags.NPROC_PER_NODE: "ranks per node differ (same world size: the arithmetic is the same)",
    tags.LAUNCHER: "launched differently (mp.spawn, Slurm or torchrun): the ranks run the same code",
    tags.RANK_START: "ranks started differently (forked from the rank server, spawned, or by torchrun): same code",
    tags.SLURM_NODELIST: "ran on other Slurm nodes",
    tags.NODES_DIFFER: "which nodes' environments differ from node 0's changed",
    tags.ENV_PREFIX + "hostname": "different host",
    # What trains the model follows the code and config (an --allow-changes train.lr shows here as the lr it set).
    tags.OPTIMIZER: "optimizer differs",
    tags.OPTIMIZER_SETTINGS: "optimizer settings differ",
    tags.LR_SCHEDULER: "LR schedulers differ",
    tags.GRAD_SCALER: "GradScaler differs",
    tags.AUTOCAST: "autocast regions differ: other dtypes in the arithmetic",
    tags.ENV_PREFIX + "os": "operating system differs",
    tags.ENV_PREFIX + "gpu_driver": "GPU driver differs (usually harmless)",
    # The host's GPUs: another count of identical GPUs, or a cpu run on a GPU host, computes the same.
    tags.ENV_PREFIX + "gpu": "the host's GPUs differ (the device rank 0 used decides: harness.env.device.*)",
    tags.ENV_PREFIX + "gpu_count": "the host's GPU count differs (the device rank 0 used decides)",
    tags.DEVICE_PREFIX + "memory": "GPU memory differs (it chooses no kernel)",
    tags.ENV_PREFIX + "python": "Python version differs",
}

# Environment variables that select kernels, thread counts or reduction algorithms. Others
# (NCCL_DEBUG, NCCL_SOCKET_IFNAME, ...) only change logging or transport. The CUDA ones matter only where
# a run's device is cuda, NCCL's only where its backend is nccl: a gloo run on CPU reads neither.
_BREAKING_VARS: frozenset[str] = frozenset({
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS",
    # The CPU's vector kernels: ATen's dispatch level, oneDNN's instruction-set limit and its floating-point mode.
    "ATEN_CPU_CAPABILITY", "DNNL_MAX_CPU_ISA", "ONEDNN_MAX_CPU_ISA", "DNNL_DEFAULT_FPMATH_MODE",
    "ONEDNN_DEFAULT_FPMATH_MODE",
})
_BREAKING_CUDA_VARS: frozenset[str] = frozenset(
    {
        "CUBLAS_WORKSPACE_CONFIG",
        "CUBLASLT_WORKSPACE_SIZE",
        "NVIDIA_TF32_OVERRIDE",
        "DISABLE_ADDMM_CUDA_LT",
        "TORCH_BLAS_PREFER_CUBLASLT",
        "CUDA_VISIBLE_DEVICES",  # which GPUs, in which order: the ranks' placement and NCCL's topology
    }
)
_BREAKING_NCCL_VARS: frozenset[str] = frozenset(
    {
        "NCCL_ALGO",
        "NCCL_PROTO",
        "NCCL_MIN_NCHANNELS",
        "NCCL_MAX_NCHANNELS",
        "NCCL_MIN_CTAS",
        "NCCL_MAX_CTAS",
        "NCCL_NTHREADS",
        "NCCL_TREE_THRESHOLD",
        "NCCL_BUFFSIZE",
        "NCCL_SHM_DISABLE",
        "NCCL_COLLNET_ENABLE",
        "NCCL_NVLS_ENABLE",  # NVLink SHARP reduces in the switch, not deterministically (NVIDIA/nccl#1497)
    }
)
_BREAKING_NCCL_VAR_PREFIXES: tuple[str, ...] = ("NCCL_P2P_",)  # which transport, chunk sizes: other channels


def var_breaks(var: str, facts_a: Mapping[str, str], facts_b: Mapping[str, str]) -> bool:
    """Whether a change of environment variable `var` (also as set by an NCCL configuration file) can change
    the arithmetic of these two runs."""
    if var in _BREAKING_VARS:
        return True
    if var in _BREAKING_CUDA_VARS:
        return "cuda" in (facts_a.get(tags.DEVICE), facts_b.get(tags.DEVICE))
    if var in _BREAKING_NCCL_VARS or var.startswith(_BREAKING_NCCL_VAR_PREFIXES):
        return "nccl" in (facts_a.get(tags.BACKEND), facts_b.get(tags.BACKEND))
    return False


# Packages whose version decides numerical kernels; other lock changes are reported only.
_BREAKING_PACKAGES: frozenset[str] = frozenset({"torch", "triton", "mkl", "intel-openmp"})
_BREAKING_PACKAGE_PREFIXES: tuple[str, ...] = ("nvidia-",)

_UNKNOWN_DIGEST = "unknown"

# Setting values under which the same code, data and seeds need not give the same bits: TF32 and reduced matmul
# precision round differently per GPU generation; benchmarking and nondeterministic kernels differ run to run.
_RISKY_SETTINGS: dict[tuple[str, str], str] = {
    ("cuda_matmul_tf32", "True"): "TF32 matmuls round their inputs to 10 mantissa bits: results may differ between GPUs",
    ("cudnn_tf32", "True"): "TF32 convolutions round their inputs to 10 mantissa bits: results may differ between GPUs",
    ("cudnn_benchmark", "True"): "cuDNN picks convolution algorithms by timing them: results may differ between runs",
    ("cudnn_deterministic", "False"): "cuDNN may pick nondeterministic algorithms: results may differ between runs",
    ("deterministic_algorithms", "False"): "nondeterministic kernels may run: results may differ between runs",
    ("deterministic_warn_only", "True"): "nondeterministic kernels only warn, and run: results may differ between runs",
}


def setting_risk(setting: str, value: str) -> str | None:
    """Why `setting` = `value` (a harness.determinism.<setting> value) can break bitwise, or None if it cannot."""
    if setting == "float32_matmul_precision" and value != "highest":
        return f"float32 matmuls at precision '{value}' may use TF32 or bf16: results may differ between GPUs"
    if setting.endswith("_fp32_precision") and value in ("tf32", "bf16"):
        ops = setting.removesuffix("_fp32_precision").replace("_", " ")
        return f"{ops} at fp32_precision '{value}' round their inputs to {value}: results may differ between devices"
    return _RISKY_SETTINGS.get((setting, value))


def _describe(changes: list[SettingChange]) -> str:
    return ", ".join(f"{c.after} at step {c.step} ({c.when})" + (f" by {c.where}" if c.where else "") for c in changes)


def _changes_delta(facts_a: Mapping[str, str], facts_b: Mapping[str, str]) -> list[FactDelta]:
    """One line per setting the training code changed in either run: a change made in one run only, or at
    another step, breaks bitwise as a differing setting does; the same change in both is shown, not counted."""
    ta, tb = facts_a.get(tags.DETERMINISM_CHANGES), facts_b.get(tags.DETERMINISM_CHANGES)
    if ta is None or tb is None:  # recorded before harness read settings back during training: nothing to hold
        return []

    def by_setting(text: str) -> dict[str, list[SettingChange]]:
        out: dict[str, list[SettingChange]] = {}
        for line in text.splitlines():
            change = SettingChange.from_line(line)
            if change is not None:
                out.setdefault(change.setting, []).append(change)
        return out

    ca, cb = by_setting(ta), by_setting(tb)
    out: list[FactDelta] = []
    for setting in sorted(ca.keys() | cb.keys()):
        a, b = ca.get(setting, []), cb.get(setting, [])
        risks = sorted({r for c in a + b if (r := setting_risk(setting, c.after))})
        risk = f": {'; '.join(risks)}" if risks else ""
        if [(c.before, c.after, c.step, c.when) for c in a] != [(c.before, c.after, c.step, c.when) for c in b]:
            which = "in one run only" if not (a and b) else "differently in the two runs"
            breaks, note = True, f"the training code changed it {which}{risk or ': different kernels may be chosen'}"
        elif [c.where for c in a] != [c.where for c in b]:
            breaks, note = False, "the same change in both runs, made by another line"
        else:
            continue  # the same change, at the same step, by the same line: no difference to show
        out.append(FactDelta(f"changed in training:{setting}", _describe(a) or None, _describe(b) or None, breaks, note))
    return out


@dataclass
class FactDelta:
    """One fact (or locked package, named `lock:<package>`) that differs between two runs."""

    name: str
    a: str | None
    b: str | None
    breaks_bitwise: bool
    note: str


def _is_fact(name: str) -> bool:
    # The changes tag is compared setting by setting (_changes_delta), not as one block of text.
    # Step times and profiles are what the run measured, not conditions it ran under: the performance line shows them.
    return (name.startswith(tags.PREFIX) and name not in IGNORED_TAGS and name != tags.DETERMINISM_CHANGES
            and not name.startswith((tags.PERF_PREFIX, tags.PROFILE_PREFIX)))


def _world_size_invariant(facts_a: Mapping[str, str], facts_b: Mapping[str, str]) -> bool:
    """Both runs trained in world-size-invariant mode with the same shards."""
    flag, shards = tags.DETERMINISM_PREFIX + "world_size_invariant", tags.DETERMINISM_PREFIX + "shards"
    return facts_a.get(flag) == facts_b.get(flag) == "True" and facts_a.get(shards) == facts_b.get(shards)


def _classify(name: str, a: str | None, b: str | None, facts_a: Mapping[str, str], facts_b: Mapping[str, str]) -> tuple[bool, str]:
    if name in (tags.WORLD_SIZE, tags.RANK_SEEDS) and _world_size_invariant(facts_a, facts_b):
        # Fixed shards, per-shard randomness and one canonical summation order: W does not enter the arithmetic.
        return False, "world size changed in world-size-invariant mode (same shards): bitwise still possible"
    if name in _BREAKING_FACTS:
        return True, _BREAKING_FACTS[name]
    if name in _BREAKING_DEVICE_FACTS:
        if "cuda" not in (facts_a.get(tags.DEVICE), facts_b.get(tags.DEVICE)):
            return False, "rank 0's device differs (a cpu run: no GPU kernel ran)"
        if a is None or b is None:
            return True, "rank 0's GPU recorded in one run only: cannot prove the same GPU"
        return True, _BREAKING_DEVICE_FACTS[name]
    if name.startswith(tags.DETERMINISM_PREFIX):
        setting = name[len(tags.DETERMINISM_PREFIX):]
        if a is None or b is None:
            # A setting a harness before it did not read back (the fp32_precision keys): nothing to hold against.
            return False, f"determinism setting '{setting}' recorded in one run only"
        return True, f"determinism setting '{setting}' changed: different kernels may be chosen"
    if name == tags.IMAGE_DIGEST:
        if tags.HOST in (a, b):
            # One ran in no image: what decides is the libraries it found, compared one by one (torch, CUDA, ...).
            return False, "ran on the host in one run (no image): the library versions decide"
        # An unknown digest proves nothing either way; only two known, different digests do.
        if a in (None, _UNKNOWN_DIGEST) or b in (None, _UNKNOWN_DIGEST):
            return False, "image digest unknown in one run: cannot prove the same image"
        return True, "image digest changed: different libraries in the image"
    if name == tags.IMAGE:
        da, db = facts_a.get(tags.IMAGE_DIGEST), facts_b.get(tags.IMAGE_DIGEST)
        if da == db == tags.HOST:
            return False, "image reference differs (both ran on the host, in neither image)"
        if da in (None, _UNKNOWN_DIGEST) and db in (None, _UNKNOWN_DIGEST):
            # Without digests the reference is the only evidence of which image ran.
            return True, "image changed and no digest proves it is the same"
        return False, "image reference differs (digests decide)"
    if name.startswith(tags.DATA_PREFIX):
        # Other bytes in, other numbers out: data is an input like the seed (its files: the data: lines).
        return True, f"data '{name[len(tags.DATA_PREFIX):]}' changed: the training read other bytes"
    if name.startswith(tags.VAR_PREFIX):
        var = name[len(tags.VAR_PREFIX):]
        if var_breaks(var, facts_a, facts_b):
            return True, f"{var} changed: selects kernels, threads or reduction algorithm"
        return False, "environment variable differs"
    if name.startswith(tags.NCCL_CONF_PREFIX):
        which, _, var = name[len(tags.NCCL_CONF_PREFIX):].partition(".")
        if not var:  # the file itself: its settings are compared one by one
            return False, f"NCCL's {which} configuration file differs (its settings decide)"
        if var_breaks(var, facts_a, facts_b):
            return True, f"{var} in NCCL's {which} configuration file changed: selects NCCL's reduction algorithm"
        return False, f"NCCL's {which} configuration file differs"
    if name in _NOTES:
        if name in _OPTIMIZATION_TAGS and (a is None or b is None):
            return False, "recorded in one run only (a harness before it did not record it)"
        return False, _NOTES[name]
    if name.startswith(tags.NODE_PREFIX):
        node, _, fact = name[len(tags.NODE_PREFIX):].partition(".")
        if a is None or b is None:
            return False, f"node {node} exists in one run only"
        if tags.ENV_PREFIX + fact in _BREAKING_FACTS:
            return True, f"node {node}: " + _BREAKING_FACTS[tags.ENV_PREFIX + fact]
        return False, f"node {node}: environment differs"
    if name.startswith(tags.ENV_PREFIX):
        return False, "environment differs"
    return False, "differs"


def _parse_lock(lines: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for raw in lines:
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if "==" in line:
            name, _, version = line.partition("==")
        elif " @ " in line:
            name, _, version = line.partition(" @ ")
        else:
            name, version = line, ""
        # PEP 503 normalisation so "Foo_Bar" and "foo-bar" are the same package.
        key = name.strip().lower().replace("_", "-").replace(".", "-")
        out[key] = version.strip()
    return out


def _lock_breaks(package: str) -> bool:
    return package in _BREAKING_PACKAGES or package.startswith(_BREAKING_PACKAGE_PREFIXES)


def _lock_delta(a: list[str], b: list[str], labels: tuple[str, str]) -> list[FactDelta]:
    if bool(a) != bool(b):
        # One run has no lock recorded: listing every package as "missing" would bury the
        # report, and says nothing about whether the packages actually differed.
        which = labels[0] if a else labels[1]
        return [FactDelta("lock", f"{len(a)} packages" if a else None, f"{len(b)} packages" if b else None,
                          False, f"package lock recorded in {the(which)} only")]
    pa, pb = _parse_lock(a), _parse_lock(b)
    out: list[FactDelta] = []
    for pkg in sorted(pa.keys() | pb.keys()):
        va, vb = pa.get(pkg), pb.get(pkg)
        if va == vb:
            continue
        if va is None:
            note = f"package only in {the(labels[1])}"
        elif vb is None:
            note = f"package only in {the(labels[0])}"
        else:
            note = "package version changed"
        breaks = _lock_breaks(pkg)
        if breaks:
            note += ": numerical kernels may differ"
        out.append(FactDelta(f"{LOCK_PREFIX}{pkg}", va, vb, breaks, note))
    return out


LOCK_PREFIX = "lock:"
_NAMED = 6  # packages named in a summary line; the rest counted


def summarized(delta: list[FactDelta], labels: tuple[str, str]) -> list[FactDelta]:
    """`delta` as a screen shows it: the packages installed on one side only (a test extra's 30-odd, say) as one
    line per side where the first of them stood, naming the first few; a package that decides kernels (torch,
    nvidia-*) keeps its own line."""
    one_side: tuple[list[FactDelta], list[FactDelta]] = ([], [])
    for d in delta:
        if d.name.startswith(LOCK_PREFIX) and not d.breaks_bitwise and (d.a is None) != (d.b is None):
            one_side[0 if d.b is None else 1].append(d)
    lines: dict[int, FactDelta] = {}  # id of the first package of a side -> its summary line
    for side, found in enumerate(one_side):
        if len(found) < 2:
            continue
        # A version that is a URL (`pkg @ https://...`) would fill the line: the name says enough.
        names = [d.name.removeprefix(LOCK_PREFIX) + ("" if "://" in (v := str(d.b if side else d.a)) else f" {v}")
                 for d in found]
        shown = ", ".join(names[:_NAMED]) + (f", +{len(names) - _NAMED} more" if len(names) > _NAMED else "")
        count = f"{len(found)} packages"
        lines[id(found[0])] = FactDelta("lock", None if side else count, count if side else None, False,
                                        f"only in {the(labels[side])}: {shown}")
    folded = {id(d) for found in one_side if len(found) >= 2 for d in found}
    return [lines.get(id(d), d) for d in delta if id(d) in lines or id(d) not in folded]


def environment_delta(a: RunRecord, b: RunRecord,
                      labels: tuple[str, str] = ("original", "replay")) -> list[FactDelta]:
    """Every provenance fact that differs (sorted by name), every setting the training code changed in either
    run, then every locked package and data file that differs. `labels` name the two runs in the notes: an original
    and its replay, or two independent runs."""
    fa = {k: v for k, v in a.facts.items() if _is_fact(k)}
    fb = {k: v for k, v in b.facts.items() if _is_fact(k)}
    out: list[FactDelta] = []
    for name in sorted(fa.keys() | fb.keys()):
        va, vb = fa.get(name), fb.get(name)
        if va == vb:
            continue
        if name.startswith(tags.NODE_PREFIX) and (va is None or vb is None) and not name.endswith(".hostname"):
            continue  # a node present in one run only is one line (its hostname), not one per fact
        if name == tags.FINGERPRINT_OF and (va is None or vb is None):
            continue  # one run has no final weights (stopped after --steps K, or failed): the verdict says so
        breaks, note = _classify(name, va, vb, fa, fb)
        out.append(FactDelta(name, va, vb, breaks, note))
    out.extend(_changes_delta(a.facts, b.facts))
    out.extend(_lock_delta(list(a.lock), list(b.lock), labels))
    out.extend(_data_delta(a.data, b.data))
    return out


def _data_delta(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None) -> list[FactDelta]:
    """One line per differing data file; what breaks bitwise is the entry's digest (harness.data.<name>)."""
    from harness.record import data

    if a is None and b is None:
        return []
    out: list[FactDelta] = []
    for change in data.diff(a, b):
        entry_a = ((a or {}).get("entries") or {}).get(change.name) or {}
        entry_b = ((b or {}).get("entries") or {}).get(change.name) or {}
        files_a = {f["path"]: f["sha256"] for f in entry_a.get("files", [])}
        files_b = {f["path"]: f["sha256"] for f in entry_b.get("files", [])}
        name = f"data:{change.name}" + (f"/{change.path}" if change.path else "")
        out.append(FactDelta(name, files_a.get(change.path), files_b.get(change.path), False, change.line()))
    return out
