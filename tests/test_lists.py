"""`harness runs` stays readable: what a command made on its way (a calibration and its members, traces, audits, a
study's seeds, a bisect's probes) is counted on its run's row and listed with --all, --kind or --status; VERDICTS
counts verdicts only. A real SQLite MLflow store, its runs recorded with the tags the commands write
(record/derived.py) and closed (sealed) as they close theirs; no rank is started."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import Project

from harness import tags as T
from harness.record import closing, derived
from harness.store.tracking import Tracker

EXPERIMENT = "lists"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Project, dict[str, str]]:
    """A run and everything made from it, oldest first, as the commands record them."""
    base = tmp_path_factory.mktemp("lists")
    (base / "store").mkdir()
    project = Project(base, base / "store")
    tracker = Tracker(project.uri)
    made: dict[str, str] = {}

    def record(name: str, tags: dict[str, str], status: str = T.FINISHED, verdict: str | None = None) -> str:
        run_id = tracker.create_run(EXPERIMENT, {T.VERSION: "0.1.0", **tags}, run_name=name)
        closing.close(tracker, run_id, status, tags={T.VERDICT: verdict} if verdict else None)
        made[name] = run_id
        return run_id

    run = record("run", {T.KIND: T.KIND_RUN})
    source = tracker.harness_run(run)
    replay = record("replay", derived.tags(T.KIND_REPLAY, source), verdict="BITWISE")
    record("trace", derived.tags(T.KIND_TRACE, source, parent=replay))  # a localization traces under the replay
    record("failed replay", derived.tags(T.KIND_REPLAY, source), status=T.FAILED)  # no verdict: counted by status
    calibration = record("calibration", derived.tags(T.KIND_CALIBRATION, source))
    for i in range(3):  # members: replays nested under the calibration, never judged
        record(f"member {i}", derived.tags(T.KIND_REPLAY, source, extra={T.CALIBRATION: calibration,
                                                                         T.MLFLOW_PARENT_RUN_ID: calibration}))
    record("audit", derived.tags(T.KIND_AUDIT, source), verdict="REPRODUCED")
    bisect = record("bisect", derived.tags(T.KIND_BISECT, parent=run))
    record("probe", derived.tags(T.KIND_REPLAY, source, extra={T.MLFLOW_PARENT_RUN_ID: bisect, T.BISECT_OF: bisect,
                                                               T.CHANGES: "train.lr=0.02"}), verdict="DIVERGED")
    study = record("study", {T.KIND: T.KIND_STUDY, T.STUDY_SIZE: "2"})
    for seed in (1, 2):
        record(f"seed {seed}", {T.KIND: T.KIND_RUN, T.STUDY: study, T.MLFLOW_PARENT_RUN_ID: study})
    return project, made


def listed(project: Project, *args: str) -> list[dict]:
    result = project.cli("runs", EXPERIMENT, "-n", "100", "--json", *args)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["runs"]


def test_runs_lists_what_a_user_made_and_counts_the_rest_on_its_row(store) -> None:
    project, made = store
    rows = {row["run_id"]: row for row in listed(project)}
    names = {v: k for k, v in made.items()}
    assert sorted(names[r] for r in rows) == ["bisect", "failed replay", "replay", "run", "study"]
    run, replay, study, bisect = (rows[made[n]] for n in ("run", "replay", "study", "bisect"))
    # The calibration run and its 3 members, and the audit, on the run's row; the trace on the replay it localized.
    assert run["nested"] == {"calibration": 4, "audit": 1} and run["nested_under"] is None
    assert replay["nested"] == {"trace": 1} and study["nested"] == {"seed": 2} and bisect["nested"] == {"probe": 1}
    # Verdicts only: the members that merely FINISHED and the bisect's probe are not counted; a replay that failed
    # without one is, by its status.
    assert run["verdicts"] == "BITWISE 1, FAILED 1"

    table = project.cli("runs", EXPERIMENT).stdout.splitlines()
    assert table[0].split()[-2:] == ["NESTED", "VERDICTS"]
    [row] = [line for line in table if line.startswith(made["run"])]
    assert row.endswith("calibration 4, audit 1  BITWISE 1, FAILED 1"), row
    assert len(table) == 1 + 5


def test_all_kind_and_status_list_the_nested_runs_too(store) -> None:
    project, made = store
    every = listed(project, "--all")
    assert len(every) == len(made)
    under = {row["run_id"]: row["nested_under"] for row in every}
    assert under[made["member 0"]] == under[made["calibration"]] == under[made["audit"]] == made["run"]
    assert (under[made["trace"]], under[made["seed 1"]], under[made["probe"]]) == (made["replay"], made["study"],
                                                                                  made["bisect"])
    assert [r["run_id"] for r in listed(project, "--kind", "trace")] == [made["trace"]]
    assert [r["run_id"] for r in listed(project, "--status", "failed")] == [made["failed replay"]]
    finished_replays = {r["run_id"] for r in listed(project, "--kind", "replay", "--status", "FINISHED")}
    assert finished_replays == {made[n] for n in ("replay", "member 0", "member 1", "member 2", "probe")}
    # Newest first, as without options: the limit keeps the newest.
    assert [r["run_id"] for r in listed(project, "--all", "-n", "2")] == [made["seed 2"], made["seed 1"]]
    none = project.cli("runs", EXPERIMENT, "--kind", "verify")
    assert none.returncode == 0 and none.stdout.strip() == (
        f"No runs in {project.uri} for experiment '{EXPERIMENT}' match --kind verify.")


def test_the_limit_counts_listed_rows_not_the_runs_folded_under_them(store) -> None:
    project, made = store
    # The two newest listed rows are the study and the bisect; the seeds and the probe between them are no rows.
    rows = listed(project, "-n", "2")
    assert [r["run_id"] for r in rows] == [made["study"], made["bisect"]]
    assert rows[0]["nested"] == {"seed": 2}


def test_a_kind_or_status_runs_does_not_know_is_one_line_exit_2(store) -> None:
    project, _ = store
    bad = project.cli("runs", "--kind", "member")
    assert bad.returncode == 2 and "Invalid value for '--kind': 'member' is not one of 'run', 'replay'" in bad.stderr
    from harness.commands import api
    from harness.errors import UsageError

    with pytest.raises(UsageError, match=r"^--status DONE: no such status\. Pass one of RUNNING, FINISHED, FAILED, "
                                         r"KILLED, STALE\.$"):
        api.runs(api.RunsOptions(EXPERIMENT, tracking_uri=project.uri, status="DONE"))


def test_compare_one_run_takes_its_newest_replay_and_a_bare_compare_says_what_to_pass(store) -> None:
    project, made = store
    bare = project.cli("compare")
    assert (bare.returncode, bare.stderr.strip()) == (2, "Error: compare needs a run: pass RUN (compared with its "
                                                          "newest replay) or RUN_A RUN_B (two runs, or two traces).")
    lonely = project.cli("compare", made["study"])
    assert lonely.returncode == 2
    assert lonely.stderr.strip().splitlines()[-1] == (
        f"Error: run {made['study']} has no replay to compare it with. Run `harness replay {made['study']}` first, "
        f"or pass the run to compare it with: harness compare {made['study']} RUN_B.")
    unknown = project.cli("compare", "0123456789abcdef0123456789abcdef")
    assert unknown.returncode == 2 and unknown.stderr.startswith("Error: no run '0123456789abcdef0123456789abcdef' in")


def test_the_ui_view_nests_what_was_made_from_a_run_under_it() -> None:
    """MLflow's UI folds child runs (mlflow.parentRunId) under their parent only while sorted by creation time."""
    from harness.store import ui

    view = json.loads(ui.experiment_tags()[T.MLFLOW_SHARED_VIEW_PREFIX + ui.VIEW_KEY])
    assert view["orderByKey"] == "attributes.start_time" and view["orderByAsc"] is False


