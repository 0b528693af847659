"""`harness replay`, `harness compare` and `harness runs` against real runs in a real store."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import OTHER_HARDWARE, WIDE_CONFIG, WIDE_TRAIN, Project, git
from snippets import UNSEEDED


def verdict_line(stdout: str) -> str:
    lines = stdout.strip().splitlines()
    assert len(lines) >= 2, stdout
    assert lines[-2].startswith("verdict: "), stdout
    return lines[-2]


def steps_values(client, run_id: str, key: str = "loss") -> dict[int, float]:
    return {m.step: m.value for m in client.get_metric_history(run_id, key)}


@pytest.fixture(scope="module")
def original(project: Project) -> str:
    result = project.harness("run", "experiments/linear_ddp")
    assert result.returncode == 0, result.stderr
    return result.last_line


@pytest.fixture(scope="module")
def clean_replay(project: Project, original: str):
    return project.harness("replay", original)


def test_replay_of_clean_run_is_bitwise(project: Project, original: str, clean_replay) -> None:
    assert clean_replay.returncode == 0, clean_replay.stderr
    # The learning rate of every step is recorded beside the loss, and judged with it.
    assert verdict_line(clean_replay.stdout).startswith("verdict: BITWISE: 1 metric x 25 steps + harness.lr bit-identical")
    replay_id = clean_replay.last_line
    client = project.client()
    recorded = client.get_run(original).data.tags
    assert recorded["harness.optimizer"] == "torch.optim.sgd.SGD"
    assert recorded["harness.optimizer.settings"].startswith("lr=0.01, momentum=0, dampening=0, weight_decay=0, ")
    assert (recorded["harness.lr_scheduler"], recorded["harness.amp.autocast"], recorded["harness.amp.grad_scaler"]) == (
        "none", "none", "none")
    assert steps_values(client, original, "harness.lr") == dict.fromkeys(range(25), 0.01)
    run = client.get_run(replay_id)
    tags = run.data.tags
    assert run.info.status == "FINISHED"
    assert tags["mlflow.parentRunId"] == original  # nested under the original in the UI
    assert tags["harness.replay_of"] == original and tags["harness.verdict"] == "BITWISE"
    assert tags["harness.kind"] == "replay"
    assert run.info.experiment_id == client.get_run(original).info.experiment_id
    assert tags["harness.fingerprint"] == client.get_run(original).data.tags["harness.fingerprint"]
    # The params are what the ranks ran on (backend "auto" resolved to gloo), the replay's too: MLflow's compare view
    # highlighted `backend auto -> gloo` between a run and its plain replay. config.yaml keeps what was asked.
    params, again = client.get_run(original).data.params, run.data.params
    assert (params["device"], params["backend"]) == (recorded["harness.device"], recorded["harness.backend"]) == (
        "cpu", "gloo")
    assert {k: v for k, v in params.items() if again.get(k) != v} == {}, again
    assert "backend: auto" in Path(client.download_artifacts(original, "config.yaml")).read_text()
    arts = {f.path for f in client.list_artifacts(replay_id, "replay")}
    assert {"replay/report.md", "replay/comparison.json", "replay/metric_loss.png"} <= arts
    png = Path(client.download_artifacts(replay_id, "replay/metric_loss.png"))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = Path(client.download_artifacts(replay_id, "replay/report.md")).read_text()
    assert "BITWISE" in report and "loss" in report
    # What the data did: every ctx.loader step's samples, per rank, digested; identical in the replay.
    assert "data order: identical at the 25 common steps (every rank drew the same samples)" in clean_replay.stdout
    assert "## Data order" in report
    order = json.loads(Path(client.download_artifacts(original, "data_order.json")).read_text())
    assert order["steps"] == list(range(25)) and client.get_run(original).data.tags["harness.data_order.steps"] == "25"
    # Step 0, computed here independently: each rank's first batch of DistributedSampler(seed 0, epoch 0).
    from torch.utils.data.distributed import DistributedSampler

    ranks = []
    for rank in (0, 1):
        first = list(DistributedSampler(range(100), num_replicas=2, rank=rank, shuffle=True, seed=0))[:10]
        ranks.append(hashlib.sha256(np.asarray(first, dtype=np.int64).tobytes()).hexdigest()[:16])
    assert order["digests"][0] == hashlib.sha256(",".join(ranks).encode()).hexdigest()[:16]


def test_replay_never_touches_the_working_tree(project: Project, original: str, clean_replay) -> None:
    assert git(project.root, "worktree", "list").count("\n") == 0  # the temporary worktree is gone
    assert git(project.root, "status", "--porcelain") == ""


def test_runs_lists_the_latest_verdict(project: Project, original: str, clean_replay) -> None:
    result = project.harness("runs", "linear_ddp")
    assert result.returncode == 0, result.stderr
    row = next(line for line in result.stdout.splitlines() if line.startswith(original))
    assert "BITWISE" in row and "FINISHED" in row and "run" in row
    assert "RUN ID" in result.stdout.splitlines()[0]


def test_replay_and_compare_say_where_the_curves_are(project: Project, original: str, clean_replay) -> None:
    """The pictures a judged replay records (replay/metric_<name>.png, original and replay overlaid) are named with
    their path; `compare RUN` alone compares the run with its newest replay, and says the same."""
    replay_id = clean_replay.last_line
    from harness.store.uris import artifact_path

    folder = Path(str(artifact_path(project.client().get_run(replay_id).info.artifact_uri))) / "replay"
    said = (f"Curves (original and replay overlaid) in {folder}: metric_harness.lr.png, metric_loss.png; the report: "
            f"{folder / 'report.md'}")
    assert said in clean_replay.stderr.splitlines(), clean_replay.stderr
    assert (folder / "metric_loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    alone = project.harness("compare", original[:8], "--json")
    newest = project.client().search_runs(
        [project.client().get_run(original).info.experiment_id], order_by=["attributes.start_time DESC"],
        filter_string=f"tags.`harness.replay_of` = '{original}' and tags.`harness.kind` = 'replay'")[0].info.run_id
    doc = json.loads(alone.stdout)
    assert (doc["run_a"], doc["run_b"], doc["relation"]) == (original, newest, "replay"), alone.stderr
    assert f"comparing run {original} with its newest replay, {newest}" in alone.stderr
    assert any(line.startswith("Curves (original and replay overlaid) in ") for line in alone.stderr.splitlines())


def test_compare_two_runs_and_json(project: Project, original: str, clean_replay) -> None:
    result = project.harness("compare", original, clean_replay.last_line)
    assert result.returncode == 0 and result.stdout.strip().splitlines()[-1].startswith("verdict: BITWISE")
    as_json = project.harness("compare", original, clean_replay.last_line, "--json")
    doc = json.loads(as_json.stdout)
    assert doc["verdict"] == "BITWISE" and doc["run_a"] == original and doc["relation"] == "replay"


def test_replay_with_other_world_size_is_judged_by_tolerance(project: Project, original: str) -> None:
    result = project.harness("replay", original, "--world-size", "1")
    assert result.returncode in (0, 1), result.stderr
    line = verdict_line(result.stdout)
    assert not line.startswith("verdict: BITWISE")
    assert "harness.world_size: 2 -> 1" in result.stdout
    assert "bitwise match is impossible" in result.stdout
    tags = project.client().get_run(result.last_line).data.tags
    assert tags["harness.world_size"] == "1" and tags["harness.replay.changes"] == "world_size=1"


def test_changed_lr_diverges_at_the_first_differing_step(project: Project, original: str) -> None:
    refused = project.cli("replay", original, "train.lr=0.02")
    assert refused.returncode == 2 and "--allow-changes" in refused.stderr
    result = project.harness("replay", original, "--allow-changes", "train.lr=0.02")
    assert result.returncode == 1, result.stderr
    client = project.client()
    a, b = steps_values(client, original), steps_values(client, result.last_line)
    first = min(s for s in a if a[s] != b[s])  # found independently of harness' comparison
    assert first == 1  # step 0's loss is computed before the first update...
    # ...which used the other learning rate: the verdict names it, at the step it acted in.
    assert verdict_line(result.stdout).startswith("verdict: DIVERGED at step 0: harness.lr 0.01 vs 0.02")
    assert "Changes requested: train.lr=0.02" in result.stdout
    # Other numbers from the same samples: the difference is the arithmetic's, not the data pipeline's.
    assert "data order: identical at the 25 common steps" in result.stdout
    assert client.get_run(result.last_line).data.tags["harness.verdict"] == "DIVERGED"


def test_unseeded_randomness_diverges_at_its_step(project: Project) -> None:
    project.add_experiment("unseeded", train_py=UNSEEDED)
    run = project.harness("run", "experiments/unseeded")
    assert run.returncode == 0, run.stderr
    result = project.harness("replay", run.last_line)
    assert result.returncode == 1, result.stderr
    assert verdict_line(result.stdout).startswith("verdict: DIVERGED at step 3: loss")


def test_replay_of_dirty_run_applies_the_patch(fresh_project: Project) -> None:
    p = fresh_project
    yaml = p.root / "experiments/linear_ddp/experiment.yaml"
    yaml.write_text(yaml.read_text().replace("epochs: 5", "epochs: 2"))
    train = p.root / "experiments/linear_ddp/train.py"
    train.write_text(train.read_text().replace("loss_fn = nn.MSELoss()", "loss_fn = nn.L1Loss()"))
    (p.root / "experiments/linear_ddp/helper.py").write_text("SCALE = 3\n")  # untracked
    run = p.harness("run", "experiments/linear_ddp")
    assert run.returncode == 0, run.stderr
    # Restore the tree: the replay must take the code from the recorded patch, not from here.
    git(p.root, "checkout", "--", ".")
    (p.root / "experiments/linear_ddp/helper.py").unlink()
    result = p.harness("replay", run.last_line)
    assert result.returncode == 0, result.stdout + result.stderr
    assert verdict_line(result.stdout).startswith("verdict: BITWISE")
    tags = p.client().get_run(result.last_line).data.tags
    assert tags["harness.git.dirty"] == "true"
    assert tags["harness.git.patch_sha256"] == p.client().get_run(run.last_line).data.tags["harness.git.patch_sha256"]
    assert git(p.root, "status", "--porcelain") == ""


def test_replay_uses_recorded_config_not_the_yaml_on_disk(fresh_project: Project) -> None:
    p = fresh_project
    run = p.harness("run", "experiments/linear_ddp", "train.lr=0.03", "train.epochs=2")
    assert run.returncode == 0, run.stderr
    yaml = p.root / "experiments/linear_ddp/experiment.yaml"
    yaml.write_text(yaml.read_text().replace("lr: 0.01", "lr: 0.5"))
    git(p.root, "commit", "-qam", "change lr")
    result = p.harness("replay", run.last_line)
    assert result.returncode == 0, result.stdout + result.stderr
    assert verdict_line(result.stdout).startswith("verdict: BITWISE")
    assert p.client().get_run(result.last_line).data.params["train.lr"] == "0.03"


def test_bad_replay_input_is_one_line_exit_2(project: Project, original: str, tmp_path: Path) -> None:
    unknown = project.cli("replay", "0123456789abcdef0123456789abcdef")
    assert unknown.returncode == 2 and unknown.stderr.strip().startswith("Error: no run '0123456789abcdef")
    assert len(unknown.stderr.strip().splitlines()) == 1

    client = project.client()
    exp = client.get_experiment_by_name("linear_ddp").experiment_id
    foreign = client.create_run(exp).info.run_id
    client.set_terminated(foreign)
    result = project.cli("replay", foreign)
    assert result.returncode == 2 and "was not made by harness" in result.stderr

    other = tmp_path / "other repo"
    other.mkdir()
    git(other, "init", "-q")
    (other / "README").write_text("x")
    git(other, "add", "-A")
    git(other, "commit", "-qm", "unrelated")
    missing = project.cli("replay", original, cwd=other)
    assert missing.returncode == 2
    assert "is not in the repository" in missing.stderr and "git fetch https://example.invalid/lab/project.git" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _read_line(proc, timeout_s: float) -> str:
    """The next stdout line of a running process, within a deadline."""
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    if not sel.select(timeout_s):
        raise AssertionError(f"no line on stdout within {timeout_s} s")
    return proc.stdout.readline().strip()


def _first_lines(pipe, n: int, timeout_s: float) -> list[str]:
    """The first `n` lines of a pipe nothing has read yet, within a deadline: read from its descriptor, since a text
    readline() would take every line already written into its buffer, where select() no longer sees them."""
    import select
    import time

    data, deadline = b"", time.monotonic() + timeout_s
    while data.count(b"\n") < n:
        ready, _, _ = select.select([pipe.fileno()], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            raise AssertionError(f"fewer than {n} lines within {timeout_s} s: {data!r}")
        data += os.read(pipe.fileno(), 65536)
    return [line.strip() for line in data.decode().splitlines()[:n]]


def test_ui_opens_on_runs_and_replays_with_their_verdicts(project: Project, original: str, clean_replay,
                                                         tmp_path: Path) -> None:
    """`harness ui` (a real MLflow server) and the page its printed link opens, in a real headless Chromium."""
    import signal
    import subprocess
    import urllib.request

    from browser import chromium as find_chromium

    chromium = find_chromium()
    port = _free_port()
    server = project.popen("ui", "linear_ddp", "--port", str(port))
    try:
        link = _read_line(server, 180)  # printed once the server answers
        exp_id = project.client().get_run(original).info.experiment_id
        assert link == (f"http://127.0.0.1:{port}/#/experiments/{exp_id}/runs"
                        "?viewStateShareKey=harness&workflowType=machine_learning&compareRunsMode=TABLE"), link
        replay_id = clean_replay.last_line
        report_url = f"http://127.0.0.1:{port}/get-artifact?path=replay%2Freport.md&run_uuid={replay_id}"
        with urllib.request.urlopen(report_url, timeout=30) as r:
            assert "BITWISE" in r.read().decode()
        browser = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                   "--disable-background-networking", "--disable-component-update", "--disable-sync",
                   f"--user-data-dir={tmp_path / 'chromium'}", "--window-size=2400,1000",
                   "--virtual-time-budget=20000"]
        dom = subprocess.run([*browser, "--dump-dom", link], capture_output=True, text=True, timeout=120).stdout
        client = project.client()
        # The training-runs table (not the GenAI overview), sorted by creation time so that what was made from a run
        # folds under it, harness's columns, and the run's row: its replays' verdicts counted in it, the replay
        # itself folded under it (MLflow draws a nested row only once its parent is expanded).
        assert 'data-testid="sort-select-dropdown"' in dom and "Sort: Created" in dom, re.findall(r"Sort: [^<]*", dom)
        for column in ("harness.verdict", "harness.replays", "harness.world_size", "harness.git.commit",
                       "harness.image.digest"):
            assert column in dom, column
        assert client.get_run(original).info.run_name in dom
        assert client.get_run(replay_id).info.run_name not in dom
        assert "BITWISE" in dom
        assert client.get_run(original).data.tags["harness.git.commit"][:8] in dom
        # The run and its replays, every metric's curves overlaid: MLflow's compare page, linked on stderr.
        starting, said = _first_lines(server.stderr, 2, 30)
        assert starting.startswith("Starting the MLflow UI for "), starting
        assert said.startswith(f"Run {original} and its replays, every metric overlaid: http://127.0.0.1:{port}/"
                               "#/compare-runs?runs="), said
        compared = subprocess.run([*browser, "--dump-dom", said.split(": ", 1)[1]], capture_output=True, text=True,
                                  timeout=120).stdout
        assert client.get_run(original).info.run_name in compared and client.get_run(replay_id).info.run_name in compared
        assert "loss" in compared
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 130
    # The server went with `harness ui`: nothing listens on the port any more.
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)


def test_ui_is_quiet_and_runs_link_to_its_port(project: Project, original: str) -> None:
    """While `harness ui` serves the store, `run` and `replay` link to its port in the model-training view; its stderr
    is its own line (no MLflow INFO lines, no deprecation warnings); once it stops, the links name the default."""
    import signal

    from harness.store.tracking import Tracker

    port = _free_port()
    server = project.popen("ui", "linear_ddp", "--port", str(port))
    exp_id = project.client().get_run(original).info.experiment_id
    try:
        assert _read_line(server, 180).startswith(f"http://127.0.0.1:{port}/#/experiments/{exp_id}/runs?")
        assert Tracker(project.uri, writable=False).ui_hint(original) == (
            f"Open it in the MLflow UI: http://127.0.0.1:{port}/#/experiments/{exp_id}/runs/{original}"
            "?workflowType=machine_learning")
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 130
    said = server.stderr.read()
    # Its own line, and, where the experiment holds a replay, the link to its curves overlaid with its run's.
    assert said.startswith("Starting the MLflow UI for ") and len(said.splitlines()) <= 2, said
    assert all(" and its replays, every metric overlaid: " in line for line in said.splitlines()[1:]), said
    hint = Tracker(project.uri, writable=False).ui_hint(original)
    assert hint.startswith("Open it in the MLflow UI: harness ui --tracking-uri ") and hint.endswith(
        f", then http://127.0.0.1:5050/#/experiments/{exp_id}/runs/{original}?workflowType=machine_learning"), hint


def test_a_ui_that_is_gone_is_not_linked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The announcement of a `harness ui` killed with SIGKILL stays behind: a dead process, or a port nobody answers
    on, is not linked; a wildcard bind is linked on the loopback."""
    import json
    import os
    import socket
    import subprocess

    from harness.store import ui

    monkeypatch.setenv("HARNESS_CACHE_DIR", str(tmp_path))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        base = ui.link_base("0.0.0.0", listening.getsockname()[1])
        assert base == f"http://127.0.0.1:{listening.getsockname()[1]}"
        with ui.announced(uri, base):
            assert ui.served_at(uri) == base
            assert ui.served_at(f"sqlite:///{tmp_path / 'other.db'}") is None  # another store's UI
            path = next((tmp_path / "ui").glob("*.json"))
            dead = subprocess.Popen(["true"])  # a pid that no longer runs
            dead.wait()
            path.write_text(json.dumps({"pid": dead.pid, "url": base}))
            assert ui.served_at(uri) is None
        assert json.loads(path.read_text())["pid"] == dead.pid  # not ours any more: left to whoever wrote it
    path.write_text(json.dumps({"pid": os.getpid(), "url": base}))  # alive, but nothing listens there now
    assert ui.served_at(uri) is None
    with ui.announced(uri, base):
        pass
    assert not path.exists()  # its own announcement goes with it


