"""The executor seam and the multi-node bookkeeping that needs no second host: registry, topology
from a scheduler's variables, per-node differences, and a backend from outside harness (tests/toy_backend)
registered through a real entry point. The built-in backends themselves run for real in test_run.py (local),
test_docker_executor.py, test_multinode.py, test_slurm.py and test_torchrun.py."""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from pathlib import Path

import click
import pytest
from omegaconf import OmegaConf

from conftest import CPU, TESTS_DIR, Project

from harness import config, executors, tags as T
from harness.cli import options as cli_options, running as cli_running
from harness.errors import ConfigError, HarnessError
from harness.executors import Backend, CliOption, Topology, topology_from_env
from harness.executors.base import Executor
from harness.executors.multinode import check_topology, differing



def test_every_builtin_backend_is_one_module_declaring_it_and_config_and_cli_follow_the_registry() -> None:
    assert list(executors.backends()) == list(executors.BUILTIN) == executors.schema().names()
    for name in executors.BUILTIN:
        declared = executors.backend(name)
        assert importlib.import_module(f"harness.executors.{name}").BACKEND is declared
        backend = executors.get(name)
        assert isinstance(backend, Executor) and backend.name == name
    assert executors.get("local") is not executors.get("local")  # per-job state never leaks between jobs
    with pytest.raises(HarnessError, match=r"^unknown executor 'k8s'; known: local, docker, slurm\."):
        executors.get("k8s")
    # Every built-in backend's segments (audit, trace) re-execute on this machine's ranks, as local runs them.
    assert [n for n, b in executors.backends().items() if b.runs_segments] == list(executors.BUILTIN)
    flags = {o.flag for b in executors.backends().values() for o in b.cli}
    assert flags == {"--allow-unpinned", "--nodes", "--partition", "--time", "--gpus-per-node"}
    assert {p.opts[0] for p in cli_options._backend_click_options("run")} == flags
    assert "--allow-unpinned" not in {p.opts[0] for p in cli_options._backend_click_options("replay")}
    assert executors.options_for("docker", allow_unpinned=True, quiet=True) == \
        executors.backend("docker").options(quiet=True, allow_unpinned=True)  # type: ignore[call-arg]
    assert executors.options_for("local", allow_unpinned=True) == executors.JobOptions()
    # What the commands ask of a backend, declared by each (none of them tests a name).
    asked = ("ranks_here", "early_ranks", "parallel_members", "runs_working_tree", "places_nodes", "executes")
    assert {n: tuple(getattr(b, a) for a in asked) for n, b in executors.backends().items()} == {
        "local": (True, True, True, True, False, ""),
        "docker": (False, False, False, True, False, "local"),
        "slurm": (False, False, False, False, True, "local"),
    }
    assert executors.backend("slurm").place is not None and executors.backend("local").place is None


def test_a_backend_registered_in_process_brings_its_section_into_the_schema(monkeypatch: pytest.MonkeyPatch) -> None:
    @dataclasses.dataclass
    class QueueConfig:
        name: str = "default"
        slots: int = 1

    def check(cfg: object) -> None:
        if cfg.queue.slots < 1:  # type: ignore[attr-defined]
            raise ConfigError("queue.slots must be >= 1.")

    executors.backends()  # the built-in ones loaded into the registry the test copies (and restores)
    monkeypatch.setattr(executors, "_REGISTRY", dict(executors._REGISTRY))
    monkeypatch.setattr(executors, "_schema", None)
    executors.register(Backend("queue", executors.get("local").__class__, section=QueueConfig, check=check,
                               help="slots on a queue of its own",
                               cli=(CliOption("--queue", "queue_name", "queue: its name.", key="name"),)))
    # --executor's help is the registry's: every backend's own line, the new one's included.
    for command in (cli_running.run, cli_running.replay):
        option = next(p for p in command.params if p.name == "executor")
        shown = option.get_help_record(click.Context(command))[1]
        assert "docker: inside the pinned image, by digest" in shown and "queue: slots on a queue of its own" in shown
    base = {"image": "none", "entry": "train.py:train"}
    cfg = config.compose([("experiment.yaml", OmegaConf.create({**base, "executor": "queue", "queue": {"slots": 2}}))], executors.schema())
    assert (cfg.executor, cfg.queue.name, cfg.queue.slots, cfg.slurm.nodes) == ("queue", "default", 2, 1)
    assert list(cfg.keys()).index("queue") == list(cfg.keys()).index("executor") + 2  # after slurm, its sections
    with pytest.raises(ConfigError, match=r"^experiment.yaml: invalid value 'x' for 'queue.slots'; expected an integer"):
        config.compose([("experiment.yaml", OmegaConf.create({**base, "queue": {"slots": "x"}}))], executors.schema())
    with pytest.raises(ConfigError, match="^queue.slots must be >= 1"):
        schema = executors.schema()
        config.validate(config.compose([("x", OmegaConf.create({**base, "queue": {"slots": 0}}))], schema), None, schema)
    with pytest.raises(ConfigError, match=r"^x: invalid value 'k8s' for 'executor'; expected one of local, docker, "
                                          r"slurm, queue\.$"):
        config.compose([("x", OmegaConf.create({**base, "executor": "k8s"}))], executors.schema())


