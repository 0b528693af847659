"""Heartbeats: STALE in `harness runs`, `harness mark`, and replay's refusal of RUNNING runs, on runs
left RUNNING in a real store (no launcher is needed to leave a run RUNNING)."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from conftest import Project
from harness import scratch, tags
from harness.commands.mark import heartbeat_age, is_stale


def test_stale_rule() -> None:
    beat = {tags.HEARTBEAT: "1000.0", tags.HEARTBEAT_S: "10"}
    assert heartbeat_age(beat, 1012.5) == 12.5
    assert not is_stale(beat, 1000.0 + tags.STALE_FACTOR * 10)  # exactly the limit is still live
    assert is_stale(beat, 1000.0 + tags.STALE_FACTOR * 10 + 0.1)
    assert not is_stale({}, 1e12) and heartbeat_age({}, 1e12) is None  # no heartbeat: never stale
    assert not is_stale({tags.HEARTBEAT: "1000.0"}, 1e12)  # no interval: nothing to judge by
    assert not is_stale({tags.HEARTBEAT: "soon", tags.HEARTBEAT_S: "10"}, 1e12)


def test_the_heartbeat_names_its_process(project: Project) -> None:
    from harness.store.tracking import Tracker

    run_id = running_run(project, "beating", None)
    beat = Tracker(project.uri).heartbeat(run_id, 3600)
    beat.close()
    assert project.client().get_run(run_id).data.tags[tags.HEARTBEAT_BY] == scratch.process_identity()
    assert scratch.ended(scratch.process_identity()) is None  # this process runs
    assert scratch.ended(None) is None and scratch.ended("boot=another pid=1") is None  # not this machine: unknown


def running_run(project: Project, name: str, beat_age_s: float | None, every_s: float = 10.0,
                by: str | None = None) -> str:
    """A harness-tagged run left RUNNING, with a heartbeat written `beat_age_s` ago every `every_s` seconds
    (None: no heartbeat tags), by the process `by` names (scratch.process_identity)."""
    client = project.client()
    exp = client.get_experiment_by_name("liveness") or None
    exp_id = exp.experiment_id if exp else client.create_experiment("liveness")
    run_tags = {tags.VERSION: "0.1.0", tags.KIND: "run", tags.WORLD_SIZE: "2"}
    if beat_age_s is not None:
        run_tags |= {tags.HEARTBEAT: str(time.time() - beat_age_s), tags.HEARTBEAT_S: str(every_s)}
    if by is not None:
        run_tags[tags.HEARTBEAT_BY] = by
    return client.create_run(exp_id, tags=run_tags, run_name=name).info.run_id


def ended_launcher() -> str:
    """The identity of a launcher on this machine that has ended (a real process, started and reaped)."""
    launcher = subprocess.Popen([sys.executable, "-c", "from harness import scratch; print(scratch.process_identity())"],
                                stdout=subprocess.PIPE, text=True)
    identity = launcher.communicate(timeout=60)[0].strip()
    assert f"pid={launcher.pid}" in identity
    return identity


def killed_in_a_derived_run(project: Project) -> str:
    """A run made from another (a trace, a bisect, a verify, a calibration: record/derived.py opened) whose command
    was SIGKILLed while its body ran: a real process, which nothing closes."""
    code = ("import os, signal, sys\n"
            "from harness.record import derived\n"
            "from harness.store.tracking import Tracker\n"
            "with derived.opened(Tracker(sys.argv[1]), 'liveness', {'harness.version': '0.1.0', 'harness.kind': 'trace'},"
            " 'trace-killed') as run_id:\n"
            "    print(run_id, flush=True)\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\n")
    killed = subprocess.run([sys.executable, "-c", code, project.uri], capture_output=True, text=True, timeout=120)
    assert killed.returncode == -9, killed.stderr
    return killed.stdout.strip()


@pytest.fixture(scope="module")
def runs(project: Project) -> dict[str, str]:
    return {
        "stale": running_run(project, "stale", 3600),
        # A long interval keeps it live however slowly the CLI starts on a busy machine.
        "live": running_run(project, "live", 0, every_s=3600),
        "silent": running_run(project, "silent", None),
        # Killed a moment ago (a resume SIGKILLed here): its heartbeat is fresh, its process is gone.
        "killed": running_run(project, "killed", 0, every_s=3600, by=ended_launcher()),
        # Its process runs (this one): live, whatever the heartbeat's age.
        "here": running_run(project, "here", 0, every_s=3600, by=scratch.process_identity()),
        "derived": killed_in_a_derived_run(project),
    }


def _status(project: Project, run_id: str) -> str:
    listed = project.cli("runs", "liveness", "--all")  # a trace is nested under its run: listed so
    assert listed.returncode == 0, listed.stderr
    row = next(line for line in listed.stdout.splitlines() if line.startswith(run_id))
    return row.split()[4]  # id, experiment, date, time, status


def test_runs_shows_stale_only_for_a_silent_launcher(project: Project, runs: dict[str, str]) -> None:
    assert _status(project, runs["stale"]) == "STALE"
    assert _status(project, runs["live"]) == "RUNNING"
    assert _status(project, runs["silent"]) == "RUNNING"  # no heartbeat tags: never STALE
    assert _status(project, runs["killed"]) == "STALE"  # its launcher ended on this machine: known at once
    assert _status(project, runs["here"]) == "RUNNING"
    assert _status(project, runs["derived"]) == "STALE"  # a trace's (a calibration's ...) command killed outright


def test_replay_refuses_running_runs(project: Project, runs: dict[str, str]) -> None:
    stale = project.cli("replay", runs["stale"])
    assert stale.returncode == 2
    assert re.fullmatch(
        rf"Error: run {runs['stale']} is RUNNING but its launcher is gone \(no heartbeat for 36\d\d s\)\. "
        rf"Close it with `harness mark {runs['stale']} --status FAILED`, then replay it with --allow-incomplete\.",
        stale.stderr.strip())
    live = project.cli("replay", runs["live"], "--allow-incomplete")
    assert live.returncode == 2
    assert live.stderr.strip() == (
        f"Error: run {runs['live']} is still RUNNING; its record is not complete. Wait until it ends, then replay it. "
        f"If its launcher was killed on another machine, `harness mark {runs['live']} --status FAILED` closes it "
        "once its heartbeat is 10800 s old.")
    killed = project.cli("replay", runs["killed"])
    assert killed.returncode == 2
    assert re.fullmatch(
        rf"Error: run {runs['killed']} is RUNNING but its launcher is gone \(its process \d+ on this machine has "
        rf"ended\)\. Close it with `harness mark {runs['killed']} --status FAILED`, then replay it with "
        r"--allow-incomplete\.", killed.stderr.strip())


def test_mark_refuses_live_and_silent_runs(project: Project, runs: dict[str, str]) -> None:
    live = project.cli("mark", runs["live"], "--status", "FAILED")
    assert live.returncode == 2 and len(live.stderr.strip().splitlines()) == 1
    assert re.fullmatch(
        rf"Error: run {runs['live']} is live: its heartbeat is \d+ s old \(written every 3600 s\), so its launcher "
        r"is still running\. Stop it with Ctrl-C or SIGTERM to its launcher; it closes the run itself\.",
        live.stderr.strip())
    silent = project.cli("mark", runs["silent"], "--status", "KILLED")
    assert silent.returncode == 2 and "has no heartbeat tags" in silent.stderr and "--force" in silent.stderr
    assert project.client().get_run(runs["live"]).info.status == "RUNNING"


def test_mark_closes_a_stale_run(project: Project, runs: dict[str, str]) -> None:
    result = project.harness("mark", runs["stale"], "--status", "FAILED")
    assert result.returncode == 0, result.stderr
    run = project.client().get_run(runs["stale"])
    assert run.info.status == "FAILED"
    reason = run.data.tags[tags.STATUS_REASON]
    assert re.fullmatch(r"marked FAILED by harness mark: no heartbeat for 36\d\d s \(launcher gone\)", reason)
    again = project.cli("mark", runs["stale"], "--status", "FAILED")
    assert again.returncode == 2 and f"run {runs['stale']} is FAILED, not RUNNING" in again.stderr
    killed = project.cli("mark", runs["killed"], "--status", "FAILED")  # what the replay's refusal named
    assert killed.returncode == 0, killed.stderr
    assert re.fullmatch(r"marked FAILED by harness mark: its process \d+ on this machine has ended \(launcher gone\)",
                        project.client().get_run(runs["killed"]).data.tags[tags.STATUS_REASON])
    derived = project.cli("mark", runs["derived"], "--status", "KILLED")
    assert derived.returncode == 0, derived.stderr
    assert project.client().get_run(runs["derived"]).info.status == "KILLED"
    here = project.cli("mark", runs["here"], "--status", "FAILED")
    assert here.returncode == 2 and "is live" in here.stderr
    forced = project.harness("mark", runs["silent"], "--status", "KILLED", "--force")
    assert forced.returncode == 0, forced.stderr
    assert project.client().get_run(runs["silent"]).info.status == "KILLED"
