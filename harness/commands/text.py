"""The verbs' results as the command line prints them: lines of text, the last one a `verdict: ...` line, and the
tone a verdict is marked in; a tracking store's failure as its one line.

The CLI imports only the commands and the leaves (the import contract in pyproject.toml): what it prints of a
comparison or a study replay is rendered here from the result it was handed, by the judge's one rendering of each
(harness/judge/text.py); an extra renders its own results (harness/extras).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from harness.errors import HarnessError

if TYPE_CHECKING:
    from harness.commands.replay import ReplayResult, StudyReplayResult
    from harness.judge.compare import Comparison

__all__ = ["comparison_lines", "replay_lines", "store_failure", "tone"]


def comparison_lines(comparison: Comparison) -> list[str]:
    """`harness compare` of two runs: the delta and the evidence, then `verdict: ...`."""
    from harness.judge.text import comparison_lines as lines, verdict_line

    return [*lines(comparison, []), verdict_line(comparison)]


def replay_lines(result: ReplayResult | StudyReplayResult) -> list[str]:
    """`harness replay`: a replay's comparison with its changes and where it was localized (a study replay: each
    member's verdict and the equivalence tests), then `verdict: ...`. Empty for a node that did not judge it."""
    from harness.commands.replay import StudyReplayResult
    from harness.judge.text import comparison_lines as lines, study_replay_lines, verdict_line

    if isinstance(result, StudyReplayResult):
        return study_replay_lines(result)
    if result.comparison is None:  # another node of a multi-node replay: node 0 judges it
        return []
    localized = result.localized.lines() if result.localized is not None else []
    return [*lines(result.comparison, result.changes), *localized, verdict_line(result.comparison)]


def tone(verdict: str) -> str | None:
    """How a terminal marks `verdict` (harness/judge/verdicts.py): pass, fail, unsure; None for no verdict's name."""
    from harness.judge.verdicts import tone as verdict_tone

    return verdict_tone(verdict)


def store_failure(err: BaseException, tracking_uri: str | None) -> HarnessError | None:
    """A tracking store's failure that got past the Tracker (MLflow, SQLAlchemy or HTTP) as its one-line error,
    naming the store; None for any other error (a bug, to show as one)."""
    from harness.store.failures import is_store_error, store_failure as failure
    from harness.store.reach import resolve_uri

    return failure(err, resolve_uri(tracking_uri)) if is_store_error(err) else None
