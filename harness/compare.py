"""Judge a replay against its original run: environment delta, per-metric comparison, verdict."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from harness import tags
from harness.configdelta import ConfigChange, config_delta
from harness.errors import EXIT_FAILED, EXIT_OK
from harness.tracking import RunRecord

BITWISE = "BITWISE"
WITHIN_TOLERANCE = "WITHIN_TOLERANCE"
DIVERGED = "DIVERGED"
# Neither run logged a metric or a fingerprint: agreement would be vacuous, so it is not a pass.
NOTHING_TO_COMPARE = "NOTHING_TO_COMPARE"
VERDICTS = (BITWISE, WITHIN_TOLERANCE, DIVERGED, NOTHING_TO_COMPARE)

# Divergence kinds.
KIND_VALUE = "value"  # a metric left its tolerance at a step both runs logged
KIND_MISSING_STEP = "missing_step"  # the original logged the step, the replay did not
KIND_EXTRA_STEP = "extra_step"  # the replay logged a step the original did not
KIND_MISSING_METRIC = "missing_metric"  # the metric exists in the original only
KIND_EXTRA_METRIC = "extra_metric"  # the metric exists in the replay only
KIND_FINGERPRINT = "fingerprint"
KIND_REPLAY_FAILED = "replay_failed"

# Tags that describe the run's role or outcome rather than the conditions it ran under;
# they differ between an original and its replay by construction.
IGNORED_TAGS: frozenset[str] = frozenset(
    {
        tags.KIND,
        tags.REPLAY_OF,
        tags.VERDICT,
        tags.CHANGES,
        tags.DATA_CHANGES,
        # A replay runs in a detached worktree; the branch name decides nothing, the commit does.
        tags.GIT_BRANCH,
        tags.FINGERPRINT,
        tags.FAILED_RANK,
        tags.STATUS_REASON,
        # Liveness and training outcomes: they describe how the run went, not what it ran under.
        tags.HEARTBEAT,
        tags.HEARTBEAT_S,
        tags.STARTED,
        tags.WEIGHTS_CHANGED,
        tags.INITIAL_FINGERPRINT,
        # Which scheduler job and which rendezvous address: where it ran, never what decided it.
        tags.SLURM_JOB_ID,
        tags.MASTER,
        # Which store the record was imported from (harness import): provenance of the record, not of the run.
        tags.IMPORTED_FROM,
        # How the tracking store behaved while the run wrote to it.
        tags.STORE_WRITE_FAILURES,
        tags.STORE_METRICS_SPOOLED,
        tags.STORE_LONGEST_OUTAGE_S,
    }
)

# MLflow's SQL store writes +-inf as +-DBL_MAX; a record read back from its history cannot tell them apart.
_CLAMPED = np.finfo(np.float64).max

# Which fact changes make a bit-identical replay impossible.
# Rule: anything that changes which floating-point operations run, or in what order, breaks
# bitwise: the parallel layout (world size, backend, threads), the hardware (device, CPU and
# GPU model), the numerical libraries (torch, CUDA, cuDNN, NCCL, the image they ship in), the
# determinism switches, the seeds, and the few environment variables that select kernels or
# reduction algorithms. Where the run happened (hostname, OS, GPU driver) and the code
# identity (commit, patch) are reported but do not break bitwise on their own: identical code
# can sit behind different commits, and a real code change shows up in the metrics anyway.
_BREAKING_FACTS: dict[str, str] = {
    tags.WORLD_SIZE: "world size changed: DDP batch split and all-reduce order differ",
    tags.BACKEND: "backend changed: collectives reduce in a different order",
    tags.DEVICE: "device changed: different kernels run",
    tags.THREADS_PER_RANK: "threads per rank changed: intra-op reductions are split differently",
    tags.SEED: "seed changed: different random streams",
    tags.RANK_SEEDS: "rank seeds changed: different random streams",
    tags.ENV_PREFIX + "torch": "torch version changed: operator implementations may differ",
    tags.ENV_PREFIX + "cuda": "CUDA version changed: cuBLAS kernels may differ",
    tags.ENV_PREFIX + "cudnn": "cuDNN version changed: convolution algorithms may differ",
    tags.ENV_PREFIX + "nccl": "NCCL version changed: all-reduce algorithms may differ",
    tags.ENV_PREFIX + "gpu": "GPU model changed: different kernels and tensor-core paths",
    tags.ENV_PREFIX + "cpu": "CPU model changed: vector kernels may round differently",
}

_NOTES: dict[str, str] = {
    tags.VERSION: "harness version differs",
    tags.EXPERIMENT_PATH: "experiment folder differs",
    tags.ENTRY: "code differs",
    tags.GIT_COMMIT: "code differs",
    tags.GIT_DIRTY: "code differs",
    tags.GIT_PATCH_SHA256: "code differs",
    tags.GIT_BRANCH: "branch differs",
    tags.GIT_REPO_URL: "repository URL differs",
    tags.IMAGE_ID: "local image id differs (compare digests)",
    tags.IMAGE_DIGEST_REASON: "digest lookup differs",
    tags.IMAGE_RESOLVED_BY: "image found by its recorded id (loaded from a bundle, no registry digest here)",
    tags.EXECUTOR: "executor differs (see image and library versions)",
    tags.IN_IMAGE: "ran inside the pinned image in one run only",
    tags.NNODES: "number of nodes differs (same world size and backend: the arithmetic is the same)",
    tags.NPROC_PER_NODE: "ranks per node differ (same world size: the arithmetic is the same)",
    tags.LAUNCHER: "launched differently (mp.spawn, Slurm or torchrun): the ranks run the same code",
    tags.SLURM_NODELIST: "ran on other Slurm nodes",
    tags.NODES_DIFFER: "which nodes' environments differ from node 0's changed",
    tags.ENV_PREFIX + "hostname": "different host",
    tags.ENV_PREFIX + "os": "operating system differs",
    tags.ENV_PREFIX + "gpu_driver": "GPU driver differs (usually harmless)",
    tags.ENV_PREFIX + "python": "Python version differs",
}

# Environment variables that select kernels, thread counts or reduction algorithms. Others
# (NCCL_DEBUG, NCCL_SOCKET_IFNAME, ...) only change logging or transport.
_BREAKING_VARS: frozenset[str] = frozenset(
    {
        "NCCL_ALGO",
        "NCCL_PROTO",
        "NCCL_MIN_NCHANNELS",
        "NCCL_MAX_NCHANNELS",
        "NCCL_MIN_CTAS",
        "NCCL_MAX_CTAS",
        "NCCL_NTHREADS",
        "NCCL_TREE_THRESHOLD",
        "OMP_NUM_THREADS",
        "MKL_NUM_THREADS",
        "MKL_CBWR",
        "MKL_ENABLE_INSTRUCTIONS",
        "CUBLAS_WORKSPACE_CONFIG",
    }
)

# Packages whose version decides numerical kernels; other lock changes are reported only.
_BREAKING_PACKAGES: frozenset[str] = frozenset({"torch", "triton", "mkl", "intel-openmp"})
_BREAKING_PACKAGE_PREFIXES: tuple[str, ...] = ("nvidia-",)

_UNKNOWN_DIGEST = "unknown"


@dataclass
class FactDelta:
    """One fact (or locked package, named `lock:<package>`) that differs between two runs."""

    name: str
    a: str | None
    b: str | None
    breaks_bitwise: bool
    note: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "a": self.a,
            "b": self.b,
            "breaks_bitwise": self.breaks_bitwise,
            "note": self.note,
        }


@dataclass
class Divergence:
    """Where the replay first left the original."""

    kind: str
    step: int | None
    metric: str | None = None
    original: float | None = None
    replay: float | None = None
    abs_diff: float | None = None
    rel_diff: float | None = None
    detail: str = ""

    def describe(self, labels: tuple[str, str] = ("original", "replay")) -> str:
        """One human line, without the verdict; `labels` name the two runs (run A / run B for a plain compare)."""
        a, b = labels
        where = f"step {self.step}" if self.step is not None else "the end"
        if self.kind == KIND_VALUE:
            return (
                f"at {where}: {self.metric} {fmt_pair(self.original, self.replay)} "
                f"(abs {fmt_short(self.abs_diff)}, rel {fmt_short(self.rel_diff)})"
            )
        if self.kind == KIND_MISSING_STEP:
            return f"at {where}: {self.metric} logged by {_the(a)} but not by {_the(b)}"
        if self.kind == KIND_EXTRA_STEP:
            return f"at {where}: {self.metric} logged by {_the(b)} but not by {_the(a)}"
        if self.kind == KIND_MISSING_METRIC:
            return f"at {where}: metric {self.metric} missing from {_the(b)}"
        if self.kind == KIND_EXTRA_METRIC:
            return f"at {where}: metric {self.metric} appears only in {_the(b)}"
        if self.kind == KIND_FINGERPRINT:
            return f"at {where}: parameter fingerprints differ ({self.detail})"
        if self.kind == KIND_REPLAY_FAILED:
            return self.detail
        return f"at {where}: {self.detail}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "step": self.step,
            "metric": self.metric,
            "original": _json_float(self.original),
            "replay": _json_float(self.replay),
            "abs_diff": _json_float(self.abs_diff),
            "rel_diff": _json_float(self.rel_diff),
            "detail": self.detail,
        }


@dataclass
class MetricStats:
    """How one metric compares across the two runs."""

    name: str
    steps_compared: int  # steps logged by both runs
    max_abs_diff: float  # nan when no step is shared, or some step has NaN on one side only
    max_rel_diff: float
    first_divergence: int | None
    first_divergence_kind: str | None
    bitwise_equal: bool
    rtol: float
    atol: float
    missing_steps: int = 0  # in the original only
    extra_steps: int = 0  # in the replay only
    in_original: bool = True
    in_replay: bool = True

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "steps_compared": self.steps_compared,
            "max_abs_diff": _json_float(self.max_abs_diff),
            "max_rel_diff": _json_float(self.max_rel_diff),
            "first_divergence": self.first_divergence,
            "first_divergence_kind": self.first_divergence_kind,
            "bitwise_equal": self.bitwise_equal,
            "rtol": _json_float(self.rtol),
            "atol": _json_float(self.atol),
            "missing_steps": self.missing_steps,
            "extra_steps": self.extra_steps,
            "in_original": self.in_original,
            "in_replay": self.in_replay,
        }


@dataclass
class FingerprintStats:
    """Parameter fingerprints over the union of fingerprinted steps, plus the final one."""

    compared: int = 0
    equal: int = 0
    first_mismatch_step: int | None = None
    final_equal: bool | None = None  # None when neither run has a final fingerprint

    @property
    def all_equal(self) -> bool:
        return self.compared == self.equal

    def to_dict(self) -> dict[str, Any]:
        return {
            "compared": self.compared,
            "equal": self.equal,
            "first_mismatch_step": self.first_mismatch_step,
            "final_equal": self.final_equal,
        }


@dataclass
class Comparison:
    """The verdict on a replay and the evidence behind it."""

    verdict: str
    original_id: str
    replay_id: str
    delta: list[FactDelta]
    bitwise_possible: bool
    bitwise_blockers: list[str]
    metrics: list[MetricStats]
    fingerprints: FingerprintStats
    divergence: Divergence | None
    tolerance: dict[str, Any] = field(default_factory=dict)
    config_delta: list[ConfigChange] = field(default_factory=list)
    of_replay: bool = True  # run B is a replay of run A (else two independent runs)
    unchanged_weights: list[str] = field(default_factory=list)  # labels of runs that trained nothing
    reached: tuple[str, int] | None = None  # (status, steps) of an incomplete original judged up to where it stopped
    failed_alike: bool = False  # the replay of an incomplete original failed with the original's own reason
    notes: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return EXIT_FAILED if self.verdict in (DIVERGED, NOTHING_TO_COMPARE) else EXIT_OK

    @property
    def labels(self) -> tuple[str, str]:
        return ("original", "replay") if self.of_replay else ("run A", "run B")

    def summary(self) -> str:
        """The verdict in one line, with what limits it (an incomplete original, weights that never changed)."""
        line = self._verdict_line()
        if self.reached is not None:
            status, steps = self.reached
            alike = "; the replay failed the same way" if self.failed_alike else ""
            line += f" (compared the {steps} steps the {status} original reached{alike})"
        if len(self.unchanged_weights) == 2:
            line += " - but the model's weights never changed: nothing was trained"
        elif self.unchanged_weights:
            line += f" - but {_the(self.unchanged_weights[0])}'s model weights never changed: nothing was trained in it"
        return line

    def _verdict_line(self) -> str:
        if self.verdict == NOTHING_TO_COMPARE:
            return (f"{NOTHING_TO_COMPARE}: there was nothing to compare (no metrics, no fingerprints): "
                    "log metrics with ctx.log and register the model with ctx.ddp")
        if self.verdict == DIVERGED and self.divergence is not None:
            if self.divergence.kind == KIND_REPLAY_FAILED:
                return f"{DIVERGED}: {self.divergence.describe(self.labels)}"
            return f"{DIVERGED} {self.divergence.describe(self.labels)}"
        shape = _shape(self.metrics)
        fps = self.fingerprints
        if self.verdict == BITWISE:
            return f"{BITWISE}: {shape} bit-identical, {fps.compared} fingerprint{'' if fps.compared == 1 else 's'} equal"
        if all(m.bitwise_equal for m in self.metrics):
            body = f"{shape} bit-identical"
        else:
            worst = max(self.metrics, key=lambda m: _sort_key(m.max_abs_diff))
            body = f"{shape} within tolerance, max abs diff {fmt_short(worst.max_abs_diff)} ({worst.name})"
        line = f"{self.verdict}: {body}, {fps.equal}/{fps.compared} fingerprints equal"
        if not self.bitwise_possible:
            n = len(self.bitwise_blockers)
            line += f"; bitwise impossible ({n} environment change{'s' if n != 1 else ''})"
        return line

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable; inf and nan become the strings "inf", "-inf" and "nan"."""
        return {
            "verdict": self.verdict,
            "summary": self.summary(),
            "exit_code": self.exit_code,
            "original_id": self.original_id,
            "replay_id": self.replay_id,
            "bitwise_possible": self.bitwise_possible,
            "bitwise_blockers": list(self.bitwise_blockers),
            "delta": [d.to_dict() for d in self.delta],
            "metrics": [m.to_dict() for m in self.metrics],
            "fingerprints": self.fingerprints.to_dict(),
            "divergence": self.divergence.to_dict() if self.divergence else None,
            "tolerance": _json_tree(self.tolerance),
            "config_delta": [c.to_dict() for c in self.config_delta],
            "failed_alike": self.failed_alike,
            "of_replay": self.of_replay,
            "weights_unchanged_in": list(self.unchanged_weights),
            "reached": None if self.reached is None else {"status": self.reached[0], "steps": self.reached[1]},
            "notes": list(self.notes),
        }


