"""The MLflow UI on a store's runs: `harness ui` serves it (or names the store's own server), and the verbs' results
say where to look at their run in it (UiLinks).

The server is a process of its own, started and stopped by harness/store/ui.py: the command line only prints what
`serve` yields and waits. Not in the API (harness.commands.api): it runs until Ctrl-C in the caller's terminal.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from harness import events
from harness.rundata import RunSummary, UiLinks
from harness.store import ui as mlflow_ui
from harness.store.reach import display_uri, resolve_uri
from harness.store.tracking import Tracker

if TYPE_CHECKING:
    import subprocess

__all__ = ["Seen", "Serving", "UiLinks", "UiOptions", "links", "seen", "serve"]


@dataclass(frozen=True)
class UiOptions:
    """`harness ui [EXPERIMENT]`."""

    experiment: str | None = None  # the experiment to open (default: the newest harness run's)
    host: str = "127.0.0.1"  # the address to bind
    port: int = mlflow_ui.UI_PORT  # the port to listen on (not 5000: a local registry's)
    tracking_uri: str | None = None  # default: $MLFLOW_TRACKING_URI, else sqlite:///./mlruns/mlflow.db


@dataclass(frozen=True)
class Serving:
    """A UI that answers: the page to open, the newest replay's run and its replays overlaid, and the server
    (None where the store is a tracking server, its own UI: nothing was started)."""

    page: str  # the experiment's page (harness's view), or the experiment list while the store holds no harness run
    overlaid: str | None  # the run whose replays `overlay` shows beside it; None: the experiment holds no replay
    overlay: str | None  # MLflow's compare page of that run and its newest replays, every metric overlaid
    server: subprocess.Popen | None = None

    def wait(self) -> int:
        """Until the server exits (its status); at once with 0 where nothing was started."""
        return 0 if self.server is None else self.server.wait()


def _serving(tracker: Tracker, base: str, experiment_id: str | None, server: subprocess.Popen | None) -> Serving:
    found = mlflow_ui.overlay(tracker, experiment_id) if experiment_id is not None else None
    if found is None:
        return Serving(mlflow_ui.page(base, experiment_id), None, None, server)
    original, replays = found
    return Serving(mlflow_ui.page(base, experiment_id), original,
                   mlflow_ui.compare_link(base, [original, *replays], [experiment_id or ""]), server)


@contextlib.contextmanager
def serve(options: UiOptions) -> Iterator[Serving]:
    """The UI on the store, answering, for as long as the block runs; its server (a local store's) stopped when the
    block ends, however it ends (Ctrl-C included). Where the store is a tracking server, that server is the UI:
    nothing is started. HarnessError when the server exits or does not answer (a port in use)."""
    o = options
    uri = resolve_uri(o.tracking_uri)
    served = mlflow_ui.server_url(uri)
    if served:  # a tracking server is its own UI
        tracker = Tracker(uri)
        yield _serving(tracker, served, mlflow_ui.prepare(tracker, o.experiment), None)
        return
    base = mlflow_ui.link_base(o.host, o.port)  # what a browser here opens (bound to 0.0.0.0: the loopback)
    events.emit(events.Notice(f"Starting the MLflow UI for {display_uri(uri)} at {base} (Ctrl-C to stop) ..."))
    server = mlflow_ui.start(uri, o.host, o.port)
    try:
        # Meanwhile (the server takes seconds to answer): pick the experiment and save its view. Read-only
        # (writable=False): a current local store is read without MLflow, which opens only to write the view.
        tracker = Tracker(uri, writable=False, must_exist=False)
        experiment_id = mlflow_ui.prepare(tracker, o.experiment)
        mlflow_ui.wait_ready(server, base)
        with mlflow_ui.announced(uri, base):  # `run` and `replay` link to this port while it serves
            yield _serving(tracker, base, experiment_id, server)
    finally:
        mlflow_ui.stop(server)


def links(tracker: Tracker, run: str | RunSummary, curves: bool = False) -> UiLinks:
    """Where to look at `run` in the MLflow UI; `curves`: a judged replay's curves and report too."""
    summary = run if isinstance(run, RunSummary) else tracker.get_run(run)
    return mlflow_ui.links(tracker.uri, summary, curves_too=curves)


@dataclass(frozen=True)
class Seen:
    """A run as the store holds it once its command closed it, and where to look at it."""

    summary: RunSummary
    ui: UiLinks


def seen(run_id: str, tracking_uri: str | None) -> Seen:
    """`run_id` read back from the store, with its UI links (store errors as the store raises them)."""
    tracker = Tracker(tracking_uri)
    summary = tracker.get_run(run_id)
    return Seen(summary, links(tracker, summary))
