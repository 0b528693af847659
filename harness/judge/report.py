"""Turn a Comparison into a Markdown report and per-metric overlay plots."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import numpy as np

from harness import tags
from harness.fmt import fmt_short, fmt_value, markdown_table, md_cell, md_code
from harness.judge.compare import Comparison, FirstSteps
from harness.judge.delta import summarized
from harness.judge.metricdiff import KIND_REPLAY_FAILED, MetricStats, as_series
from harness.judge.noise import FALSE_ALARM, percent
from harness.judge.perf import step_series
from harness.judge.text import envelope_first, first_divergence, given_tolerances, judged_by, one_run, weights_line
from harness.judge.verdicts import Verdict
from harness.rundata import RunRecord

_VERDICT_WORDS = {v.value: v.row.words for v in Verdict}


def _stat(m: MetricStats, value: float) -> str:
    return "n/a" if m.steps_compared == 0 else fmt_short(value)


def render_markdown(cmp: Comparison, changes: list[str] | None = None) -> str:
    """The comparison as a Markdown document, verdict first and evidence after."""
    out = _head(cmp) + _changes_section(cmp, changes) + _config_section(cmp) + _environment_section(cmp)
    out += _metrics_section(cmp) + _fingerprints_section(cmp)
    out += _checkpoint_section(cmp) + _data_order_section(cmp)
    out += _noise_section(cmp)
    out += _speed_section(cmp)
    out += _divergence_section(cmp)
    return "\n".join(out)


# The report belongs to a replay run, so its columns are always the original and the replay.
_A_LABEL, _B_LABEL = "Original", "Replay"


def _head(cmp: Comparison) -> list[str]:
    """The verdict, the two runs, and what a reader must know before the evidence: weights that never changed, the
    steps that were compared, the notes, and whether the environment left bitwise possible."""
    out: list[str] = [
        f"# Replay verdict: {cmp.verdict}",
        "",
        f"**{cmp.summary()}**",
        "",
        f"- Original run: {md_code(cmp.run_a)}",
        f"- Replay run: {md_code(cmp.run_b)}",
        f"- Outcome: the replay {_VERDICT_WORDS.get(cmp.verdict, cmp.verdict)} (exit code {cmp.exit_code})",
        "",
    ]
    if cmp.weights_unchanged_in:
        who = "either run" if len(cmp.weights_unchanged_in) == 2 else cmp.weights_unchanged_in[0]
        out += [f"> **The model's weights never changed in {who}**: it ended with exactly the weights it started "
                "with, so nothing was trained and agreement proves little.", ""]
    if isinstance(cmp.reached, FirstSteps):
        held = ("were held to the original's checkpoint of that step" if cmp.fingerprints.final_equal is not None
                else "were not compared: the original has no checkpoint fingerprint of that step")
        out += [f"> A first check (`--steps {cmp.reached.steps}`): the replay stopped on purpose after the first "
                f"{cmp.reached.steps} of the original's {cmp.reached.of} steps; only those steps were compared, and its "
                f"weights after step {cmp.reached.steps} {held}.", ""]
    elif cmp.reached is not None:
        out += [f"> The original is {cmp.reached.status}: only the {cmp.reached.steps} steps it reached were compared, "
                "and its missing final fingerprint is not held against the replay.", ""]
    if cmp.notes:
        out += ["Notes:", ""] + [f"- {md_cell(n)}" for n in cmp.notes] + [""]
    if not cmp.bitwise_possible and cmp.verdict == Verdict.BITWISE:
        out += ["> **Bitwise despite** environment changes that usually alter the arithmetic:", ">"]
        out += [f"> - {md_cell(b)}" for b in cmp.bitwise_blockers]
        out += [">", "> Every value and fingerprint came out bit-identical all the same.", ""]
    elif not cmp.bitwise_possible:
        out += ["> **Bitwise impossible** because the environment changed in ways that alter the arithmetic:", ">"]
        out += [f"> - {md_cell(b)}" for b in cmp.bitwise_blockers]
        out += [">", f"> The verdict is {md_cell(judged_by(cmp))} instead.", ""]
    return out


def _changes_section(cmp: Comparison, changes: list[str] | None) -> list[str]:
    """The overrides the replay was allowed, and the tolerance it was judged by where the user gave one."""
    out = ["## Changes requested", ""]
    if changes:
        out += ["Overrides allowed with `--allow-changes`:", ""]
        out += [f"- {md_code(c)}" for c in changes]
    else:
        out.append("None: the replay used the recorded configuration.")
    given = given_tolerances(cmp)
    if given:
        out += ["", "Tolerance given with `--tolerance` (over the recorded `replay.tolerance`):", ""]
        out += [f"- {md_code(m)}: never judged (inf)" if math.isinf(atol) or math.isinf(rtol)
                else f"- {md_code(m)}: atol {fmt_short(atol)}, rtol {fmt_short(rtol)}" for m, atol, rtol in given]
    weights = weights_line(cmp)
    if weights:
        out += ["", f"Tolerance: {md_cell(weights)}."]
    return out + [""]


def _config_section(cmp: Comparison) -> list[str]:
    out = ["## Config delta", ""]
    if cmp.config_delta:
        rows = [[md_code(c.key), md_code(c.a), md_code(c.b), "yes" if c.affects_result else "no (how it is run or judged)"]
                for c in cmp.config_delta]
        out += markdown_table(["Key", _A_LABEL, _B_LABEL, "Affects the result"], rows)
    else:
        out.append("No differences in the recorded config.")
    return out + [""]


def _environment_section(cmp: Comparison) -> list[str]:
    out = ["## Environment delta", ""]
    if cmp.delta:
        rows = []
        for fact in summarized(cmp.delta, cmp.labels):
            name = f"**{md_cell(fact.name)}** (breaks bitwise)" if fact.breaks_bitwise else md_cell(fact.name)
            rows.append([name, md_code(fact.a), md_code(fact.b), md_cell(fact.note)])
        out += markdown_table(["Fact", _A_LABEL, _B_LABEL, "Note"], rows)
    else:
        out.append("No differences in recorded facts or locked packages.")
    return out + [""]


def _metrics_section(cmp: Comparison) -> list[str]:
    out = ["## Metrics", ""]
    if cmp.metrics:
        out += markdown_table(
            ["Metric", "Steps compared", "Max abs diff", "Max rel diff", "First divergence", "Bit-identical",
             "rtol / atol"],
            [_metric_row(m, cmp) for m in cmp.metrics],
        )
    else:
        out.append("Neither run logged any metric.")
    return out + [""]


def _metric_row(m: MetricStats, cmp: Comparison) -> list[str]:
    """One metric's row: where it was logged, how many steps were compared, how far apart, where it first parted."""
    where = "both" if m.in_original and m.in_replay else ("original only" if m.in_original else "replay only")
    seen = None if one_run(m) else envelope_first(m, cmp)
    if seen is not None:  # the envelope decided: what it saw, not the tolerance's first divergence
        first = md_cell(seen)
    elif m.first_divergence is None:
        first = "-"
    elif one_run(m):
        first = first_divergence(m, ("original", "replay"))
    else:
        first = f"{m.counts + ' ' if m.counts else ''}{m.first_divergence} ({m.first_divergence_kind})"
    gaps = []
    if m.missing_steps and m.in_replay:
        gaps.append(f"{m.missing_steps} missing in replay")
    if m.extra_steps and m.in_original:
        gaps.append(f"{m.extra_steps} extra in replay")
    return [
        md_cell(m.name) + ("" if where == "both" else f" ({where})"),
        str(m.steps_compared) + (f" ({', '.join(gaps)})" if gaps else ""),
        _stat(m, m.max_abs_diff),
        _stat(m, m.max_rel_diff),
        first,
        "yes" if m.bitwise_equal else "no (not determined by the training)" if m.name in cmp.undetermined else "no",
        f"{fmt_short(m.rtol)} / {fmt_short(m.atol)}",
    ]


