"""The Python API (`harness.run`, `harness.replay`, ...): typed options in, typed results out, the same
routing and the same refusals as the command line, and nothing on stderr unless the caller listens."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import keyword
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import CPU, ROOT, Project

import harness
from harness import events
from harness.commands.replay import ReplayResult, StudyReplayResult
from harness.commands.study import StudyOutcome
from harness.errors import HarnessError
from harness.executors import Outcome
from harness.judge.compare import Comparison
from harness.judge.verdicts import Verdict


def test_import_harness_leaves_the_api_unloaded_until_it_is_used() -> None:
    code = ("import sys, harness\n"
            "assert 'harness.commands.api' not in sys.modules and 'omegaconf' not in sys.modules, sorted(sys.modules)\n"
            "assert harness.ReplayOptions is sys.modules['harness.commands.api'].ReplayOptions\n"
            "try:\n    harness.no_such_verb\nexcept AttributeError as err:\n    print(err)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "module 'harness' has no attribute 'no_such_verb'\n"


def test_a_run_and_its_replay_through_the_api_are_bitwise_and_say_nothing_unasked(
    fresh_project: Project, capfd: pytest.CaptureFixture[str]
) -> None:
    p = fresh_project
    outcome = harness.run(harness.RunOptions(p.root / "experiments" / "linear_ddp", ("train.epochs=1", CPU),
                                             tracking_uri=p.uri))
    assert isinstance(outcome, Outcome) and outcome.status == "FINISHED", outcome
    result = harness.replay(harness.ReplayOptions(outcome.run_id, tracking_uri=p.uri, repo=p.root))
    assert isinstance(result, ReplayResult)
    assert result.judged.verdict == Verdict.BITWISE, result.judged.summary()
    assert result.original.run_id == outcome.run_id
    # Where to look at it, carried by the result: no UI serves this store, so the hint says how to start one.
    assert result.ui is not None and result.ui.page is None, result.ui
    assert result.ui.hint.startswith("Open it in the MLflow UI: harness ui --tracking-uri ") and \
        result.ui.hint.endswith(f"/runs/{result.outcome.run_id}?workflowType=machine_learning"), result.ui.hint
    assert result.ui.curves[0].startswith("Curves (original and replay overlaid) in "), result.ui.curves
    compared = harness.compare(harness.CompareOptions(outcome.run_id, tracking_uri=p.uri))
    assert isinstance(compared, Comparison) and compared.ui == result.ui, (compared.ui, result.ui)
    # Without on_event nothing reaches stderr: neither the launcher's words (the CLI would have said "harness:
    # recording linear_ddp, ...") nor rank 0's output or a progress bar; rank 0's log holds its output all the same.
    assert capfd.readouterr().err == ""
    log = p.client().download_artifacts(outcome.run_id, "logs/rank0.log")
    assert "epoch 1/1 loss " in open(log).read()

    # With a listener, what the CLI prints arrives as events: replaying a replay replays its original.
    said: list[events.Event] = []
    again = harness.replay(harness.ReplayOptions(result.outcome.run_id, tracking_uri=p.uri, repo=p.root,
                                                 on_event=said.append))
    assert isinstance(again, ReplayResult) and again.original.run_id == outcome.run_id
    assert events.Notice(f"run {result.outcome.run_id} is a replay of {outcome.run_id}; "
                         f"replaying {outcome.run_id}") in said
    # ... and so do rank 0's output and its steps, which the CLI draws as lines above a bar: nothing on stderr.
    assert any(isinstance(e, events.RankOutput) and e.text.startswith("epoch 1/1 loss ") for e in said), said
    steps = [e for e in said if isinstance(e, events.Steps)]
    assert steps[0] == events.Steps("linear_ddp x2") and steps[-1].ended, steps
    assert steps[-1].total == 5 and 0 <= steps[-1].done <= 5, steps  # counted as polled: a short run may end first
    assert capfd.readouterr().err == ""


def test_a_study_is_run_and_replayed_through_the_api_as_the_cli_does(fresh_project: Project) -> None:
    p = fresh_project
    said: list[events.Event] = []
    study = harness.run(harness.RunOptions(p.root / "experiments" / "linear_ddp", ("train.epochs=1", CPU), seeds=2,
                                           tracking_uri=p.uri, on_event=said.append))
    assert isinstance(study, StudyOutcome) and study.status == "FINISHED" and len(study.members) == 2, study
    assert any(isinstance(e, events.Notice) and e.text.startswith("study ") for e in said), said
    # The members run in threads of their own and speak through the command's listener: each one's steps end.
    assert sum(isinstance(e, events.Steps) and e.ended for e in said) == 2, said
    assert any(isinstance(e, events.RankOutput) for e in said), said
    # harness.replay(STUDY) replays the study (the CLI's `harness replay STUDY`), not a refusal of it.
    said.clear()
    result = harness.replay(harness.ReplayOptions(study.run_id, tracking_uri=p.uri, repo=p.root, on_event=said.append))
    assert isinstance(result, StudyReplayResult)
    assert result.verdict == Verdict.BITWISE and len(result.members) == 2, result.summary()
    assert [e.done for e in said if isinstance(e, events.Progress)] == [1, 2]
    # A replay of the study replay means the study again (follow), as on the command line.
    with pytest.raises(HarnessError) as err:
        harness.replay(harness.ReplayOptions(result.run_id, members_seed=3, tracking_uri=p.uri))
    answer = p.cli("replay", result.run_id, "--members-seed", "3")
    assert answer.stderr.splitlines() == [f"run {result.run_id} is a replay of study {study.run_id}; replaying the study",
                                          f"Error: {err.value}"], answer.stderr
    assert str(err.value) == "--members-seed draws --members K of the study's members; pass --members too."


def test_two_calls_in_two_threads_each_hear_only_their_own_events() -> None:
    import threading

    both = threading.Barrier(2)
    heard: dict[str, list[events.Event]] = {"a": [], "b": []}

    def call(name: str) -> None:
        with events.listening(heard[name].append):
            both.wait(timeout=10)  # both listen at once
            events.emit(events.Notice(name))

            # A thread harness starts for the call (a study's member, the reader of rank 0's messages) speaks through
            # the call's listener; a bare thread does not.
            carried = threading.Thread(target=events.carry(events.emit), args=(events.Notice(f"{name} carried"),))
            bare = threading.Thread(target=events.emit, args=(events.Notice(f"{name} bare"),))
            for thread in (carried, bare):
                thread.start()
                thread.join()
            both.wait(timeout=10)
            events.emit(events.Steps(name, 1, 2))
        events.emit(events.Notice(f"{name} after"))  # no one listens any more

    threads = [threading.Thread(target=call, args=(name,)) for name in heard]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    for name, said in heard.items():
        assert said == [events.Notice(name), events.Notice(f"{name} carried"), events.Steps(name, 1, 2)], said
    assert not events.heard()


def test_bad_input_raises_the_error_the_cli_prints(fresh_project: Project) -> None:
    p = fresh_project
    cases = [
        (harness.replay, harness.ReplayOptions("0123456789abcdef0123456789abcdef", tracking_uri=p.uri),
         ["replay", "0123456789abcdef0123456789abcdef"], harness.RunNotFound),
        (harness.run, harness.RunOptions(p.root / "experiments" / "linear_ddp", ("seed=-1", CPU), tracking_uri=p.uri),
         ["run", "experiments/linear_ddp", "seed=-1"], harness.ConfigError),
        (harness.run, harness.RunOptions(p.root / "experiments" / "linear_ddp", (CPU,), seeds=2,
                                         placement=harness.Placement(nnodes=2), tracking_uri=p.uri),
         ["run", "experiments/linear_ddp", "--seeds", "2", "--nnodes", "2"], harness.UsageError),
        (harness.compare, harness.CompareOptions("0123456789abcdef0123456789abcdef", "fedcba9876543210fedcba9876543210",
                                                 tracking_uri=p.uri),
         ["compare", "0123456789abcdef0123456789abcdef", "fedcba9876543210fedcba9876543210"], harness.RunNotFound),
    ]
    for call, options, argv, kind in cases:
        with pytest.raises(kind) as err:  # the case by its class, not by its text
            call(options)
        answer = p.cli(*argv)
        assert answer.returncode == err.value.exit_code == 2, answer
        assert answer.stderr == f"Error: {err.value}\n", (argv, answer.stderr)


def test_a_refused_run_and_a_store_that_cannot_be_used_raise_their_own_classes(tmp_path: Path) -> None:
    """RunRefused: the run is there but the command may not use it; StoreUnavailable: no store to ask at all."""
    from harness import tags as T
    from harness.record import closing
    from harness.store.tracking import Tracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = Tracker(uri)
    running = tracker.create_run("api", {T.VERSION: "0.1.0", T.KIND: T.KIND_RUN})
    finished = tracker.create_run("api", {T.VERSION: "0.1.0", T.KIND: T.KIND_RUN})
    closing.close(tracker, finished, T.FINISHED)
    for call, refused, said in (
        (harness.replay, harness.ReplayOptions(running, tracking_uri=uri), f"run {running} is still RUNNING"),
        (harness.mark, harness.MarkOptions(finished[:8], "FAILED", tracking_uri=uri),
         f"run {finished} is FINISHED, not RUNNING; only a RUNNING run can be marked"),
    ):
        with pytest.raises(harness.RunRefused, match=f"^{said}") as err:
            call(refused)
        assert err.value.exit_code == 2
    assert tracker.get_run(running).status == T.RUNNING and tracker.get_run(finished).status == T.FINISHED

    with socket.socket() as sock:  # a loopback port that nothing listens on once closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    away = f"http://127.0.0.1:{port}"
    for reach in (lambda: harness.runs(harness.RunsOptions(tracking_uri=away)),
                  lambda: harness.replay(harness.ReplayOptions(running, tracking_uri=away))):
        with pytest.raises(harness.StoreUnavailable, match=f"^cannot reach the tracking store {away}: connection refused"):
            reach()
    with pytest.raises(harness.StoreUnavailable, match="names a folder, not a database file") as err:
        harness.runs(harness.RunsOptions(tracking_uri=f"sqlite:///{tmp_path}"))
    assert err.value.exit_code == 2


def test_the_code_record_refusals_raise_repository_and_secret_errors(fresh_project: Project, tmp_path: Path) -> None:
    p = fresh_project
    exp = p.root / "experiments" / "linear_ddp"
    (exp / ".env").write_text("TOKEN=x\n")  # untracked, named as a secret
    with pytest.raises(harness.SecretRefused, match=r"is an untracked file whose name marks it as a secret \(\.env\)"):
        harness.check(harness.CheckOptions(exp, (CPU,), tracking_uri=p.uri))
    (exp / ".env").unlink()
    with (exp / "train.py").open("a") as f:
        f.write("# an uncommitted change\n")
    with pytest.raises(harness.RepositoryError, match="has uncommitted changes and --require-clean was given") as err:
        harness.check(harness.CheckOptions(exp, (CPU,), require_clean=True, tracking_uri=p.uri))
    assert err.value.exit_code == 2
    outside = tmp_path / "outside"
    shutil.copytree(exp, outside)
    with pytest.raises(harness.RepositoryError, match="is not inside a git repository"):
        harness.check(harness.CheckOptions(outside, (CPU,), tracking_uri=p.uri))


def test_placement_splits_the_backends_options_into_recorded_overrides_and_job_choices() -> None:
    """The CLI hands every placement option by name; the backends' declarations decide what each one is."""
    placement = harness.Placement.of({"nnodes": None, "node_rank": None, "master_addr": None, "master_port": None,
                                      "slurm_nodes": 2, "partition": "gpu", "slurm_time": None,
                                      "allow_unpinned": True})
    assert placement.nnodes is None and dict(placement.backend) == {"slurm_nodes": 2, "partition": "gpu",
                                                                     "allow_unpinned": True}
    # A config key: recorded as that backend's override (a replay shows it as a change); none: this job only.
    assert placement.backend_overrides() == ["slurm.nodes=2", "slurm.partition=gpu"]
    assert placement.job_options() == {"allow_unpinned": True}
    assert placement.given() == ["--allow-unpinned", "--nodes", "--partition"]  # the registry's order: docker, slurm
    assert harness.Placement(nnodes=2, node_rank=1).multi_node() == ["--nnodes", "--node-rank"]
    assert harness.Placement().backend_overrides() == [] and harness.Placement().job_options() == {}
    with pytest.raises(HarnessError, match="no backend takes the option"):
        harness.Placement(backend={"no_such_option": 1}).backend_overrides()


