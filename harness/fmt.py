"""Numbers and words for reports: shortest round-tripping floats, "a vs b" with just enough digits, JSON-safe values."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any


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


def the(label: str) -> str:
    """ "the original", "the replay", but "run A", "run B"."""
    return label if label.startswith("run ") else f"the {label}"


def step_list(steps: Iterable[int], runs: int = 3) -> str:
    """Ascending steps as runs of consecutive ones ("0-99", "0, 5, 7-9"); past `runs` runs the rest is counted
    ("0, 10, 20, ... (101 steps)"), so a long series reads in one line."""
    shown: list[str] = []
    start = prev = None
    count = 0
    for step in steps:
        count += 1
        if prev is not None and step == prev + 1:
            prev = step
            continue
        if start is not None and len(shown) <= runs:
            shown.append(f"{start}" if start == prev else f"{start}-{prev}")
        start = prev = step
    if start is not None and len(shown) <= runs:
        shown.append(f"{start}" if start == prev else f"{start}-{prev}")
    if not shown:
        return "none"
    if len(shown) > runs:
        return ", ".join(shown[:runs]) + f", ... ({count} steps)"
    return ", ".join(shown)


def json_float(x: float | None) -> float | str | None:
    if x is None:
        return None
    x = float(x)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


def json_safe(obj: Any) -> Any:
    """A tree of plain JSON values; inf and nan become the strings "inf", "-inf" and "nan"."""
    if isinstance(obj, Mapping):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, float):
        return json_float(obj)
    if hasattr(obj, "item") and not isinstance(obj, (str, bytes)):  # a numpy scalar
        return json_safe(obj.item())
    return obj


def plain_name(value: object) -> bool:
    """A name the store turns into a folder or a path segment (an experiment's), one a bundle carries back: no
    separator, no '..', no control character, at most 256 characters. The folder a run records from and the
    bundle it is imported from hold their names to the same rule."""
    return (isinstance(value, str) and bool(value.strip()) and value not in (".", "..") and "/" not in value
            and "\\" not in value and "\0" not in value and value.isprintable() and len(value) <= 256)


def printable(text: str) -> str:
    """`text` as a terminal may show it: control characters (an escape sequence in a folder or run name would
    drive the terminal) written out as Python escapes."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


def text_table(rows: Sequence[Sequence[str]]) -> str:
    """Rows of cells (the header first) as a terminal table: each column as wide as its widest cell, two spaces
    between columns, no trailing spaces. The one way the CLI draws a table (`runs`, a study's spread, `verify`)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))] if rows else []
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows)


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    """A Markdown table's lines; the cells are written as given (escape `|` and newlines in outside text first).
    The one way a report draws a table (replay, verify, audit, bisect, a trace's localization)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def md_cell(value: object) -> str:
    """A Markdown table cell: pipes and newlines would break the row."""
    text = "" if value is None else str(value)
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ").replace("\r", " ")


def md_code(value: object) -> str:
    """An outside value as inline Markdown code that renders literally whatever backticks it holds."""
    if value is None:
        return "*(absent)*"
    text = md_cell(value)
    # Fence with more backticks than the value holds, so any value renders literally.
    ticks = "`" * (max((len(m) for m in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{ticks}{pad}{text}{pad}{ticks}"
