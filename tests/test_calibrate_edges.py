"""`harness calibrate` at its edges: a launcher killed outright (its calibration goes STALE and `harness mark` closes
it), a run recorded with a secret (given again as to replay), a replay's id (followed to its run), and a store whose
disk fills during the calibration (said with what it left there).

One tiny run (linear_ddp on 1 rank, 2 steps, a heartbeat every 0.5 s, a secret in its config) serves the first three;
the full disk needs its own store on a real tmpfs (root; CI runs as root). Members and steps are the fewest a
calibration takes: 2 members x 1 step."""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import time
from contextlib import closing
from pathlib import Path

import pytest
from conftest import KEPT_RANK_SERVER, Project, fill_disk, git, make_project, pid_alive, tmpfs

from harness import tags as T
from harness.errors import EXIT_FAILED, EXIT_USAGE, StoreUnavailable

SECRET = "train.api_key=pw-calib-7f3a"
FROM_ENV = {"CALIB_KEY": "pw-calib-7f3a"}  # the variable the run read its secret from
TINY = ["world_size=1", "train.epochs=1", "train.samples=20", "heartbeat_s=0.5"]  # 2 steps of 10 samples


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Project, str]:
    """(its project, the run): recorded with a secret, read from $CALIB_KEY, that the store holds only as a digest."""
    project = make_project(tmp_path_factory.mktemp("calibrate edges"))
    run = project.harness("run", "experiments/linear_ddp", *TINY, "train.api_key=${oc.env:CALIB_KEY}", env=FROM_ENV)
    assert run.returncode == 0, run.stderr
    return project, run.last_line


def _runs(project: Project, **wanted: str) -> list:
    return [r for r in project.all_runs() if all(r.data.tags.get(k) == v for k, v in wanted.items())]


@pytest.fixture(scope="module")
def killed(tiny: tuple[Project, str]) -> tuple[str, str]:
    """(calibration, its reference member) of a calibration whose launcher was SIGKILLed while the reference ran."""
    project, run = tiny
    # A rank server of this launch's own: its ranks are in the killed command's session, where _session looks.
    proc = project.popen("calibrate", run, "--members", "2", "--steps", "1", env={**FROM_ENV, KEPT_RANK_SERVER: "0"})
    deadline = time.monotonic() + 120
    while True:
        cals = _runs(project, **{T.CALIBRATION_OF: run})
        members = _runs(project, **{T.CALIBRATION: cals[0].info.run_id}) if cals else []
        if members:
            break
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the calibration's reference never started"
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its ranks, as a lost machine would
    proc.communicate(timeout=60)
    deadline = time.monotonic() + 30
    while left := _session(proc.pid):  # the member's ranks die with their launcher
        assert time.monotonic() < deadline, f"the killed calibration left processes behind: {left}"
        time.sleep(0.2)
    return cals[0].info.run_id, members[0].info.run_id