def _docs_snippet() -> str:
    """The first Python block of docs/python-api.md, as a reader would paste it into a script."""
    text = (ROOT / "docs" / "python-api.md").read_text()
    return text.split("```python\n", 1)[1].split("```", 1)[0]


def test_the_docs_snippet_runs_as_a_script_and_without_its_guard_is_refused_before_anything_starts(
    fresh_project: Project,
) -> None:
    """Ranks import the script that started them again: an unguarded call would run in each of them (raw tracebacks
    of multiprocessing's bootstrapping, a FAILED run). It is refused in one line, before a rank or a record exists."""
    p = fresh_project
    snippet = _docs_snippet()
    guard = 'if __name__ == "__main__":'
    assert guard in snippet
    head, body = snippet.split(guard, 1)
    unguarded = head + textwrap.dedent(body.split("\n", 1)[1])
    env = {**os.environ, "MLFLOW_TRACKING_URI": p.uri}
    for name, source in (("pasted.py", unguarded), ("docs_snippet.py", snippet)):
        (p.root / name).write_text(source)
    refused = subprocess.run([sys.executable, "pasted.py"], cwd=p.root, env=env, capture_output=True, text=True,
                             timeout=300)
    assert refused.returncode == 1, refused.stderr
    line = next(n for n, text in enumerate(unguarded.splitlines(), 1) if "harness.run(" in text)
    assert refused.stderr.strip().splitlines()[-1] == (
        f"harness.errors.HarnessError: pasted.py calls harness at its top level (line {line}), outside an "
        '`if __name__ == "__main__":` block: every rank starts as a fresh Python process that imports the script '
        'again and would run that call again. Put the script\'s calls under `if __name__ == "__main__":` '
        "(docs/python-api.md shows it)."), refused.stderr
    assert "bootstrapping" not in refused.stderr and "Error" not in refused.stderr.replace("HarnessError", ""), refused.stderr
    assert p.all_runs() == []  # nothing recorded
    # The snippet as the docs show it, pasted as it is: a run, and its replay's verdict.
    ran = subprocess.run([sys.executable, "docs_snippet.py"], cwd=p.root, env=env, capture_output=True, text=True,
                         timeout=600)
    assert ran.returncode == 0, ran.stderr
    *_, ran_line, verdict, speed = ran.stdout.splitlines()
    assert ran_line.endswith(" FINISHED") and verdict == Verdict.BITWISE, ran.stdout
    assert speed.startswith("performance: replay ") and speed.endswith("(wall clock: not part of the verdict)"), speed