# ---------------------------------------------------------------------------------------------
# Environment delta


def _is_fact(name: str) -> bool:
    return name.startswith(tags.PREFIX) and name not in IGNORED_TAGS


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
    if name.startswith(tags.DETERMINISM_PREFIX):
        setting = name[len(tags.DETERMINISM_PREFIX):]
        return True, f"determinism setting '{setting}' changed: different kernels may be chosen"
    if name == tags.IMAGE_DIGEST:
        # An unknown digest proves nothing either way; only two known, different digests do.
        if a in (None, _UNKNOWN_DIGEST) or b in (None, _UNKNOWN_DIGEST):
            return False, "image digest unknown in one run: cannot prove the same image"
        return True, "image digest changed: different libraries in the image"
    if name == tags.IMAGE:
        da, db = facts_a.get(tags.IMAGE_DIGEST), facts_b.get(tags.IMAGE_DIGEST)
        if da in (None, _UNKNOWN_DIGEST) and db in (None, _UNKNOWN_DIGEST):
            # Without digests the reference is the only evidence of which image ran.
            return True, "image changed and no digest proves it is the same"
        return False, "image reference differs (digests decide)"
    if name.startswith(tags.DATA_PREFIX):
        # Other bytes in, other numbers out: data is an input like the seed (its files: the data: lines).
        return True, f"data '{name[len(tags.DATA_PREFIX):]}' changed: the training read other bytes"
    if name.startswith(tags.VAR_PREFIX):
        var = name[len(tags.VAR_PREFIX):]
        if var in _BREAKING_VARS:
            return True, f"{var} changed: selects kernels, threads or reduction algorithm"
        return False, "environment variable differs"
    if name in _NOTES:
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