def test_curves_are_said_as_a_local_path_or_the_artifact_uri(store, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a judged replay's pictures are (its replay/ artifacts), and their page while a `harness ui` serves."""
    import socket

    from harness.store import ui

    project, made = store
    monkeypatch.setenv("HARNESS_CACHE_DIR", str(tmp_path))

    tracker = Tracker(project.uri, writable=False)
    replay = tracker.get_run(made["replay"])
    [line] = ui.curves(project.uri, replay)  # no `harness ui` serves this store: no link
    folder = Path(str(tracker.local_artifact_dir(made["replay"])))
    assert line == (f"Curves (original and replay overlaid) in {folder / 'replay'}: metric_<name>.png; the report: "
                    f"{folder / 'replay' / 'report.md'}")
    (folder / "replay").mkdir(parents=True)
    for name in ("metric_loss.png", "metric_acc.png"):
        (folder / "replay" / name).write_bytes(b"")
    assert ui.curves(project.uri, replay)[0].startswith(f"Curves (original and replay overlaid) in {folder / 'replay'}: "
                                                        "metric_acc.png, metric_loss.png; the report: ")
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        base = ui.link_base("127.0.0.1", listening.getsockname()[1])
        with ui.announced(project.uri, base):
            assert ui.curves(project.uri, replay)[1] == (
                f"See them in the MLflow UI: {base}/#/experiments/{replay.experiment_id}/runs/{replay.run_id}"
                "/artifacts/replay?workflowType=machine_learning")
    remote = replace_uri(replay, "s3://bucket/1/abc/artifacts")
    assert ui.curves(project.uri, remote) == ["Curves (original and replay overlaid) in s3://bucket/1/abc/artifacts/"
                                              "replay: metric_<name>.png; the report: s3://bucket/1/abc/artifacts/"
                                              "replay/report.md"]


def replace_uri(run, uri: str):
    from dataclasses import replace

    return replace(run, artifact_uri=uri)