def test_ui_of_an_unknown_experiment_is_one_line(project: Project, original: str) -> None:
    result = project.harness("ui", "no_such_experiment", "--port", str(_free_port()))
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1].startswith(
        "Error: no MLflow experiment 'no_such_experiment'")


FAILS_ONCE = '''
import os
import torch
from torch import nn


def train(ctx):
    cfg = ctx.cfg
    data = torch.randn(cfg.samples, 10, generator=torch.Generator().manual_seed(ctx.seed))
    loader = ctx.loader(data, batch_size=cfg.batch_size)
    model = ctx.ddp(nn.Linear(10, 5))
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    ctx.track(opt)
    for _ in ctx.epochs(cfg.epochs):
        for batch in loader:
            # Only when the test asks: the original fails at step 7, its replay does not.
            if ctx.step == 7 and os.environ.get("HARNESS_TEST_FAIL_AT_7") == "1":
                raise RuntimeError("failing at step 7 on purpose")
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(batch), torch.randn(batch.shape[0], 5))
            loss.backward()
            opt.step()
            ctx.log({"loss": loss}, ctx.step)
'''


@pytest.fixture(scope="module")
def failed_run(project: Project) -> str:
    project.add_experiment("fails_once", train_py=FAILS_ONCE)
    result = project.harness("run", "experiments/fails_once", "checkpoint_every=5",
                             env={"HARNESS_TEST_FAIL_AT_7": "1"})
    assert result.returncode == 1, result.stderr
    return result.last_line


