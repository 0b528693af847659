"""What a run's end leaves in its record: fingerprints and final metrics, performance, the optimizer and scheduler
tags, the determinism changes - written once the ranks are done (harness/record/recorder.py feeds it)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from harness import tags as T
from harness.judge.weightdistance import Sketch
from harness.messages import (
    Optimization,
    Performance,
    SettingChange,
)
from harness.runtime import userseed
from harness.secrets import scrub_known
from harness.store.outages import Patient
from harness.store.tracking import Tracker


def record_results(
    tracker: Tracker | Patient, run_id: str, fingerprints: dict[int, str], final: dict[str, Any], work: Path, logs: str,
    hidden: set[str] | None = None,
) -> None:
    """The end-of-run tags and artifacts: determinism in force and its changes, fingerprints, notices, seeds,
    checkpoint fingerprints, the metric series, the rank logs (under `logs`, the `hidden` secret values and every
    token scrubbed out) and the ranks' outputs."""
    tags: dict[str, str] = {}
    if "determinism" in final:
        tags.update({T.DETERMINISM_PREFIX + k: v for k, v in final["determinism"].items()})
        tags.update({T.VAR_PREFIX + k: v for k, v in final["vars"].items()})
        tags.update(final.get("rank_facts", {}))
        changes = final.get("determinism_changes", [])
        tags[T.DETERMINISM_CHANGES] = changes_tag(changes)
        doc = {"start": final.get("determinism_start", {}), "in_force": final["determinism"],
               "changes": [asdict(c) for c in changes]}
        tracker.log_text(run_id, json.dumps(doc, indent=1), T.ARTIFACT_DETERMINISM)
    if final.get("fingerprint"):
        tags[T.FINGERPRINT] = final["fingerprint"]
    if final.get("data_order"):
        tags[T.DATA_ORDER_STEPS] = str(len(final["data_order"]))
    if final.get("of"):
        tags[T.FINGERPRINT_OF] = final["of"]
    if final.get("notices"):
        tags[T.NOTICES] = "\n".join(final["notices"].values())[:4900]
    if final.get("loop"):
        tags[T.LOOP] = final["loop"]
    if final.get("evaluation"):
        tags[T.EVALUATION_METRICS] = json.dumps(final["evaluation"], sort_keys=True)
    if final.get("user_seeds"):
        tags[T.USER_SEEDS] = userseed.describe(final["user_seeds"])
    if final.get("optimization") is not None:
        tags.update(optimization_tags(final["optimization"]))
        tracker.log_text(run_id, json.dumps(asdict(final["optimization"]), indent=1), T.ARTIFACT_OPTIMIZATION)
    tracker.set_tags(run_id, tags)
    if final.get("sketch") is not None:
        tracker.log_bytes(run_id, Sketch.of(final["sketch"]).dump(), T.ARTIFACT_WEIGHTS_SKETCH)
    if fingerprints or final.get("fingerprint") or final["checkpoints"]:
        doc = {
            "steps": {str(k): v for k, v in sorted(fingerprints.items())},
            "final": final.get("fingerprint"),
            "steps_total": final.get("steps_total"),
            "checkpoints": {str(k): v for k, v in sorted(final["checkpoints"].items())},
        }
        tracker.log_text(run_id, json.dumps(doc, indent=2), T.ARTIFACT_FINGERPRINTS)
    if final.get("checkpoint_tensors"):
        tracker.log_text(run_id, checkpoint_fingerprints_json(final["checkpoint_tensors"]),
                         T.ARTIFACT_CHECKPOINT_FINGERPRINTS)
    if final.get("data_order"):
        order = sorted(final["data_order"].items())
        tracker.log_text(run_id, json.dumps({"steps": [k for k, _ in order], "digests": [v for _, v in order]}),
                         T.ARTIFACT_DATA_ORDER)
    if (work / "series.npz").exists():
        tracker.log_file(run_id, work / "series.npz", str(Path(T.ARTIFACT_SERIES).parent))
    logs_dir = work / "logs"
    if logs_dir.is_dir() and any(logs_dir.iterdir()):
        scrub_logs(logs_dir, hidden or set())
        tracker.log_dir(run_id, logs_dir, logs)
    outputs = work / "outputs"
    if outputs.is_dir() and any(outputs.iterdir()):
        tracker.log_dir(run_id, outputs, T.ARTIFACT_OUTPUTS_DIR)


def scrub_logs(folder: Path, hidden: set[str]) -> None:
    """The rank logs under `folder` rewritten in place without the `hidden` values and the tokens scrub() finds:
    the training code may print them (print(dict(ctx.cfg)), os.environ), and the logs are stored and exported."""
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and not p.is_symlink()):
        raw = path.read_bytes()
        text = raw.decode("utf-8", errors="surrogateescape")  # bytes that are no UTF-8 come back as they were
        clean = scrub_known(text, hidden).encode("utf-8", errors="surrogateescape")
        if clean != raw:
            path.write_bytes(clean)


