"""A paper's claims file: the numbers it prints, exactly as printed, and which recorded runs they rest on;
and a claim judged against those runs (the verdict harness verify records)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from decimal import ROUND_HALF_EVEN, ROUND_HALF_UP, Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from harness import tags as T
from harness.errors import HarnessError, UsageError
from harness.fmt import json_float
from harness.judge.perf import MEDIAN_OF
from harness.judge.verdicts import Verdict as ReplayVerdict
from harness.rundata import RunRecord, RunSummary, wall_clock

VALUES = ("final", "max", "min")  # per run: the value at the last step, or the best over all steps
STATISTICS = ("mean", "median", "min", "max")  # over a study's seeds
SPREADS = ("std", "sem", "ci95")  # what the printed +- is
KEYS = ("id", "text", "study", "run", "metric", "paper", "value", "statistic", "spread", "scale", "rtol")

# A number as a paper prints it: sign, digits, an optional exponent ("1e-3", "1.5E-4").
_NUMBER = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?"
# "0.953", "0.953 ± 0.012", "0.953 +- 0.012", "0.953±0.012" (U+2212 minus accepted as '-').
_PRINTED = re.compile(rf"^\s*({_NUMBER})\s*(?:(?:±|\+-|\+/-)\s*({_NUMBER}))?\s*$")


@dataclass(frozen=True)
class Printed:
    """A number with the precision it was printed at: Decimal keeps '0.970' apart from '0.97'."""

    value: Decimal
    pm: Decimal | None = None  # the +- part, None when the paper prints none

    def __str__(self) -> str:
        return f"{self.value} ± {self.pm}" if self.pm is not None else str(self.value)


def parse_printed(text: str) -> Printed:
    """'97.3 ± 0.4' -> Printed(Decimal('97.3'), Decimal('0.4')). Raises ValueError with the reason.

    Exponent notation is read as printed: '1e-3' is 0.001 given to the nearest 0.001, '1.5e-3' to the
    nearest 0.0001 (Decimal's exponent is the printed precision). A trailing '%' is refused: the scale
    field says how the paper turned a fraction into a percent.
    """
    clean = text.replace("\u2212", "-")
    if clean.strip().endswith("%") or "%" in clean:
        raise ValueError("drop the '%' and set scale: 100 (the recorded fraction is multiplied by it)")
    found = _PRINTED.match(clean)
    if not found:
        raise ValueError("not a number as printed (e.g. 0.953, 97.3 ± 0.4, 0.953 +- 0.012, 1e-3)")
    value = Decimal(found.group(1))
    pm = Decimal(found.group(2)) if found.group(2) is not None else None
    if pm is not None and pm < 0:
        raise ValueError("the ± part is negative")
    return Printed(value, pm)


def possible_typo(x: float | Decimal, printed: Decimal) -> str | None:
    """'possible typo: printed 2.858, runs give 2.885' when the printed number is the recorded one, at the printed
    precision, with two adjacent digits swapped or one digit other than the last replaced - the slips of a hand
    copying a number. A last digit that differs is left alone: rounding and a seed's noise move it too.
    None when no such slip explains the difference."""
    for shown in sorted(roundings(x, printed)):
        a, b = str(printed), str(shown)
        if a == b or len(a) != len(b):
            continue
        diff = [i for i, (p, q) in enumerate(zip(a, b)) if p != q]
        if not all(a[i].isdigit() and b[i].isdigit() for i in diff):
            continue  # a sign or the decimal point moved: another number, not a slip of one digit
        swapped = len(diff) == 2 and diff[1] == diff[0] + 1 and a[diff[0]] == b[diff[1]] and a[diff[1]] == b[diff[0]]
        last = max(i for i, ch in enumerate(a) if ch.isdigit())
        replaced = len(diff) == 1 and diff[0] != last
        if swapped or replaced:
            return f"possible typo: printed {a}, runs give {b}"
    return None


def as_decimal(x: float) -> Decimal:
    """The float's shortest repr as a Decimal: '0.9535' rather than the binary 0.953499999..., which is the
    number a person reads off a log and rounds by hand."""
    return Decimal(repr(float(x)))


def roundings(x: float | Decimal, printed: Decimal) -> set[Decimal]:
    """Every way `x` prints at the precision of `printed`: round-half-up and round-half-even of its
    shortest repr, and the correctly rounded exact binary value (what '%.3f' gives)."""
    quantum = Decimal(1).scaleb(printed.as_tuple().exponent)  # type: ignore[arg-type]
    out: set[Decimal] = set()
    exact = Decimal(x) if isinstance(x, float) else x
    shown = as_decimal(x) if isinstance(x, float) else x
    try:
        out.add(shown.quantize(quantum, rounding=ROUND_HALF_UP))
        out.add(shown.quantize(quantum, rounding=ROUND_HALF_EVEN))
        out.add(exact.quantize(quantum, rounding=ROUND_HALF_EVEN))
    except InvalidOperation:  # nan, inf, or too many digits for the context
        return set()
    return out


def prints_as(x: float | Decimal, printed: Decimal) -> bool:
    """Does `x`, rounded to the printed number of decimals, equal the printed number?"""
    return printed in roundings(x, printed)


@dataclass(frozen=True)
class Claim:
    """One claim: a printed number and the recorded study (or single run) it rests on."""

    id: str
    metric: str
    paper: Printed
    paper_text: str  # exactly as written in the file
    study: str | None = None
    run: str | None = None
    text: str = ""
    value: str = "final"
    statistic: str = "mean"
    spread: str = "std"
    scale: Decimal = Decimal(1)
    # A speed claim (metric: harness.perf.samples_per_s, ...): held to this relative tolerance, not to the printed
    # precision; None for every other claim.
    rtol: float | None = None

    @property
    def source(self) -> str:
        """The id the claim names (a study or a run)."""
        return self.study or self.run or ""


def _fail(path: Path, where: str, what: str) -> HarnessError:
    return UsageError(f"{path}: {where}: {what}")


def load_claims(path: Path) -> list[Claim]:
    """Parse and validate a claims file; every problem is one line naming the claim and the field."""
    import yaml

    try:
        raw = path.read_bytes()
    except OSError as err:
        raise UsageError(f"cannot read the claims file {path}: {err.strerror or err}. Check the path.") from None
    try:
        root = yaml.compose(raw.decode("utf-8"), Loader=yaml.SafeLoader)
    except UnicodeDecodeError:
        raise UsageError(f"{path}: not UTF-8 text. Save the claims file as UTF-8.") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise UsageError(f"{path}: not valid YAML{where}: {problem}.") from None
    top = _mapping(path, "the file", root, "a mapping with a `claims:` list")
    if set(top) != {"claims"}:
        extra = sorted(set(top) - {"claims"})
        raise _fail(path, "the file", f"unknown key {extra[0]!r}; the file holds only `claims:` (a list)"
                    if extra else "missing `claims:` (a list of claims)")
    items = top["claims"]
    if not isinstance(items, yaml.SequenceNode) or not items.value:
        raise _fail(path, "claims", "must be a non-empty list of claims (`- id: ...`)")
    claims: list[Claim] = []
    seen: dict[str, int] = {}
    for i, node in enumerate(items.value, 1):
        claim = _claim(path, i, node)
        if claim.id in seen:
            raise _fail(path, f"claim {claim.id!r}", f"id: duplicate (claims {seen[claim.id]} and {i}); give each claim "
                        "its own id")
        seen[claim.id] = i
        claims.append(claim)
    return claims


def _mapping(path: Path, where: str, node: object, what: str) -> dict[str, object]:
    import yaml

    if not isinstance(node, yaml.MappingNode):
        raise _fail(path, where, f"must be {what}")
    out: dict[str, object] = {}
    for key, value in node.value:
        name = key.value if isinstance(key, yaml.ScalarNode) else str(key)
        if name in out:
            raise _fail(path, where, f"key {name!r} is given twice (line {key.start_mark.line + 1}); give it once")
        out[name] = value
    return out


def _claim(path: Path, index: int, node: object) -> Claim:
    import yaml

    line = getattr(getattr(node, "start_mark", None), "line", -1) + 1
    fields = _mapping(path, f"claim {index} (line {line})", node, "a mapping (id:, study: or run:, metric:, paper:)")

    def scalar(name: str) -> str | None:
        value = fields.get(name)
        if value is None:
            return None
        if not isinstance(value, yaml.ScalarNode) or value.tag == "tag:yaml.org,2002:null":
            raise _fail(path, where, f"{name}: must be a single value")
        return str(value.value)  # the source text: 0.970 keeps its trailing zero

    where = f"claim {index} (line {line})"
    cid = scalar("id")
    if not cid or not cid.strip():
        raise _fail(path, where, "id: missing; give every claim a short unique id (e.g. id: table1-linear)")
    where = f"claim {cid!r}"
    unknown = sorted(set(fields) - set(KEYS))
    if unknown:
        raise _fail(path, where, f"unknown key {unknown[0]!r}; valid keys: {', '.join(KEYS)}")
    study, run = scalar("study"), scalar("run")
    if (study is None) == (run is None):
        both = "both study: and run:" if study is not None else "neither study: nor run:"
        raise _fail(path, where, f"{both}; give exactly one: study: <study run id> (harness run --seeds N) or "
                    "run: <run id> for a single run")
    metric = scalar("metric")
    if not metric:
        raise _fail(path, where, "metric: missing; name the logged metric the printed number is (e.g. metric: loss)")
    paper_text = scalar("paper")
    if paper_text is None:
        raise _fail(path, where, "paper: missing; write the number exactly as printed, e.g. paper: \"0.953 ± 0.012\"")
    try:
        paper = parse_printed(paper_text)
    except ValueError as err:
        raise _fail(path, where, f"paper: {paper_text!r}: {err}") from None

    def choice(name: str, valid: tuple[str, ...]) -> str:
        given = scalar(name)
        if given is None:
            return valid[0]
        if given not in valid:
            raise _fail(path, where, f"{name}: unknown {name} {given!r}; valid: {', '.join(valid)}")
        return given

    value, statistic, spread = choice("value", VALUES), choice("statistic", STATISTICS), choice("spread", SPREADS)
    scale_text = scalar("scale") or "1"
    try:
        scale = Decimal(scale_text)
        if not scale.is_finite() or scale <= 0:
            raise InvalidOperation
    except InvalidOperation:
        raise _fail(path, where, f"scale: {scale_text!r} is not a positive number (100 when the paper prints a "
                    "fraction as a percent)") from None
    rtol = _rtol(path, where, metric, scalar("rtol"), paper, scalar("value"))
    return Claim(id=cid, metric=metric, paper=paper, paper_text=paper_text, study=study, run=run,
                 text=scalar("text") or "", value=value, statistic=statistic, spread=spread, scale=scale, rtol=rtol)


def _rtol(path: Path, where: str, metric: str, text: str | None, paper: Printed, value: str | None) -> float | None:
    """A speed claim's relative tolerance: required for a wall-clock metric, refused for any other."""
    speeds = ", ".join(MEDIAN_OF)
    if not wall_clock(metric):
        if text is not None:
            raise _fail(path, where, f"rtol: only a speed claim states one (metric: one of {speeds}); a claim on "
                        f"{metric!r} is held to the precision its number is printed at")
        return None
    if metric not in MEDIAN_OF:
        raise _fail(path, where, f"metric: {metric!r} is no speed harness records; use one of {speeds}")
    if text is None:
        raise _fail(path, where, "rtol: missing; a speed claim states how far another machine's speed may be "
                    "from the printed one, e.g. rtol: 0.2 (within 20%)")
    try:
        rtol = float(text)
    except ValueError:
        rtol = math.nan
    if not math.isfinite(rtol) or rtol < 0:
        raise _fail(path, where, f"rtol: {text!r} is not a number >= 0 (0.2: within 20% of the printed speed)")
    if paper.pm is not None:
        raise _fail(path, where, f"paper: a speed claim prints no ± (rtol: {text} is its tolerance)")
    if value is not None:
        raise _fail(path, where, "value: a speed claim takes each run's median over its steps; drop value:")
    return rtol


# -- a claim judged (harness verify) ------------------------------------------------------------------
# A claim's outcome. HOLDS: printed as recorded and (with --replay) the replay reproduced it.
HOLDS = "HOLDS"
# A mean over seeds printed otherwise than recorded, but where the mean of another N seeds could land
# (noise.another_mean): the claim stands, the printed digits are not these runs'. It holds.
CLAIM_WITHIN_NOISE = ReplayVerdict.WITHIN_NOISE
MISPRINTED = "MISPRINTED"  # the printed number (or its +-) is not what the runs produced, nor within their noise
NOT_REPRODUCED = "NOT_REPRODUCED"  # printed correctly, but the replay DIVERGED or had nothing to compare
# The facts shown per run in the report's environment section: (label, tag).
ENVIRONMENT = (
    ("commit", T.GIT_COMMIT), ("dirty", T.GIT_DIRTY), ("image digest", T.IMAGE_DIGEST),
    ("torch", T.ENV_PREFIX + "torch"), ("cpu", T.ENV_PREFIX + "cpu"), ("gpu", T.ENV_PREFIX + "gpu"),
    ("threads per rank", T.THREADS_PER_RANK), ("world size", T.WORLD_SIZE), ("backend", T.BACKEND),
    ("determinism", T.DETERMINISM_PREFIX + "level"),
)


@dataclass
class Source:
    """A study or single run that claims rest on, resolved in this store, with its runs' records."""

    given: str  # the id as the claims file names it
    run: RunSummary  # the study's run, or the single run
    records: list[RunRecord]  # the FINISHED members (a single run: itself)
    is_study: bool
    replay_verdict: str | None = None
    replay_summary: str = ""
    replay_id: str | None = None  # the study replay or the replay run
    replays: list[RunRecord] = field(default_factory=list)
    replayed_originals: list[str] = field(default_factory=list)  # the run each replay reran (--members K draws some)
    blockers: list[str] = field(default_factory=list)  # why the replays could not be bitwise

    @property
    def run_id(self) -> str:
        return self.run.run_id


@dataclass
class Verdict:
    """One claim judged: the recorded (and replayed) numbers next to the printed one."""

    claim: Claim
    source: Source
    values: list[float]  # per recorded run, scaled, in member order
    recorded: float  # the statistic over `values`
    recorded_spread: float | None  # what the +- means, over `values` (None: one run)
    value_ok: bool
    spread_ok: bool
    replayed_values: list[float] = field(default_factory=list)
    replayed: float | None = None
    # The recorded statistic over just the members that were replayed (--members K < N): the like-for-like number.
    recorded_replayed_members: float | None = None
    outcome: str = HOLDS
    noise_interval: tuple[float, float] | None = None  # where another N seeds' mean lands (a mean claim on a study)
    noise_level: float | None = None  # that interval's level, set for the whole claims file (noise.claims_level)
    typo: str | None = None  # possible_typo(): the printed number is the recorded one with a digit slipped

    @property
    def holds(self) -> bool:
        return self.outcome in (HOLDS, CLAIM_WITHIN_NOISE)

    def to_dict(self) -> dict[str, Any]:
        c = self.claim
        return {
            "id": c.id, "text": c.text, "metric": c.metric, "paper": c.paper_text,
            "study" if c.study else "run": c.source, "resolved": self.source.run_id,
            "value": c.value, "statistic": c.statistic, "spread": c.spread, "scale": str(c.scale),
            "n": len(self.values), "values": [json_float(v) for v in self.values],
            "recorded": json_float(self.recorded), "recorded_spread": json_float(self.recorded_spread),
            "printed_value_matches": self.value_ok, "printed_spread_matches": self.spread_ok,
            "noise_interval": None if self.noise_interval is None else [json_float(x) for x in self.noise_interval],
            "noise_level": self.noise_level,
            "replay_verdict": self.source.replay_verdict, "replay_id": self.source.replay_id,
            "replayed_values": [json_float(v) for v in self.replayed_values], "replayed": json_float(self.replayed),
            "recorded_replayed_members": json_float(self.recorded_replayed_members),
            "outcome": self.outcome, "possible_typo": self.typo,
        }


def environment(records: list[RunRecord]) -> list[tuple[str, str]]:
    """Each ENVIRONMENT fact over the runs: one value, or the distinct values joined with ' | '."""
    out = []
    for label, tag in ENVIRONMENT:
        seen = list(dict.fromkeys(r.facts.get(tag, "-") for r in records))
        out.append((label, " | ".join(seen)))
    return out


def fmt(x: float | None, like: Decimal | None = None) -> str:
    """A recorded number with two more decimals than the printed one it is held against (else 6 significant)."""
    if x is None:
        return "-"
    if not math.isfinite(x):
        return str(x)
    if like is not None:
        decimals = max(0, -int(like.as_tuple().exponent)) + 2
        return f"{x:.{decimals}f}"
    return f"{x:.6g}"