def _fingerprints_section(cmp: Comparison) -> list[str]:
    fps = cmp.fingerprints
    out = ["## Parameter fingerprints", ""]
    if fps.compared == 0:
        out.append("Neither run recorded parameter fingerprints.")
    else:
        final = {None: "not recorded", True: "equal", False: "differs"}[fps.final_equal]
        first = "none" if fps.first_mismatch_step is None else f"step {fps.first_mismatch_step}"
        out += [
            f"- Compared: {fps.compared} (every fingerprinted step in either run, plus the final one)",
            f"- Equal: {fps.equal}",
            f"- First mismatching step: {first}",
            f"- Final fingerprint: {final}",
        ]
    return out + [""]


def _divergence_section(cmp: Comparison) -> list[str]:
    """Where the runs first parted, in full: the value, the step, how far."""
    out = ["## First divergence", ""]
    d = cmp.divergence
    if d is None and cmp.undetermined:
        out.append(f"None: {md_cell(', '.join(cmp.undetermined))} differ, but not as a function of the training: every "
                   "fingerprint and every other value is bit-identical.")
    elif d is None:
        out.append("None: every metric stayed within its tolerance at every step.")
    else:
        if d.kind == KIND_REPLAY_FAILED:
            out += [f"The replay did not finish: {md_cell(d.detail)}", ""]
        rows = [["Kind", md_cell(d.kind)], ["Step", "-" if d.step is None else str(d.step)]]
        if d.metric is not None:
            rows += [
                ["Metric", md_cell(d.metric)],
                ["Original", fmt_value(d.original)],
                ["Replay", fmt_value(d.replay)],
                ["Abs diff", fmt_short(d.abs_diff)],
                ["Rel diff", fmt_short(d.rel_diff)],
            ]
        if d.detail and d.kind != KIND_REPLAY_FAILED:
            rows.append(["Detail", md_cell(d.detail)])
        out += markdown_table(["", ""], rows)
    return out + [""]


