"""Start-up: ranks started before the run is recorded, and the progress bar's rate and ETA.

The ranks are real spawned processes (they import torch while the launcher records); the rate and ETA
are a pure function, tested without a clock.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from conftest import KEPT_RANK_SERVER, ROOT, Project, pid_alive
from harness import events
from harness.cli.progress import Bar, progress_note, rate_and_eta
from harness.errors import RunFailed
from harness.executors.launch import launch, start_ranks
from harness.runtime.rank.spec import LaunchSpec


def test_rate_and_eta_count_from_the_first_step_not_from_start_up() -> None:
    # 30 s of start-up before the first step, then 10 steps in 2 s: 5 steps/s, 90 steps left -> 18 s.
    first, last = (1, 130.0), (11, 132.0)
    assert rate_and_eta(first, last, total=101) == (5.0, 18.0)
    assert progress_note(5.0, 18.0) == "5 step/s, 00:18 left"
    # One step seen: nothing to measure yet (the start-up is never a step's duration).
    assert rate_and_eta(first, first, total=101) == (None, None)
    assert progress_note(None, None) == ""
    # No total yet (before the training loader is known): a rate, no ETA; done past total: 0 s left.
    assert rate_and_eta(first, last, total=None) == (5.0, None)
    assert rate_and_eta(first, (120, 140.0), total=101)[1] == 0.0


def test_the_cli_draws_the_steps_as_a_bar_on_a_terminal_and_lines_above_it(monkeypatch: pytest.MonkeyPatch) -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    class File(io.StringIO):
        def isatty(self) -> bool:
            return False

    def draw(stderr: io.StringIO) -> str:
        monkeypatch.setattr(sys, "stderr", stderr)
        bar = Bar()
        bar.steps(events.Steps("linear_ddp x2"))
        bar.steps(events.Steps("linear_ddp x2", 0, 5))
        bar.write("epoch 1/1 loss 0.1")
        for done in (1, 2, 3):
            bar.steps(events.Steps("linear_ddp x2", done, 5))
        bar.steps(events.Steps("linear_ddp x2", 3, 5, ended=True))
        bar.write("after the ranks")
        return stderr.getvalue()

    shown = draw(Terminal())
    assert "linear_ddp x2:  60%|" in shown and "| 3/5 [" in shown, shown
    assert "epoch 1/1 loss 0.1\n" in shown and shown.endswith("\nafter the ranks\n"), shown
    # Not a terminal (a log file, a pipe): the lines only, no bar redrawn with carriage returns.
    assert draw(File()) == "epoch 1/1 loss 0.1\nafter the ranks\n"


def test_the_bar_ends_full_when_the_ranks_end_well(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Rank 0's step clock is read every 0.2 s: a fast run's last reading was step 172 of 184, and the bar stayed at
    # 93% after FINISHED. Ranks that ended well ran every step: the last Steps says the record's count, of itself.
    from harness.executors.follow import Follower

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    def follow(finished: bool, steps: int | None) -> tuple[events.Steps, str]:
        monkeypatch.setattr(sys, "stderr", Terminal())
        bar, said = Bar(), []

        def listen(event: events.Event) -> None:
            if isinstance(event, events.Steps):
                said.append(event)
                bar.steps(event)

        with events.listening(listen):
            follower = Follower(tmp_path / "rank0.log", "digits_cnn x2")
            follower.total(184)
            follower.follow_steps([171])  # rank 0's clock: step index 171, 172 steps done
            time.sleep(0.3)  # the follower's thread reads the clock every 0.2 s
            follower.close(finished=finished, steps=steps)
        return said[-1], sys.stderr.getvalue()

    last, shown = follow(True, 184)
    assert (last.done, last.total, last.ended) == (184, 184, True)
    assert shown.rstrip().endswith("]") and "100%|" in shown.splitlines()[-1] and "| 184/184 [" in shown, shown
    # replay --steps 8 ended well after its 8 steps: 8 of 8, not 8 of the run's 184.
    last = follow(True, 8)[0]
    assert last.done == last.total == 8
    # No count came (no registered model): the total it was to run.
    assert follow(True, None)[0].done == 184
    # A failed run ends where its ranks were.
    last, shown = follow(False, None)
    assert (last.done, last.total) == (172, 184) and "| 172/184 [" in shown.splitlines()[-1]


def test_a_calibrations_members_count_on_one_bar_and_their_output_is_not_shown(tmp_path: Path) -> None:
    """Calibration members run one after another in the same ranks, each from step 0: one count over all of them
    (3 members x 10 steps), rank 0's training output (the same each time) not told, the run's own total ignored."""
    from harness.executors.follow import Follower

    said: list[events.Event] = []
    (tmp_path / "rank0.log").write_text("epoch 1/1 loss 1.0\n")
    clock = [-1.0]
    with events.listening(said.append):
        follower = Follower(tmp_path / "rank0.log", "calibrating", segments=(3, 10))
        follower.follow_steps(clock)
        follower.total(184)  # a member's own count
        clock[0] = 9
        time.sleep(0.3)  # the follower's thread reads the clock every 0.2 s
        follower.segment(1)
        clock[0] = 4
        time.sleep(0.3)
        follower.close(finished=True, steps=10)
    steps = [(e.done, e.total) for e in said if isinstance(e, events.Steps)]
    assert steps[0] == (0, 30) and (10, 30) in steps and (15, 30) in steps and steps[-1] == (30, 30), steps
    assert not [e for e in said if isinstance(e, events.RankOutput)]


def _spec(log_dir: Path) -> LaunchSpec:
    return LaunchSpec(
        code_dir=str(ROOT / "experiments" / "linear_ddp"), entry_file="train.py", entry_func="train", world_size=2,
        device="cpu", backend="gloo", seed=0, rank_seeds=[1, 2], threads_per_rank=1, determinism="strict",
        fingerprint_every=5, train_cfg={"lr": 0.01, "epochs": 1, "batch_size": 10, "samples": 100},
        log_dir=str(log_dir),
    )


def _wait_alive(ranks, deadline_s: float = 120) -> list[int]:
    deadline = time.monotonic() + deadline_s
    procs = ranks.context.processes
    while not all(p.pid for p in procs):
        assert time.monotonic() < deadline, "ranks never started"
        time.sleep(0.1)
    return [p.pid for p in procs]


def test_rank_dying_while_the_run_is_recorded_fails_the_launch_and_leaves_nothing(tmp_path: Path) -> None:
    ranks = start_ranks(2, tmp_path / "logs")
    pids = _wait_alive(ranks)
    os.kill(pids[1], signal.SIGKILL)  # rank 1 dies while the launcher would still be recording
    with pytest.raises(RunFailed, match=r"^rank 1 was killed by SIGKILL"):
        launch(_spec(tmp_path / "logs"), lambda msg: None, ranks=ranks)
    assert not any(pid_alive(p) for p in pids)


def test_ranks_whose_launcher_gives_up_exit_by_themselves(tmp_path: Path) -> None:
    # A launcher that dies before the run exists (SIGKILL, a failed record) closes its end of their
    # spec pipes: the ranks, still waiting for a spec, end on their own; stop() is the polite way.
    ranks = start_ranks(2, tmp_path / "logs")
    pids = _wait_alive(ranks)
    for inbox in ranks.inboxes:
        inbox.close()
    for proc in ranks.context.processes:
        proc.join(timeout=300)
        assert proc.exitcode == 0, proc.exitcode
    ranks.stop()  # idempotent once they are gone
    assert not any(pid_alive(p) for p in pids)
    assert {"rank0.log", "rank1.log"} <= {p.name for p in (tmp_path / "logs").iterdir()}


def test_ranks_on_a_gpu_give_init_process_group_their_device(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    import torch.distributed as dist

    from harness.runtime.rank.body import device_id

    assert device_id(torch.device("cpu")) == {}
    assert device_id(torch.device("cuda", 3)) == {"device_id": torch.device("cuda", 3)}
    # A torch before 2.3 (none installable here) has no device_id: a stand-in with that older signature.
    def older(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1, store=None, group_name="",
              pg_options=None):  # type: ignore[no-untyped-def]
        raise AssertionError("not called")

    monkeypatch.setattr(dist, "init_process_group", older)
    assert device_id(torch.device("cuda", 3)) == {}


# --- the warm rank server: a forked rank is a spawned one, started warm -------------------------------------------

def _probe(method: str, out: Path, marker_inode: int) -> list[dict]:
    import json

    from harness.executors import procs

    out.mkdir()
    from rankprobe import probe_rank  # a module of the standard library's imports only

    ranks = procs.start(probe_rank, (str(out), marker_inode), 2, procs.Method(method))
    deadline = time.monotonic() + 300
    try:
        while not ranks.join(timeout=1):  # True once both ended with status 0; a failure raises
            assert time.monotonic() < deadline, "the probes did not finish"
    finally:
        ranks.stop(5)
    return [json.loads((out / f"{i}.json").read_text()) for i in range(2)]


@pytest.mark.parametrize("kept", ["per launch", "kept"])
def test_a_forked_rank_sees_what_a_spawned_rank_sees_and_starts_warm(kept: str, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # A server of this launch's own, or one kept between commands (of its own: a variable of the import-time kind).
    if kept == "kept":
        monkeypatch.setenv(KEPT_RANK_SERVER, "30")
        monkeypatch.setenv("PYTORCH_HARNESS_TEST_KEY", str(tmp_path))
    else:
        monkeypatch.setenv(KEPT_RANK_SERVER, "0")
    # The launcher's environment as spawn would pass it, a descriptor of its own the ranks must not inherit.
    monkeypatch.setenv("HARNESS_PROBE_SET", "set after the launcher started")
    monkeypatch.delenv("HARNESS_PROBE_GONE", raising=False)
    (tmp_path / "t").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "t"))  # after the server started, when it is kept
    read_end, write_end = os.pipe()
    try:
        marker = os.fstat(write_end).st_ino
        forked = _probe("forkserver", tmp_path / "fork", marker)
        spawned = _probe("spawn", tmp_path / "spawn", marker)
    finally:
        os.close(read_end)
        os.close(write_end)
    for rank in forked + spawned:
        assert rank["env"] == {"HARNESS_PROBE_SET": "set after the launcher started", "HARNESS_PROBE_GONE": None}
        assert not rank["marker_held"], "a rank inherited a descriptor of the launcher's"
        assert not rank["cuda_initialised"]
        assert not rank["preloaded"]["mlflow"] and not rank["preloaded"]["sqlalchemy"]  # no MLflow, no store
    for f, s in zip(forked, spawned):
        assert (f["cwd"], f["sys_path"], f["handlers"], f["tmp"]) == (s["cwd"], s["sys_path"], s["handlers"], s["tmp"])
        assert f["tmp"] == str(tmp_path / "t")
        assert f["threads"] <= s["threads"] + 1  # the one that watches the launcher (runtime/rank/child.py)
    # Warm: torch, DDP's dynamo import and harness's rank body were loaded before the rank's code ran, in one
    # server whose child each forked rank is; a spawned rank loads them itself.
    assert all(r["preloaded"]["torch"] and r["preloaded"]["torch._dynamo"] for r in forked)
    assert all(r["preloaded"]["harness.runtime.context"] for r in forked)
    assert not any(r["preloaded"]["torch"] for r in spawned)
    assert forked[0]["ppid"] == forked[1]["ppid"] != os.getpid()
    assert spawned[0]["ppid"] == spawned[1]["ppid"] == os.getpid()
    # The global RNGs a spawned process seeds from the OS (torch's default generator too) differ in
    # every rank: a fork of one server must not hand every rank the server's state.
    for rng in ("numpy", "random", "torch_seed", "torch_draw"):
        assert len({r[rng] for r in forked + spawned}) == 4, rng


def test_the_rank_server_is_reused_while_the_environment_holds_and_restarted_when_it_changes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Variables read at torch's import (OMP_*, ATEN_CPU_CAPABILITY) decided how the server loaded it: a launch under
    # other values gets a server that loaded under them.
    monkeypatch.setenv(KEPT_RANK_SERVER, "0")  # a server of this launch's own
    monkeypatch.delenv("HARNESS_PROBE_SET", raising=False)
    first = _probe("forkserver", tmp_path / "a", 0)
    again = _probe("forkserver", tmp_path / "b", 0)
    assert first[0]["ppid"] == again[0]["ppid"]  # the same warm server
    monkeypatch.setenv("HARNESS_PROBE_SET", "other")
    changed = _probe("forkserver", tmp_path / "c", 0)
    assert changed[0]["ppid"] != first[0]["ppid"] and not pid_alive(first[0]["ppid"])
    assert changed[0]["env"]["HARNESS_PROBE_SET"] == "other"


def test_the_rank_server_never_initialises_cuda() -> None:
    # On this CPU machine torch.cuda is never initialised anyway; what is checked is that the preload makes no call
    # that would initialise it on a GPU host (torch.cuda's lazy initialiser and its public init are watched).
    import subprocess
    import sys

    code = (
        "import torch, torch.cuda as c\n"
        "calls = []\n"
        "for name in ('_lazy_init', 'init', 'device_count', 'is_available', 'get_device_name', 'get_device_properties'):\n"
        "    original = getattr(c, name)\n"
        "    setattr(c, name, lambda *a, _n=name, _o=original, **k: calls.append(_n) or _o(*a, **k))\n"
        "import harness.executors.warm\n"
        "import sys\n"
        "assert 'harness.runtime.context' in sys.modules and 'mlflow' not in sys.modules, sorted(sys.modules)\n"
        "print(calls, c.is_initialized())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[] False", out.stdout


def test_a_rank_forked_after_cuda_was_initialised_refuses_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    # Faked: no GPU here, so CUDA cannot really be initialised in a server; torch's own bad-fork flag says it was.
    import torch

    from harness.errors import HarnessError
    from harness.runtime.rank import child

    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: True)
    with pytest.raises(HarnessError, match="^the rank server initialised CUDA before forking this rank.*launcher: spawn"):
        child._as_if_spawned(dict(os.environ))


# --- a rank server kept warm between commands (harness/executors/rankserver.py) -----------------------------------

def _kept_env(tmp_path: Path, idle: str) -> dict[str, str]:
    # A variable of the import-time kind, unique to the test: a server of the test's own, not the session's.
    return {KEPT_RANK_SERVER: idle, "PYTORCH_HARNESS_TEST_KEY": str(tmp_path)}


def test_a_kept_server_serves_later_launches_and_goes_once_idle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    import psutil

    from harness.executors import procs, rankserver

    for name, value in _kept_env(tmp_path, "2").items():
        monkeypatch.setenv(name, value)
    folder = rankserver.root() / rankserver.key()
    first = _probe("forkserver", tmp_path / "a", 0)
    state = json.loads((folder / "state.json").read_text())
    procs.stop_server()  # this command lets go; a later one finds the same server
    again = _probe("forkserver", tmp_path / "b", 0)
    assert first[0]["ppid"] == again[1]["ppid"] == state["server"]
    # Kept by a keeper in a session of its own: no terminal's Ctrl-C, and not the launcher's child.
    assert psutil.Process(state["server"]).ppid() == state["keeper"] == os.getsid(state["keeper"])
    assert len({r["torch_seed"] for r in first + again}) == 4
    # Held while a command holds it; gone within its idle time once none does, and nothing of it is left.
    time.sleep(3)
    assert pid_alive(state["server"]) and pid_alive(state["keeper"])
    procs.stop_server()
    deadline = time.monotonic() + 30
    while (pid_alive(state["server"]) or pid_alive(state["keeper"])) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not pid_alive(state["server"]) and not pid_alive(state["keeper"])
    assert not (folder / "state.json").exists() and not (folder / "socket").exists()


def test_a_kept_servers_ranks_die_with_their_killed_launcher_and_the_server_serves_on(
        project: Project, tmp_path: Path) -> None:
    import json

    import psutil

    from harness import seeds
    from harness.executors import rankserver

    env = _kept_env(tmp_path, "30")
    command_env = {**os.environ, "MLFLOW_TRACKING_URI": project.uri, "PYTHONUNBUFFERED": "1", **env}  # Project's
    # ...with the string-hash seed both runs (seed 0) start their ranks under: a server is kept per hash seed.
    command_env["PYTHONHASHSEED"] = str(seeds.derive_hash_seed(0))
    folder = rankserver.root() / rankserver.key(command_env)
    # Ranks that say nothing to their launcher (no step, no log, no pipe written to, which would fail once it is gone):
    # only their watch on the launcher can end them.
    project.add_experiment("kept_quiet", train_py=(
        "import os\nimport time\n\n\ndef train(ctx):\n"
        "    open(os.path.join(os.environ['KEPT_MARKS'], os.environ['RANK']), 'w').close()\n    time.sleep(600)\n"))
    doomed = project.popen("run", "experiments/kept_quiet", env={**env, "KEPT_MARKS": str(tmp_path)})
    try:
        deadline = time.monotonic() + 300
        ranks: list[int] = []
        # Both in the user's code (before it, a rank also ends when its launcher's spec never comes).
        while len(ranks) < 2 or not ((tmp_path / "0").exists() and (tmp_path / "1").exists()):
            assert doomed.poll() is None and time.monotonic() < deadline, doomed.communicate()
            time.sleep(0.2)
            with contextlib.suppress(OSError, ValueError, psutil.Error):
                server = json.loads((folder / "state.json").read_text())["server"]
                ranks = [c.pid for c in psutil.Process(server).children()]
        keeper = psutil.Process(server).ppid()
        assert os.getsid(keeper) == keeper != os.getsid(doomed.pid)  # the server outlives the launcher's session
        os.kill(doomed.pid, signal.SIGKILL)  # the launcher alone, as the OOM killer would
        doomed.communicate(timeout=60)
    finally:
        if doomed.poll() is None:
            doomed.kill()
            doomed.communicate(timeout=60)
    deadline = time.monotonic() + 20
    while any(pid_alive(p) for p in ranks) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(pid_alive(p) for p in ranks), "a kept server's rank outlived its killed launcher"
    assert pid_alive(server)
    after = project.harness("run", "experiments/linear_ddp", "train.epochs=1", env=env)
    assert after.returncode == 0, after.stderr
    assert json.loads((folder / "state.json").read_text())["server"] == server  # the same server served it
    rankserver.stop_all(ROOT / "harness")


def test_the_kept_servers_key_and_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from harness.errors import HarnessError
    from harness.executors import rankserver

    base = {"PATH": "/usr/bin", KEPT_RANK_SERVER: "60"}
    key = rankserver.key(base)
    # What a rank takes from the command at the fork does not matter; what the server loaded under does.
    assert rankserver.key({**base, "MLFLOW_TRACKING_URI": "sqlite:///x", "TMPDIR": "/elsewhere"}) == key
    for name in ("OMP_NUM_THREADS", "ATEN_CPU_CAPABILITY", "LD_PRELOAD", "PYTHONPATH", "MKL_CBWR", "PYTHONHASHSEED"):
        assert rankserver.key({**base, name: "x"}) != key, name
    assert rankserver.idle_s(base) == 60 and rankserver.idle_s({}) == 0
    for bad in ("soon", "-1", "inf", "nan"):
        with pytest.raises(HarnessError, match=f"^{KEPT_RANK_SERVER}='{bad}' is not a number of seconds"):
            rankserver.idle_s({KEPT_RANK_SERVER: bad})
    # The folder whose socket takes pickles to run: this user's, private, never a planted link.
    monkeypatch.setattr(rankserver, "_ROOT", tmp_path)
    assert rankserver._private_dir(tmp_path / "a" / "b") == tmp_path / "a" / "b"
    assert oct((tmp_path / "a").stat().st_mode & 0o777) == oct(0o700)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    (tmp_path / "open").mkdir(mode=0o777)
    os.chmod(tmp_path / "open", 0o777)
    for planted in ("link", "open"):
        with pytest.raises(HarnessError, match="is not a private folder of this user's"):
            rankserver._private_dir(tmp_path / planted / "k")


def test_stale_key_folders_are_swept_and_used_ones_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every edit of harness makes a new key: the folders of old keys go once unused for a day."""
    import fcntl

    from harness.executors import rankserver

    monkeypatch.setattr(rankserver, "_ROOT", tmp_path)
    root = rankserver.root()
    day_ago = time.time() - rankserver.STALE_S - 60

    def folder(name: str, old: bool) -> Path:
        f = rankserver._private_dir(root / name)
        for n in ("lock", "lease"):
            (f / n).touch()
        if old:
            for g in (f / "lock", f / "lease", f):
                os.utime(g, (day_ago, day_ago))
        return f

    stale, recent, mine, held = folder("stale", True), folder("recent", False), folder("mine", True), folder("held", True)
    (root / "elsewhere").mkdir()
    (root / "link").symlink_to(root / "elsewhere")
    fd = os.open(held / "lock", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a command attaching right now
    os.utime(held / "lock", (day_ago, day_ago))
    try:
        assert rankserver.sweep(keep=mine) == [stale]
    finally:
        os.close(fd)
    assert not stale.exists() and recent.is_dir() and mine.is_dir() and held.is_dir() and (root / "link").is_symlink()
