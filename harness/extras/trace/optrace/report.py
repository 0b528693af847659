"""The op-trace diff as Markdown and as a self-contained HTML page (inline CSS, no requests)."""

from __future__ import annotations

import html as _html

from harness.extras.trace.optrace.trace import Localization, OpRecord, Trace, describe_sig
from harness.fmt import markdown_table

_HEADLINES = {
    "IDENTICAL": "No difference found",
    "CULPRIT": "First op whose outputs differ while its inputs were equal",
    "INPUTS_DIFFER_FROM_START": "The inputs differ from the start of the step",
    "NOT_ALIGNED": "The traces take different paths",
}


def _rows(loc: Localization) -> list[tuple[str, str, str]]:
    def field(r: OpRecord | None, what: str) -> str:
        if r is None:
            return "(trace ended)"
        if what == "inputs":
            return "; ".join(describe_sig(s) for s in r.inputs if s is not None) or "(none)"
        if what == "outputs":
            return "; ".join(describe_sig(s) for s in r.outputs if s is not None) or "(none)"
        return str(getattr(r, what)) or "-"

    if loc.a is None and loc.b is None:
        return []
    return [(w, field(loc.a, w), field(loc.b, w))
            for w in ("op", "module", "phase", "user_line", "inputs", "outputs", "params")]


def _meta_rows(a: Trace, b: Trace) -> list[tuple[str, str, str]]:
    keys = sorted(set(a.meta) | set(b.meta))
    return [(k, repr(a.meta.get(k)), repr(b.meta.get(k))) for k in keys
            if a.meta.get(k) != b.meta.get(k)]


def _md_cell(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def markdown(loc: Localization, a: Trace, b: Trace) -> str:
    out = [f"# Op trace diff: {loc.status}", "", f"**{_HEADLINES.get(loc.status, loc.status)}**"]
    if loc.index is not None:
        out[-1] += f" - op {loc.index}"
    out.append("")
    if loc.likely_cause:
        out += [f"Likely cause: {loc.likely_cause}", ""]
    rows = _rows(loc)
    if rows:
        out += markdown_table(["", "trace A", "trace B"], [[w, f"`{_md_cell(x)}`", f"`{_md_cell(y)}`"] for w, x, y in rows])
        out.append("")
    out += [f"- {line}" for line in loc.detail]
    meta = _meta_rows(a, b)
    out += ["", f"Traces: A {len(a.ops)} ops, B {len(b.ops)} ops."]
    if meta:
        out += ["", *markdown_table(["setting that differs", "trace A", "trace B"],
                                    [[k, _md_cell(x), _md_cell(y)] for k, x, y in meta])]
    return "\n".join(out) + "\n"


_CSS = """
body{font-family:system-ui,sans-serif;margin:2em;max-width:70em;color:#222}
h1{font-size:1.4em} .status{font-weight:bold;padding:.2em .5em;border-radius:4px}
.IDENTICAL{background:#d8f3dc} .CULPRIT,.NOT_ALIGNED{background:#ffd6d6}
.INPUTS_DIFFER_FROM_START{background:#fff3bf}
table{border-collapse:collapse;margin:1em 0} td,th{border:1px solid #ccc;padding:.3em .6em;
text-align:left;vertical-align:top} td code{white-space:pre-wrap;word-break:break-all}
.cause{background:#f1f3f5;padding:.6em;border-left:4px solid #495057}
"""


def html(loc: Localization, a: Trace, b: Trace) -> str:
    e = _html.escape
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             f"<title>Op trace diff: {e(loc.status)}</title><style>{_CSS}</style></head><body>",
             f'<h1>Op trace diff: <span class="status {e(loc.status)}" id="status">'
             f"{e(loc.status)}</span></h1>",
             f"<p>{e(_HEADLINES.get(loc.status, loc.status))}"
             + (f" - op <span id=\"index\">{loc.index}</span>" if loc.index is not None else "")
             + "</p>"]
    if loc.likely_cause:
        parts.append(f'<p class="cause" id="cause">Likely cause: {e(loc.likely_cause)}</p>')
    rows = _rows(loc)
    if rows:
        parts.append('<table id="op"><tr><th></th><th>trace A</th><th>trace B</th></tr>')
        parts += [f'<tr class="{e(w)}"><th>{e(w)}</th><td><code>{e(x)}</code></td>'
                  f"<td><code>{e(y)}</code></td></tr>" for w, x, y in rows]
        parts.append("</table>")
    parts.append("<ul id=\"detail\">" + "".join(f"<li>{e(d)}</li>" for d in loc.detail) + "</ul>")
    parts.append(f"<p>Traces: A {len(a.ops)} ops, B {len(b.ops)} ops.</p>")
    meta = _meta_rows(a, b)
    if meta:
        parts.append('<table id="meta"><tr><th>setting that differs</th><th>trace A</th>'
                     "<th>trace B</th></tr>")
        parts += [f"<tr><td>{e(k)}</td><td>{e(x)}</td><td>{e(y)}</td></tr>" for k, x, y in meta]
        parts.append("</table>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"