def _lock_delta(a: list[str], b: list[str]) -> list[FactDelta]:
    if bool(a) != bool(b):
        # One run has no lock recorded: listing every package as "missing" would bury the
        # report, and says nothing about whether the packages actually differed.
        which = "original" if a else "replay"
        return [FactDelta("lock", f"{len(a)} packages" if a else None, f"{len(b)} packages" if b else None,
                          False, f"package lock recorded in the {which} only")]
    pa, pb = _parse_lock(a), _parse_lock(b)
    out: list[FactDelta] = []
    for pkg in sorted(pa.keys() | pb.keys()):
        va, vb = pa.get(pkg), pb.get(pkg)
        if va == vb:
            continue
        if va is None:
            note = "package only in the replay"
        elif vb is None:
            note = "package only in the original"
        else:
            note = "package version changed"
        breaks = _lock_breaks(pkg)
        if breaks:
            note += ": numerical kernels may differ"
        out.append(FactDelta(f"lock:{pkg}", va, vb, breaks, note))
    return out


def environment_delta(a: RunRecord, b: RunRecord) -> list[FactDelta]:
    """Every provenance fact that differs (sorted by name), then every locked package that differs."""
    fa = {k: v for k, v in a.facts.items() if _is_fact(k)}
    fb = {k: v for k, v in b.facts.items() if _is_fact(k)}
    out: list[FactDelta] = []
    for name in sorted(fa.keys() | fb.keys()):
        va, vb = fa.get(name), fb.get(name)
        if va == vb:
            continue
        if name.startswith(tags.NODE_PREFIX) and (va is None or vb is None) and not name.endswith(".hostname"):
            continue  # a node present in one run only is one line (its hostname), not one per fact
        breaks, note = _classify(name, va, vb, fa, fb)
        out.append(FactDelta(name, va, vb, breaks, note))
    out.extend(_lock_delta(list(a.lock), list(b.lock)))
    out.extend(_data_delta(a.data, b.data))
    return out