def test_replay_of_a_failed_run_is_refused_with_the_ways_out(project: Project, failed_run: str) -> None:
    before = len(project.all_runs())
    result = project.cli("replay", failed_run)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip() == (
        f"Error: run {failed_run} is FAILED: it stopped before its end, so a full replay cannot be judged against "
        f"it. Resume it with `harness resume {failed_run}` (it has checkpoints), or pass --allow-incomplete to "
        "replay it and compare only the steps it reached."
    )
    assert len(project.all_runs()) == before  # nothing recorded
    assert git(project.root, "worktree", "list").count("\n") == 0  # nothing checked out


def test_allow_incomplete_compares_the_steps_the_original_reached(project: Project, failed_run: str) -> None:
    reached = steps_values(project.client(), failed_run)
    assert reached and max(reached) <= 6  # it raised at step 7, before logging it
    result = project.harness("replay", failed_run, "--allow-incomplete")
    assert result.returncode == 0, result.stdout + result.stderr
    line = verdict_line(result.stdout)
    assert line.startswith("verdict: BITWISE: 1 metric x")
    assert line.endswith(f"(compared the {len(reached)} steps the FAILED original reached)")
    client = project.client()
    assert client.get_run(result.last_line).info.status == "FINISHED"
    doc = json.loads(Path(client.download_artifacts(result.last_line, "replay/comparison.json")).read_text())
    assert doc["reached"] == {"status": "FAILED", "steps": len(reached)} and doc["config_delta"] == []


