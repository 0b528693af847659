"""The `harness verify` report: Markdown, and one self-contained HTML page (inline CSS, plots as data URIs)."""

from __future__ import annotations

import base64
import html
import io
import math
from typing import TYPE_CHECKING

from harness.extras.verify.claims import environment, fmt
from harness.fmt import markdown_table, md_cell, md_code
from harness.judge.noise import percent, spread
from harness.judge.verdicts import Verdict as ReplayVerdict

if TYPE_CHECKING:
    from harness.extras.verify.claims import Source, Verdict

# Verdict colours of the HTML page (background of the verdict cell): a claim's outcome, a replay's verdict.
_COLOURS = {"HOLDS": "#c8f0c8", "MISPRINTED": "#ffd9a8", "NOT_REPRODUCED": "#f7b8b8",
            **{v.value: v.row.colour for v in ReplayVerdict}}
_CSS = """
body{font-family:system-ui,sans-serif;margin:2em auto;max-width:70em;color:#222;line-height:1.4}
table{border-collapse:collapse;margin:.6em 0}th,td{border:1px solid #bbb;padding:.25em .6em;text-align:left}
th{background:#eee}td.num{font-family:monospace}code{font-size:.95em}
.verdict{font-weight:bold}section.claim{border-top:2px solid #ccc;margin-top:1.5em}
img{max-width:100%;border:1px solid #ddd}
"""


def _recorded_text(v: Verdict) -> str:
    c = v.claim
    text = fmt(v.recorded, c.paper.value)
    if c.paper.pm is not None or (v.recorded_spread is not None and v.source.is_study):
        text += f" ± {fmt(v.recorded_spread, c.paper.pm)}"
    return text + f" (n={len(v.values)})"


def _replayed_text(v: Verdict, replayed: bool) -> str:
    if not replayed:
        return "-"
    k = len(v.replayed_values)
    text = f"{fmt(v.replayed, v.claim.paper.value)} (n={k}"
    if v.recorded_replayed_members is not None:
        # --members K of N: the replayed K beside the same K as recorded, not beside all N (the recorded column).
        text += f"; these {k} recorded: {fmt(v.recorded_replayed_members, v.claim.paper.value)}"
    return text + ")"


def rows(verdicts: list[Verdict], replayed: bool) -> list[list[str]]:
    """The claims table: claim, paper value, recorded, replayed, replay verdict, verdict."""
    return [[v.claim.id, v.claim.paper_text, _recorded_text(v), _replayed_text(v, replayed),
             v.source.replay_verdict or "-", v.outcome] for v in verdicts]


HEADER = ["claim", "paper", "recorded", "replayed", "replay", "verdict"]


def why(v: Verdict) -> list[str]:
    """Sentences explaining the claim's verdict."""
    c = v.claim
    kind = f"{c.statistic} over {len(v.values)} seeds" if v.source.is_study else "one run"
    if c.rtol is not None:
        return _why_speed(v, kind)
    per_run = {"final": "the value at the last step", "max": "the maximum over all steps",
               "min": "the minimum over all steps"}[c.value]
    scale = f", x{c.scale}" if c.scale != 1 else ""
    out = [f"The paper prints {c.paper_text} for {c.metric} ({per_run} of each run{scale}; {kind})."]
    dec = abs(int(c.paper.value.as_tuple().exponent))
    verb = "prints as" if v.value_ok else "does NOT print as"
    out.append(f"Recorded: {fmt(v.recorded, c.paper.value)}, which {verb} {c.paper.value} at {dec} decimals.")
    if v.typo:
        out.append(f"A {v.typo}: a misprint, even where the noise would cover the number.")
    if c.paper.pm is not None:
        verb = "prints as" if v.spread_ok else "does NOT print as"
        out.append(f"Recorded {c.spread}: {fmt(v.recorded_spread, c.paper.pm)}, which {verb} ± {c.paper.pm}.")
    if v.noise_interval is not None:
        lo, hi = v.noise_interval
        inside = "inside" if lo <= float(c.paper.value) <= hi else "OUTSIDE"
        level = percent(v.noise_level if v.noise_level is not None else 0.95)
        out.append(f"The printed {c.paper.value} lies {inside} [{lo:.6g}, {hi:.6g}], the {level} prediction interval for "
                   f"the mean of another {len(v.values)} seeds (mean ± t·sd·√(2/N); one 5% bound for the file's claims): "
                   + ("printed as recorded." if v.value_ok else "the claim stands within the noise, "
                      "not these runs' digits." if inside == "inside" else "not within the noise either."))
    if len(v.values) >= 2:
        s = spread(v.values)
        out.append(f"95% prediction interval for one new seed: [{s.pi95[0]:.6g}, {s.pi95[1]:.6g}] (N={s.n}).")
    if v.source.replay_verdict is not None:
        out.append(f"Replay {v.source.replay_id}: {v.source.replay_summary}")
        if v.replayed is not None:
            k = len(v.replayed_values)
            line = f"Replayed {c.statistic}: {fmt(v.replayed, c.paper.value)} over {k} replayed run{'s' if k != 1 else ''}"
            if v.recorded_replayed_members is not None:
                line += (f" (the recorded {c.statistic} of the same {k} of {len(v.values)} members: "
                         f"{fmt(v.recorded_replayed_members, c.paper.value)})")
            out.append(line + ".")
    return out