def _speed_section(cmp: Comparison) -> list[str]:
    """The two runs' step times side by side: wall clock, shown beside the verdict and never part of it."""
    speed = cmp.speed
    if speed is None or speed.line() is None:
        return []
    a, b = speed.a, speed.b

    def num(x: float | None, unit: str = "") -> str:
        return "-" if x is None else f"{x:.4g}{unit}"

    def share(x: float | None) -> str:
        return "-" if x is None else f"{x:.1%}"

    rows = [
        ["Median step time, rank 0", num(a.step_s, " s"), num(b.step_s, " s")],
        ["Median step time, slowest rank", num(a.slowest_step_s, " s"), num(b.slowest_step_s, " s")],
        ["Samples per second", num(a.samples_per_s), num(b.samples_per_s)],
        ["Loader wait (share of the step)", share(a.loader_wait), share(b.loader_wait)],
        ["Communication share (profiled step)", share(a.comm_share), share(b.comm_share)],
        ["Steps counted (after warm-up, unprofiled)", str(a.steps or "-"), str(b.steps or "-")],
    ]
    out = ["## Performance (wall clock: not part of the verdict)", "", md_cell(speed.line() or ""), ""]
    out += markdown_table(["", "Original", "Replay"], rows)
    out += ["", f"Per-step times: `{tags.ARTIFACT_PLOTS_DIR}/{STEP_TIMES_PLOT}`.", ""]
    return out