def _data_delta(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None) -> list[FactDelta]:
    """One line per differing data file; what breaks bitwise is the entry's digest (harness.data.<name>)."""
    from harness import data

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


# ---------------------------------------------------------------------------------------------
# Metrics


def default_tolerance(config: Mapping[str, Any] | None) -> dict[str, Any]:
    """config["replay"]["tolerance"], or zero tolerance when the config has none."""
    tol = ((config or {}).get("replay") or {}).get("tolerance")
    if not tol:
        return {"default": {"rtol": 0.0, "atol": 0.0}, "metrics": {}}
    return {"default": dict(tol.get("default") or {}), "metrics": {k: dict(v) for k, v in (tol.get("metrics") or {}).items()}}


def _tol_pair(entry: Mapping[str, Any] | None, where: str) -> tuple[float, float]:
    entry = entry or {}
    rtol, atol = float(entry.get("rtol", 0.0)), float(entry.get("atol", 0.0))
    if not (rtol >= 0 and atol >= 0):  # also rejects NaN
        raise ValueError(f"tolerance {where}: rtol and atol must be >= 0, got rtol={rtol}, atol={atol}")
    return rtol, atol


def _tolerance_for(tolerance: Mapping[str, Any], metric: str) -> tuple[float, float]:
    per_metric = tolerance.get("metrics") or {}
    if metric in per_metric:
        return _tol_pair(per_metric[metric], f"'{metric}'")
    return _tol_pair(tolerance.get("default"), "default")