# The verbs of the command line that have no function in the API, and why.
NOT_IN_THE_API = {
    "ui": "a server that runs until Ctrl-C in the caller's terminal; the API's callers open MLflow's UI themselves",
    "_execute": "internal: how a container or a Slurm task runs an already recorded run (`harness run` starts it)",
}


def _api_name(verb: str) -> str:
    name = verb.replace("-", "_")
    return name + "_" if keyword.iskeyword(name) else name  # `import` -> harness.import_


@pytest.mark.unit
def test_every_cli_verb_has_a_typed_api_function_that_the_cli_calls() -> None:
    """Each verb of `harness` is `harness.<verb>(harness.<Verb>Options(...))`, and the CLI's verb calls it, so that
    the command line and the API cannot disagree; a new verb without one fails here."""
    from harness.cli.main import main as cli

    verbs = sorted(cli.commands)
    assert set(NOT_IN_THE_API) <= set(verbs), verbs
    missing, uncalled = [], []
    for verb in verbs:
        if verb in NOT_IN_THE_API:
            continue
        name = _api_name(verb)
        fn = getattr(harness, name, None) if name in harness.__all__ else None
        if not callable(fn):
            missing.append(verb)
            continue
        signature = inspect.signature(fn)
        (param,) = signature.parameters.values()  # one options object, a public frozen dataclass
        options = getattr(harness, str(param.annotation))
        assert str(param.annotation).endswith("Options") and dataclasses.is_dataclass(options), verb
        assert options.__dataclass_params__.frozen, verb  # type: ignore[attr-defined]
        assert signature.return_annotation not in (inspect.Signature.empty, "None"), verb  # a typed result
        body = inspect.getsource(inspect.unwrap(cli.commands[verb].callback))
        if f"api.{name}(" not in body:
            uncalled.append(verb)
    assert not missing, (f"CLI verbs without an API function (add one to harness/commands/api.py, or to the "
                         f"extra's api module): {missing}")
    assert not uncalled, f"CLI verbs that do not call their API function: {uncalled}"