def _checkpoint_section(cmp: Comparison) -> list[str]:
    """The checkpoint tensors compared: the first step whose weights differ and which tensors (tensordiff.py)."""
    ck = cmp.checkpoints
    if ck is None:
        return []
    out = ["## Checkpoint tensors", ""]
    if ck.missing_in or ck.common_steps == 0:
        return out + [md_cell(ck.describe(cmp.labels)), ""]
    last = "none" if ck.last_equal_step is None else f"step {ck.last_equal_step}"
    out += [f"- Common checkpoint steps: {ck.common_steps}", f"- Last with every tensor equal: {last}"]
    if ck.first_diff_step is None:
        out.append("- First differing: none")
    else:
        out += [f"- First differing: step {ck.first_diff_step}: {md_cell(ck.what_differs(cmp.labels))}", ""]
        a, b = cmp.labels
        rows = [[md_code(n), "differs"] for n in ck.differing]
        rows += [[md_code(n), f"only in {a}"] for n in ck.only_in_a] + [[md_code(n), f"only in {b}"] for n in ck.only_in_b]
        out += markdown_table(["Tensor", f"at step {ck.first_diff_step}"], rows)
    for label, steps in ck.desynced_ranks.items():
        shown = "; ".join(f"step {s}: ranks {', '.join(map(str, r))}" for s, r in steps.items())
        out.append(f"- In {label}, ranks that held other tensors than rank 0: {shown}")
    out.append("")
    return out


def _data_order_section(cmp: Comparison) -> list[str]:
    """Whether both runs drew the same samples at each ctx.loader step (dataorder.py)."""
    if cmp.data_order is None:
        return []
    return ["## Data order", "", md_cell(cmp.data_order.describe(cmp.labels)), ""]


def render_study_markdown(result: Any) -> str:
    """A study replay (replay.StudyReplayResult): every member's verdict, then the test that judged them together."""
    study = result.study
    out = [f"# Study replay verdict: {result.verdict}", "", f"**{md_cell(result.summary())}**", "",
           f"- Study: {md_code(study.run_id)} ({len(study.members)} members, seeds {md_cell(', '.join(map(str, study.seeds)))})",
           f"- Study replay run: {md_code(result.run_id)}"]
    if result.draw_seed is not None:
        out.append(f"- Members drawn at random with seed {result.draw_seed} (`--members {len(result.members)} "
                   f"--members-seed {result.draw_seed}` draws them again)")
    out += ["", "## Members", ""]
    rows = [[md_cell(r.original.tags.get("harness.seed", "")), md_code(r.original.run_id), md_code(r.outcome.run_id),
             md_cell(r.comparison.summary())] for r in result.members]
    out += markdown_table(["Seed", "Member", "Replay", "Verdict"], rows) + [""]
    if result.equivalence:
        out += ["## Equivalence within the seeds' noise", "",
                "Two one-sided tests on the paired differences replay - original of the replayed members: the "
                "replays are equivalent when the 90% confidence interval of the mean difference lies within "
                "+- one standard deviation of the seeds' final values.", ""]
        rows = [[md_cell(t.metric), str(t.k), f"{t.mean_diff:.3g}", f"[{t.ci90[0]:.3g}, {t.ci90[1]:.3g}]",
                 f"+-{t.margin:.3g}", md_cell(t.reason) if t.reason else ("**yes**" if t.equivalent else "**NO**")]
                for t in result.equivalence]
        out += markdown_table(["Metric", "Members", "Mean difference", "90% CI", "Margin (seed sd)", "Equivalent"], rows)
        out.append("")
    return "\n".join(out)


def _noise_section(cmp: Comparison) -> list[str]:
    """Where the replay's final values fall among the study's seeds (only when it was judged against them)."""
    j = cmp.noise
    if j is None:
        return []
    out = ["## Run-to-run noise", "",
           f"The original is a member of study {md_code(j.study_id)} ({j.seeds} seeds). Each {j.what} of the replay "
           "is judged against the prediction interval of the seeds' values at that step, "
           "mean +- t(N-1, 1 - a/2) x sd x sqrt(1 + 1/N): where one more seed would land 1 - a of the time, with a "
           f"set so that an honest replay is called DIVERGED at most {percent(FALSE_ALARM)} of the time over all its "
           f"checks ({md_cell(j.family()) if j.checks else 'Bonferroni'}; measured in benchmarks/verdict_bench.py).", ""]
    if j.reason:
        return out + [f"**Not judged:** {md_cell(j.reason)}", ""]
    rows = []
    for c in j.checks:
        s = c.spread
        rows.append([
            md_cell(c.label), fmt_value(c.value), fmt_value(c.original), f"{s.mean:.6g}", f"{s.std:.3g}",
            f"[{c.interval[0]:.6g}, {c.interval[1]:.6g}] ({percent(c.level)}{', log scale' if c.log else ''})",
            f"{c.below} of {s.n}",
            md_cell(c.reason) if c.reason else ("**inside**" if c.inside else "**OUTSIDE**"),
        ])
    out += markdown_table(["Metric", "Replay", "Original", "Seeds' mean", "Seeds' sd", "Prediction interval",
                   "Seeds below the replay", "Verdict"], rows)
    return out + [""]