def _zero_everywhere(tolerance: Mapping[str, Any]) -> bool:
    entries = [("default", tolerance.get("default"))] + [(f"'{k}'", v) for k, v in (tolerance.get("metrics") or {}).items()]
    return all(_tol_pair(v, where) == (0.0, 0.0) for where, v in entries)


def as_series(steps: Any, values: Any) -> tuple[np.ndarray, np.ndarray]:
    """Steps int64 strictly ascending with float64 values; a step logged twice keeps its last value."""
    s = np.asarray(steps, dtype=np.int64).ravel()
    v = np.ascontiguousarray(values, dtype=np.float64).ravel()
    if s.shape != v.shape:
        raise ValueError(f"steps and values differ in length ({s.size} vs {v.size})")
    if s.size > 1 and not bool(np.all(s[1:] > s[:-1])):
        order = np.argsort(s, kind="stable")
        s, v = s[order], v[order]
        last = np.append(s[1:] != s[:-1], True)
        s, v = s[last], v[last]
    return s, v


def _metric_only_in_one(name: str, steps: np.ndarray, values: np.ndarray, in_original: bool,
                        rtol: float, atol: float) -> tuple[MetricStats, Divergence]:
    kind = KIND_MISSING_METRIC if in_original else KIND_EXTRA_METRIC
    step = int(steps[0])
    value = float(values[0])
    div = Divergence(kind, step, name, value if in_original else None, None if in_original else value)
    stats = MetricStats(
        name=name, steps_compared=0, max_abs_diff=math.nan, max_rel_diff=math.nan,
        first_divergence=step, first_divergence_kind=kind, bitwise_equal=False, rtol=rtol, atol=atol,
        missing_steps=int(steps.size) if in_original else 0, extra_steps=0 if in_original else int(steps.size),
        in_original=in_original, in_replay=not in_original,
    )
    return stats, div