def test_topology_from_slurm_variables() -> None:
    env = {"SLURM_JOB_ID": "42", "SLURM_NODEID": "1", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "node[1-2]",
           "MASTER_ADDR": "198.51.100.1", "MASTER_PORT": "20042"}
    topo = topology_from_env(env)
    assert topo == Topology(nnodes=2, node_rank=1, master_addr="198.51.100.1", master_port=20042, launcher="slurm",
                            scheduler={T.SLURM_JOB_ID: "42", T.SLURM_NODELIST: "node[1-2]"})


def test_topology_from_plain_variables_and_none_without_them() -> None:
    topo = topology_from_env({"NODE_RANK": "0", "NNODES": "3", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    assert (topo.nnodes, topo.node_rank, topo.launcher) == (3, 0, "spawn")
    assert topology_from_env({"MASTER_ADDR": "h", "RANK": "0"}) is None  # a torchrun-style rank, not a node


def test_torchrun_placement_is_decided_once_and_the_executor_prepares_what_runs_here() -> None:
    """torchrun's variables make one topology that carries them; the executor that runs it is torchrun's; what happens
    on this machine before the record is the executor's decision (a Here), none for a backend whose ranks run elsewhere."""
    env = {"TORCHELASTIC_RUN_ID": "j", "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "h", "MASTER_PORT": "29500"}
    layout = executors.torchrun_topology(env)
    assert layout is not None and layout.torchrun is not None
    assert (layout.nnodes, layout.node_rank, layout.launcher, layout.torchrun.rank) == (2, 1, "torchrun", 3)
    assert not layout.speaks_for_job and Topology().speaks_for_job  # torchrun's rank 0 alone says the run id
    assert executors.torchrun_topology({}) is None
    assert executors.placed(layout) is layout and executors.placed(Topology(nnodes=2)) == Topology(nnodes=2)
    assert executors.executor_for("local", layout).name == "torchrun"
    assert executors.executor_for("local", Topology()).name == "local"
    with pytest.raises(HarnessError, match=r"^torchrun started this process \(rank 3 of 4\): --nnodes cannot apply"):
        executors.check_torchrun(layout, None, ["--nnodes"])
    with pytest.raises(HarnessError, match=r"--executor docker does not apply"):
        executors.check_torchrun(layout, "docker", [])
    base = {"image": "none", "entry": "train.py:train", "device": "cpu"}
    cfg = config.compose([("x", OmegaConf.create({**base, "world_size": 4, "threads_per_rank": 4096}))],
                         executors.schema())
    here = executors.get("local").check_here(cfg, Topology())
    assert (here.device, here.backend, here.ranks, here.starts_all) == ("cpu", "gloo", None, False)
    assert len(here.warnings) == 1 and "x threads_per_rank 4096" in here.warnings[0]
    assert executors.executor_for("local", layout).check_here(cfg, layout).warnings[0].startswith("world_size 2 x")
    assert executors.get("docker").check_here(cfg, Topology()) == executors.Here()
    assert executors.get("docker").start_here(cfg, Topology(), here) is here
    assert not executors.get("docker").warm(cfg, Topology(), before=lambda: pytest.fail("docker warms nothing"))
    two = config.compose([("x", OmegaConf.create({**base, "world_size": 2}))], executors.schema())
    with pytest.raises(HarnessError, match=r"^torchrun started 4 ranks but world_size is 2"):
        executors.executor_for("local", layout).start_here(two, layout, here)


@pytest.mark.parametrize("env, message", [
    ({"NODE_RANK": "0", "NNODES": "2"}, "MASTER_ADDR/MASTER_PORT are not set"),
    ({"NODE_RANK": "x", "NNODES": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "not numbers"),
])
def test_bad_scheduler_variables_are_one_line(env: dict[str, str], message: str) -> None:
    with pytest.raises(HarnessError, match=message):
        topology_from_env(env)


@pytest.mark.parametrize("topo, message", [
    (Topology(nnodes=2, node_rank=2, master_addr="h", master_port=1), "--node-rank must be within 0..1"),
    (Topology(nnodes=2, node_rank=0), "needs --master-addr"),
    (Topology(nnodes=2, node_rank=0, master_addr="h", master_port=70000), "needs --master-addr"),
])
def test_impossible_topologies_are_refused(topo: Topology, message: str) -> None:
    with pytest.raises(HarnessError, match=message):
        check_topology(topo)


def test_nodes_that_differ_are_named_and_per_node_facts_are_not() -> None:
    base = {"facts": {"hostname": "a", "torch": "2.13", "cpu": "EPYC"}, "vars": {"GLOO_SOCKET_IFNAME": "eth0"}}
    same = {"facts": {"hostname": "b", "torch": "2.13", "cpu": "EPYC"}, "vars": {"GLOO_SOCKET_IFNAME": "ens5"}}
    other = {"facts": {"hostname": "c", "torch": "2.12", "cpu": "EPYC"}, "vars": {"NCCL_ALGO": "Ring"}}
    assert differing({0: base, 1: same, 2: other}) == {2: ["torch", "NCCL_ALGO"]}


# -- the generated sbatch script, byte for byte ---------------------------------------------------------------
SBATCH_GOLDEN = TESTS_DIR / "golden" / "sbatch.txt"
# HARNESS_REGEN_GOLDEN=1 rewrites tests/golden/sbatch.txt from the script generated now (then review its diff);
# without it the test compares.
REGEN_GOLDEN = os.environ.get("HARNESS_REGEN_GOLDEN") == "1"


def test_the_sbatch_script_is_the_golden_file(tmp_path: Path) -> None:
    """Every option the slurm section and a resume put in the script; the paths that vary (this test's folder, the
    interpreter) are written as <tmp> and <python>."""
    from harness.executors.slurm import batch_script

    exp = tmp_path / "repo" / "experiments" / "golden run"
    cfg = config.Experiment.of(config.compose([("golden", OmegaConf.create({
        "image": "none", "entry": "train.py:train", "executor": "slurm", "world_size": 4, "threads_per_rank": 2,
        "slurm": {"nodes": 2, "partition": "debug", "time": "01:00:00", "gpus_per_node": 1},
    }))], executors.schema())).config
    job = executors.Job(None, cfg, executors.JobInputs(tmp_path / "repo", exp), run_id="0123456789abcdef0123456789abcdef",
                        resume_step=40)  # type: ignore[arg-type]  (the script needs no store)
    script = batch_script(job, exp, tmp_path / "jobs" / job.run_id, f"sqlite:///{tmp_path}/store dir/mlflow.db")
    normal = script.replace(sys.executable, "<python>").replace(str(tmp_path), "<tmp>")
    if REGEN_GOLDEN:
        SBATCH_GOLDEN.write_text(normal)
    assert normal == SBATCH_GOLDEN.read_text(), "the sbatch script changed; HARNESS_REGEN_GOLDEN=1 rewrites the golden file"


# -- a backend from outside harness, through a real entry point -----------------------------------------------


@pytest.fixture(scope="module")
def toy_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """PYTHONPATH holding a distribution that declares tests/toy_backend as the `inline` executor and
    tests/toy_backend/child.py as the `child` one. One for the module: a PYTHONPATH is part of a kept rank server's
    key, so the module's launches share one server instead of starting one (and importing torch) per test."""
    tmp_path = tmp_path_factory.mktemp("toy backend")
    dist = tmp_path / "dist" / "toy_backend-0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-backend\nVersion: 0\n")
    (dist / "entry_points.txt").write_text("[harness.executors]\ninline = toy_backend:BACKEND\nchild = toy_backend.child:BACKEND\n")
    path = [str(tmp_path / "dist"), str(TESTS_DIR), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {"PYTHONPATH": os.pathsep.join(path)}


def test_an_outside_backend_runs_records_its_options_and_replays_bitwise(fresh_project: Project,
                                                                        toy_env: dict[str, str]) -> None:
    env = toy_env
    helped = fresh_project.harness("run", "--help", env=env)
    assert helped.returncode == 0 and "--inline-label" in helped.stdout and "slurm|inline|child]" in helped.stdout

    run = fresh_project.harness("run", "experiments/linear_ddp", "--executor", "inline", "--inline-label", "lab-7",
                                "train.epochs=1", "checkpoint_every=5", env=env)
    assert run.returncode == 0, run.stderr
    recorded = fresh_project.client().get_run(run.last_line)
    assert recorded.data.tags[T.EXECUTOR] == "inline" and recorded.data.tags["toy.inline.label"] == "lab-7"
    assert recorded.data.params["executor"] == "inline" and recorded.data.params["inline.label"] == "lab-7"

    replay = fresh_project.harness("replay", run.last_line, env=env)
    assert replay.returncode == 0, replay.stderr
    assert "verdict: BITWISE" in replay.stdout
    assert fresh_project.client().get_run(replay.last_line).data.tags["toy.inline.label"] == "lab-7"

    # It runs no segments: audit and trace say so in one line, before anything is recorded.
    before = len(fresh_project.all_runs())
    for args in (["audit", run.last_line, "--segments", "1"], ["trace", run.last_line, "--step", "1"]):
        refused = fresh_project.harness(*args, env=env)
        assert refused.returncode == 2, refused.stderr
        assert refused.stderr.strip().splitlines() == [
            f"Error: {args[0]} re-executes segments of the run on its backend, and the inline backend runs no "
            "segments (those that do: local, docker, slurm)."]
    assert len(fresh_project.all_runs()) == before


def test_a_backend_written_from_the_seam_alone_runs_and_replays_bitwise(fresh_project: Project,
                                                                       toy_env: dict[str, str]) -> None:
    """tests/toy_backend/child.py imports only harness/executors/base.py (and harness.errors): it records the run,
    runs it as `harness _execute` in a child process, and its runs replay through it."""
    source = (TESTS_DIR / "toy_backend" / "child.py").read_text()
    assert {line.split()[1] for line in source.splitlines() if line.startswith("from harness")} == \
        {"harness.errors", "harness.executors.base"}
    env = toy_env
    run = fresh_project.harness("run", "experiments/linear_ddp", "--executor", "child", "train.epochs=1", env=env)
    assert run.returncode == 0, run.stderr
    assert fresh_project.client().get_run(run.last_line).data.tags[T.EXECUTOR] == "child"
    replay = fresh_project.harness("replay", run.last_line, env=env)
    assert replay.returncode == 0, replay.stderr
    assert "verdict: BITWISE" in replay.stdout
    replayed = fresh_project.client().get_run(replay.last_line)
    assert (replayed.data.tags[T.EXECUTOR], replayed.info.status) == ("child", "FINISHED")


def test_an_unknown_executor_is_one_line_naming_the_known_ones(fresh_project: Project, toy_env: dict[str, str]) -> None:
    env = toy_env
    for args in (["--executor", "k8s"], ["executor=k8s"]):
        result = fresh_project.harness("run", "experiments/linear_ddp", *args, env=env)
        assert result.returncode == 2
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert "'k8s'" in result.stderr and "local, docker, slurm, inline, child" in result.stderr, result.stderr
    # What a command asks of a backend is its declaration: only one with parallel_members runs a study's members at once.
    parallel = fresh_project.harness("run", "experiments/linear_ddp", "--executor", "child", "--seeds", "2",
                                     "--parallel", "2", env=env)
    assert parallel.returncode == 2
    assert parallel.stderr.strip().splitlines()[-1] == \
        "Error: --parallel 2 needs the local executor (this study runs on child); drop --parallel.", parallel.stderr
    assert fresh_project.all_runs() == []


def test_a_handle_says_where_its_job_stands_without_waiting(project: Project) -> None:
    """The local backend's handle through run_job: PENDING once the run is recorded (its ranks not yet running),
    FINISHED once wait() has closed the run."""
    from harness.commands import run as runner
    from harness.commands.options import CheckOptions
    from harness.record.newrun import create_record
    from harness.store.tracking import Tracker

    exp = project.root / "experiments" / "linear_ddp"
    checked = runner.preflight(CheckOptions(exp, ("train.epochs=1", CPU), tracking_uri=project.uri))
    tracker = Tracker(project.uri)
    job = executors.Job(
        tracker, checked.cfg, executors.JobInputs(checked.git.root, exp, code_id=checked.git.commit),
        record=lambda tags: create_record(tracker, checked.experiment, exp, checked.git, image=tags),
    )
    handles: list[executors.Handle] = []
    seen: list[str] = []
    outcome = executors.run_job(executors.get("local"), job, on_start=lambda h: (handles.append(h), seen.append(h.status())))
    assert outcome.status == "FINISHED" and seen == ["PENDING"]
    assert handles[0].status() == "FINISHED" == project.client().get_run(outcome.run_id).info.status


def test_docker_forwards_the_hosts_numerics_variables_and_gives_only_the_visible_gpus(tmp_path: Path) -> None:
    from harness.executors.docker import host_environment
    from harness.systems import docker

    host = {
        "NCCL_ALGO": "Ring", "NCCL_P2P_DISABLE": "1", "NCCL_NVLS_ENABLE": "0", "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
        "CUBLASLT_WORKSPACE_SIZE": "1024", "TORCH_BLAS_PREFER_CUBLASLT": "1", "NVIDIA_TF32_OVERRIDE": "0",
        "DISABLE_ADDMM_CUDA_LT": "1", "CUDA_VISIBLE_DEVICES": "2,3",
        "NCCL_AUTH_KEY": "s3cr3t-nccl", "TORCH_HUB_TOKEN": "s3cr3t-hub",  # credentials by their names
        "HOME": "/root", "OMP_NUM_THREADS": "8", "MLFLOW_TRACKING_URI": "http://u:pw@host", "PATH": "/usr/bin",
    }
    env = host_environment("cuda", host, gpus_here=True)
    assert env.values == {k: host[k] for k in (
        "NCCL_ALGO", "NCCL_P2P_DISABLE", "NCCL_NVLS_ENABLE", "CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE",
        "TORCH_BLAS_PREFER_CUBLASLT", "NVIDIA_TF32_OVERRIDE", "DISABLE_ADDMM_CUDA_LT")}
    assert env.by_name == {"NCCL_AUTH_KEY": "s3cr3t-nccl", "TORCH_HUB_TOKEN": "s3cr3t-hub"}
    # Host indices 2,3 are the container's 0,1: the list becomes --gpus, and CUDA_VISIBLE_DEVICES stays out.
    assert env.gpus == '"device=2,3"'
    args = docker.run_args("img@sha256:" + "0" * 64, workdir_host=tmp_path, workdir_container="/w", mounts=[],
                           env={**env.values, "PYTHONUNBUFFERED": "1"}, passed=("MLFLOW_TRACKING_URI", *env.by_name),
                           gpus=env.gpus, command=["true"], name="n")
    assert args[args.index("--gpus") + 1] == '"device=2,3"'
    pairs = [args[i + 1] for i, a in enumerate(args) if a == "-e"]
    assert "NCCL_ALGO=Ring" in pairs and "NVIDIA_TF32_OVERRIDE=0" in pairs and "CUBLASLT_WORKSPACE_SIZE=1024" in pairs
    assert "NCCL_AUTH_KEY" in pairs and "TORCH_HUB_TOKEN" in pairs
    assert not any(secret in " ".join(args) for secret in ("s3cr3t", "pw@host"))
    assert not any(p.startswith(("CUDA_VISIBLE_DEVICES", "HOME", "OMP_", "PATH")) for p in pairs)
    # Which GPUs: all when CUDA_VISIBLE_DEVICES is unset, none when it hides them all or the job runs on cpu.
    assert host_environment("cuda", {}, gpus_here=False).gpus == "all"
    assert host_environment("auto", {}, gpus_here=True).gpus == "all"
    assert host_environment("auto", {}, gpus_here=False).gpus is None
    assert host_environment("cpu", {"CUDA_VISIBLE_DEVICES": "0"}, gpus_here=True).gpus is None
    for hidden in ("", "-1", " "):
        assert host_environment("cuda", {"CUDA_VISIBLE_DEVICES": hidden}, gpus_here=True).gpus is None, hidden
    assert host_environment("cuda", {"CUDA_VISIBLE_DEVICES": "GPU-8f3e9a1c, 1"}, gpus_here=True).gpus == (
        '"device=GPU-8f3e9a1c,1"')
    single = docker.run_args("img", workdir_host=tmp_path, workdir_container="/w", mounts=[], env={},
                             gpus=True, command=["true"], name="n")
    assert single[single.index("--gpus") + 1] == "all"


# -- the remote base (harness/executors/remote.py): what docker and slurm share ---------------------------------


class _Gone(Exception):
    pass


def _remote_backend(ended: object = None, closes: str | None = None, fail_launch: bool = False) -> type:
    """A remote backend whose job 'ran' elsewhere: its handle closes the run `closes` (None: leaves it RUNNING, as
    a job killed from outside does) and reports `ended`; with `fail_launch` the launch raises."""
    from harness.executors.remote import RemoteExecutor, RemoteHandle

    class Handle(RemoteHandle):
        def poll(self) -> str:
            return "RUNNING"

        def stop(self) -> None:
            pass

        def follow(self):  # type: ignore[no-untyped-def]
            if closes is not None:  # as the harness inside the job closes it
                from harness.record import closing

                closing.close(self.job.tracker, self.job.run_id, closes)
            return ended

    class Remote(RemoteExecutor):
        name = "remote"

        def launch(self, job, on_event, code):  # type: ignore[no-untyped-def]
            if fail_launch:
                raise _Gone("the cluster refused the job")
            return Handle(job, code)

    return Remote


def test_the_remote_base_records_closes_what_vanished_and_says_the_outcome(tmp_path: Path) -> None:
    from harness.executors.remote import Ended
    from harness.store.tracking import Tracker

    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}")
    cfg = config.Experiment.of(config.compose([("x", OmegaConf.create({"image": "none", "entry": "train.py:train"}))],
                                              executors.schema())).config

    created: list[str] = []

    def record(tags: dict[str, str]) -> str:
        created.append(tracker.create_run("remote", {T.KIND: T.KIND_RUN, **tags}))
        return created[-1]

    def job() -> executors.Job:
        return executors.Job(tracker, cfg, executors.JobInputs(tmp_path, tmp_path), record=record)

    def close(remote: type, signum: int | None = None) -> tuple[executors.Outcome, dict[str, str]]:
        handle = remote().start(job(), lambda event: None)
        if signum is not None:
            handle.cancel(signum)
        outcome = handle.wait()
        assert handle.status() == outcome.status == tracker.get_run(outcome.run_id).status  # closed, and says so
        return outcome, tracker.get_run(outcome.run_id).tags

    # The job closed its run: the outcome is the run's, the exit code the job's.
    outcome, _ = close(_remote_backend(Ended(0, "unused"), closes="FINISHED"))
    assert (outcome.status, outcome.exit_code, outcome.message) == ("FINISHED", 0, "")
    outcome, _ = close(_remote_backend(Ended(3, "the job exited with code 3"), closes="FAILED"))
    assert (outcome.status, outcome.exit_code, outcome.message) == ("FAILED", 3, "the job exited with code 3")
    # It vanished with its run open: closed here, FAILED with the reason, or KILLED when stopped from outside.
    outcome, tags = close(_remote_backend(Ended(137, "x", vanished="the job died before the run ended")))
    assert (outcome.status, outcome.exit_code, outcome.message) == ("FAILED", 1, "the job died before the run ended")
    assert tags[T.STATUS_REASON] == "the job died before the run ended"
    outcome, _ = close(_remote_backend(Ended(0, "x", vanished="the scheduler cancelled it", killed=True)))
    assert (outcome.status, outcome.exit_code) == ("KILLED", 1)
    # Cancelled here (Ctrl-C): KILLED, 128 + the signal.
    outcome, _ = close(_remote_backend(Ended(143, "x")), signum=2)
    assert (outcome.status, outcome.exit_code) == ("KILLED", 130)
    # A launch that fails closes the recorded run FAILED with its reason, and raises.
    with pytest.raises(_Gone):
        _remote_backend(fail_launch=True)().start(job(), lambda event: None)
    failed = tracker.get_run(created[-1])
    assert (failed.status, failed.tags[T.STATUS_REASON]) == ("FAILED", "the cluster refused the job")
    assert len(created) == 6  # one run per job, none left RUNNING
    assert all(tracker.get_run(run_id).status != "RUNNING" for run_id in created)
