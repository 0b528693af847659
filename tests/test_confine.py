"""Issue 21, confined and secret: code outside the repository is refused, recorded paths stay in the checkout,
bundles cannot write outside the store or attach to its runs, and secrets never reach the record."""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import EXPERIMENTS, Project, git, make_project, mlflow_server

from harness import secrets, tags as T
from harness.cli.main import main
from harness.commands import bundle
from harness.commands.options import ImportOptions
from harness.errors import EXIT_USAGE, HarnessError
from harness.record import confine, provenance, redaction
from harness.runtime import usermlflow
from harness.systems import docker, git as gitsource, gitworktree

SECRET = "sk-test0123456789abcdefghijklmnopqrstuv"
PASSWORD = "hunter2pw"
ENV_SECRET = "wJalrXUtnFEMI7K7MDENG2bPxRfiCYEXAMPLEKEY"


def _cli(project: Project, monkeypatch: pytest.MonkeyPatch, *args: str):
    monkeypatch.chdir(project.root)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", project.uri)
    return CliRunner().invoke(main, list(args))


def _one_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if not line.startswith("Warning:")]
    assert len(lines) == 1 and lines[0].startswith("Error: "), text
    return lines[0]


def _nothing_recorded(project: Project) -> None:
    assert not (project.store / "mlflow.db").exists() or project.all_runs() == []


# -- code outside the repository ----------------------------------------------------------------------
def _outside_entry(project: Project, tmp: Path) -> str:
    (tmp / "x").mkdir()
    (tmp / "x" / "train.py").write_text((EXPERIMENTS / "linear_ddp" / "train.py").read_text())
    rel = os.path.relpath(tmp / "x" / "train.py", project.root / "experiments" / "linear_ddp")
    yaml = project.root / "experiments" / "linear_ddp" / "experiment.yaml"
    yaml.write_text(yaml.read_text().replace("entry: train.py:train", f"entry: {rel}:train"))
    git(project.root, "commit", "-qam", "entry outside")
    return "experiments/linear_ddp"


def _absolute_entry(project: Project, tmp: Path) -> str:
    yaml = project.root / "experiments" / "linear_ddp" / "experiment.yaml"
    path = project.root / "experiments" / "linear_ddp" / "train.py"  # inside, but absolute: replay would read it
    yaml.write_text(yaml.read_text().replace("entry: train.py:train", f"entry: {path}:train"))
    git(project.root, "commit", "-qam", "absolute entry")
    return "experiments/linear_ddp"


def _symlinked_entry(project: Project, tmp: Path) -> str:
    (tmp / "elsewhere.py").write_text((EXPERIMENTS / "linear_ddp" / "train.py").read_text())
    train = project.root / "experiments" / "linear_ddp" / "train.py"
    train.unlink()
    train.symlink_to(tmp / "elsewhere.py")
    git(project.root, "commit", "-qam", "symlink out")
    return "experiments/linear_ddp"


def _symlinked_module(project: Project, tmp: Path) -> str:
    (tmp / "helpers.py").write_text("X = 1\n")
    (project.root / "experiments" / "linear_ddp" / "helpers.py").symlink_to(tmp / "helpers.py")  # untracked
    return "experiments/linear_ddp"


def _symlinked_folder(project: Project, tmp: Path) -> str:
    import shutil

    shutil.copytree(EXPERIMENTS / "linear_ddp", tmp / "exp")
    (project.root / "experiments" / "away").symlink_to(tmp / "exp", target_is_directory=True)
    return "experiments/away"


OUTSIDE = {
    "entry with ..": (_outside_entry, "outside the git repository"),
    "absolute entry": (_absolute_entry, "is an absolute path"),
    "committed symlink entry": (_symlinked_entry, "outside the git repository"),
    "untracked symlinked module": (_symlinked_module, "is a symbolic link to"),
    "symlinked experiment folder": (_symlinked_folder, "lies outside the git repository"),
}


