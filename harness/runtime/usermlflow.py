"""The training code's own MLflow calls: which store and run they reach in each rank, and which keys they logged.

Ranks run with the experiment folder as their cwd, so an `mlflow.log_metric` there would open MLflow's
default store in the code folder (a second store, a separate run, and a dirty next run). Instead:

- rank 0 reaches the job's run: MLFLOW_TRACKING_URI is the job's store as an absolute URI, MLFLOW_RUN_ID
  the run's id (MLflow's fluent API attaches to it), MLFLOW_EXPERIMENT_ID and MLFLOW_EXPERIMENT_NAME its
  experiment (a nested run of the user's lands beside it; a library that names an experiment of its own, such
  as Accelerate's MLflow tracker, takes the variable's name first and makes no experiment of its own);
- every other rank, and every rank of a re-execution that records no run (audit, trace), reaches a
  scratch store in the job's work folder, discarded with it: like ctx.log, their calls are ignored.

This module never imports mlflow: it sets variables, and wraps the user's mlflow once the user's code
imported it (mlflow's own module stays harness.store's to use).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Callable, Mapping, MutableMapping
from pathlib import Path
from typing import Any

from harness.rundata import wall_clock
from harness.tags import MLFLOW_SUPPRESS_URL_ENV as SUPPRESS_URL, USER_PARAM_PREFIX

TRACKING_URI = "MLFLOW_TRACKING_URI"
RUN_ID = "MLFLOW_RUN_ID"
EXPERIMENT_ID = "MLFLOW_EXPERIMENT_ID"
EXPERIMENT_NAME = "MLFLOW_EXPERIMENT_NAME"
# MLflow's default artifact root for a store it creates is "./mlruns", relative to the cwd (the code folder);
# MLflow reads this variable first (as `harness ui` uses it too).
_ARTIFACT_ROOT = "_MLFLOW_SERVER_ARTIFACT_ROOT"
_JOB_VARIABLES = (TRACKING_URI, RUN_ID, EXPERIMENT_ID, EXPERIMENT_NAME)
SCRATCH_DIR = "user-mlflow"  # beside the job's logs/ folder, removed with the job's work folder


def run_env(tracking_uri: str, run_id: str, experiment_id: str, experiment_name: str) -> dict[str, str]:
    """What rank 0 gets so that the user's fluent MLflow calls land in the job's run (LaunchSpec.env).

    `tracking_uri` is already absolute (harness.store.uris.absolute_uri, the launcher's to call): a rank runs
    in the code folder, and this layer never reaches the store."""
    return {TRACKING_URI: tracking_uri, RUN_ID: run_id, EXPERIMENT_ID: experiment_id, EXPERIMENT_NAME: experiment_name}


def route(environ: MutableMapping[str, str], rank: int, log_dir: str, job_env: Mapping[str, str]) -> str | None:
    """Point this rank's MLflow at the job's run (rank 0 of a recorded job: its id is returned) or at a scratch
    store (None).

    `job_env` is LaunchSpec.env: run_env()'s variables when the job records a run. What the launcher itself
    was started with (an MLFLOW_RUN_ID of the user's shell) never reaches the user's code.
    """
    environ[SUPPRESS_URL] = "true"  # the user's own end_run in any rank (left set: restore() keeps it)
    if rank == 0 and job_env.get(RUN_ID) and job_env.get(TRACKING_URI):
        environ.update({k: job_env[k] for k in _JOB_VARIABLES if k in job_env})
        if EXPERIMENT_NAME not in job_env:
            environ.pop(EXPERIMENT_NAME, None)
        return job_env[RUN_ID]
    scratch = Path(log_dir).parent / SCRATCH_DIR / f"rank{rank}"
    environ[TRACKING_URI] = f"sqlite:///{scratch / 'mlflow.db'}"
    environ[_ARTIFACT_ROOT] = (scratch / "artifacts").as_uri()
    for name in (RUN_ID, EXPERIMENT_ID, EXPERIMENT_NAME):
        environ.pop(name, None)
    scratch.mkdir(parents=True, exist_ok=True)  # the store itself is made only by a first call of the user's
    return None


def snapshot(environ: Mapping[str, str]) -> dict[str, str | None]:
    """The MLflow variables route() and run_env() change, to put back with restore(): under torchrun a rank's body
    runs in its launcher's process, whose own store must stay the job's."""
    return {name: environ.get(name) for name in (*_JOB_VARIABLES, _ARTIFACT_ROOT)}


def restore(environ: MutableMapping[str, str], saved: Mapping[str, str | None]) -> None:
    for name, value in saved.items():
        if value is None:
            environ.pop(name, None)
        else:
            environ[name] = value


def keep_run_open(run_id: str) -> None:
    """The user's mlflow.end_run() (or the end of `with mlflow.start_run():`) detaches from the job's run instead
    of ending it: the launcher ends it when the job ends, with the job's status. And a param the user logs under a
    name the run already holds with another value (harness's `seed`) is kept as `user.<name>` (see _wrap_params).
    Installed in rank 0."""
    mlflow = sys.modules.get("mlflow")
    if mlflow is not None and hasattr(mlflow, "tracking"):
        _wrap(mlflow, run_id)
        return
    # Wrapped when the user's code imports mlflow: a job that never does pays nothing (mlflow takes seconds).
    sys.meta_path.insert(0, _OnImport(run_id))


def notify_with(notice: Callable[[str, str], None]) -> None:
    """Where the wraps' one-line notices go: the rank's context (ctx._notice), once it exists."""
    _NOTICE[:] = [notice]


_NOTICE: list[Callable[[str, str], None]] = []


class _OnImport(importlib.abc.MetaPathFinder):
    """Lets `import mlflow` happen as usual, then wraps it. It stays first in sys.meta_path until mlflow's module
    has run: a library's availability probe (`importlib.util.find_spec("mlflow")`, as transformers and Accelerate
    make) asks for a spec it never executes, and the import that follows must still find the wrapping loader."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != "mlflow":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader, run_id = spec.loader, self.run_id
        exec_module = loader.exec_module

        def exec_then_wrap(module: Any) -> None:
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            exec_module(module)
            _wrap(module, run_id)

        loader.exec_module = exec_then_wrap  # type: ignore[method-assign]
        return spec


def _wrap(mlflow: Any, run_id: str) -> None:
    _wrap_end_run(mlflow, run_id)
    _wrap_params(mlflow, run_id)


def _wrap_params(mlflow: Any, run_id: str) -> None:
    """mlflow.log_param(s) into the job's run: a name the run holds already with another value (harness logged the
    experiment's config and `seed` before the ranks started; a Trainer logs its own `seed`) would fail the whole
    call with MLflow's "Changing param values is not allowed" - and a library that logs params in batches would
    lose the batch. Such a value is kept as `user.<name>`, with one notice per name; an equal value is logged as
    it is (MLflow takes it again)."""
    fluent = mlflow.tracking.fluent
    log_param, log_params = fluent.log_param, fluent.log_params
    if getattr(log_params, "_harness_run_id", None) == run_id:
        return
    held: dict[str, str] = {}

    def renamed(params: Mapping[str, Any]) -> dict[str, Any]:
        active = fluent.active_run()
        if (active.info.run_id if active is not None else os.environ.get(RUN_ID)) != run_id:
            return dict(params)  # a run of the user's own
        if not held:
            held.update(mlflow.tracking.MlflowClient().get_run(run_id).data.params)
        kept: dict[str, Any] = {}
        for key, value in params.items():
            if key in held and held[key] != str(value):
                new = f"{USER_PARAM_PREFIX}{key}"
                _notify(f"user-param-{key}", f"mlflow.log_param: '{key}' is the run's param already ({held[key]!r}); "
                        f"your value {str(value)!r} is kept as '{new}' (MLflow cannot change a param).")
                key = new
            kept[key] = value
        return kept

    def log_param_kept(key: str, value: Any, *args: Any, **kwargs: Any) -> Any:
        ((key, value),) = renamed({key: value}).items()
        return log_param(key, value, *args, **kwargs)

    def log_params_kept(params: Mapping[str, Any], *args: Any, **kwargs: Any) -> Any:
        return log_params(renamed(params), *args, **kwargs)

    for wrapper, original in ((log_param_kept, log_param), (log_params_kept, log_params)):
        wrapper._harness_run_id = run_id  # type: ignore[union-attr]
        wrapper.__doc__ = original.__doc__
    fluent.log_param, fluent.log_params = log_param_kept, log_params_kept
    mlflow.log_param, mlflow.log_params = log_param_kept, log_params_kept


def _notify(key: str, text: str) -> None:
    if _NOTICE:
        _NOTICE[0](key, text)
    else:  # before the rank's context exists: its stderr, which the rank's log keeps
        print(f"harness: {text}", file=sys.stderr)


def _wrap_end_run(mlflow: Any, run_id: str) -> None:
    fluent = mlflow.tracking.fluent
    original = fluent.end_run
    if getattr(original, "_harness_run_id", None) == run_id:
        return

    def end_run(*args: Any, **kwargs: Any) -> None:
        active = fluent.active_run()
        if active is None or active.info.run_id != run_id:
            original(*args, **kwargs)  # a run of the user's own (nested, or in another store): theirs to end
            return
        stack = getattr(fluent, "_active_run_stack", None)
        runs = stack.get() if stack is not None and hasattr(stack, "get") else None
        if isinstance(runs, list) and runs and runs[-1] is active:
            runs.pop()  # detached, the run untouched: MLflow's own end_run would mark it FINISHED mid-job
        else:  # a future MLflow that keeps its active runs elsewhere: end, then reopen at once
            original(*args, **kwargs)
            mlflow.tracking.MlflowClient().update_run(run_id, status="RUNNING")
        # mlflow.start_run() consumed this; a later fluent call must find the job's run again, not make a new one.
        os.environ[RUN_ID] = run_id

    end_run._harness_run_id = run_id  # type: ignore[attr-defined]
    end_run.__doc__ = original.__doc__
    # ActiveRun.__exit__ and MLflow's atexit hook call the module's global; `mlflow.end_run` is the user's name.
    fluent.end_run = end_run
    mlflow.end_run = end_run


def direct_keys(run_metric_keys: list[str], ctx_keys: set[str]) -> list[str]:
    """The metric keys in the run that were not logged through ctx.log: the user's own MLflow calls (judged by a
    replay like ctx.log's, read back from MLflow's history: Tracker.load_record)."""
    return sorted(k for k in set(run_metric_keys) - set(ctx_keys) if not wall_clock(k))  # harness's step times