def record_performance(tracker: Tracker | Patient, run_id: str, performance: Performance | None, work: Path) -> None:
    """The step times as metrics (tags.PERF_PREFIX: the MLflow UI draws their curves; never judged, see
    rundata.wall_clock), their statistics and the profiled steps' summary as tags, the profile files as artifacts."""
    import time

    from harness.runtime.perf import summary

    profile_dir = work / T.ARTIFACT_PROFILE_DIR
    if profile_dir.is_dir():
        for stray in profile_dir.glob("*.tmp"):  # a file a rank was writing when it stopped: never half a file
            stray.unlink()
        if any(profile_dir.iterdir()):
            tracker.log_dir(run_id, profile_dir, T.ARTIFACT_PROFILE_DIR)
    if performance is None:
        return
    p = performance
    now = int(time.time() * 1000)
    entries = [(T.METRIC_STEP_S, s, now, k) for k, s in zip(p.steps, p.seconds)]
    entries += [(T.METRIC_STEP_S_MAX, s, now, k) for k, s in zip(p.steps, p.slowest)]
    entries += [(T.METRIC_LOADER_WAIT, w / s if s > 0 else 0.0, now, k) for k, s, w in zip(p.steps, p.seconds, p.waits)]
    entries += [(T.METRIC_SAMPLES_PER_S, n / s, now, k) for k, s, n in zip(p.steps, p.slowest, p.samples) if n and s > 0]
    if entries:
        tracker.log_metric_entries(run_id, entries)
    stats = summary(list(p.steps), list(p.seconds), list(p.slowest), list(p.waits), list(p.samples))
    names = {"step_median_s": T.PERF_STEP_MEDIAN_S, "step_max_median_s": T.PERF_STEP_MAX_MEDIAN_S,
             "loader_wait_share": T.PERF_LOADER_WAIT, "samples_per_s_median": T.PERF_SAMPLES_PER_S,
             "samples_per_step": T.PERF_SAMPLES_PER_STEP, "steps": T.PERF_STEPS}
    tags = {names[k]: f"{v:.6g}" for k, v in stats.items()}
    if p.profiled:
        first = p.profiled[0]
        tags.update({
            T.PROFILE_STEPS: ",".join(str(s) for s in sorted({q["step"] for q in p.profiled})),
            T.PROFILE_RANKS: ",".join(str(r) for r in sorted({q["rank"] for q in p.profiled})),
            T.PROFILE_STEP_S: f"{first['step_s']:.6g}",
            T.PROFILE_COMM_SHARE: f"{first['comm_share']:.4f}",
            T.PROFILE_PEAK_MEMORY_MB: f"{first['peak_memory_mb']:.1f}",
            T.PROFILE_PEAK_MEMORY_OF: first["peak_memory_of"],
        })
    if tags:
        tracker.set_tags(run_id, tags)


_TAG_CHARS = 4900  # MLflow keeps 5,000 characters of a tag value on older stores; the artifact holds the rest


def optimization_tags(opt: Optimization) -> dict[str, str]:
    """The tags of what trained the model: optimizer, its settings, LR schedulers, GradScaler, autocast."""
    def call(part: dict[str, Any]) -> str:
        return f"{part['class']}({settings_line(part['settings'])})"

    optimizer = opt.optimizer
    if optimizer is None:
        tags = {T.OPTIMIZER: "none"}
    else:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer["groups"]]
        if len(groups) > 1 and any(g != groups[0] for g in groups):
            settings = "; ".join(f"group {i}: {settings_line(g)}" for i, g in enumerate(groups))
        else:
            settings = settings_line(groups[0] if groups else {}) + (f" ({len(groups)} groups)" if len(groups) > 1 else "")
        tags = {T.OPTIMIZER: optimizer["class"], T.OPTIMIZER_SETTINGS: settings}
    scaler = opt.grad_scaler
    tags.update({
        T.LR_SCHEDULER: "; ".join(call(s) for s in opt.schedulers) or "none",
        T.GRAD_SCALER: "none" if scaler is None else call(scaler) if scaler["settings"].get("enabled") else "disabled",
        T.AUTOCAST: ", ".join(f"{a['device_type']} {a['dtype']} from step {a['first_step']}" for a in opt.autocast) or "none",
    })
    return {k: v if len(v) <= _TAG_CHARS else v[:_TAG_CHARS - 3] + "..." for k, v in tags.items()}


def settings_line(settings: dict[str, Any]) -> str:
    """"lr=0.1, momentum=0.9, betas=[0.9, 0.999]": a set-up's plain values, in their order."""
    return ", ".join(f"{k}={v!r}" for k, v in settings.items())


_CHANGES_SHOWN = 40  # lines in the changes tag (MLflow keeps 8,000 characters); the artifact holds them all


def changes_tag(changes: list[SettingChange]) -> str:
    """The harness.determinism.changes tag: one line per change, "none" when the training code changed nothing."""
    if not changes:
        return "none"
    lines = [c.line() for c in changes[:_CHANGES_SHOWN]]
    if len(changes) > _CHANGES_SHOWN:
        lines.append(f"... {len(changes) - _CHANGES_SHOWN} more in {T.ARTIFACT_DETERMINISM}")
    return "\n".join(lines)


def checkpoint_fingerprints_json(steps: dict[int, dict[str, Any]]) -> str:
    """The per-tensor checkpoint fingerprints artifact: step -> {"tensors": name -> sha256, "ranks": [sha256]}."""
    from harness.runtime.checkpoint import FINGERPRINT_FORMAT

    doc = {"format": FINGERPRINT_FORMAT, "steps": {str(k): v for k, v in sorted(steps.items())}}
    return json.dumps(doc, indent=1, sort_keys=True)
