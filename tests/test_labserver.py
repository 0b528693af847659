"""harness against a lab's tracking server: PostgreSQL behind `mlflow server --serve-artifacts`, reached
over http:// only (tests/infra.py `lab_server`). The whole lifecycle, concurrent runs, a server restarted
mid-run, and the docker executor, all with real ranks, a real database and a real server."""

from __future__ import annotations

import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from conftest import EXPERIMENTS, Project, make_project
from infra import LabServer

EXP = "experiments/linear_lab"
# linear_ddp with two hooks chosen by the environment: a real crash of rank 1 at step KILL_AT, and a
# sleep per step (STEP_SLEEP_S) that keeps a run going while the server restarts.
HOOKS = '''
            if ctx.rank == 1 and ctx.step == int(os.environ.get("KILL_AT", "-1")):
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(float(os.environ.get("STEP_SLEEP_S", "0")))
'''
LOG_LINE = '            ctx.log({"loss": loss}, ctx.step)\n'
# 100 samples, 2 ranks, batch 10: 5 steps per epoch. 4 epochs: 20 steps, checkpoints 0, 4, 8, 12, 16.
RUN = ("train.epochs=4", "checkpoint_every=4")


def lab_train_py() -> str:
    text = (EXPERIMENTS / "linear_ddp" / "train.py").read_text()
    assert LOG_LINE in text
    return "import os\nimport signal\nimport time\n" + text.replace(LOG_LINE, LOG_LINE + HOOKS, 1)


@pytest.fixture(scope="module")
def lab(lab_server: LabServer, tmp_path_factory: pytest.TempPathFactory) -> Project:
    project = make_project(tmp_path_factory.mktemp("lab"))
    project.uri = lab_server.uri  # every harness call and the test's client talk to the server
    project.add_experiment("linear_lab", train_py=lab_train_py())
    return project


@pytest.fixture(scope="module")
def concurrent(lab: Project) -> list[str]:
    """Four runs of one config at once, all writing to the server: the lifecycle tests use the first."""
    procs = [lab.popen("run", EXP, *RUN) for _ in range(4)]
    ids = []
    for proc in procs:
        out, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, err
        ids.append(out.strip().splitlines()[-1])
    return ids


@pytest.fixture(scope="module")
def finished(concurrent: list[str]) -> str:
    return concurrent[0]


def history(project: Project, run_id: str, key: str = "loss") -> list[tuple[int, str]]:
    return sorted((m.step, m.value.hex()) for m in project.client().get_metric_history(run_id, key))


def checkpoint_listing(project: Project, run_id: str) -> dict[str, list[str]]:
    client = project.client()
    return {
        Path(d.path).name: sorted(Path(f.path).name for f in client.list_artifacts(run_id, d.path))
        for d in client.list_artifacts(run_id, "checkpoints")
    }


def test_run_checkpoints_through_the_artifact_proxy(lab: Project, lab_server: LabServer, finished: str) -> None:
    run = lab.client().get_run(finished)
    assert run.info.status == "FINISHED"
    assert run.info.artifact_uri.startswith("mlflow-artifacts:/")  # the server holds the artifacts
    listing = checkpoint_listing(lab, finished)
    assert listing == {f"step-{s:08d}": ["COMPLETE", "rank0.pt", "rank1.pt"] for s in (0, 4, 8, 12, 16)}
    assert not (Path(tempfile.gettempdir()) / f"harness-checkpoints-{finished}").exists()  # staging removed
    assert len(history(lab, finished)) == 20
    # The database password stays with the server: the record only ever saw http://.
    recorded = [*run.data.tags.values(), *run.data.params.values()]
    assert not [v for v in recorded if lab_server.password in v]
    assert "harness.store.write_failures" not in run.data.tags  # no outage, no outage tags


def test_replay_compare_audit(lab: Project, finished: str) -> None:
    replay = lab.harness("replay", finished)
    assert replay.returncode == 0, replay.stderr
    assert "verdict: BITWISE" in replay.stdout
    compare = lab.harness("compare", finished, replay.last_line)
    assert compare.returncode == 0, compare.stderr
    assert "BITWISE" in compare.stdout
    audit = lab.harness("audit", finished, "--segments", "2", "--seed", "0")
    assert audit.returncode == 0, audit.stderr
    assert "verdict: BITWISE" in audit.stdout


