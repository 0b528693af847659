"""Issue 36, secrets: a token or password in the uncommitted changes, in a store's error text, inside config values
and variables never reaches the store or the terminal; the placeholder is a digest keyed by the store."""

from __future__ import annotations

import copy
import hashlib
import os
import pickle
import signal
import stat
import subprocess
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import EXPERIMENTS, Project, git, make_project, mlflow_server
from omegaconf import DictConfig, OmegaConf

from harness import secrets, tags as T
from harness.errors import EXIT_USAGE, HarnessError
from harness.record import provenance, redaction
from harness.runtime.cfgview import redacted_view
from harness.store.probe import reason_of

# Tokens are put together here, so that this file holds none of them whole (and no scanner of this repository
# takes the tests for a leak).
GHP = "ghp_" + "A1b2C3d4" * 5
HF = "hf_" + "xY9z" * 9
DB_PW = "correct-horse-42"
PASSWORD = "PASSWORD-hunter2"

PROVIDERS = [
    ("GitHub token", GHP),
    ("GitHub token", "gho_" + "Zq1" * 12),
    ("GitHub token", "github_pat_" + "11ABCDEFG0" * 4 + "_" + "x" * 20),
    ("Hugging Face token", HF),
    ("OpenAI/Anthropic key", "sk-" + "proj-" + "Ab1" * 15),
    ("OpenAI/Anthropic key", "sk-" + "ant-api03-" + "Zz9_" * 10),
    ("AWS access key id", "AKIA" + "Z7Q2W3E4R5T6Y7U8"),
    ("Slack token", "xox" + "b-1234567890-abcdefghijkl"),
    ("GitLab token", "glpat-" + "Ab3_" * 6),
    ("Google API key", "AIza" + "SyD" + "x1Y2z3" * 5 + "abcdefgh"[:2]),
    ("Stripe key", "sk_" + "live_" + "51Hx" * 6),
    ("npm token", "npm_" + "a1B2c3" * 6),
    ("PyPI token", "pypi-" + "AgEIcHlwaS5vcmc" + "Q" * 50),
    ("JSON web token", "eyJ" + "hbGciOiJIUzI1NiJ9" + ".eyJ" + "zdWIiOiIxMjM0NTY3ODkwIn0" + ".SflKxwRJSMeKKF2QT4fw"),
    ("private key", "-----BEGIN " + "OPENSSH PRIVATE KEY-----"),
    ("private key", "-----BEGIN " + "RSA PRIVATE KEY-----"),
]


@pytest.mark.parametrize(("kind", "token"), PROVIDERS, ids=[f"{k}-{i}" for i, (k, _) in enumerate(PROVIDERS)])
def test_provider_token_shapes(kind: str, token: str) -> None:
    for line, path in ((f'HF = "{token}"', "train.py"), (f"TOKEN={token}", ".env"), (f"  key: {token}", "c.yaml"),
                       (f"run --auth {token} now", "notes.txt")):
        hit = secrets.in_line(line, path)
        assert hit is not None and hit.kind == kind and line[hit.start:hit.start + len(hit.value)] == hit.value, line
    assert secrets.value_is_secret(token)
    assert token not in secrets.scrub(f"failed with {token}.") and secrets.SCRUBBED in secrets.scrub(token)


@pytest.mark.parametrize(("line", "path"), [
    ('DB_PASSWORD = "hunter2"', "train.py"),
    ("password: str = 'hunter2'", "train.py"),
    ('login(user="bob", password="hunter2")', "train.py"),
    ('cfg = {"api_key": "abc123"}', "train.py"),
    ("DB_PASSWORD=hunter2", ".env"),
    ("export HF_TOKEN=abc123", "setup.sh"),
    ("secret: hunter2", "conf/db.yaml"),
    ("client_secret = hunter2", "config.local"),
    ('url = "postgresql://bob:pw@db/x"', "train.py"),
    ("OMP_PROXY=http://u:pw@proxy:3128", ".env"),
])
def test_literal_credentials_are_found(line: str, path: str) -> None:
    assert secrets.in_line(line, path) is not None, line