# ---------------------------------------------------------------------------------------------
# Plots

# Above this many points a line is reduced to a per-bucket min/max envelope: the picture keeps
# every spike, and rendering stays fast.
_MAX_POINTS = 8_000


def _envelope(steps: np.ndarray, values: np.ndarray, buckets: int = _MAX_POINTS // 2) -> tuple[np.ndarray, np.ndarray]:
    n = steps.size
    if n <= _MAX_POINTS:
        return steps, values
    k = math.ceil(n / buckets)
    m = (n // k) * k
    s = steps[:m].reshape(-1, k)
    v = values[:m].reshape(-1, k)
    # NaN would win argmin/argmax; keep NaN buckets as NaN gaps instead of hiding them.
    filled_lo = np.where(np.isnan(v), np.inf, v)
    filled_hi = np.where(np.isnan(v), -np.inf, v)
    lo = np.argmin(filled_lo, axis=1)
    hi = np.argmax(filled_hi, axis=1)
    first, second = np.minimum(lo, hi), np.maximum(lo, hi)
    rows = np.arange(s.shape[0])
    out_s = np.column_stack([s[rows, first], s[rows, second]]).ravel()
    out_v = np.column_stack([v[rows, first], v[rows, second]]).ravel()
    return np.concatenate([out_s, steps[m:]]), np.concatenate([out_v, values[m:]])


def plot_file_name(prefix: str, key: str, used: set[str]) -> str:
    """A file name for a plot of metric `key`, unique in `used` even on a case-insensitive file system."""
    base = prefix + (re.sub(r"[^A-Za-z0-9._-]+", "_", key).strip("._") or "unnamed")
    name, i = base, 2
    while name.lower() in used:  # case-insensitive file systems would merge "Loss" and "loss"
        name, i = f"{base}_{i}", i + 1
    used.add(name.lower())
    return name + ".png"


def plot_metrics(original: RunRecord, replay: RunRecord, cmp: Comparison, out_dir: Path) -> list[Path]:
    """One PNG per metric, original and replay overlaid, first divergence marked; returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stats = {m.name: m for m in cmp.metrics}
    orig = {k: as_series(*v) for k, v in original.metrics.items()}
    rep = {k: as_series(*v) for k, v in replay.metrics.items()}
    overall = cmp.divergence
    used: set[str] = set()
    paths: list[Path] = []

    for name in sorted(orig.keys() | rep.keys()):
        m = stats.get(name)
        fig, (ax, ax_diff) = plt.subplots(
            2, 1, sharex=True, figsize=(9, 5.5), gridspec_kw={"height_ratios": [3, 1]}
        )
        # Fixed margins: an automatic layout measures every line artist, which dominates the
        # cost of long runs.
        fig.subplots_adjust(left=0.1, right=0.97, top=0.93, bottom=0.09, hspace=0.08)
        try:
            few = max(orig.get(name, (np.empty(0),))[0].size, rep.get(name, (np.empty(0),))[0].size) <= 200
            if name in orig:
                s, v = _envelope(*orig[name])
                # Wide, pale solid line under a narrow dashed one: identical curves show both.
                ax.plot(s, v, color="tab:blue", linewidth=3.0, alpha=0.45, label=f"original {cmp.run_a[:8]}")
            if name in rep:
                s, v = _envelope(*rep[name])
                ax.plot(s, v, color="tab:red", linewidth=1.2, linestyle="--",
                        marker="o" if few else None, markersize=3.5, fillstyle="none",
                        label=f"replay {cmp.run_b[:8]}")
            ax.set_ylabel(name)
            ax.legend(loc="best", fontsize=8)
            ax.grid(True, alpha=0.3)

            if name in orig and name in rep:
                common, ia, ib = np.intersect1d(orig[name][0], rep[name][0], assume_unique=True, return_indices=True)
                with np.errstate(invalid="ignore", over="ignore"):
                    diff = rep[name][1][ib] - orig[name][1][ia]
                s, v = _envelope(common, diff)
                ax_diff.plot(s, v, color="tab:purple", linewidth=0.9)
                ax_diff.axhline(0.0, color="grey", linewidth=0.6)
            else:
                ax_diff.text(0.5, 0.5, "logged by one run only", ha="center", va="center", transform=ax_diff.transAxes)
            ax_diff.set_ylabel("replay - original", fontsize=8)
            ax_diff.set_xlabel(m.counts if m is not None and m.counts else "step")
            ax_diff.grid(True, alpha=0.3)

            title = name
            if m is not None:
                if m.bitwise_equal:
                    title += ": bit-identical"
                elif m.steps_compared:
                    title += f": max abs diff {fmt_short(m.max_abs_diff)}"
            ax.set_title(title)

            if m is not None and m.first_divergence is not None:
                step = m.first_divergence
                is_first = overall is not None and overall.metric == name and overall.step == step
                label = f"{'first divergence' if is_first else 'diverges'}: {m.counts or 'step'} {step}"
                for axis in (ax, ax_diff):
                    axis.axvline(step, color="black", linestyle=":", linewidth=1.2)
                lo, hi = ax.get_xlim()
                right_half = step > (lo + hi) / 2
                # Text goes on the side with room, so a late divergence is not clipped.
                ax.annotate(label, xy=(step, 1.0), xycoords=("data", "axes fraction"),
                            xytext=(-4 if right_half else 4, -14), textcoords="offset points",
                            ha="right" if right_half else "left", fontsize=8, color="black")
            path = out_dir / plot_file_name("metric_", name, used)
            fig.savefig(path, dpi=100)
            paths.append(path)
        finally:
            plt.close(fig)
    step_times = plot_step_times(original, replay, cmp, out_dir)
    return paths + ([step_times] if step_times is not None else [])


STEP_TIMES_PLOT = "step_times.png"


def plot_step_times(original: RunRecord, replay: RunRecord, cmp: Comparison, out_dir: Path) -> Path | None:
    """The two runs' per-step wall times (the slowest rank's) side by side, one panel each on one scale; None when
    neither run recorded them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = [step_series(original), step_series(replay)]
    if not any(steps for steps, _ in series):
        return None
    fig, axes = plt.subplots(1, 2, sharey=True, figsize=(11, 3.8))
    fig.subplots_adjust(left=0.07, right=0.98, top=0.88, bottom=0.13, wspace=0.06)
    try:
        for ax, (steps, seconds), label, run_id, color in zip(
                axes, series, ("original", "replay"), (cmp.run_a, cmp.run_b), ("tab:blue", "tab:red")):
            if steps:
                s, v = _envelope(np.asarray(steps), np.asarray(seconds))
                ax.plot(s, v, color=color, linewidth=1.0)
                ax.axhline(float(np.median(seconds)), color="grey", linestyle=":", linewidth=1.0)
            else:
                ax.text(0.5, 0.5, "no step times recorded", ha="center", va="center", transform=ax.transAxes)
            ax.set_title(f"{label} {run_id[:8]}", fontsize=10)
            ax.set_xlabel("step")
            ax.grid(True, alpha=0.3)
        axes[0].set_ylabel("seconds per step (slowest rank)")
        fig.suptitle("Step times (wall clock, not part of the verdict)", fontsize=10)
        path = Path(out_dir) / STEP_TIMES_PLOT
        fig.savefig(path, dpi=100)
        return path
    finally:
        plt.close(fig)
