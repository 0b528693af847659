"""`--json` on every command that prints a result, run ids given as prefixes, `run --name/--tag`, --quiet/--verbose.

One recorded run and one replay of it (module fixtures) are shared by every --json check: each document must
parse as strict JSON, be the only thing on stdout, and carry the keys docs/json.md documents for its command.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from conftest import Project, Result, make_project

import harness
from harness.store.tracking import full_ids

# The keys docs/json.md documents, per command (every document starts with HEAD).
HEAD = {"command", "schema", "exit_code", "exit_meaning"}
KEYS = {
    "run": {"run_id", "name", "experiment", "kind", "status", "message", "members"},
    "check": {"ok", "experiment_dir", "world_size", "seed", "commit", "dirty", "warnings", "study"},
    "replay": {"run_id", "replay_of", "kind", "status", "verdict", "summary", "changes", "comparison", "localized"},
    "compare": {"verdict", "summary", "relation", "run_a", "run_b", "delta", "metrics", "fingerprints", "divergence",
                "config_delta", "bitwise_possible", "bitwise_blockers"},
    "compare traces": {"relation", "run_a", "run_b", "rank", "differs", "status", "op_index", "likely_cause", "lines"},
    "runs": {"runs"},
    "audit": {"run_id", "audited", "verdict", "summary", "seed", "segments_total", "steps_total", "catch_probability",
              "step_fraction", "segments"},
    "trace": {"run_id", "traced", "step", "ranks", "from_checkpoint", "reproduced", "detail", "seconds"},
    "bisect": {"run_id", "good", "bad", "found", "culprit", "probes", "not_varied", "unresolved", "localized"},
    "verify": {"run_id", "claims_file", "replayed", "held", "total", "report", "claims"},
    "export": {"run_id", "path", "replays", "members", "size", "image", "attestation"},
    "import": {"run_id", "original_id", "already", "replays", "image", "data"},
    "attest": {"run_id", "path"},
    "verify-record": {"run_id", "attested_run_id", "sha256", "holds"},
    "error": {"error"},
}
RUN_ROW = {"run_id", "name", "experiment", "start", "status", "kind", "study_size", "world_size", "commit", "dirty",
           "image_digest", "verdicts", "nested", "nested_under"}


def document(result: Result, command: str, keys: str | None = None) -> dict:
    """stdout as the one JSON document of `command` (strict JSON: no NaN), with its documented keys and exit code."""
    doc = json.loads(result.stdout, parse_constant=lambda c: pytest.fail(f"{c} in a --json document"))
    assert isinstance(doc, dict), result.stdout
    assert HEAD | KEYS[keys or command] <= doc.keys(), sorted(HEAD | KEYS[keys or command] - doc.keys())
    assert doc["command"] == command and doc["schema"] == 1
    assert doc["exit_code"] == result.returncode, (doc, result.stderr)
    assert isinstance(doc["exit_meaning"], str) and doc["exit_meaning"] != "unexpected"
    return doc


@pytest.fixture(scope="module")
def recorded(project: Project) -> Result:
    """linear_ddp, one epoch of 5 steps, checkpointed every 2: recorded quietly, with --json and tags of the user's."""
    return project.harness("--quiet", "run", "experiments/linear_ddp", "train.epochs=1", "checkpoint_every=2",
                           "--tag", "team=ml", "--tag", "note=a b, c", "--json")


@pytest.fixture(scope="module")
def run_id(recorded: Result) -> str:
    assert recorded.returncode == 0, recorded.stderr
    return json.loads(recorded.stdout)["run_id"]


@pytest.fixture(scope="module")
def replayed(project: Project, run_id: str) -> Result:
    """The run replayed by an 8-digit prefix of its id."""
    return project.harness("replay", run_id[:8], "--json")


@pytest.fixture(scope="module")
def replay_id(replayed: Result) -> str:
    assert replayed.returncode == 0, replayed.stderr
    return json.loads(replayed.stdout)["run_id"]