@pytest.mark.parametrize(("line", "path"), [
    ('password = os.environ["DB_PASSWORD"]', "train.py"),
    ("token = None", "train.py"),
    ("secret = cfg.secret", "train.py"),
    ("password = getpass.getpass()", "train.py"),
    ('token = ""', "train.py"),
    ("api_key: str", "train.py"),
    ("password: ${oc.env:DB_PASSWORD}", "experiment.yaml"),
    ("DB_PASSWORD=$DB_PASSWORD", ".env"),
    ("token: null", "experiment.yaml"),
    ("max_tokens: 512", "experiment.yaml"),
    ("token_type = bearer", "config.ini"),
    ('url = f"postgresql://{user}:{pw}@db/x"', "train.py"),
    ("git clone ssh://git@github.com/lab/x.git", "README.md"),
    ('sha = "sha256:" + "ab" * 32', "train.py"),
    ('print("sk-learn is not scikit-learn")', "train.py"),
    ("cd /data/sk-learn-experiments-from-the-last-year", "run.sh"),
])
def test_obvious_non_secrets_are_left_alone(line: str, path: str) -> None:
    assert secrets.in_line(line, path) is None, line


def test_messages_with_outside_text_are_scrubbed() -> None:
    mlflow_text = (f"API request to http://alice:{PASSWORD}@127.0.0.1:1/api/2.0/mlflow/runs/update failed with "
                   "exception HTTPConnectionPool(host='127.0.0.1', port=1): Max retries exceeded")
    err = HarnessError(f"the tracking store failed: {mlflow_text}. Check it.")
    assert PASSWORD not in str(err) and "http://alice:<redacted>@127.0.0.1:1/api" in str(err)
    # Cut after scrubbing: a password cut short would no longer read as a URL's.
    assert PASSWORD not in reason_of(Exception("x" * 280 + mlflow_text))
    assert PASSWORD[:6] not in reason_of(Exception("x" * 280 + mlflow_text))
    assert secrets.scrub("postgresql://bob:${DB_PASS}@db/x") == "postgresql://bob:${DB_PASS}@db/x"


def test_variables_keep_their_host_not_their_password() -> None:
    env = {"OMP_PROXY": "http://u:pw@proxy:3128", "NCCL_SOCKET_IFNAME": "eth0", "TORCH_HOME": "/x"}
    assert provenance.env_vars(env) == {"OMP_PROXY": "http://u:<redacted>@proxy:3128", "NCCL_SOCKET_IFNAME": "eth0",
                                        "TORCH_HOME": "/x"}