def test_replaying_a_replay_replays_its_original(project: Project, original: str, clean_replay) -> None:
    replay_id = clean_replay.last_line
    result = project.harness("replay", replay_id)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"run {replay_id} is a replay of {original}; replaying {original}" in result.stderr
    assert project.client().get_run(result.last_line).data.tags["harness.replay_of"] == original
    assert "Config delta: none" in result.stdout and "Environment delta: none" in result.stdout
    listed = project.harness("runs", "linear_ddp", "-n", "100")
    row = next(line for line in listed.stdout.splitlines() if line.startswith(original))
    assert "BITWISE 2" in row  # every replay counted, not just the latest
    # The original's row in the UI says the same (a tag rewritten as each replay is judged). This replay checked the
    # original's seal after the first replay had written that tag: the tag is outside the seal.
    counted = project.client().get_run(original).data.tags["harness.replays"]
    assert "BITWISE 2" in counted and row.endswith(counted), (counted, row)


def test_compare_lists_the_config_delta_first(project: Project, original: str) -> None:
    other = project.harness("run", "experiments/linear_ddp", "train.lr=0.02", "flush_interval_s=1.0")
    assert other.returncode == 0, other.stderr
    result = project.harness("compare", original, other.last_line)
    assert result.returncode == 1, result.stdout + result.stderr
    out = result.stdout
    assert "Config delta (run A -> run B):\n   flush_interval_s: 2.0 -> 1.0  (does not affect the result)\n" \
           "   train.lr: 0.01 -> 0.02\n" in out
    assert "Environment delta: none" not in out
    assert out.index("Config delta") < out.index("Environment delta")