def _compare_metric(name: str, sa: np.ndarray, va: np.ndarray, sb: np.ndarray, vb: np.ndarray,
                    rtol: float, atol: float, clamped: tuple[bool, bool] = (False, False)) -> tuple[MetricStats, Divergence | None]:
    if sa.size == sb.size and np.array_equal(sa, sb):
        # The usual case: both runs logged the same steps, so no set operations are needed.
        common, a, b = sa, va, vb
        only_a = only_b = np.empty(0, dtype=np.int64)
    else:
        common, ia, ib = np.intersect1d(sa, sb, assume_unique=True, return_indices=True)
        a, b = va[ia], vb[ib]
        only_a = np.setdiff1d(sa, sb, assume_unique=True)
        only_b = np.setdiff1d(sb, sa, assume_unique=True)

    # NaN on both sides is equal whatever its payload bits: the payload says nothing about the
    # arithmetic. x86 returns a negative "default NaN" for an invalid operation, ARM a positive one,
    # and which operand's payload survives NaN + NaN depends on an operand order that compilers
    # may swap for a commutative op without changing any other result.
    bit_equal = (a.view(np.int64) == b.view(np.int64)) | (np.isnan(a) & np.isnan(b))
    for values, read_back_clamped in ((a, clamped[0]), (b, clamped[1])):
        if read_back_clamped:
            # +-DBL_MAX read from MLflow's history may have been +-inf: equal, but not provably bit-identical.
            bit_equal &= np.abs(values) != _CLAMPED
    # Equal values (including inf == inf and -0.0 == 0.0) and NaN on both sides are always
    # within tolerance; the subtraction below would turn them into NaN.
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        diff = np.abs(b - a)
        diff[same] = 0.0
        abs_a = np.abs(a)
        # isfinite: an infinite difference must never pass, even where rtol * |inf| is inf.
        ok = same | (np.isfinite(diff) & (diff <= atol + rtol * abs_a))
        rel = diff / abs_a
        rel[diff == 0.0] = 0.0

    n = int(common.size)
    max_abs = float(np.max(diff)) if n else math.nan
    max_rel = float(np.max(rel)) if n else math.nan

    candidates: list[tuple[int, Divergence]] = []
    bad = ~ok
    if n and bool(bad.any()):
        i = int(np.argmax(bad))
        candidates.append((int(common[i]), Divergence(
            KIND_VALUE, int(common[i]), name, float(a[i]), float(b[i]), float(diff[i]), float(rel[i]))))
    if only_a.size:
        step = int(only_a[0])
        value = float(va[np.searchsorted(sa, step)])
        candidates.append((step, Divergence(KIND_MISSING_STEP, step, name, value, None)))
    if only_b.size:
        step = int(only_b[0])
        value = float(vb[np.searchsorted(sb, step)])
        candidates.append((step, Divergence(KIND_EXTRA_STEP, step, name, None, value)))
    first = min(candidates, key=lambda c: c[0])[1] if candidates else None

    stats = MetricStats(
        name=name,
        steps_compared=n,
        max_abs_diff=max_abs,
        max_rel_diff=max_rel,
        first_divergence=first.step if first else None,
        first_divergence_kind=first.kind if first else None,
        bitwise_equal=bool(only_a.size == 0 and only_b.size == 0 and bit_equal.all()),
        rtol=rtol,
        atol=atol,
        missing_steps=int(only_a.size),
        extra_steps=int(only_b.size),
    )
    return stats, first