def test_a_server_run_travels_in_a_bundle(lab: Project, finished: str, tmp_path: Path) -> None:
    """A run recorded on the server, exported, and imported where there is only the bundle (a folder that is
    no repository, a fresh local store, no server): its replay there is BITWISE."""
    bundle = tmp_path / "run.tar.gz"
    export = lab.harness("export", finished, "-o", str(bundle))
    assert export.returncode == 0, export.stderr
    elsewhere = Project(tmp_path / "elsewhere", tmp_path / "elsewhere" / "store")
    elsewhere.store.mkdir(parents=True)
    imported = elsewhere.harness("import", str(bundle))
    assert imported.returncode == 0, imported.stderr
    replay = elsewhere.harness("replay", imported.last_line)
    assert replay.returncode == 0, replay.stderr + replay.stdout
    assert replay.stdout.strip().splitlines()[-2].startswith("verdict: BITWISE"), replay.stdout


def test_resume_of_a_crashed_run_through_the_server(lab: Project, finished: str) -> None:
    crashed = lab.harness("run", EXP, *RUN, env={"KILL_AT": "13"})
    assert crashed.returncode == 1 and "was killed by SIGKILL" in crashed.stderr, crashed.stderr
    run_id = crashed.last_line
    assert lab.client().get_run(run_id).info.status == "FAILED"
    resumed = lab.harness("resume", run_id)
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.last_line == run_id
    a, b = lab.client().get_run(run_id), lab.client().get_run(finished)
    assert a.info.status == "FINISHED"
    assert a.data.tags["harness.resumed_from"] == "12"  # downloaded from the server's artifacts
    assert a.data.tags["harness.fingerprint"] == b.data.tags["harness.fingerprint"]
    assert history(lab, run_id) == history(lab, finished)  # bit for bit, no step twice
    assert sorted(checkpoint_listing(lab, run_id)) == [f"step-{s:08d}" for s in (0, 4, 8, 12, 16)]


def test_runs_ui_and_mark(lab: Project, lab_server: LabServer, finished: str) -> None:
    listing = lab.harness("runs", "linear_lab", "-n", "50")
    assert listing.returncode == 0, listing.stderr
    line = next(x for x in listing.stdout.splitlines() if x.startswith(finished))
    assert "FINISHED" in line and "BITWISE" in line
    started = time.monotonic()
    ui = lab.harness("ui", timeout=60)
    assert ui.returncode == 0, ui.stderr
    experiment_id = lab.client().get_run(finished).info.experiment_id
    # The server is the UI: its page is printed, nothing is started (the command returns at once).
    assert ui.stdout.strip().startswith(f"{lab_server.uri}/#/experiments/{experiment_id}/runs")
    assert time.monotonic() - started < 30
    mark = lab.harness("mark", finished, "--status", "FAILED")
    assert mark.returncode == 2 and "only a RUNNING run can be marked" in mark.stderr


def test_four_concurrent_runs(lab: Project, concurrent: list[str]) -> None:
    client = lab.client()
    runs = [client.get_run(run_id) for run_id in concurrent]
    assert [r.info.status for r in runs] == ["FINISHED"] * 4
    for run_id in concurrent:
        assert [s for s, _ in history(lab, run_id)] == list(range(20))  # every metric of every run
        assert sorted(checkpoint_listing(lab, run_id)) == [f"step-{s:08d}" for s in (0, 4, 8, 12, 16)]
    # Sharing the server at once changed nothing: one config, one result, bit for bit.
    assert len({r.data.tags["harness.fingerprint"] for r in runs}) == 1
    assert len({tuple(history(lab, run_id)) for run_id in concurrent}) == 1


def _running_run(lab: Project, since_ms: int, timeout_s: float = 180) -> str:
    """The id of the run started after `since_ms` once it has written a metric to the server."""
    client = lab.client()
    experiment = client.get_experiment_by_name("linear_lab")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for run in client.search_runs([experiment.experiment_id], "attributes.status = 'RUNNING'"):
            if run.info.start_time >= since_ms and run.data.metrics:
                return run.info.run_id
        time.sleep(0.5)
    raise TimeoutError("the run never wrote a metric")