def test_run_json_is_the_only_stdout_and_the_run_is_named_and_tagged(project: Project, recorded: Result,
                                                                      run_id: str) -> None:
    doc = document(recorded, "run")
    assert doc["status"] == "FINISHED" and doc["kind"] == "run" and doc["members"] == [] and doc["message"] is None
    assert doc["experiment"] == "linear_ddp" and len(run_id) == 32
    # Named after its experiment and its id, not MLflow's random words; the name is MLflow's run name (the UI's).
    assert doc["name"] == f"linear_ddp-{run_id[:8]}"
    run = project.client().get_run(run_id)
    assert run.info.run_name == doc["name"]
    assert run.data.tags["team"] == "ml" and run.data.tags["note"] == "a b, c"
    # --quiet: no notice, no progress, no link; only the warnings (none here: the tree is clean).
    assert "harness: recording" not in recorded.stderr and "Open it in the MLflow UI" not in recorded.stderr
    assert recorded.stderr.strip() == "", recorded.stderr


def test_a_study_named_and_tagged_json(project: Project) -> None:
    """A study's document lists its members; --name names the study and, with its seed, each member; --tag tags all."""
    result = project.harness("run", "experiments/linear_ddp", "train.epochs=1", "--seeds", "2", "--name", "lr sweep",
                             "--tag", "team=ml", "--json")
    doc = document(result, "run")
    assert doc["kind"] == "study" and doc["status"] == "FINISHED" and doc["name"] == "lr sweep"
    assert [m["seed"] for m in doc["members"]] == [0, 1] and all(m["status"] == "FINISHED" for m in doc["members"])
    client = project.client()
    for run_id, name in [(doc["run_id"], "lr sweep"), *((m["run_id"], f"lr sweep-seed{m['seed']}") for m in doc["members"])]:
        run = client.get_run(run_id)
        assert (run.info.run_name, run.data.tags["team"]) == (name, "ml")


def test_replay_by_prefix_json(replayed: Result, run_id: str, replay_id: str) -> None:
    doc = document(replayed, "replay")
    assert doc["replay_of"] == run_id and doc["run_id"] == replay_id and doc["kind"] == "replay"
    assert doc["verdict"] == "BITWISE" and doc["summary"].startswith("BITWISE") and doc["changes"] == []
    cmp = doc["comparison"]
    assert cmp["run_a"] == run_id and cmp["run_b"] == replay_id and cmp["relation"] == "replay"
    assert "original_id" not in cmp and "replay_id" not in cmp
    # Without --quiet the link is said, on stderr: stdout holds the document alone.
    assert "Open it in the MLflow UI" in replayed.stderr


def test_compare_json_names_two_runs_a_and_b(project: Project, run_id: str, replay_id: str) -> None:
    doc = document(project.harness("compare", run_id[:8], replay_id[:10], "--json"), "compare")
    assert (doc["run_a"], doc["run_b"], doc["relation"], doc["verdict"]) == (run_id, replay_id, "replay", "BITWISE")
    # The other way round: the replay is not a replay of run B, so the two are independent runs.
    back = document(project.harness("compare", replay_id, run_id, "--json"), "compare")
    assert (back["run_a"], back["run_b"], back["relation"]) == (replay_id, run_id, "independent")


def test_runs_json(project: Project, run_id: str, replay_id: str) -> None:
    doc = document(project.harness("runs", "linear_ddp", "-n", "500", "--json"), "runs")
    by_id = {row["run_id"]: row for row in doc["runs"]}
    assert all(RUN_ROW <= row.keys() for row in doc["runs"])
    assert by_id[run_id]["name"] == f"linear_ddp-{run_id[:8]}" and by_id[run_id]["verdicts"] == "BITWISE 1"
    assert by_id[replay_id]["kind"] == "replay" and by_id[replay_id]["name"] == f"replay-of-linear_ddp-{run_id[:8]}"


