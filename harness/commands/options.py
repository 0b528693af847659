"""The options of the verbs whose module takes them whole (resume, audit, calibrate, verify, bisect, runs, mark):
one frozen dataclass per verb, the API's (`harness.ResumeOptions`, ...: re-exported by api.py) and the verb
function's argument. Light on purpose: the API imports it at once, and audit and resume load torch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from harness.events import Listener

DEFAULT_MAX_PROBES = 24  # bisect: the replays it may run before it stops and says how far it got


@dataclass(frozen=True)
class CalibrateOptions:
    """`harness calibrate RUN_ID [KEY=VALUE ...] [--members K] [--steps M]`: the rounding envelope of a run's first M
    steps."""

    run_id: str  # a run, or a replay / audit of one (the run it was made from is calibrated)
    members: int | None = None  # default calibrate.DEFAULT_MEMBERS
    steps: int | None = None  # default: calibrate.DEFAULT_STEPS, or the run's steps when fewer
    tracking_uri: str | None = None
    on_event: Listener | None = None
    overrides: tuple[str, ...] = ()  # KEY=VALUE: only the secrets the record hides, given again as to replay


@dataclass(frozen=True)
class ResumeOptions:
    """`harness resume RUN_ID`: continue a FAILED or KILLED run from its last complete checkpoint."""

    run_id: str
    tracking_uri: str | None = None
    repo: Path | None = None
    on_event: Listener | None = None


@dataclass(frozen=True)
class AuditOptions:
    """`harness audit RUN_ID --segments K`: replay K random checkpoint-to-checkpoint segments of a FINISHED run."""

    run_id: str
    segments: int
    seed: int | None = None  # the draw's seed (default: random, recorded)
    tracking_uri: str | None = None
    repo: Path | None = None
    on_event: Listener | None = None


@dataclass(frozen=True)
class VerifyOptions:
    """`harness verify CLAIMS_FILE`: a paper's claims against the recorded studies and runs, optionally replayed."""

    claims_file: Path
    overrides: tuple[str, ...] = ()  # with replay and allow_changes: KEY=VALUE changes of the replays' config
    replay: bool = False  # replay each study or run the claims rest on (once) and judge the claims on the replays
    members: int | None = None  # replay: K members of each study (default: all)
    world_size: int | None = None
    allow_changes: bool = False
    executor: str | None = None
    tracking_uri: str | None = None
    on_event: Listener | None = None


@dataclass(frozen=True)
class BisectOptions:
    """`harness bisect GOOD BAD`: the commit or config key whose change flips GOOD's result into BAD's."""

    good: str
    bad: str
    max_probes: int = DEFAULT_MAX_PROBES  # replays it may run before it stops and says how far it got
    tracking_uri: str | None = None
    repo: Path | None = None  # the clone holding both runs' commits (default: the one holding the current folder)
    localize: bool = False  # trace the culprit's probe and name the first op that differs from GOOD
    resume: str | None = None  # an earlier bisect of GOOD and BAD, cut short: its probes are taken up
    on_event: Listener | None = None


@dataclass(frozen=True)
class RunsOptions:
    """`harness runs [EXPERIMENT]`: the newest runs, with their replays' verdicts."""

    experiment: str | None = None  # default: every experiment
    limit: int = 20
    tracking_uri: str | None = None
    on_event: Listener | None = None
    all: bool = False  # also the runs folded under the run they were made from (record/nesting.py)
    kind: str | None = None  # only runs of this harness.kind (folded ones too)
    status: str | None = None  # only runs with this status (RUNNING, FINISHED, FAILED, KILLED or STALE; folded ones too)


@dataclass(frozen=True)
class MarkOptions:
    """`harness mark RUN_ID --status FAILED|KILLED`: close a RUNNING run whose launcher is gone."""

    run_id: str
    status: str  # FAILED | KILLED (tags.INCOMPLETE)
    force: bool = False  # close a run that has no heartbeat tags
    tracking_uri: str | None = None
    on_event: Listener | None = None
