"""Runs made from another run (a replay, an audit, a trace, a study replay, a calibration) or from a claims file (a
verify run).

One place says how such a run is recorded: its kind, the tag naming the run it was made from, the MLflow
parent it is nested under, the facts it carries from its source and the machine it ran on; and how it
closes: FINISHED when its body completes, KILLED on Ctrl-C, FAILED with the error as its status reason on
any other error (never left RUNNING), and marked alive meanwhile (its heartbeat: a command killed outright leaves a
run `harness runs` shows STALE and `harness mark` closes). A training replay's run is opened by `harness run`'s recorder
(record/newrun.py create_record), which closes it when the ranks end: `opened(..., close=False)`. And which run a
command given a derived run means: the one it was made from (`followed`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

from harness import events, tags as T
from harness.configschema import ExperimentConfig
from harness.errors import Interrupted
from harness.record import closing
from harness.record.provenance import runtime_facts
from harness.rundata import RunSummary
from harness.store.tracking import Tracker

# kind -> the tag naming the run it was made from
OF_TAG: dict[str, str] = {T.KIND_REPLAY: T.REPLAY_OF, T.KIND_STUDY_REPLAY: T.REPLAY_OF, T.KIND_AUDIT: T.AUDIT_OF, T.KIND_TRACE: T.TRACE_OF,
          T.KIND_CALIBRATION: T.CALIBRATION_OF}


def tags(
    kind: str,
    source: RunSummary | None = None,
    *,
    parent: str | None = None,
    version: str | None = None,
    runtime: bool = False,
    copy: tuple[str, ...] = (),
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The tags of a run of `kind` made from `source`: its of-tag and MLflow parent (`parent`, default the source).

    `version`: the harness version tag (a run recorded by `harness run`'s recorder gets its own); `runtime`: the
    facts of the machine it runs on (an audit or a trace re-executes here); `copy`: tags carried from the source
    when it has them; `extra`: the kind's own tags.
    """
    out = {T.VERSION: version} if version is not None else {}
    out[T.KIND] = kind
    if source is not None:
        out[OF_TAG[kind]] = source.run_id
        out[T.MLFLOW_PARENT_RUN_ID] = parent or source.run_id
        out.update({name: source.tags[name] for name in copy if source.tags.get(name)})
    elif parent is not None:
        out[T.MLFLOW_PARENT_RUN_ID] = parent
    if runtime:
        out.update({T.ENV_PREFIX + k: v for k, v in runtime_facts().items()})
    out.update(extra or {})
    return out


# The kinds a command on a run follows to the run they were made from (a trace is not followed: the loader refuses it).
FOLLOWED = {kind: OF_TAG[kind] for kind in (T.KIND_REPLAY, T.KIND_STUDY_REPLAY, T.KIND_AUDIT)}


def followed(tracker: Tracker, run: RunSummary, doing: str) -> RunSummary:
    """The run a replay or an audit was made from (and so on), which is what replaying or calibrating it means; one
    line says each step, e.g. "run R is a replay of O; calibrating O" (`doing`: "calibrating")."""
    seen = {run.run_id}
    while (tag := FOLLOWED.get(run.tags.get(T.KIND, ""))) and run.tags.get(tag):
        source = tracker.harness_run(run.tags[tag])
        if source.run_id in seen:  # a hand-edited tag could close a loop
            break
        events.emit(events.Notice(f"run {run.run_id} is {'an audit' if tag == T.AUDIT_OF else 'a replay'} of "
                                  f"{source.run_id}; {doing} {source.run_id}"))
        seen.add(source.run_id)
        run = source
    return run


@contextlib.contextmanager
def opened(tracker: Tracker, experiment: str, run_tags: Mapping[str, str], run_name: str | None, *,
           close: bool = True, heartbeat_s: float = ExperimentConfig.heartbeat_s) -> Iterator[str]:
    """Create the run and yield its id; it ends FINISHED when the body completes (unless `close` is False: its
    launcher ends it, and marks it alive), KILLED on Ctrl-C, FAILED with the error as harness.status_reason on any
    other error. While the body runs here, the run's heartbeat is written every `heartbeat_s`."""
    run_id = tracker.create_run(experiment, dict(run_tags), run_name=run_name)
    heartbeat = None
    try:
        if close:
            heartbeat = tracker.heartbeat(run_id, heartbeat_s)
        yield run_id
    except BaseException as err:
        status = T.KILLED if isinstance(err, (KeyboardInterrupt, Interrupted)) else T.FAILED
        if heartbeat is not None:
            heartbeat.close()
        # The store that failed may refuse the reason too; the close must still come.
        closing.close(tracker, run_id, status, closing.error_reason(err), reason_may_fail=True)
        raise
    if heartbeat is not None:
        heartbeat.close()  # before the close: no beat lands on a closed run
    if close:
        closing.close(tracker, run_id, T.FINISHED)