def test_check_json_says_when_the_config_runs_a_study(project: Project) -> None:
    single = document(project.cli("check", "experiments/linear_ddp", "--json"), "check")
    assert single["ok"] is True and single["study"] is None and single["world_size"] == 2
    study = document(project.cli("check", "experiments/linear_ddp", "seeds=[3,4,5]", "--json"), "check")
    assert study["study"] == {"seeds": [3, 4, 5]}
    text = project.cli("check", "experiments/linear_ddp", "seeds=[3,4,5]")
    assert text.returncode == 0 and "a study: 3 runs, seeds 3, 4, 5" in text.stdout


def test_audit_json(project: Project, run_id: str) -> None:
    doc = document(project.harness("audit", run_id[:8], "--segments", "1", "--seed", "1", "--json"), "audit")
    assert doc["audited"] == run_id and doc["verdict"] == "BITWISE" and len(doc["segments"]) == 1
    assert doc["segments"][0]["ok"] is True and doc["segments_total"] == 3


def test_trace_json(project: Project, run_id: str) -> None:
    doc = document(project.harness("trace", run_id[:8], "--step", "1", "--json"), "trace")
    assert doc["traced"] == run_id and doc["step"] == 1 and doc["ranks"] == [0] and doc["reproduced"] is True
    assert doc["from_checkpoint"] == 0 and len(doc["run_id"]) == 32
    # The same step traced again: the two traces compare as identical, with compare's document for traces.
    again = json.loads(project.harness("trace", run_id, "--step", "1", "--json").stdout)["run_id"]
    traces = document(project.harness("compare", doc["run_id"][:8], again[:8], "--json"), "compare",
                      keys="compare traces")
    assert (traces["relation"], traces["run_a"], traces["run_b"]) == ("traces", doc["run_id"], again)
    assert traces["differs"] is False and traces["status"] == "IDENTICAL" and traces["exit_meaning"] == "the traces are identical"


def test_bisect_json_names_the_culprit_key(project: Project, run_id: str) -> None:
    # BAD: another learning rate, named by the user.
    bad = project.harness("run", "experiments/linear_ddp", "train.epochs=1", "checkpoint_every=2", "train.lr=0.02",
                          "--name", "lr 0.02 probe")
    assert bad.returncode == 0, bad.stderr
    assert project.client().get_run(bad.last_line).info.run_name == "lr 0.02 probe"
    doc = document(project.harness("bisect", run_id[:8], bad.last_line[:8], "--json"), "bisect")
    assert doc["good"] == run_id and doc["bad"] == bad.last_line and doc["found"] is True
    assert [c["key"] for c in doc["culprit"]["config"]] == ["train.lr"] and doc["probes"]
    assert all({"what", "run_id", "verdict", "summary", "reused_from"} <= p.keys() for p in doc["probes"])


def test_verify_json(project: Project, run_id: str, tmp_path: Path) -> None:
    loss = project.client().get_run(run_id).data.metrics["loss"]
    claims = tmp_path / "claims.yaml"
    claims.write_text(f"claims:\n  - id: final-loss\n    run: {run_id[:8]}\n    metric: loss\n    paper: {loss:.4f}\n")
    result = project.harness("verify", str(claims), "--json")
    doc = document(result, "verify")
    assert doc["total"] == 1 and doc["held"] == 1 and doc["claims"][0]["id"] == "final-loss"
    assert doc["claims"][0]["resolved"] == run_id and (project.root / doc["report"]).exists()