def _why_speed(v: Verdict, kind: str) -> list[str]:
    """A speed claim: held to its stated relative tolerance, on every machine that replays it."""
    c = v.claim
    assert c.rtol is not None
    scale = f", x{c.scale}" if c.scale != 1 else ""
    lo, hi = float(c.paper.value) * (1 - c.rtol), float(c.paper.value) * (1 + c.rtol)
    out = [f"The paper prints {c.paper_text} for {c.metric} (each run's median over its timed steps{scale}; {kind}), "
           f"a speed held to rtol {c.rtol:g}: [{lo:.6g}, {hi:.6g}]."]
    out.append(f"Recorded: {v.recorded:.6g}, " + ("within it." if v.value_ok else "OUTSIDE it."))
    if v.source.replay_verdict is not None:
        out.append(f"Replay {v.source.replay_id}: {v.source.replay_summary}")
        out.append(f"Replayed speed: {v.replayed:.6g}, " + ("within the claim's rtol." if v.replayed is not None and
                   lo <= v.replayed <= hi else "not within the claim's rtol.") if v.replayed is not None else
                   "Replayed speed: not recorded by the replays.")
    return out


def _sources(verdicts: list[Verdict]) -> list[Source]:
    """Each study or run once, in the order the claims first name them."""
    return list({id(v.source): v.source for v in verdicts}.values())


def render_markdown(verdicts: list[Verdict], replayed: bool, changes: list[str], run_id: str) -> str:
    held = sum(v.holds for v in verdicts)
    out = [f"# Claims check: {held} of {len(verdicts)} hold", "", f"- Verify run: {md_code(run_id)}",
           f"- Replayed: {'yes' if replayed else 'no (checked against the record only)'}"]
    if changes:
        out.append("- Changes allowed for the replays: " + ", ".join(md_code(c) for c in changes))
    out += [""] + markdown_table(HEADER, [[md_cell(x) for x in row] for row in rows(verdicts, replayed)]) + [""]
    for v in verdicts:
        out += [f"## {md_cell(v.claim.id)}: {v.outcome}", ""]
        if v.claim.text:
            out += [f"*{md_cell(v.claim.text)}*", ""]
        out += [f"- {md_cell(line)}" for line in why(v)]
        out += [f"- Recorded values (one per run): {', '.join(f'{x:.6g}' for x in v.values)}"]
        if v.replayed_values:
            out += [f"- Replayed values: {', '.join(f'{x:.6g}' for x in v.replayed_values)}"]
        out.append("")
    out += ["## Environment", ""]
    for s in _sources(verdicts):
        label = "study" if s.is_study else "run"
        out += [f"### {label} {md_cell(s.run_id)}", ""]
        facts = [[md_cell(k), md_code(o)] for k, o in environment(s.records)]
        if s.replays:
            replays = dict(environment(s.replays))
            facts = [[md_cell(k), md_code(o), md_code(replays[k])] for k, o in environment(s.records)]
            out += markdown_table(["fact", "original runs", "replays"], facts)
            out += ["", "What differed (why the replays could not be bitwise):", ""]
            out += [f"- {md_cell(b)}" for b in s.blockers] or ["- nothing: bitwise was possible"]
        else:
            out += markdown_table(["fact", "original runs"], facts)
        out.append("")
    return "\n".join(out)


