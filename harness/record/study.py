"""What a recorded study is: its run (kind study), its seeds, and its member runs (tagged with the study's id).

`harness run --seeds N` records one (commands/study.py); replay, compare, verify and the API's study routing read it
here, so that none of them imports another verb to learn what a study is.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness import tags as T
from harness.errors import RunRefused
from harness.store.tracking import RunRecord, RunSummary, Tracker


@dataclass
class StudyRecord:
    """A recorded study: its run, its seeds, and its member runs in seed order."""

    run: RunSummary
    seeds: list[int]
    members: list[RunSummary]

    @property
    def run_id(self) -> str:
        return self.run.run_id


def is_study(run: RunSummary) -> bool:
    return run.tags.get(T.KIND) == T.KIND_STUDY


def members_of(tracker: Tracker, study_id: str) -> list[RunSummary]:
    """The member runs of a study (any status), in no particular order."""
    return tracker.search(filter_string=f"tags.`{T.STUDY}` = '{study_id}'", max_results=10_000)


def load_study(tracker: Tracker, study_id: str) -> StudyRecord:
    run = tracker.harness_run(study_id)
    if not is_study(run):
        raise RunRefused(f"run {study_id} is a {run.tags.get(T.KIND, 'run')}, not a study (harness run --seeds N).")
    seeds = [int(s) for s in run.tags.get(T.STUDY_SEEDS, "").split(",") if s]
    members = members_of(tracker, study_id)
    order = {s: i for i, s in enumerate(seeds)}
    members.sort(key=lambda m: order.get(int(m.tags.get(T.SEED, "-1")), len(order)))
    return StudyRecord(run, seeds, members)


def member_records(tracker: Tracker, study: StudyRecord) -> list[RunRecord]:
    """The FINISHED members' records (what the study's spread is computed from)."""
    return [tracker.load_record(m.run_id) for m in study.members if m.status == T.FINISHED]