def test_export_import_attest_and_verify_record_json(project: Project, run_id: str, tmp_path: Path) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    key = ed25519.Ed25519PrivateKey.generate()
    private, public = tmp_path / "k.pem", tmp_path / "k.pub.pem"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                     serialization.PublicFormat.SubjectPublicKeyInfo))
    bundle = tmp_path / "run.tar.gz"
    exported = document(project.harness("export", run_id[:8], "-o", str(bundle), "--json"), "export")
    assert exported["run_id"] == run_id and exported["path"] == str(bundle) and bundle.exists()
    assert exported["attestation"] is None and exported["size"] == bundle.stat().st_size
    other = Project(tmp_path, tmp_path / "store")
    (tmp_path / "store").mkdir()
    imported = document(other.harness("import", str(bundle), "--json"), "import")
    assert imported["original_id"] == run_id and imported["already"] is False and imported["run_id"] != run_id
    again = document(other.harness("import", str(bundle), "--json"), "import")
    assert again["already"] is True and again["run_id"] == imported["run_id"]
    signed = tmp_path / "att.json"
    attested = document(project.harness("attest", run_id[:8], "--key", str(private), "-o", str(signed), "--json"),
                        "attest")
    assert attested == {**attested, "run_id": run_id, "path": str(signed)} and signed.exists()
    holds = document(project.harness("verify-record", run_id[:8], "--attestation", str(signed), "--key", str(public),
                                     "--json"), "verify-record")
    assert holds["run_id"] == holds["attested_run_id"] == run_id and holds["holds"] is True


def test_a_refusal_with_json_is_its_error_document(project: Project, run_id: str) -> None:
    result = project.cli("mark", run_id[:8], "--status", "FAILED", "--json")
    doc = document(result, "mark", keys="error")
    assert result.returncode == 2 and doc["error"] == f"run {run_id} is FINISHED, not RUNNING; only a RUNNING run " \
                                                      "can be marked. Nothing to do."
    assert result.stderr.strip() == f"Error: {doc['error']}"
    calibrate = project.cli("calibrate", run_id, "--members", "1", "--json")
    assert document(calibrate, "calibrate", keys="error")["exit_code"] == 2


@pytest.mark.parametrize(("args", "command", "said"), [
    (("replay", "--json"), "replay", "Missing argument 'RUN_ID'."),
    (("runs", "--json", "--limit", "x"), "runs", "Invalid value for '-n' / '--limit': 'x' is not a valid integer."),
    (("compare", "abcdef", "--json", "--no-such"), "compare", "No such option '--no-such'."),
    (("--quiet", "--verbose", "runs", "--json"), "runs", "--quiet and --verbose contradict each other; pass one."),
], ids=["missing", "type", "option", "group"])
def test_a_usage_error_with_json_is_its_error_document(project: Project, args: tuple[str, ...], command: str,
                                                       said: str) -> None:
    """What click refuses before the command runs is a refusal too: its document on stdout, its usage on stderr."""
    result = project.cli(*args)
    doc = document(result, command, keys="error")
    assert (result.returncode, doc["error"]) == (2, said)
    assert result.stderr.rstrip().endswith(f"Error: {said}")
    assert project.cli("replay").stdout == ""  # without --json, stdout stays empty


# -- run ids given as prefixes ---------------------------------------------------------------------------------
SHARED = "abcdef12"
IDS = [SHARED + "0" * 24, SHARED + "f" * 24, "9" * 32]


@pytest.fixture(scope="module")
def look_alike(tmp_path_factory: pytest.TempPathFactory) -> Project:
    """A store holding two harness runs whose ids share their first 8 digits, and a third: real MLflow runs, whose
    ids MLflow draws from uuid4 (drawn here from IDS instead, since a chance collision takes ~5,000 runs)."""
    from mlflow.tracking import MlflowClient

    project = make_project(tmp_path_factory.mktemp("look_alike"))
    drawn = iter(IDS)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(uuid, "uuid4", lambda: uuid.UUID(next(drawn)))
        client = MlflowClient(project.uri)
        experiment = client.create_experiment("look_alike")
        for _ in IDS:
            run = client.create_run(experiment, tags={"harness.version": "0", "harness.kind": "run"})
            client.set_terminated(run.info.run_id, "FINISHED")
    assert sorted(r.info.run_id for r in project.all_runs()) == sorted(IDS)
    return project