def test_server_restarted_mid_run_loses_no_metric(lab: Project, lab_server: LabServer) -> None:
    since = int(time.time() * 1000)
    # 40 steps of 0.5 s: the server goes away and comes back (~10-25 s) while the ranks train.
    proc = lab.popen("run", EXP, "train.epochs=8", "checkpoint_every=10", "flush_interval_s=0.5", "heartbeat_s=1",
                     env={"STEP_SLEEP_S": "0.5"})
    try:
        run_id = _running_run(lab, since)
        lab_server.stop_server()
        time.sleep(3)  # several flushes, beats and a checkpoint upload fail meanwhile
        lab_server.start_server()
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert out.strip().splitlines()[-1] == run_id
    run = lab.client().get_run(run_id)
    assert run.info.status == "FINISHED"
    assert [s for s, _ in history(lab, run_id)] == list(range(40))  # every step, once
    assert sorted(checkpoint_listing(lab, run_id)) == [f"step-{s:08d}" for s in (0, 10, 20, 30)]
    tags = run.data.tags
    assert int(tags["harness.store.write_failures"]) >= 1
    assert float(tags["harness.store.longest_outage_s"]) >= 3
    assert int(tags["harness.store.metrics_spooled"]) >= 1


@pytest.fixture(scope="module")
def lab_image(engine: str) -> str:
    """The CPU image under a tag of this module's own: `engine`'s shared tag may be pushed again by another
    session between its build and this run (every layer is cached: a retag and push, seconds)."""
    from conftest import ROOT

    image = "localhost:5000/harness-cpu:labserver"
    proc = subprocess.run(["bash", str(ROOT / "docker" / "build-cpu-image.sh"), "--push", image],
                          capture_output=True, text=True, timeout=3600, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return image


@pytest.mark.slow
def test_docker_executor_reaches_the_server(lab_image: str, lab: Project) -> None:
    result = lab.harness("run", EXP, "--executor", "docker", f"image={lab_image}", "train.epochs=1",
                         "checkpoint_every=2")
    assert result.returncode == 0, result.stderr
    run = lab.client().get_run(result.last_line)
    assert run.info.status == "FINISHED"
    assert run.data.tags["harness.in_image"] == "true"
    assert [s for s, _ in history(lab, result.last_line)] == list(range(5))
    # The launcher inside the container uploaded the checkpoints through the server.
    assert checkpoint_listing(lab, result.last_line) == {
        f"step-{s:08d}": ["COMPLETE", "rank0.pt", "rank1.pt"] for s in (0, 2, 4)
    }


# --- the outage rules, without a server -----------------------------------------------------------


def test_outages_retry_transient_failures_until_the_limit() -> None:
    import requests
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import INTERNAL_ERROR, RESOURCE_DOES_NOT_EXIST

    from harness.store.failures import transient
    from harness.store.outages import Outages

    refused = requests.ConnectionError("connection refused")
    assert transient(refused) and transient(MlflowException("API request failed", error_code=INTERNAL_ERROR))
    assert not transient(MlflowException("no such run", error_code=RESOURCE_DOES_NOT_EXIST))
    assert not transient(ValueError("a harness bug is never retried"))
    outages = Outages(limit_s=30)
    answers = iter([refused, refused, "written"])

    def call() -> str:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert outages.retry(call) == "written"
    tags = outages.tags()
    assert tags["harness.store.write_failures"] == "2" and float(tags["harness.store.longest_outage_s"]) >= 1.5
    assert Outages(limit_s=5).tags() == {}  # nothing failed: nothing recorded
    with pytest.raises(requests.ConnectionError):
        Outages(limit_s=0).retry(lambda: (_ for _ in ()).throw(refused))  # past the limit: the error itself


def test_outage_limit_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from harness.errors import HarnessError
    from harness.store.outages import DEFAULT_OUTAGE_S, outage_limit

    monkeypatch.delenv("HARNESS_STORE_OUTAGE_S", raising=False)
    assert outage_limit() == DEFAULT_OUTAGE_S
    monkeypatch.setenv("HARNESS_STORE_OUTAGE_S", "12.5")
    assert outage_limit() == 12.5
    monkeypatch.setenv("HARNESS_STORE_OUTAGE_S", "soon")
    with pytest.raises(HarnessError, match="HARNESS_STORE_OUTAGE_S='soon' is not a number of seconds"):
        outage_limit()
