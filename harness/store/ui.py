"""What the MLflow UI shows first for a harness experiment: every run, one row each, with what was made from it
folded under it, and the facts a reproducibility check is read from (verdict, world size, commit, image digest).

MLflow keeps a user's column choice in the browser, so a new reader (a co-author, a reviewer) would
see MLflow's default columns - none of these. What MLflow itself offers to carry a view to others
is a *shared view*: its state as JSON in the experiment tag `mlflow.sharedViewState.<key>`, opened
by `?viewStateShareKey=<key>`. harness writes one such view per experiment (key `harness`) and
links to it; a user can leave it ("Exit shared view") or save it as their own.

This module also owns the life of the server `harness ui` runs on a local store: its port (UI_PORT unless
given), its start in a process group of its own, the wait until it answers (READY_TIMEOUT_S) and its stop
(STOP_TIMEOUT_S), and the note that says which `harness ui` serves a store, so that other commands link to it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote, urlsplit

from harness import events, scratch, tags as T
from harness.errors import HarnessError
from harness.rundata import UiLinks
from harness.store.fastpath import mlflow_file
from harness.store.uris import artifact_path, artifact_root, default_uri, display_uri

if TYPE_CHECKING:
    from harness.rundata import RunSummary
    from harness.store.tracking import Tracker

VIEW_KEY = "harness"
# The UI's experiment "kind": without it MLflow 3 may open an experiment on its GenAI overview.
EXPERIMENT_KIND = "custom_model_development"
# MLflow 3's UI picks its sidebar and pages by a workflow type: the link's `workflowType`, else the reader's last
# choice kept in the browser, else GenAI (its JS: the `mlflow.workflowType` local-storage key, initial value "genai").
# Every link harness prints says "machine_learning": the training runs' table and run pages, not traces and prompts.
WORKFLOW = "workflowType=machine_learning"
# Not MLflow's 5000: a local Docker registry (the docker executor's) usually listens there.
UI_PORT = 5050
CURVES_NAMED = 4  # the metric plots `curves` names; past them, how many more


def _tag(name: str) -> str:
    return f"tags.`{name}`"  # the UI's canonical column key for a run tag


COLUMNS = [
    "attributes.`Run Name`",
    "attributes.`Created`",
    "attributes.`Duration`",
    _tag(T.VERDICT),
    _tag(T.REPLAYS),  # an original's row: its replays' verdicts, as `harness runs` shows them
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
    # The UI nests child runs (mlflow.parentRunId) under their parent, collapsed, only while the table is sorted by
    # creation time (a filtered one too): what was made from a run - replays, calibrations, traces, audits, a study's
    # seeds - folds under its row, which shows its replays' verdicts counted (harness.replays).
    "orderByKey": "attributes.start_time",
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
        f"?viewStateShareKey={VIEW_KEY}&{WORKFLOW}&compareRunsMode=TABLE"
    )


def run_link(base_url: str, experiment_id: str, run_id: str) -> str:
    """One run's page, in the model-training view."""
    return f"{base_url.rstrip('/')}/#/experiments/{quote(experiment_id)}/runs/{quote(run_id)}?{WORKFLOW}"


def hint(uri: str, experiment_id: str, run_id: str) -> str:
    """Where to look at a run: on the store's server, on the `harness ui` serving this store now, else the command
    that starts one and the link it will answer at (its default port)."""
    return _hint(uri, server_url(uri) or served_at(uri), experiment_id, run_id)


def _hint(uri: str, base: str | None, experiment_id: str, run_id: str) -> str:
    if base:
        return f"Open it in the MLflow UI: {run_link(base, experiment_id, run_id)}"
    store = "" if uri == default_uri() else f" --tracking-uri {display_uri(uri)}"  # never a password on the terminal
    return f"Open it in the MLflow UI: harness ui{store}, then {run_link(f'http://127.0.0.1:{UI_PORT}', experiment_id, run_id)}"


def links(uri: str, run: RunSummary, curves_too: bool = False) -> UiLinks:
    """Where to look at `run`: its page while a UI serves the store, the line that says it, and (`curves_too`: a
    judged replay) where its curves are."""
    base = server_url(uri) or served_at(uri)
    return UiLinks(page=run_link(base, run.experiment_id, run.run_id) if base else None,
                   hint=_hint(uri, base, run.experiment_id, run.run_id),
                   curves=tuple(curves(uri, run)) if curves_too else ())