@pytest.mark.unit
def test_every_public_name_resolves_and_type_checkers_see_the_same_names() -> None:
    for name in harness.__all__:
        assert getattr(harness, name) is not None, name
    # __init__.pyi is what mypy and IDEs read (the package is lazy at run time): the same names, from the API.
    stub = ast.parse((ROOT / "harness" / "__init__.pyi").read_text())
    imports = [node for node in stub.body if isinstance(node, ast.ImportFrom)]
    from harness import extensions

    extras = {extra.api for extra in extensions.extras().values() if extra.api is not None}
    assert sorted(str(node.module) for node in imports) == sorted(["harness.commands.api", "harness.errors", *extras])
    stubbed = [a.asname or a.name for node in imports for a in node.names]
    assert sorted(stubbed) == sorted(set(harness.__all__) - {"__version__"})
    # The errors a call raises: every HarnessError subclass of harness/errors.py, each with its exit code.
    from harness import errors

    typed = {name for name, value in vars(errors).items()
             if isinstance(value, type) and issubclass(value, HarnessError) and name != "ExperimentError"}
    assert typed <= set(harness.__all__), typed - set(harness.__all__)
    assert all(isinstance(getattr(harness, name).exit_code, int) for name in typed)
    assert (ROOT / "harness" / "py.typed").is_file()