def _session(sid: int) -> list[int]:
    """The live processes of the session `sid` leads (the killed command started it: start_new_session)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and os.getsid(int(entry.name)) == sid and pid_alive(int(entry.name)):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def test_a_killed_calibration_goes_stale_and_mark_closes_it_without_force(tiny, killed) -> None:
    project, _ = tiny
    calibration, _ = killed
    assert project.client().get_run(calibration).info.status == "RUNNING"
    time.sleep(T.STALE_FACTOR * 0.5 + 0.5)  # three missed heartbeats
    listed = project.cli("runs", "linear_ddp", "-n", "20", "--status", "STALE")  # a calibration is nested: listed so
    assert listed.returncode == 0, listed.stderr
    row = next(line for line in listed.stdout.splitlines() if line.startswith(calibration))
    assert row.split()[4] == "STALE", listed.stdout
    marked = project.cli("mark", calibration, "--status", "KILLED")
    assert marked.returncode == 0, marked.stderr
    closed = project.client().get_run(calibration)
    assert closed.info.status == "KILLED"
    assert re.fullmatch(r"marked KILLED by harness mark: no heartbeat for \d+ s \(launcher gone\)",
                        closed.data.tags[T.STATUS_REASON])


def test_calibrate_asks_for_a_secret_as_replay_does(tiny) -> None:
    project, run = tiny
    before = len(project.all_runs())
    missing = project.cli("calibrate", run, "--members", "2", "--steps", "1")
    assert missing.returncode == EXIT_USAGE
    assert re.fullmatch(rf"Error: train\.api_key of run {run} is a secret the record does not hold "
                        rf"\(<redacted hmac-[0-9a-f]{{8}}:[0-9a-f]{{16}}>\); set \$CALIB_KEY as when it ran, or pass harness "
                        rf"calibrate {run} train\.api_key=VALUE\.", missing.stderr.strip().splitlines()[-1]), missing.stderr
    changed = project.cli("calibrate", run, SECRET, "train.lr=0.02", "--members", "2", "--steps", "1")
    assert changed.returncode == EXIT_USAGE
    assert changed.stderr.strip().splitlines()[-1] == (
        f"Error: calibrate re-executes run {run} as recorded and takes KEY=VALUE only for a secret its record hides; "
        "train.lr=0.02 would change it. Drop it (to calibrate another config, run it and calibrate that run).")
    assert len(project.all_runs()) == before  # refused before anything was recorded

    done = project.harness("calibrate", run, SECRET, "--members", "2", "--steps", "1")
    assert done.returncode == 0, done.stderr
    calibration = project.client().get_run(done.last_line)
    assert calibration.data.tags[T.CALIBRATION_OF] == run and calibration.info.status == "FINISHED"
    assert calibration.data.tags[T.HEARTBEAT_S] == "0.5"  # it was marked alive while it ran
    members = _runs(project, **{T.CALIBRATION: done.last_line})
    assert len(members) == 3 and all(m.info.status == "FINISHED" for m in members)
    assert all(T.CHANGES not in m.data.tags for m in members)  # a secret given again is no change
    assert "pw-calib-7f3a" not in done.stderr + done.stdout
    # One launch for the 3 of them: one bar, not each member's training output; then a short table, the id last.
    assert "epoch 1/1" not in done.stderr, done.stderr
    table = done.stdout.strip().splitlines()
    assert table[0] == f"calibration {done.last_line} of run {run}: 2 members x 1 steps; the run itself re-executed " \
                       "bit for bit here", table
    assert table[1].split() == ["half-width", "step", "0"] and table[-1] == done.last_line, table


def test_calibrate_follows_a_replay_to_its_run_in_one_line(tiny, killed) -> None:
    project, run = tiny
    _, member = killed  # a replay of the run (the killed calibration's reference), itself never FINISHED
    followed = project.cli("calibrate", member, "--steps", "99")
    assert followed.returncode == EXIT_USAGE
    assert followed.stderr.strip().splitlines()[-2:] == [
        f"run {member} is a replay of {run}; calibrating {run}",
        f"Error: --steps 99: run {run} took 2 steps. Pass --steps 2 or fewer."], followed.stderr


def test_a_full_disk_during_a_calibration_says_what_it_left(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The store's disk fills once the calibration is recorded, right before its members' runs are (they run in one
    launch, recorded together): the error is exit 1, never a refusal that "recorded nothing", and names each run the
    store holds, in the state it holds it, with the command that closes what stays RUNNING."""
    from harness.commands import calibrate as calibrate_command, replay as replay_command
    from harness.commands.options import CalibrateOptions

    project = make_project(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with tmpfs(tmp_path / "disk", "size=12m") as disk:
        store = Project(project.root, disk)
        run = store.harness("run", "experiments/linear_ddp", *TINY, env={"XDG_CACHE_HOME": str(tmp_path)})
        assert run.returncode == 0, run.stderr
        calls: list[int] = []

        def filling(options, context):
            calls.append(context.perturb_seed)
            fill_disk(disk)
            return replay_command.replay(options, context)

        monkeypatch.chdir(project.root)
        with pytest.raises(StoreUnavailable) as raised:
            calibrate_command.calibrate(CalibrateOptions(run.last_line, members=2, steps=1, tracking_uri=store.uri),
                                        replay=filling)
        with closing(sqlite3.connect(f"{(disk / 'mlflow.db').as_uri()}?mode=ro", uri=True)) as db:
            rows = db.execute("SELECT r.run_uuid, r.status, t.key, t.value FROM runs r JOIN tags t "
                              "ON t.run_uuid = r.run_uuid WHERE t.key IN (?, ?)",
                              (T.CALIBRATION_OF, T.CALIBRATION)).fetchall()
    cal, = [(rid, status) for rid, status, key, _ in rows if key == T.CALIBRATION_OF]
    members = [(rid, status) for rid, status, key, value in rows if key == T.CALIBRATION and value == cal[0]]
    assert calls == [0] and members == [], rows  # one launch for all of them: no member got a row
    err = raised.value
    assert err.exit_code == EXIT_FAILED, err
    close = "" if cal[1] != "RUNNING" else (
        f" Once its disk takes writes again and `harness runs --status STALE` shows it, close it: harness mark {cal[0]} --status "
        "FAILED.")
    assert str(err).startswith(f"the tracking store {store.uri} is full ("), err
    assert str(err).endswith(
        f"then rerun. It left calibration {cal[0]} {cal[1]}, with no envelope, and its member replays: none.{close} "
        f"Then calibrate again: harness calibrate {run.last_line}."), err
    trees = git(project.root, "worktree", "list", "--porcelain")
    assert trees.count("worktree ") == 1, trees  # the refused member's checkout is gone too