def test_config_values_redacted_with_a_keyed_digest(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    key = redaction.store_key(uri)
    key_path = tmp_path / "store" / "mlflow.db.harness-key"
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600
    assert redaction.store_key(uri).secret == key.secret  # created once
    other = redaction.store_key(f"sqlite:///{tmp_path / 'other.db'}")
    assert other.secret != key.secret
    config = {"train": {"db_url": "postgresql://bob:pw@db/x", "token_list": ["tok-a", "tok-b"], "lr": 0.1,
                        "token": None}}
    clean, keys = redaction.redact(config, key)
    assert keys == ["train.db_url", "train.token_list.0", "train.token_list.1"]
    # A copy under another key (`${train.db_url}` resolved) is hidden too.
    copied, names = redaction.redact({**config, "log_to": "postgresql://bob:pw@db/x"}, key)
    assert names[-1] == "log_to" and copied["log_to"] == copied["train"]["db_url"]
    given = ["train.db_url=postgresql://bob:pw@db/x", "train.token_list.0=tok-a", "train.token_list.1=tok-b"]
    assert redaction.restore(copied, given, {}, {}, "r0", key)[0]["log_to"] == "postgresql://bob:pw@db/x"
    assert clean["train"]["lr"] == 0.1 and clean["train"]["token"] is None
    shown = clean["train"]["db_url"]
    # The same secret in the same store: the same placeholder; "hunter2"'s sha256 no longer tells what it hides.
    assert shown == redaction.placeholder("postgresql://bob:pw@db/x", key) == redaction.redact(config, key)[0]["train"]["db_url"]
    assert hashlib.sha256(b"postgresql://bob:pw@db/x").hexdigest()[:16] not in shown
    assert redaction.placeholder("postgresql://bob:pw@db/x", other) != shown
    # Restored from KEY=VALUE, checked against the digest; a wrong value is refused by name.
    restored, rest = redaction.restore(clean, ["train.db_url=postgresql://bob:pw@db/x", "train.token_list.0=tok-a",
                                               "train.token_list.1=tok-b", "train.lr=0.2"], {}, {}, "r1", key)
    assert restored["train"]["token_list"] == ["tok-a", "tok-b"] and rest == ["train.lr=0.2"]
    clean = redaction.redact(config, key)[0]
    with pytest.raises(HarnessError, match="train.token_list.1 of run r1 is a secret the record does not hold"):
        redaction.restore(clean, ["train.db_url=postgresql://bob:pw@db/x", "train.token_list.0=tok-a"], {}, {}, "r1", key)
    with pytest.raises(HarnessError, match=r"train.token_list.0=\.\.\. is not the value run r1 recorded"):
        redaction.restore(redaction.redact(config, key)[0], ["train.db_url=postgresql://bob:pw@db/x",
                          "train.token_list.0=tok-x", "train.token_list.1=tok-b"], {}, {}, "r1", key)
    # A run imported from another store: its key is not here, the value given is used unchecked.
    foreign = redaction.redact(config, other)[0]
    restored, _ = redaction.restore(foreign, ["train.db_url=anything", "train.token_list.0=a", "train.token_list.1=b"],
                                    {}, {}, "r2", key)
    assert restored["train"]["db_url"] == "anything"


def test_a_key_that_cannot_be_made_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("HARNESS_KEY_DIR", str(tmp_path / "file" / "keys"))
    with pytest.raises(HarnessError, match=r"cannot make the store's redaction key .*set HARNESS_KEY_DIR"):
        redaction.store_key(f"http://alice:{PASSWORD}@127.0.0.1:1")
    monkeypatch.setenv("HARNESS_KEY_DIR", str(tmp_path / "keys"))
    # One key per store, whatever credentials its URI carries.
    assert redaction.store_key(f"http://alice:{PASSWORD}@127.0.0.1:1").id == redaction.store_key("http://127.0.0.1:1").id
    assert [p.name for p in (tmp_path / "keys").iterdir()] == [next((tmp_path / "keys").iterdir()).name]


def test_ctx_cfg_prints_redacted_and_reads_real() -> None:
    cfg = redacted_view(OmegaConf.create({"lr": 0.1, "api_key": "abc-def", "db": {"url": "postgresql://bob:pw@db/x",
                                                                               "login": "${api_key}"},
                                          "token_list": ["tok-a", "tok-b"]}))
    assert isinstance(cfg, DictConfig) and cfg.api_key == "abc-def" and cfg.db.url == "postgresql://bob:pw@db/x"
    assert cfg.token_list[1] == "tok-b" and OmegaConf.to_container(cfg)["api_key"] == "abc-def"
    assert cfg.db.login == "abc-def"
    for text in (str(cfg), repr(cfg), f"{cfg.db}", str(cfg.token_list), str(copy.deepcopy(cfg)),
                 str(pickle.loads(pickle.dumps(cfg)))):
        assert not any(s in text for s in ("abc-def", "bob:pw", "tok-a", "tok-b")), text
    assert "'lr': 0.1" in str(cfg) and "<redacted>" in str(cfg)


# --- the real thing: a repository with secrets in its uncommitted changes, a run, its replay -------------------
TRAIN = "import os\n" + (EXPERIMENTS / "linear_ddp" / "train.py").read_text().replace(
    "    cfg = ctx.cfg\n",
    "    cfg = ctx.cfg\n"
    "    print(ctx.cfg, flush=True)\n"
    "    assert cfg.db_url.startswith('postgresql://bob:') and list(cfg.token_list) == ['tok-a1', 'tok-b2']\n",
)
YAML = "  db_url: postgresql://bob:pw-in-url@db/x\n  token_list: [tok-a1, tok-b2]\n"
VALUES = ("pw-in-url", "tok-a1", "tok-b2", "proxy-pw")


@pytest.fixture(scope="module")
def dirty(tmp_path_factory: pytest.TempPathFactory) -> Project:
    """A repository whose uncommitted changes hold four secrets: an edited tracked .env, an hf_ token and a
    DB_PASSWORD literal added to train.py, a ghp_ token in an untracked config.local."""
    project = make_project(tmp_path_factory.mktemp("dirty"))
    exp = project.add_experiment("secrets36", train_py=TRAIN, yaml_extra=YAML, commit=False)
    (project.root / ".env").write_text("LOG_LEVEL=info\n")
    git(project.root, "add", "-A")
    git(project.root, "commit", "-qm", "secrets36")
    (project.root / ".env").write_text("LOG_LEVEL=info\nHF_TOKEN=" + HF + "\n")
    with open(exp / "train.py", "a") as fh:
        fh.write(f'\nHUB = "{HF}"\nDB_PASSWORD = "{DB_PW}"\npassword = os.environ.get("X")\n')
    (exp / "config.local").write_text(f"[github]\ntoken_for_ci={GHP}\n")
    return project


def _store_bytes(project: Project) -> bytes:
    return b"".join(p.read_bytes() for p in project.store.rglob("*") if p.is_file() and "harness-key" not in p.name)


def test_check_and_run_refuse_secrets_in_the_uncommitted_changes(dirty: Project) -> None:
    for result in (dirty.cli("check", "experiments/secrets36"), dirty.harness("run", "experiments/secrets36")):
        assert result.returncode == EXIT_USAGE, result.stderr
        errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
        assert len(errors) == 1 and not result.stdout.strip(), result.stderr
        line = errors[0]
        for where in ("'.env' line 2 (Hugging Face token)", "'experiments/secrets36/train.py' line 34 (Hugging Face token)",
                      "'experiments/secrets36/train.py' line 35 (literal DB_PASSWORD)",
                      "'experiments/secrets36/config.local' line 2 (GitHub token)", "--allow-secret-in-diff"):
            assert where in line, line
        assert "line 36" not in line  # password = os.environ.get(...) is no literal
        assert not any(s in result.stdout + result.stderr for s in (HF, GHP, DB_PW))
    # A study's members run from a checkout of the stored patch: with the secrets cut out, it is refused.
    study = dirty.cli("run", "experiments/secrets36", "--seeds", "2", "--allow-secret-in-diff")
    assert study.returncode == EXIT_USAGE and "a study runs its members from a checkout" in study.stderr
    slurm = dirty.cli("check", "experiments/secrets36", "--allow-secret-in-diff", "executor=slurm")
    assert slurm.returncode == EXIT_USAGE and "the slurm executor runs the recorded code" in slurm.stderr
    assert dirty.all_runs() == []  # refused before anything was recorded


@pytest.fixture(scope="module")
def allowed(dirty: Project) -> tuple[str, str]:
    """The run with --allow-secret-in-diff, the config secrets and a proxy password in a variable: (its id, stderr)."""
    result = dirty.harness("run", "experiments/secrets36", "train.epochs=1", "--allow-secret-in-diff",
                           env={"OMP_PROXY": "http://u:proxy-pw@proxy:3128"})
    assert result.returncode == 0, result.stderr
    return result.last_line, result.stderr


def test_allowed_secrets_never_reach_the_store_or_the_terminal(dirty: Project, allowed: tuple[str, str]) -> None:
    run_id, stderr = allowed
    store = _store_bytes(dirty)
    for value in (HF, GHP, DB_PW, *VALUES):
        assert value.encode() not in store and value not in stderr, value
    run = dirty.client().get_run(run_id)
    tags, params = run.data.tags, run.data.params
    assert tags[T.GIT_PATCH_REDACTED] == ("experiments/secrets36/config.local:2, .env:2, "
                                          "experiments/secrets36/train.py:34, experiments/secrets36/train.py:35") or \
        set(tags[T.GIT_PATCH_REDACTED].split(", ")) == {"experiments/secrets36/config.local:2", ".env:2",
                                                        "experiments/secrets36/train.py:34",
                                                        "experiments/secrets36/train.py:35"}
    patch = Path(dirty.client().download_artifacts(run_id, T.ARTIFACT_PATCH)).read_bytes()
    assert b'+DB_PASSWORD = "<redacted>"' in patch and b"+HF_TOKEN=<redacted>" in patch
    assert b'+password = os.environ.get("X")' in patch
    assert tags[T.GIT_PATCH_SHA256] == hashlib.sha256(patch).hexdigest()  # the seal holds what is stored
    key = redaction.store_key(dirty.uri)
    assert params["train.db_url"] == redaction.placeholder("postgresql://bob:pw-in-url@db/x", key)
    assert params["train.token_list"].count(f"<redacted hmac-{key.id}:") == 2
    assert tags["harness.var.OMP_PROXY"] == "http://u:<redacted>@proxy:3128"
    logs = b"".join(p.read_bytes() for p in dirty.store.rglob("*") if "logs" in p.parts and p.is_file())
    assert b"'db_url': '<redacted>'" in logs and b"'lr': 0.01" in logs  # print(ctx.cfg) in the rank
    assert "--allow-secret-in-diff: the secrets at" in stderr


def test_replay_asks_for_the_secrets_and_reproduces(dirty: Project, allowed: tuple[str, str]) -> None:
    run_id, _ = allowed
    runs = len(dirty.all_runs())
    missing = dirty.harness("replay", run_id)
    assert missing.returncode == EXIT_USAGE
    assert f"Error: train.db_url of run {run_id} is a secret the record does not hold" in missing.stderr
    assert f"harness replay {run_id} train.db_url=VALUE" in missing.stderr
    given = ("train.db_url=postgresql://bob:pw-in-url@db/x", "train.token_list.0=tok-a1", "train.token_list.1=tok-b2")
    wrong = dirty.harness("replay", run_id, *given[:2], "train.token_list.1=tok-b3")
    assert wrong.returncode == EXIT_USAGE and "train.token_list.1=... is not the value run" in wrong.stderr
    assert len(dirty.all_runs()) == runs
    replay = dirty.harness("replay", run_id, *given)
    assert replay.returncode == 0, replay.stderr + replay.stdout
    assert "verdict: BITWISE" in replay.stdout, replay.stdout
    assert "this replay runs those lines with <redacted>" in replay.stderr
    tags = dirty.client().get_run(replay.last_line).data
    assert tags.tags[T.GIT_PATCH_REDACTED] and tags.params["train.db_url"] == \
        dirty.client().get_run(run_id).data.params["train.db_url"]  # the same secret, the same store: equal
    store = _store_bytes(dirty)
    assert not any(v.encode() in store for v in (HF, GHP, DB_PW, *VALUES))


def test_a_bundle_carries_placeholders_not_the_key(dirty: Project, allowed: tuple[str, str], tmp_path: Path) -> None:
    """Imported into another store, a run's placeholders name a key that store lacks: its replay takes the secrets
    as given (they cannot be checked there), and reproduces with the right ones."""
    run_id, _ = allowed
    bundle = tmp_path / "run.tar.gz"
    exported = dirty.harness("export", run_id, "-o", str(bundle))
    assert exported.returncode == 0, exported.stderr
    key = redaction.store_key(dirty.uri)
    raw = bundle.read_bytes()
    with tarfile.open(bundle) as tar:
        members = b"".join(tar.extractfile(m).read() for m in tar.getmembers() if m.isfile())  # type: ignore[union-attr]
    assert key.secret.hex().encode() not in members + raw and not any(v.encode() in members for v in VALUES)
    other = Project(dirty.root, tmp_path / "other")
    other.store.mkdir()
    imported = other.harness("import", str(bundle))
    assert imported.returncode == 0, imported.stderr
    assert redaction.store_key(other.uri).id != key.id
    given = ("train.db_url=postgresql://bob:pw-in-url@db/x", "train.token_list.0=tok-a1", "train.token_list.1=tok-b2")
    replay = other.harness("replay", imported.last_line, *given)
    assert replay.returncode == 0, replay.stderr + replay.stdout
    assert "verdict: BITWISE" in replay.stdout, replay.stdout
    assert not any(v.encode() in _store_bytes(other) for v in (HF, GHP, DB_PW, *VALUES))


# --- the tracking server's password in an outage's last line -------------------------------------------------
SLOW_TRAIN = "import os\n" + (EXPERIMENTS / "linear_ddp" / "train.py").read_text().replace(
    '            ctx.log({"loss": loss}, ctx.step)\n',
    '            ctx.log({"loss": loss}, ctx.step)\n            __import__("time").sleep(0.3)\n', 1,
)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[subprocess.Popen, int]]:
    """A real `mlflow server` on loopback (SQLite behind it, artifacts served) that the test may stop."""
    with mlflow_server(tmp_path / "server") as running:
        yield running