@pytest.mark.parametrize("kind", list(OUTSIDE))
def test_check_refuses_code_outside_the_repository(kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    project = make_project(tmp_path / "p")
    outside = tmp_path / "outside"
    outside.mkdir()
    make, message = OUTSIDE[kind]
    exp = make(project, outside)
    result = _cli(project, monkeypatch, "check", exp)
    assert result.exit_code == EXIT_USAGE, result.output
    assert message in _one_line(result.output)
    _nothing_recorded(project)


def test_run_refuses_an_entry_outside_the_repository_and_records_nothing(tmp_path: Path) -> None:
    project = make_project(tmp_path / "p")
    (tmp_path / "outside").mkdir()
    exp = _outside_entry(project, tmp_path / "outside")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    result = project.harness("run", exp, "train.epochs=1", env={"TMPDIR": str(tmp)})
    assert result.returncode == EXIT_USAGE and result.stdout == ""
    assert "outside the git repository" in _one_line(result.stderr)
    _nothing_recorded(project)
    assert list(tmp.iterdir()) == []  # nothing left behind


def test_recorded_paths_stay_in_the_checkout() -> None:
    assert confine.recorded_path("experiments/x", "experiment folder", "r") == "experiments/x"
    for bad in ("/etc", "../x", "experiments/../../x", "C:/x", "a\\..\\b"):
        with pytest.raises(HarnessError, match="leaves the checkout") as err:
            confine.recorded_path(bad, "experiment folder", "r")
        assert "\n" not in str(err.value)


def test_a_commit_holding_a_git_path_is_one_line(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    blob = gitsource.run_git(repo, ["hash-object", "-w", "--stdin"], stdin=b"evil\n").decode().strip()
    sub = gitsource.run_git(repo, ["mktree"], stdin=f"100644 blob {blob}\tconfig\n".encode()).decode().strip()
    top = gitsource.run_git(repo, ["mktree"], stdin=f"040000 tree {sub}\t.git\n100644 blob {blob}\tok\n".encode())
    commit = git(repo, "commit-tree", top.decode().strip(), "-m", "x")
    with pytest.raises(HarnessError, match=r"cannot be checked out \(error: invalid path '\.git/config'\)") as err:
        with gitworktree.worktree(repo, commit, None, base=tmp_path):
            pass
    assert "\n" not in str(err.value)
    assert [p.name for p in tmp_path.iterdir()] == ["repo"]  # nothing left behind
    assert "harness-code-" not in git(repo, "worktree", "list")


# -- bundles --------------------------------------------------------------------------------------------
def _bundle(path: Path, record: dict | None = None, extra: list[tarfile.TarInfo] = (), raw_manifest: bytes | None = None,
            raw_record: bytes | None = None, run_id: str = "r") -> Path:
    rec = raw_record or json.dumps(record or _record()).encode()
    files = {"run/record.json": rec, "code/code.bundle": b"not read before a replay"}
    members = {n: {"size": len(d), "sha256": hashlib.sha256(d).hexdigest()} for n, d in files.items()}
    manifest = raw_manifest or json.dumps({"format": 1, "run_id": run_id, "replays": [], "members": members}).encode()
    with tarfile.open(path, "w:gz", format=tarfile.PAX_FORMAT) as tar:
        head = tarfile.TarInfo(bundle.MANIFEST)
        head.size = len(manifest)
        tar.addfile(head, io.BytesIO(manifest))
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for info in extra:
            tar.addfile(info)
    return path


def _record(experiment: str = "exp", tags: dict | None = None) -> dict:
    return {"run_id": "r", "experiment": experiment, "status": "FINISHED", "params": {}, "tags": tags or {},
            "metrics": {}}


def _folder(name: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE
    return info


@pytest.mark.parametrize("experiment", ["../../evil", "/tmp/evil", "a/b", "..", "a\\b"])
def test_a_bundle_whose_experiment_name_is_a_path_is_refused(experiment: str, tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    (tmp_path / "store").mkdir()
    with pytest.raises(HarnessError, match="experiment name") as err:
        bundle.import_bundle(ImportOptions(_bundle(tmp_path / "b.tar.gz", _record(experiment)), tracking_uri=uri))
    assert "\n" not in str(err.value) and err.value.exit_code == EXIT_USAGE
    assert not (tmp_path / "store" / "mlflow.db").exists()  # refused before the store was even opened
    assert not (tmp_path / "evil").exists() and not Path("/tmp/evil").exists()


def test_unlisted_folders_and_duplicate_keys_are_refused(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    many = [_folder(f"run/d{i}") for i in range(50)]
    with pytest.raises(HarnessError, match="'run/d0' is a folder the manifest does not list"):
        bundle.import_bundle(ImportOptions(_bundle(tmp_path / "dirs.tar.gz", extra=many), tracking_uri=uri))
    assert not (tmp_path / "mlflow.db").exists()
    twice = b'{"format": 1, "run_id": "r", "run_id": "s", "replays": [], "members": {}}'
    with pytest.raises(HarnessError, match="not valid JSON .*key 'run_id' appears twice"):
        bundle.import_bundle(ImportOptions(_bundle(tmp_path / "twice.tar.gz", raw_manifest=twice), tracking_uri=uri))
    rec = json.dumps(_record())[:-1] + ', "experiment": "other"}'
    with pytest.raises(HarnessError, match="record.json is missing or malformed .*appears twice"):
        bundle.import_bundle(ImportOptions(_bundle(tmp_path / "rec.tar.gz", raw_record=rec.encode()), tracking_uri=uri))
    assert not (tmp_path / "mlflow.db").exists()


@pytest.fixture(scope="module")
def store_uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    from harness.store.tracking import Tracker

    uri = f"sqlite:///{tmp_path_factory.mktemp('store') / 'mlflow.db'}"
    Tracker(uri)  # made once: a new store's schema takes seconds
    return uri


def test_references_to_runs_outside_the_bundle_never_land(tmp_path: Path, store_uri: str) -> None:
    """A crafted record that points at a run of this store (its parent, its original, its study) carries no seal
    harness made: refused whole, so nothing is attached to the victim (a sealed record's references to runs outside
    its bundle are dropped on import: bundle.RUN_REFERENCES)."""
    from harness.store.tracking import Tracker

    uri = store_uri
    tracker = Tracker(uri)
    victim = tracker.create_run("exp", {T.KIND: T.KIND_RUN})
    forged = {T.KIND: T.KIND_REPLAY, T.REPLAY_OF: victim, T.MLFLOW_PARENT_RUN_ID: victim, T.STUDY: victim,
              T.AUDIT_OF: victim, T.TRACE_OF: victim, "harness.verdict": "BITWISE"}
    with pytest.raises(HarnessError, match="carries no seal") as refused:
        bundle.import_bundle(ImportOptions(_bundle(tmp_path / "forged.tar.gz", _record(tags=forged)), tracking_uri=uri))
    assert refused.value.exit_code == EXIT_USAGE
    assert tracker.children(victim) == []
    assert [r.run_id for r in tracker.search(None, max_results=10)] == [victim]


# -- secrets -------------------------------------------------------------------------------------------
def test_secret_names_and_values() -> None:
    for name in ("TORCH_HUB_PAT", "OMP_PASSPHRASE", "NCCL_AUTH_KEY", "TORCH_TOKEN", "CUDA_PASS"):
        assert provenance.env_vars({name: "v"}) == {name: provenance.REDACTED}, name
    assert provenance.env_vars({"TORCH_HOME": "/x", "CUDA_PATH": "/c"}) == {"TORCH_HOME": "/x", "CUDA_PATH": "/c"}
    for key in ("train.api_key", "hf_token", "db.password", "github.pat", "x.client_secret", "passphrase"):
        assert secrets.key_is_secret(key), key
    for key in ("train.max_tokens", "tokenizer", "key_dim", "train.lr", "path", "sort_key"):
        assert not secrets.key_is_secret(key), key
    for value in (SECRET, "ghp_" + "a1B2" * 9, "AKIAIOSFODNN7EXAMPLE", "xoxb-1234-abcdefghij", ENV_SECRET):
        assert secrets.value_is_secret(value), value
    for value in ("sha256:" + "ab" * 32, "ab" * 32, "experiments/linear_ddp", "hello world", "localhost:5000/x:0.1"):
        assert not secrets.value_is_secret(value), value
    # --allow-changes KEY=VALUE is recorded (harness.replay.changes) and printed: a secret there is redacted too.
    key = redaction.Key(b"k" * 32)
    assert redaction.redact_override("train.hf_token=abc", key) == f"train.hf_token={redaction.placeholder('abc', key)}"
    assert redaction.redact_override("train.lr=0.1", key) == "train.lr=0.1"


def test_mlflow_never_prints_the_server_url_and_docker_gets_it_by_name(tmp_path: Path, store_uri: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from harness.store.tracking import Tracker

    monkeypatch.setenv("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "false")
    Tracker(store_uri)
    from mlflow.environment_variables import MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT

    assert MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT.get() is True  # what MlflowClient._log_url reads
    environ: dict[str, str] = {}
    usermlflow.route(environ, 1, str(tmp_path / "logs"), {})
    assert environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] == "true"  # the ranks' own end_run too
    args = docker.run_args("img:1", workdir_host=tmp_path, workdir_container="/w", mounts=[], env={"A": "1"},
                           gpus=False, command=["true"], name="n", passed=("MLFLOW_TRACKING_URI",))
    assert args[-6:] == ["-e", "A=1", "-e", "MLFLOW_TRACKING_URI", "img:1", "true"]


def test_the_docker_executor_refuses_a_secret_it_could_not_pass(tmp_path: Path) -> None:
    project = make_project(tmp_path / "p")
    result = project.cli("run", "experiments/linear_ddp", "--executor", "docker", f"train.api_key={SECRET}")
    assert result.returncode == EXIT_USAGE and result.stdout == ""
    assert "train.api_key looks like a secret" in _one_line(result.stderr) and SECRET not in result.stderr
    _nothing_recorded(project)


SECRET_TRAIN = (EXPERIMENTS / "linear_ddp" / "train.py").read_text().replace(
    "    cfg = ctx.cfg\n",
    "    cfg = ctx.cfg\n"
    f"    assert cfg.api_key == {SECRET!r} and cfg.aws == {ENV_SECRET!r}, 'the ranks get the real values'\n",
)


def _store_text(project: Project) -> bytes:
    return b"".join(p.read_bytes() for p in project.store.rglob("*") if p.is_file())


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A real `mlflow server` on loopback (SQLite behind it, artifacts served): (its folder, its http URI)."""
    folder = tmp_path / "server"
    with mlflow_server(folder) as (_, port):
        yield folder, f"http://127.0.0.1:{port}"


def test_secrets_are_redacted_in_the_record_and_asked_for_again_by_replay(
    tmp_path: Path, server: tuple[Path, str]
) -> None:
    from mlflow.tracking import MlflowClient

    project = make_project(tmp_path / "p")
    project.store, plain = server  # a lab server: its URL with a user and password, as MLflow's clients take it
    project.add_experiment("secretive", train_py=SECRET_TRAIN, yaml_extra="  aws: ${oc.env:HARNESS_TEST_AWS}\n")
    env = {"HARNESS_TEST_AWS": ENV_SECRET, "MLFLOW_TRACKING_URI": plain.replace("http://", f"http://alice:{PASSWORD}@")}
    project.uri = plain
    # image=none: the shared engine's tags may move between the run and its replay (a bitwise verdict needs neither).
    run = project.harness("run", "experiments/secretive", "train.epochs=1", "image=none", f"train.api_key={SECRET}",
                          env=env)
    assert run.returncode == 0, run.stderr
    warnings = [line for line in run.stderr.splitlines() if "look like a secret" in line]
    assert len(warnings) == 1 and warnings[0].startswith("Warning: train.aws, train.api_key look like a secret")
    store = _store_text(project)
    for secret in (SECRET, ENV_SECRET, PASSWORD):
        assert secret.encode() not in store and secret not in run.stdout + run.stderr
    assert "View run" not in run.stdout + run.stderr  # MLflow's line, the URL with the password in it
    client = MlflowClient(plain)
    recorded = client.get_run(run.last_line)
    assert recorded.data.params["train.api_key"] == redaction.placeholder(SECRET, redaction.store_key(plain))
    assert recorded.data.tags[T.CONFIG_REDACTED] == "train.aws=$HARNESS_TEST_AWS, train.api_key"
    runs = len(project.all_runs())

    missing = project.harness("replay", run.last_line, env=env)
    assert missing.returncode == EXIT_USAGE
    assert _one_line(missing.stderr).startswith(f"Error: train.api_key of run {run.last_line} is a secret")
    wrong = project.harness("replay", run.last_line, f"train.api_key={SECRET}x", env=env)
    assert wrong.returncode == EXIT_USAGE and "is not the value run" in _one_line(wrong.stderr)
    no_env = project.harness("replay", run.last_line, f"train.api_key={SECRET}")
    assert no_env.returncode == EXIT_USAGE and "set $HARNESS_TEST_AWS as when it ran" in _one_line(no_env.stderr)
    assert len(project.all_runs()) == runs  # refused before anything was recorded

    replay = project.harness("replay", run.last_line, f"train.api_key={SECRET}", env=env)
    assert replay.returncode == 0, replay.stderr + replay.stdout
    assert "verdict: BITWISE" in replay.stdout and "delta: none" in replay.stdout, replay.stdout
    assert PASSWORD not in replay.stdout + replay.stderr and "View run" not in replay.stdout + replay.stderr
    assert not any(s.encode() in _store_text(project) for s in (SECRET, ENV_SECRET, PASSWORD))

    # A record whose experiment path leaves the checkout is refused at replay: by its seal first, and - for a run
    # recorded before seals existed (no seal tag, no manifest) - by the path's own check.
    client.set_tag(run.last_line, T.EXPERIMENT_PATH, "../../outside")
    sealed = project.harness("replay", run.last_line, f"train.api_key={SECRET}", env=env)
    assert sealed.returncode == EXIT_USAGE and "was changed after it was sealed: tag harness.experiment.path" in sealed.stderr
    client.delete_tag(run.last_line, T.SEAL)
    for manifest in project.store.rglob(f"{run.last_line}/artifacts/seal/manifest.json"):
        manifest.unlink()
    tampered = project.harness("replay", run.last_line, f"train.api_key={SECRET}", env=env)
    assert tampered.returncode == EXIT_USAGE and "leaves the checkout" in _one_line(tampered.stderr)