def _compare_fingerprints(original: RunRecord, replay: RunRecord, incomplete: bool = False) -> FingerprintStats:
    fa, fb = original.fingerprints, replay.fingerprints
    if incomplete:
        # Only the steps the original reached; it has no final fingerprint to hold the replay to.
        last = max(fa, default=-1)
        fb = {k: v for k, v in fb.items() if k <= last}
    stats = FingerprintStats()
    for step in sorted(fa.keys() | fb.keys()):
        stats.compared += 1
        # A step fingerprinted by one run only is a mismatch: it cannot be shown equal.
        if fa.get(step) is not None and fa.get(step) == fb.get(step):
            stats.equal += 1
        elif stats.first_mismatch_step is None:
            stats.first_mismatch_step = int(step)
    if not incomplete and (original.final_fingerprint is not None or replay.final_fingerprint is not None):
        stats.compared += 1
        stats.final_equal = original.final_fingerprint == replay.final_fingerprint
        stats.equal += int(stats.final_equal)
    return stats


def compare_runs(
    original: RunRecord,
    replay: RunRecord,
    tolerance: dict | None = None,
    replay_failed: str | None = None,
    incomplete_original: bool = False,
) -> Comparison:
    """Compare a replay with its original and give the verdict (one of VERDICTS).

    With `incomplete_original` (a FAILED or KILLED original), only the steps the original reached
    are judged, and its missing final fingerprint is no divergence.
    """
    tol = default_tolerance(original.config) if tolerance is None else tolerance
    delta = environment_delta(original, replay)
    blockers = [f"{d.name}: {d.note}" for d in delta if d.breaks_bitwise]
    of_replay = replay.facts.get(tags.REPLAY_OF) == original.run_id
    labels = ("original", "replay") if of_replay else ("run A", "run B")
    notes = [
        f"metrics of {_the(label)} {rec.run_id} were read from MLflow's metric history ({tags.ARTIFACT_SERIES} is missing), "
        "which stores +-inf as +-1.8e308: such values are not counted as bit-identical"
        for label, rec in zip(labels, (original, replay)) if not rec.metrics_exact
    ]
    if bool(original.config) != bool(replay.config):
        notes.append(f"config recorded in {_the(labels[0] if original.config else labels[1])} only: no config delta")

    orig_metrics = {k: as_series(*v) for k, v in original.metrics.items()}
    rep_metrics = {k: as_series(*v) for k, v in replay.metrics.items()}
    # A key with no logged values carries no evidence; treat it as absent.
    orig_metrics = {k: v for k, v in orig_metrics.items() if v[0].size}
    rep_metrics = {k: v for k, v in rep_metrics.items() if v[0].size}
    reached = None
    if incomplete_original:
        last = max((int(s[-1]) for s, _ in orig_metrics.values()), default=-1)
        rep_metrics = {k: (s[s <= last], v[s <= last]) for k, (s, v) in rep_metrics.items() if s[0] <= last}
        steps = np.unique(np.concatenate([s for s, _ in orig_metrics.values()])) if orig_metrics else []
        reached = (original.status, len(steps))
    clamped = (not original.metrics_exact, not replay.metrics_exact)

    stats: list[MetricStats] = []
    firsts: list[Divergence] = []
    for name in sorted(orig_metrics.keys() | rep_metrics.keys()):
        rtol, atol = _tolerance_for(tol, name)
        if name not in rep_metrics:
            st, div = _metric_only_in_one(name, *orig_metrics[name], True, rtol, atol)
        elif name not in orig_metrics:
            st, div = _metric_only_in_one(name, *rep_metrics[name], False, rtol, atol)
        else:
            st, div = _compare_metric(name, *orig_metrics[name], *rep_metrics[name], rtol, atol, clamped)
        stats.append(st)
        if div is not None:
            firsts.append(div)

    # Smallest step wins, ties by metric name (stats are already in name order).
    metric_div = min(firsts, key=lambda d: (d.step, d.metric or "")) if firsts else None
    fps = _compare_fingerprints(original, replay, incomplete_original)

    failure = replay_failed
    if failure is None and replay.status != tags.FINISHED:
        reason = replay.facts.get(tags.STATUS_REASON)
        failure = f"{labels[1]} status {replay.status}" + (f" ({reason})" if reason else "")
    failed_alike = bool(
        incomplete_original and failure is not None and replay.status == original.status
        and replay.facts.get(tags.STATUS_REASON) is not None
        and replay.facts.get(tags.STATUS_REASON) == original.facts.get(tags.STATUS_REASON)
    )
    if failed_alike:
        # A deterministic failure that recurs at the same point, for the same reason, is reproduced too.
        notes.append(f"{_the(labels[1])} failed as {_the(labels[0])} did: {replay.facts[tags.STATUS_REASON]}")
        failure = None

    divergence: Divergence | None
    if failure is not None:
        detail = f"{labels[1]} failed: {failure}"
        if metric_div is not None:
            detail += f"; first metric difference {metric_div.describe(labels)}"
            divergence = Divergence(KIND_REPLAY_FAILED, metric_div.step, metric_div.metric, metric_div.original,
                                    metric_div.replay, metric_div.abs_diff, metric_div.rel_diff, detail)
        else:
            divergence = Divergence(KIND_REPLAY_FAILED, None, detail=detail)
        verdict = DIVERGED
    elif not stats and fps.compared == 0:
        divergence, verdict = None, NOTHING_TO_COMPARE
    elif metric_div is not None:
        divergence, verdict = metric_div, DIVERGED
    elif not fps.all_equal and _zero_everywhere(tol):
        # Zero tolerance asks for exactness, so the parameters themselves must match too.
        if fps.first_mismatch_step is not None:
            step = fps.first_mismatch_step
            detail = f"{original.fingerprints.get(step, 'none')[:12]} vs {replay.fingerprints.get(step, 'none')[:12]}"
        else:
            step = None
            detail = f"final {(original.final_fingerprint or 'none')[:12]} vs {(replay.final_fingerprint or 'none')[:12]}"
        divergence, verdict = Divergence(KIND_FINGERPRINT, step, detail=detail), DIVERGED
    else:
        divergence = None
        exact = all(s.bitwise_equal for s in stats) and fps.all_equal
        verdict = BITWISE if exact and not blockers else WITHIN_TOLERANCE

    return Comparison(
        verdict=verdict,
        original_id=original.run_id,
        replay_id=replay.run_id,
        delta=delta,
        bitwise_possible=not blockers,
        bitwise_blockers=blockers,
        metrics=stats,
        fingerprints=fps,
        divergence=divergence,
        tolerance=tol,
        config_delta=config_delta(original.config, replay.config, original.facts, replay.facts),
        of_replay=of_replay,
        unchanged_weights=[label for label, rec in zip(labels, (original, replay))
                           if rec.facts.get(tags.WEIGHTS_CHANGED) == "false"],
        reached=reached,
        notes=notes,
        failed_alike=failed_alike,
    )