def strip_plot(v: Verdict) -> bytes:
    """The seeds' values as a strip, the paper's value and +- as a band, the replayed values marked; PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    c = v.claim
    fig, ax = plt.subplots(figsize=(7, 2.2))
    fig.subplots_adjust(left=0.05, right=0.98, top=0.85, bottom=0.25)
    try:
        paper = float(c.paper.value)
        if c.paper.pm is not None:
            pm = float(c.paper.pm)
            ax.axvspan(paper - pm, paper + pm, color="tab:green", alpha=0.15, label=f"paper ± {c.paper.pm}")
        ax.axvline(paper, color="tab:green", linewidth=2, label=f"paper {c.paper.value}")
        if len(v.values) >= 2:
            from harness.judge.noise import spread

            s = spread(v.values)
            if all(math.isfinite(x) for x in s.pi95):
                for x in s.pi95:
                    ax.axvline(x, color="grey", linestyle="--", linewidth=1)
                ax.plot([], [], color="grey", linestyle="--", label="95% prediction interval")
        rng = np.random.default_rng(0)  # fixed jitter: the same record draws the same picture
        ax.scatter(v.values, rng.uniform(-0.2, 0.2, len(v.values)), color="tab:blue", zorder=3,
                   label=f"recorded ({len(v.values)})")
        ax.axvline(v.recorded, color="tab:blue", linestyle=":", linewidth=1.5, label=f"recorded {c.statistic}")
        if v.replayed_values:
            ax.scatter(v.replayed_values, rng.uniform(-0.2, 0.2, len(v.replayed_values)), color="tab:red",
                       marker="x", s=60, zorder=4, label=f"replayed ({len(v.replayed_values)})")
        ax.set_ylim(-1, 1)
        ax.margins(x=0.15)
        ax.ticklabel_format(axis="x", useOffset=False)
        ax.set_yticks([])
        ax.set_title(f"{c.id}: {c.metric}", fontsize=10)
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3, fontsize=7, frameon=False)
        fig.subplots_adjust(bottom=0.38)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=90)
        return buf.getvalue()
    finally:
        plt.close(fig)


def _h(x: object) -> str:
    return html.escape(str(x), quote=True)


def _html_table(header: list[str], body: list[list[str]], coloured: tuple[int, ...] = ()) -> str:
    head = "".join(f"<th>{_h(h)}</th>" for h in header)
    lines = []
    for row in body:
        cells = []
        for i, x in enumerate(row):
            style = f' class="verdict" style="background:{_COLOURS[x]}"' if i in coloured and x in _COLOURS else ""
            cells.append(f"<td{style}>{_h(x)}</td>")
        lines.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(lines)}</table>"


def render_html(verdicts: list[Verdict], replayed: bool, changes: list[str], run_id: str) -> str:
    """A single page: nothing is fetched from anywhere (the plots are data: URIs)."""
    held = sum(v.holds for v in verdicts)
    title = f"Claims check: {held} of {len(verdicts)} hold"
    parts = [f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{_h(title)}</title>",
             f"<style>{_CSS}</style></head><body><h1>{_h(title)}</h1>",
             f"<p>Verify run <code>{_h(run_id)}</code>; "
             f"{'replayed' if replayed else 'checked against the record only (no replay)'}"
             + (f"; changes allowed for the replays: <code>{_h(' '.join(changes))}</code>" if changes else "")
             + ".</p>",
             _html_table(HEADER, rows(verdicts, replayed), coloured=(4, 5))]
    for v in verdicts:
        png = base64.b64encode(strip_plot(v)).decode("ascii")
        parts.append(f"<section class=\"claim\" id=\"{_h(v.claim.id)}\"><h2>{_h(v.claim.id)}: "
                     f"<span class=\"verdict\" style=\"background:{_COLOURS.get(v.outcome, '#fff')}\">{_h(v.outcome)}"
                     "</span></h2>")
        if v.claim.text:
            parts.append(f"<p><em>{_h(v.claim.text)}</em></p>")
        parts.append("<ul>" + "".join(f"<li>{_h(line)}</li>" for line in why(v)) + "</ul>")
        parts.append(f"<img alt=\"{_h(v.claim.id)}: recorded values and the paper's\" src=\"data:image/png;base64,{png}\">")
        parts.append("</section>")
    parts.append("<h2>Environment</h2>")
    for s in _sources(verdicts):
        parts.append(f"<h3>{'study' if s.is_study else 'run'} <code>{_h(s.run_id)}</code></h3>")
        original = environment(s.records)
        if s.replays:
            replays = dict(environment(s.replays))
            parts.append(_html_table(["fact", "original runs", "replays"], [[k, o, replays[k]] for k, o in original]))
            parts.append("<p>What differed (why the replays could not be bitwise):</p><ul>"
                         + ("".join(f"<li>{_h(b)}</li>" for b in s.blockers) or "<li>nothing: bitwise was possible</li>")
                         + "</ul>")
        else:
            parts.append(_html_table(["fact", "original runs"], [[k, o] for k, o in original]))
    parts.append("</body></html>")
    return "\n".join(parts)