def test_outage_past_the_limit_never_prints_the_password(tmp_path: Path, server: tuple[subprocess.Popen, int]) -> None:
    from mlflow.tracking import MlflowClient

    proc, port = server
    project = make_project(tmp_path / "p")
    project.add_experiment("slow36", train_py=SLOW_TRAIN)
    project.uri = f"http://alice:{PASSWORD}@127.0.0.1:{port}"
    run = project.popen("run", "experiments/slow36", "train.epochs=6", "flush_interval_s=0.5", "heartbeat_s=1",
                        env={"HARNESS_STORE_OUTAGE_S": "2", "XDG_CACHE_HOME": str(tmp_path / "cache")})
    try:
        client = MlflowClient(f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + 180
        while not any(r.data.metrics for e in client.search_experiments()
                      for r in client.search_runs([e.experiment_id])):
            assert run.poll() is None and time.monotonic() < deadline, run.communicate()
            time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGTERM)  # the port is closed from now on: the outage outlasts the limit
        proc.wait(timeout=30)
        out, err = run.communicate(timeout=300)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode != 0, err
    errors = [line for line in err.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "unreachable" in errors[0], err
    assert PASSWORD not in out + err, err
    left = [p for p in tmp_path.rglob("*") if p.is_file() and PASSWORD.encode() in p.read_bytes()]
    assert left == []