# ---------------------------------------------------------------------------------------------
# Formatting and normalising helpers, shared with harness.report


def fmt_value(x: float | None) -> str:
    """Shortest repr that round-trips, so a 1-ulp difference stays visible."""
    if x is None:
        return "none"
    return repr(float(x))


def fmt_pair(a: float | None, b: float | None) -> str:
    """"a vs b" with just enough digits to tell the two apart (full precision for a 1-ulp gap)."""
    if a is None or b is None or math.isnan(a) or math.isnan(b):
        return f"{fmt_value(a)} vs {fmt_value(b)}"
    for digits in range(3, 18):
        sa, sb = f"{a:.{digits}g}", f"{b:.{digits}g}"
        if sa != sb:
            return f"{sa} vs {sb}"
    return f"{fmt_value(a)} vs {fmt_value(b)}"


def fmt_short(x: float | None) -> str:
    if x is None:
        return "n/a"
    if math.isnan(x) or math.isinf(x):
        return str(x)
    return f"{x:.3g}"


def _the(label: str) -> str:
    """ "the original", "the replay", but "run A", "run B"."""
    return label if label.startswith("run ") else f"the {label}"


def _sort_key(x: float) -> float:
    # nan marks "NaN on one side only", which is worse than any finite difference.
    return math.inf if math.isnan(x) else x


def _shape(metrics: list[MetricStats]) -> str:
    counts = {m.steps_compared for m in metrics}
    noun = "metric" if len(metrics) == 1 else "metrics"
    if len(counts) <= 1:
        steps = counts.pop() if counts else 0
        return f"{len(metrics)} {noun} x {steps} steps"
    return f"{len(metrics)} {noun} ({sum(m.steps_compared for m in metrics)} values)"


def _json_float(x: float | None) -> float | str | None:
    if x is None:
        return None
    x = float(x)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


def _json_tree(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {str(k): _json_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_tree(v) for v in obj]
    if isinstance(obj, float):
        return _json_float(obj)
    return obj
