"""What the MLflow UI shows first for a harness experiment: every run and replay, one row each, with
the facts a reproducibility check is read from (verdict, world size, commit, image digest).

MLflow keeps a user's column choice in the browser, so a new reader (a co-author, a reviewer) would
see MLflow's default columns - none of these. What MLflow itself offers to carry a view to others
is a *shared view*: its state as JSON in the experiment tag `mlflow.sharedViewState.<key>`, opened
by `?viewStateShareKey=<key>`. harness writes one such view per experiment (key `harness`) and
links to it; a user can leave it ("Exit shared view") or save it as their own.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from typing import TYPE_CHECKING
from urllib.parse import quote

from harness import events, tags as T
from harness.errors import HarnessError

if TYPE_CHECKING:
    from harness.store.tracking import Tracker

VIEW_KEY = "harness"
# The UI's experiment "kind": without it MLflow 3 may open an experiment on its GenAI overview.
EXPERIMENT_KIND = "custom_model_development"


def _tag(name: str) -> str:
    return f"tags.`{name}`"  # the UI's canonical column key for a run tag


COLUMNS = [
    "attributes.`Run Name`",
    "attributes.`Created`",
    "attributes.`Duration`",
    _tag(T.VERDICT),
    _tag(T.KIND),
    _tag(T.SEED),  # a study's members differ only in it
    _tag(T.WORLD_SIZE),
    _tag(T.NNODES),
    _tag(T.GIT_COMMIT),
    _tag(T.GIT_DIRTY),
    _tag(T.IMAGE_DIGEST),
    _tag(T.EXECUTOR),
    _tag(T.REPLAY_OF),
    _tag(T.STUDY),
    # Speed beside the verdict (docs/performance.md): the slowest rank's median step, throughput, the profiled share.
    _tag(T.PERF_STEP_MAX_MEDIAN_S),
    _tag(T.PERF_SAMPLES_PER_S),
    _tag(T.PROFILE_COMM_SHARE),
]

VIEW = {
    # The UI nests child runs (replays, audits) under their parent, collapsed, whenever the table is
    # sorted by creation time; sorted by harness's own start-time tag (UTC ISO 8601: the same order)
    # it lists every run and replay as its own row, each with its verdict visible.
    "orderByKey": _tag(T.STARTED),
    "orderByAsc": False,
    "searchFilter": f"{_tag(T.VERSION)} LIKE '%'",  # runs made by harness
    "selectedColumns": COLUMNS,
    "columnOrder": COLUMNS,  # else the UI orders tag columns by name, the verdict last
    # Charts without data hidden (the only chart setting a shared view carries that is not per run); the link
    # adds `compareRunsMode=TABLE`, so the page opens on the table, not the charts.
    "hideEmptyCharts": True,
}


def experiment_tags() -> dict[str, str]:
    """The experiment tags that make the UI open a harness experiment on this view."""
    return {
        T.MLFLOW_EXPERIMENT_KIND: EXPERIMENT_KIND,
        T.MLFLOW_SHARED_VIEW_PREFIX + VIEW_KEY: json.dumps(VIEW, sort_keys=True),
    }


def link(base_url: str, experiment_id: str) -> str:
    """The experiment's training-runs page, opened on harness's view ("Model training", not GenAI)."""
    return (
        f"{base_url.rstrip('/')}/#/experiments/{quote(experiment_id)}/runs"
        f"?viewStateShareKey={VIEW_KEY}&workflowType=machine_learning&compareRunsMode=TABLE"
    )


# --- serving -------------------------------------------------------------------------------------
READY_TIMEOUT_S = 120.0  # a cold `mlflow server` answers in ~8 s here; a dead one is named, not waited on


def prepare(tracker: Tracker, experiment: str | None) -> str | None:
    """The experiment to open (given, else the one of the newest harness run), its view (re)written.

    None when the store holds no harness run yet: the UI then opens on its experiment list.
    """
    if experiment:
        exp_id = tracker.experiment_id_of(experiment)
    else:
        newest = tracker.search(max_results=1, filter_string=f"tags.`{T.VERSION}` LIKE '%'")
        if not newest:
            return None
        exp_id = newest[0].experiment_id
    try:
        tracker.set_ui_view(exp_id)
    except HarnessError as err:  # a read-only store still gets its UI, without harness's columns
        events.emit(events.Notice(f"note: the UI view could not be saved ({err}); the UI opens on MLflow's default "
                                  "columns."))
    return exp_id


def page(base_url: str, experiment_id: str | None) -> str:
    return link(base_url, experiment_id) if experiment_id else f"{base_url.rstrip('/')}/#/experiments"


def wait_ready(server: subprocess.Popen, base_url: str, timeout_s: float = READY_TIMEOUT_S) -> None:
    """Until the server answers /health; one line if it exits or does not answer in time."""
    deadline = time.monotonic() + timeout_s
    while True:
        if server.poll() is not None:
            raise HarnessError(
                f"the MLflow UI server exited with status {server.returncode} before it answered (see the "
                "lines above). Check that the port is free (--port) and the store is readable."
            )
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise HarnessError(
                    f"the MLflow UI server did not answer at {base_url} within {timeout_s:.0f} s. "
                    "Check the lines above, or try another --port."
                ) from None
            time.sleep(0.25)


def stop(server: subprocess.Popen) -> None:
    """The server and its worker go with `harness ui`, whoever stops it."""
    if server.poll() is not None:
        return
    try:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=10)
    except ProcessLookupError:
        pass