def compare_link(base_url: str, run_ids: list[str], experiment_ids: list[str]) -> str:
    """MLflow's compare page of `run_ids`: their params side by side and every metric's curves overlaid."""
    runs, experiments = json.dumps(run_ids, separators=(",", ":")), json.dumps(sorted(set(experiment_ids)),
                                                                              separators=(",", ":"))
    return f"{base_url.rstrip('/')}/#/compare-runs?runs={quote(runs)}&experiments={quote(experiments)}&{WORKFLOW}"


OVERLAID = 6  # replays shown beside their run on the compare page, the newest first


def overlay(tracker: Tracker, experiment_id: str | None) -> tuple[str, list[str]] | None:
    """The run of the experiment's newest replay and its newest replays (up to OVERLAID): what `harness ui` offers to
    open overlaid. None when the experiment holds no replay."""
    replays = [r for r in tracker.search(max_results=50, filter_string=f"tags.`{T.KIND}` = '{T.KIND_REPLAY}'")
               if experiment_id is None or r.experiment_id == experiment_id]
    original = next((r.tags.get(T.REPLAY_OF) for r in replays if r.tags.get(T.REPLAY_OF)), None)
    if original is None:
        return None
    return original, [r.run_id for r in replays if r.tags.get(T.REPLAY_OF) == original][:OVERLAID]


def curves(uri: str, run: RunSummary) -> list[str]:
    """Where a judged replay's pictures are: its replay/ artifacts (metric_<name>.png, the original's and the replay's
    curves overlaid; report.md), as a path on this machine when the artifacts are local, else as their URI; and their
    page in the MLflow UI when one serves the store."""
    folder = artifact_path(run.artifact_uri) if run.artifact_uri else None
    if folder is not None:
        plots = folder / T.ARTIFACT_PLOTS_DIR
        names = sorted(p.name for p in plots.glob("metric_*.png")) if plots.is_dir() else []
        shown = ", ".join(names[:CURVES_NAMED]) + (f" and {len(names) - CURVES_NAMED} more" if len(names) > CURVES_NAMED
                                                   else "")
        lines = [f"Curves (original and replay overlaid) in {plots}: {shown or 'metric_<name>.png'}; "
                 f"the report: {folder / T.ARTIFACT_REPORT}"]
    else:
        where = f"{run.artifact_uri.rstrip('/')}/{T.ARTIFACT_PLOTS_DIR}"
        lines = [f"Curves (original and replay overlaid) in {where}: metric_<name>.png; the report: {where}/report.md"]
    base = server_url(uri) or served_at(uri)
    if base:
        lines.append(f"See them in the MLflow UI: {base.rstrip('/')}/#/experiments/{quote(run.experiment_id)}/runs/"
                     f"{quote(run.run_id)}/artifacts/{T.ARTIFACT_PLOTS_DIR}?{WORKFLOW}")
        original = run.tags.get(T.REPLAY_OF)
        if original:
            lines.append(f"Overlaid with its run, every metric: {compare_link(base, [original, run.run_id], [run.experiment_id])}")
    return lines


# --- which `harness ui` serves a store -----------------------------------------------------------
# `harness ui` says where it serves a store in a small file (one per store) for as long
# as it runs (in harness's cache folder, scratch.cache_dir), so that `run` and `replay` print links with the port it
# actually listens on.


def _announcement(uri: str) -> Path:
    from harness.store.uris import absolute_uri

    return scratch.cache_dir() / "ui" / f"{hashlib.sha256(absolute_uri(uri).encode()).hexdigest()[:16]}.json"


def link_base(host: str, port: int) -> str:
    """The address a browser on this machine opens for a server bound to host:port (a wildcard: the loopback)."""
    host = "127.0.0.1" if host in ("", "0.0.0.0") else "::1" if host == "::" else host
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


@contextlib.contextmanager
def announced(uri: str, base_url: str) -> Iterator[None]:
    """While the block runs, `served_at(uri)` answers base_url. Nothing is said where the cache cannot be written:
    the links then name the default port, as before a UI runs."""
    path = _announcement(uri)
    mine = json.dumps({"pid": os.getpid(), "url": base_url})
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(mine, encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        yield
        return
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            if path.read_text(encoding="utf-8") == mine:  # a later `harness ui` of the same store took it over
                path.unlink()


def served_at(uri: str) -> str | None:
    """The address of the `harness ui` serving `uri` now; None when none does (or it left a stale file behind)."""
    try:
        said = json.loads(_announcement(uri).read_text(encoding="utf-8"))
        pid, url = int(said["pid"]), str(said["url"])
        if not scratch.alive(pid):  # killed with SIGKILL, the `harness ui` that wrote it left the file behind
            return None
        parts = urlsplit(url)
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 80), timeout=0.5):
            return url
    except (OSError, ValueError, KeyError, TypeError):
        return None


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


