"""The verdicts a replay or a comparison gets: each one's exit code, its words, and its place in every named policy.

A policy names a question that commands ask of a verdict ("is this the same training?", "did it reproduce?"), so
that each question is answered here and nowhere else. Adding a verdict is one member below, with its row, plus
the judge that gives it (harness/judge/compare.py, rounding.py, noise.py). Every row answers every policy, so no
command has to guess what a new verdict means for its question.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from harness.errors import EXIT_FAILED, EXIT_OK


class Policy(str, Enum):
    """The questions asked of a verdict, from the strictest. Each verdict's row answers every one."""

    # Bit for bit, or its last bits differing only as a calibrated run's rounding makes them differ: a study
    # replay is WITHIN_ROUNDING when every member is this.
    SAME_TRAINING = "same training"
    # The same result by the reference's tolerance, the seeds left out: a bisect probe that is this keeps the change
    # it carries innocent (and two runs that are this leave nothing to bisect); a study replay is WITHIN_TOLERANCE
    # when every member is this, and only a member that is not is judged against the seeds.
    WITHIN_TOLERANCE = "within tolerance"
    # A pass: exit 0 for replay, compare and a study replay; a claim's replay (verify --replay) must be this.
    REPRODUCED = "reproduced"
    # Nothing a calibration's envelope or a study's seeds could judge again: bit-identical, or nothing compared.
    SETTLED = "settled"


@dataclass(frozen=True)
class Row:
    exit_code: int  # the exit code of replay and compare for this verdict
    words: str  # "the replay ... (exit code N)" in the replay report
    colour: str  # its cell in the claims report (verify's HTML)
    policies: dict[Policy, bool]  # every policy, and whether this verdict meets it


class Verdict(str, Enum):
    """A verdict, as its name: a plain string wherever one is stored, printed or compared (tags, JSON, lines)."""

    BITWISE = "BITWISE"
    # Not bit-identical, but inside the rounding envelope a calibration measured (rounding.py): the same training,
    # its last bits differing as another machine's rounding makes them differ.
    WITHIN_ROUNDING = "WITHIN_ROUNDING"
    WITHIN_TOLERANCE = "WITHIN_TOLERANCE"
    # Outside the tolerance, but where a new seed could have landed: judged against a study's spread (noise.py).
    WITHIN_NOISE = "WITHIN_NOISE"
    # Inside the seeds' noise, but by intervals so wide that a doubled learning rate would have passed too
    # (noise.Power): no evidence either way, so no pass.
    INCONCLUSIVE = "INCONCLUSIVE"
    DIVERGED = "DIVERGED"
    # Neither run logged a metric or a fingerprint: agreement would be vacuous, so it is not a pass.
    NOTHING_TO_COMPARE = "NOTHING_TO_COMPARE"

    # Its name, not `Verdict.BITWISE`, in f-strings and str() on every Python harness supports.
    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @property
    def row(self) -> Row:
        return ROWS[self]

    @property
    def exit_code(self) -> int:
        return self.row.exit_code

    def meets(self, policy: Policy) -> bool:
        return self.row.policies[policy]


def _row(exit_code: int, words: str, colour: str, *met: Policy) -> Row:
    return Row(exit_code, words, colour, {p: p in met for p in Policy})


_P = Policy
ROWS: dict[Verdict, Row] = {
    Verdict.BITWISE: _row(EXIT_OK, "bit-identical to the original", "#c8f0c8",
                          _P.SAME_TRAINING, _P.WITHIN_TOLERANCE, _P.REPRODUCED, _P.SETTLED),
    Verdict.WITHIN_ROUNDING: _row(
        EXIT_OK, "not bit-identical, but inside the rounding envelope of the original's calibration", "#d2f2c8",
        _P.SAME_TRAINING, _P.WITHIN_TOLERANCE, _P.REPRODUCED),
    Verdict.WITHIN_TOLERANCE: _row(EXIT_OK, "within tolerance of the original", "#dff5c8",
                                   _P.WITHIN_TOLERANCE, _P.REPRODUCED),
    Verdict.WITHIN_NOISE: _row(EXIT_OK, "outside the tolerance, but where a new seed of the study could have landed",
                               "#eef5c0", _P.REPRODUCED),
    Verdict.INCONCLUSIVE: _row(
        EXIT_FAILED, "inside the seeds' noise, but by intervals too wide to have caught a doubled learning rate",
        "#ffd9a8"),
    Verdict.DIVERGED: _row(EXIT_FAILED, "diverged from the original", "#f7b8b8"),
    Verdict.NOTHING_TO_COMPARE: _row(EXIT_FAILED, "could not be judged: neither run logged a metric or a fingerprint",
                                     "#f7b8b8", _P.SETTLED),
}


def verdicts(policy: Policy) -> tuple[Verdict, ...]:
    """The verdicts that meet `policy`, in their documented order."""
    return tuple(v for v in Verdict if v.meets(policy))


def meets(verdict: str | None, policy: Policy) -> bool:
    """Whether `verdict` (a tag's text, say) meets `policy`; a name that is no verdict (a run's status) meets none."""
    try:
        return verdict is not None and Verdict(verdict).meets(policy)
    except ValueError:
        return False


def listed(policy: Policy) -> str:
    """The verdicts that meet `policy` as words: "BITWISE, WITHIN_ROUNDING, WITHIN_TOLERANCE or WITHIN_NOISE"."""
    names = [v.value for v in verdicts(policy)]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def exit_code(verdict: str) -> int:
    """The exit code of `verdict`; a name that is no verdict fails (EXIT_FAILED)."""
    return EXIT_OK if meets(verdict, Policy.REPRODUCED) else EXIT_FAILED


def tone(verdict: str) -> str | None:
    """How a terminal marks `verdict`: "pass" where it meets REPRODUCED, "fail" for DIVERGED (shown to differ),
    "unsure" for the others (no pass, and no difference shown: INCONCLUSIVE, NOTHING_TO_COMPARE); None for a name
    that is no verdict."""
    try:
        found = Verdict(verdict)
    except ValueError:
        return None
    if found.meets(Policy.REPRODUCED):
        return "pass"
    return "fail" if found is Verdict.DIVERGED else "unsure"