# --- the tolerance a judgement uses: --tolerance, and --allow-changes replay.tolerance.* -------------------


@pytest.fixture(scope="module")
def wide_run(project: Project) -> str:
    """One run of the wide experiment: replayed with another thread count its losses differ in their last bits
    (conftest.OTHER_HARDWARE says why that is an honest stand-in for other hardware)."""
    project.add_experiment("wide", train_py=WIDE_TRAIN)
    result = project.harness("run", "experiments/wide", *WIDE_CONFIG)
    assert result.returncode == 0, result.stderr
    return result.last_line


def test_tolerance_given_decides_the_verdict_and_is_recorded(project: Project, wide_run: str) -> None:
    exact = project.harness("replay", wide_run, *OTHER_HARDWARE)
    assert exact.returncode == 1, exact.stdout + exact.stderr
    assert verdict_line(exact.stdout).startswith("verdict: DIVERGED at step "), exact.stdout

    # Values within the loss tolerance, but other weights: never within a tolerance set for the metrics.
    metrics_only = project.harness("replay", wide_run, *OTHER_HARDWARE, "--tolerance", "loss=1e-2")
    assert metrics_only.returncode == 1, metrics_only.stdout + metrics_only.stderr
    assert "parameter fingerprints differ" in verdict_line(metrics_only.stdout), metrics_only.stdout
    assert "--tolerance weights=any would let the metrics decide" in metrics_only.stdout

    wide = project.harness("replay", wide_run, *OTHER_HARDWARE, "--tolerance", "loss=1e-2", "--tolerance", "weights=any")
    assert wide.returncode == 0, wide.stdout + wide.stderr
    assert verdict_line(wide.stdout).startswith("verdict: WITHIN_TOLERANCE: "), wide.stdout
    assert "(weights may differ: weights=any)" in verdict_line(wide.stdout)
    assert "Tolerance given (--tolerance, over the recorded replay.tolerance): loss atol 0.01 rtol 0" in wide.stdout
    assert ", tolerance atol 0.01 rtol 0" in wide.stdout  # on the loss line
    client = project.client()
    run = client.get_run(wide.last_line)
    assert run.data.tags["harness.replay.tolerance"] == "loss=0.01,0.0 weights=any"
    assert run.data.tags["harness.verdict"] == "WITHIN_TOLERANCE"
    assert "harness.replay.tolerance:" not in wide.stdout  # a judgement's choice, not an environment fact
    report = Path(client.download_artifacts(wide.last_line, "replay/report.md")).read_text()
    assert "Tolerance given with `--tolerance`" in report and "- `loss`: atol 0.01, rtol 0" in report

    # Comparing later judges the replay as it was judged; --tolerance on compare decides for itself.
    again = project.harness("compare", wide_run, wide.last_line)
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.strip().splitlines()[-1].startswith("verdict: WITHIN_TOLERANCE"), again.stdout
    assert project.harness("compare", wide_run, exact.last_line).returncode == 1
    loose = project.harness("compare", wide_run, exact.last_line, "--tolerance", "loss=1e-2", "--tolerance", "weights=any")
    assert loose.returncode == 0, loose.stdout + loose.stderr
    assert "verdict: WITHIN_TOLERANCE" in loose.stdout and "loss atol 0.01 rtol 0" in loose.stdout


def test_allowed_tolerance_change_is_the_tolerance_judged(project: Project, wide_run: str) -> None:
    result = project.harness("replay", wide_run, *OTHER_HARDWARE, "replay.tolerance.metrics.loss.atol=1e-2",
                             "replay.tolerance.weights=any")
    assert result.returncode == 0, result.stdout + result.stderr
    assert verdict_line(result.stdout).startswith("verdict: WITHIN_TOLERANCE: "), result.stdout
    assert "replay.tolerance.metrics.loss.atol=1e-2" in result.stdout  # the change requested, as recorded


@pytest.mark.parametrize("spec", ["loss", "loss=", "loss=abc", "loss=-1", "=1e-3", "loss=1,2,3", "loss=-inf"])
def test_bad_tolerance_is_one_line_exit_2_and_records_nothing(project: Project, wide_run: str, spec: str) -> None:
    before = len(project.all_runs())
    for command in (["replay", wide_run], ["compare", wide_run, wide_run]):
        result = project.cli(*command, "--tolerance", spec)
        assert result.returncode == 2, result.stdout + result.stderr
        assert result.stderr.startswith(f"Error: --tolerance {spec!r} is not METRIC=ATOL[,RTOL]"), result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert len(project.all_runs()) == before