@pytest.mark.parametrize("args", [("replay", "{p}"), ("compare", "{p}", IDS[2]), ("export", "{p}", "-o", "x.tar.gz"),
                                  ("audit", "{p}", "--segments", "1"), ("trace", "{p}", "--step", "0"),
                                  ("resume", "{p}"), ("calibrate", "{p}"), ("mark", "{p}", "--status", "FAILED"),
                                  ("attest", "{p}", "--key", "k.pem", "-o", "a.json")],
                         ids=lambda a: a[0])
def test_an_ambiguous_prefix_is_refused_listing_its_runs(look_alike: Project, args: tuple[str, ...]) -> None:
    (look_alike.root / "k.pem").write_text("not a key")
    result = look_alike.cli(*(a.format(p=SHARED) for a in args))
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        f"Error: run id prefix '{SHARED}' is ambiguous: it starts 2 runs ({IDS[0]}, {IDS[1]}). Pass more of the id."]
    assert not (look_alike.root / "x.tar.gz").exists() and not (look_alike.root / "a.json").exists()


def test_a_unique_prefix_names_its_run_and_an_unknown_one_no_run(look_alike: Project) -> None:
    # Unique from its 9th digit; case does not matter; the whole id still works.
    doc = json.loads(look_alike.cli("compare", SHARED + "F", IDS[0], "--json").stdout)
    assert (doc["run_a"], doc["run_b"], doc["relation"]) == (IDS[1], IDS[0], "independent")
    assert json.loads(look_alike.cli("compare", "999999", "ABCDEF12F", "--json").stdout)["run_b"] == IDS[1]
    # A whole id in capitals names its run as its prefix does, where it is resolved without the store too.
    doc = json.loads(look_alike.cli("compare", IDS[2].upper(), f" {IDS[0].upper()} ", "--json").stdout)
    assert (doc["run_a"], doc["run_b"]) == (IDS[2], IDS[0])
    assert full_ids(look_alike.uri, IDS[0].upper()) == [IDS[0]]
    for unknown in ("abcdef13", "123456"):  # no run starts so
        result = look_alike.cli("replay", unknown)
        assert result.returncode == 2 and result.stderr.startswith(f"Error: no run '{unknown}' in the tracking store")
    for short in ("12345", SHARED[:5], "a"):  # under 6 digits is no prefix: said so, not "no run"
        result = look_alike.cli("replay", short)
        assert result.returncode == 2 and result.stderr.strip() == (
            f"Error: run id '{short}' is too short: a prefix needs 6 hex digits or more. Pass more of the id "
            "(`harness runs` lists them)."), result.stderr


def test_an_api_call_on_an_id_that_names_no_one_run_raises_run_not_found(look_alike: Project) -> None:
    """What the CLI says as a line, the API raises as a class: ambiguous, too short and unknown ids alike."""
    for ref, said in ((SHARED, f"run id prefix '{SHARED}' is ambiguous"), ("12345", "run id '12345' is too short"),
                      ("abcdef13", "no run 'abcdef13' in the tracking store")):
        with pytest.raises(harness.RunNotFound) as err:
            harness.replay(harness.ReplayOptions(ref, tracking_uri=look_alike.uri))
        assert str(err.value).startswith(said) and err.value.exit_code == 2, err.value
        with pytest.raises(harness.RunNotFound):
            harness.compare(harness.CompareOptions(IDS[2], ref, tracking_uri=look_alike.uri))
    with pytest.raises(harness.RunNotFound, match="^no MLflow experiment 'nope' in "):
        harness.runs(harness.RunsOptions("nope", tracking_uri=look_alike.uri))


def test_verbose_adds_the_traceback_and_quiet_with_verbose_is_refused(look_alike: Project) -> None:
    result = look_alike.cli("--verbose", "compare", "0123456789abcdef", IDS[2])
    assert result.returncode == 2 and "Traceback" in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("Error: no run '0123456789abcdef'")
    assert look_alike.cli("--quiet", "--verbose", "runs").returncode == 2
