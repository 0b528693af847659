"""A command's result as one JSON document: what `--json` prints, one schema per command (docs/json.md).

Every document carries `command`, `schema` (this module's SCHEMA, raised when a key changes meaning or goes),
`exit_code` and `exit_meaning` (the code's meaning for that command), then the command's own keys; `run_id` is
always the run the command made or names as its result (the id its text output prints last). A refused
command's document is the same head with `error`, the one line the text output prints. inf and nan are the
strings "inf", "-inf" and "nan", so that every document is strict JSON.

A result that is a dataclass is its document: each field under its name (`keys`), with the renames, the fields left
out and the values added that the documented shape (docs/json.md) names beside it, so that a field added to a result
reaches `--json` without a line here.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, fields, is_dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.commands.bundle import ExportResult, ImportResult
from harness.commands.calibrate import Calibration
from harness.commands.replay import ReplayResult, StudyReplayResult, study_document
from harness.commands.run import Preflight
from harness.commands.study import StudyOutcome
from harness.errors import EXIT_FAILED, EXIT_OK, EXIT_SIGINT, EXIT_SIGTERM, EXIT_USAGE
from harness.executors import Outcome
from harness.extensions import Compared
from harness.fmt import json_safe
from harness.judge.compare import Comparison
from harness.judge.verdicts import Policy, listed
from harness.rundata import RunSummary

if TYPE_CHECKING:  # audit loads torch at import; its result is only read here (compare stays light)
    from harness.commands.audit import AuditResult

SCHEMA = 1

_BAD_INPUT = "bad input: refused in one line, nothing recorded"
TRACES = "compare (two traces)"  # compare's meanings where it compares two traces
_INTERRUPTED = {EXIT_SIGINT: "interrupted (SIGINT)", EXIT_SIGTERM: "terminated (SIGTERM)"}

# What each command's exit codes mean (the same as its --help and docs/troubleshooting.md).
EXIT_MEANINGS: dict[str, dict[int, str]] = {
    "run": {EXIT_OK: "the run finished (a study: every member did)", EXIT_FAILED: "the training failed or was stopped",
            EXIT_USAGE: _BAD_INPUT},
    "resume": {EXIT_OK: "the resumed run finished", EXIT_FAILED: "the training failed again", EXIT_USAGE: _BAD_INPUT},
    "check": {EXIT_OK: "`harness run` would start", EXIT_USAGE: "`harness run` would refuse (the error says why)"},
    "replay": {EXIT_OK: f"reproduced ({listed(Policy.REPRODUCED)})",
               EXIT_FAILED: "diverged, inconclusive, nothing to compare, or the replay failed", EXIT_USAGE: _BAD_INPUT},
    "compare": {EXIT_OK: "reproduced", EXIT_FAILED: "diverged or nothing to compare",
                EXIT_USAGE: "bad input (compare records nothing)"},
    TRACES: {EXIT_OK: "the traces are identical", EXIT_FAILED: "the traces differ",
              EXIT_USAGE: "bad input (compare records nothing)"},
    "calibrate": {EXIT_OK: "calibrated",
                  EXIT_FAILED: "a member failed, or the store failed once the calibration was recorded (said what it left)",
                  EXIT_USAGE: _BAD_INPUT},
    "audit": {EXIT_OK: "every drawn segment reproduced", EXIT_FAILED: "a segment did not", EXIT_USAGE: _BAD_INPUT},
    "trace": {EXIT_OK: "traced", EXIT_FAILED: "the ranks failed", EXIT_USAGE: _BAD_INPUT},
    "bisect": {EXIT_OK: "a culprit was found", EXIT_FAILED: "no culprit was found (`unresolved` says why)",
               EXIT_USAGE: _BAD_INPUT},
    "verify": {EXIT_OK: "every claim holds", EXIT_FAILED: "a claim does not hold", EXIT_USAGE: _BAD_INPUT},
    "runs": {EXIT_OK: "listed", EXIT_USAGE: "bad input (an unknown experiment, no store)"},
    "export": {EXIT_OK: "written", EXIT_USAGE: "bad input: nothing written"},
    "import": {EXIT_OK: "imported, or already in this store", EXIT_USAGE: "refused: nothing imported"},
    "attest": {EXIT_OK: "written", EXIT_USAGE: "refused: nothing written"},
    "verify-record": {EXIT_OK: "the attestation holds", EXIT_USAGE: "refused (`error` says which check failed)"},
    "mark": {EXIT_OK: "closed", EXIT_USAGE: "refused: the run is unchanged"},
}


def meaning(command: str, exit_code: int) -> str:
    """What `exit_code` means for `command` (a code the command does not document: "unexpected")."""
    return EXIT_MEANINGS.get(command, {}).get(exit_code) or _INTERRUPTED.get(exit_code, "unexpected")


def document(command: str, exit_code: int, body: Mapping[str, Any], meanings: str | None = None) -> dict[str, Any]:
    """The head every document starts with, then the command's own keys (`meanings`: another table's exit meanings)."""
    head = {"command": command, "schema": SCHEMA, "exit_code": exit_code,
            "exit_meaning": meaning(meanings or command, exit_code)}
    return {**head, **json_safe(dict(body))}


def error(command: str, exit_code: int, message: str) -> dict[str, Any]:
    """A refused or failed command: the head and the one line its text output prints (without `Error: `)."""
    return document(command, exit_code, {"error": message})


def dumps(doc: Mapping[str, Any]) -> str:
    return json.dumps(doc, indent=2, allow_nan=False)


def keys(result: Any, *, rename: Mapping[str, str] | None = None, drop: Iterable[str] = (),
         **added: Any) -> dict[str, Any]:
    """A result dataclass as a document's keys: every field by its name (or `rename`'s), less `drop`, then `added`
    (what a property or a method says; an added key replaces a field's). A value that is a dataclass is its fields, one
    with `to_dict` that document, a path its string."""
    left_out, renamed = set(drop), dict(rename or {})
    body = {renamed.get(f.name, f.name): plain(getattr(result, f.name)) for f in fields(result)
            if f.name not in left_out}
    return {**body, **added}


def plain(value: Any) -> Any:
    """A field's value as a document holds it."""
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if is_dataclass(value) and not isinstance(value, type):
        return asdict(value)
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    return value


# -- one function per result type ------------------------------------------------------------------------
def run(command: str, outcome: Outcome | StudyOutcome, summary: RunSummary | None = None) -> dict[str, Any]:
    """`run` and `resume`: the run (or study) id, its name, how it ended; a study's members."""
    study = isinstance(outcome, StudyOutcome)
    return document(command, outcome.exit_code, {
        "run_id": outcome.run_id,
        "name": summary.run_name if summary is not None else None,
        "experiment": summary.experiment if summary is not None else None,
        "kind": "study" if study else "run",
        "status": outcome.status,
        "message": outcome.message or None,
        "members": [{"seed": m.seed, "run_id": m.run_id or None, "status": m.status, "error": m.error or None}
                    for m in outcome.members] if isinstance(outcome, StudyOutcome) else [],
    })


def check(checked: Preflight, experiment_dir: str) -> dict[str, Any]:
    """`check`: what `harness run` would run; `study` the seeds when the config makes it a study."""
    cfg = checked.cfg
    return document("check", EXIT_OK, {
        "ok": True, "experiment_dir": experiment_dir, "world_size": int(cfg.world_size), "seed": int(cfg.seed),
        "commit": checked.git.commit, "dirty": bool(checked.git.dirty), "warnings": list(checked.warnings),
        "study": None if cfg.seeds is None else {"seeds": [int(s) for s in cfg.seeds]},
    })


def replay(result: ReplayResult | StudyReplayResult) -> dict[str, Any]:
    """`replay`: the replay's id, the run it replayed, the verdict; the whole comparison (a study: its members)."""
    if isinstance(result, StudyReplayResult):
        doc = study_document(result)
        return document("replay", result.exit_code, {
            "run_id": result.run_id, "replay_of": doc.pop("study_id"), "kind": "study_replay", **doc})
    if result.comparison is None:  # another node of a multi-node replay: node 0 judges it
        return document("replay", result.outcome.exit_code, {
            "run_id": result.outcome.run_id, "replay_of": result.original.run_id, "kind": "replay",
            "status": result.outcome.status, "verdict": None, "summary": None, "judged_on": "node 0",
            "changes": result.changes, "comparison": None, "localized": None,
        })
    cmp = result.comparison
    return document("replay", cmp.exit_code, {
        "run_id": result.outcome.run_id, "replay_of": result.original.run_id, "kind": "replay",
        "status": result.outcome.status, "verdict": cmp.verdict, "summary": cmp.summary(), "changes": result.changes,
        "comparison": cmp.to_dict(),
        "localized": result.localized.lines() if result.localized is not None else None,
    })


def compare(found: Comparison | Compared) -> dict[str, Any]:
    """`compare`: two runs (the comparison's keys at the top, `run_a`/`run_b` and their `relation`), or what an
    extra compares (two traces: its own document)."""
    if not isinstance(found, Comparison):
        return found.document()
    return document("compare", found.exit_code, found.to_dict())


def calibrate(done: Calibration) -> dict[str, Any]:
    return document("calibrate", EXIT_OK, keys(done, summary=done.summary(), rename={
        "calibration_id": "run_id", "run_id": "calibrated", "member_ids": "members", "reference_id": "reference"}))


def audit(result: AuditResult) -> dict[str, Any]:
    return document("audit", result.exit_code, keys(
        result, rename={"audit_id": "run_id", "run_id": "audited", "drawn": "segments"}, summary=result.summary(),
        catch_probability=result.catch_probability, step_fraction=result.step_fraction))


def runs(listed: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    return document("runs", EXIT_OK, {"runs": list(listed)})


def export(result: ExportResult, attestation: str | None) -> dict[str, Any]:
    return document("export", EXIT_OK, keys(result, drop=("signed",), attestation=attestation))


def import_(result: ImportResult) -> dict[str, Any]:
    return document("import", EXIT_OK, keys(result))


def mark(run_id: str, status: str, reason: str) -> dict[str, Any]:
    return document("mark", EXIT_OK, {"run_id": run_id, "status": status, "reason": reason})