def start(uri: str, host: str, port: int) -> subprocess.Popen:
    """MLflow's UI server on the store at host:port, started now (it answers seconds later: wait_ready).

    Its own process group: the server's worker goes with it, whoever stops it (stop). Its log goes to stderr: the
    caller's stdout carries only what the caller prints.
    """
    cmd, env = ui_command(uri, host, port)
    return subprocess.Popen(cmd, env=env, start_new_session=True, stdout=sys.stderr)


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


STOP_TIMEOUT_S = 10.0  # a server that ignores SIGTERM this long is killed


def stop(server: subprocess.Popen, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """The server and its worker (its process group), asked to stop, then killed past `timeout_s`."""
    if server.poll() is not None:
        return
    try:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=timeout_s)
    except ProcessLookupError:
        pass


def server_url(uri: str) -> str | None:
    """The web address of an http(s) tracking store, without credentials; None for a local or database store."""
    shown = display_uri(uri)
    return shown.rstrip("/") if shown.split("://", 1)[0].lower() in ("http", "https") else None


_QUIET_WARNINGS = ("ignore::DeprecationWarning", "ignore::PendingDeprecationWarning", "ignore::FutureWarning",
                   "ignore:starlette:UserWarning")


def ui_command(uri: str, host: str, port: int) -> tuple[list[str], dict[str, str]]:
    """MLflow's UI server on this store, as an argument list and its environment.

    What `mlflow server --workers 1` runs, started directly: that command imports MLflow (~3 s here)
    only to start uvicorn, which imports it again; by default it also runs 4 workers and a job runner
    with 7 consumers. The UI is for one reader: one uvicorn process, no job runner, started with the
    environment `mlflow server` gives it (MLflow 3's server reads its settings from these variables).
    """
    root = artifact_root(uri)
    # Its own warnings only: no line per request or per start-up stage, no access log.
    cmd = [sys.executable, "-m", "uvicorn", "--host", host, "--port", str(port), "--workers", "1",
           "--log-level", "warning", "--no-access-log"]
    log_config = mlflow_file("server", "uvicorn_log_config.yaml")
    if log_config is not None:
        cmd += ["--log-config", str(log_config)]
    cmd.append("mlflow.server.fastapi_app:app")
    env = {
        **os.environ,
        # A reader of the UI has no use for MLflow's INFO lines or its dependencies' deprecation warnings (Starlette's
        # WSGI middleware on every start: a UserWarning whose text starts with "starlette"); errors and other
        # warnings still show.
        "MLFLOW_LOGGING_LEVEL": "WARNING",
        "PYTHONWARNINGS": ",".join(filter(None, [os.environ.get("PYTHONWARNINGS"), *_QUIET_WARNINGS])),
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        "MLFLOW_SERVER_X_FRAME_OPTIONS": "SAMEORIGIN",
        "MLFLOW_ENABLE_WORKSPACES": "false",
        "MLFLOW_TRACKING_URI": uri,
        "MLFLOW_REGISTRY_URI": uri,
        "MLFLOW_SERVER_SECRETS_CACHE_TTL": "60",
        "MLFLOW_SERVER_SECRETS_CACHE_MAX_SIZE": "1000",
        "_MLFLOW_SERVER_FILE_STORE": uri,
        "_MLFLOW_SERVER_REGISTRY_STORE": uri,
        "_MLFLOW_SERVER_SERVE_ARTIFACTS": "true",
        "_MLFLOW_SERVER_ARTIFACT_DESTINATION": "./mlartifacts",
        "_MLFLOW_SERVER_BOOT_ID": os.urandom(16).hex(),
        "_MLFLOW_IN_JOB_EXECUTOR": "false",
        "_MLFLOW_SGI_NAME": "uvicorn",
    }
    if root:
        env["_MLFLOW_SERVER_ARTIFACT_ROOT"] = Path(root).as_uri()
    return cmd, env
