"""The seal: a record edited in the store after its run closed is refused, with one line naming the edit.

Each test edits the store the way an attacker would - sqlite3 on mlflow.db, MlflowClient, files in the
artifact folder - runs a real command, checks the refusal and that nothing was recorded, then puts the
record back exactly (so the module needs one run and one replay).
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import sqlite3
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import Project, make_project

import harness
from harness import tags as T
from harness.commands import bundle
from harness.errors import EXIT_USAGE
from harness.record import seal
from harness.store.tracking import Tracker

FIX = ("Use an intact copy of the run (its original store, or a bundle exported before the edit), or record it "
       "again with `harness run`.")


@dataclass
class Sealed:
    project: Project
    run_id: str
    replay_id: str
    bundle: Path

    @property
    def db(self) -> Path:
        return self.project.store / "mlflow.db"

    def artifacts(self, run_id: str | None = None) -> Path:
        uri = self.project.client().get_run(run_id or self.run_id).info.artifact_uri
        return Path(uri.removeprefix("file://"))

    def sql(self, statement: str, *args: object) -> list[tuple]:
        with contextlib.closing(sqlite3.connect(self.db)) as db:
            rows = db.execute(statement, args).fetchall()
            db.commit()
        return rows

    def refused(self, *command: str, what: str, run_id: str | None = None) -> None:
        """`command` exits 2 with the one line naming `what`, and no run was recorded."""
        before = len(self.project.all_runs())
        result = self.project.cli(*command)
        assert result.returncode == EXIT_USAGE, result.stderr
        assert result.stderr.strip().splitlines()[-1] == (
            f"Error: run {run_id or self.run_id} was changed after it was sealed: {what}. {FIX}"), result.stderr
        assert len(self.project.all_runs()) == before


@pytest.fixture(scope="module")
def sealed(tmp_path_factory: pytest.TempPathFactory) -> Sealed:
    base = tmp_path_factory.mktemp("seal")
    project = make_project(base)
    # Uncommitted: the run records a patch, which harness.git.dirty=false would have replay skip.
    (project.root / "experiments" / "linear_ddp" / "notes.txt").write_text("not committed\n")
    run = project.harness("run", "experiments/linear_ddp", "train.epochs=1")
    assert run.returncode == 0, run.stderr
    replay = project.harness("replay", run.last_line)
    assert replay.returncode == 0, replay.stderr
    out = base / "run.tar.gz"
    exported = project.harness("export", run.last_line, "-o", str(out))
    assert exported.returncode == 0, exported.stderr
    return Sealed(project, run.last_line, replay.last_line, out)


def test_every_run_harness_closes_is_sealed_and_an_intact_record_passes(sealed: Sealed) -> None:
    client = sealed.project.client()
    for run_id in (sealed.run_id, sealed.replay_id):  # the replay is sealed again once its verdict is written
        run = client.get_run(run_id)
        assert run.data.tags[T.SEAL].startswith("v1:")
        manifest = json.loads((sealed.artifacts(run_id) / T.ARTIFACT_SEAL).read_text())
        assert T.ARTIFACT_CONFIG in manifest["artifacts"] and T.ARTIFACT_SERIES in manifest["artifacts"]
    assert client.get_run(sealed.replay_id).data.tags[T.VERDICT] == "BITWISE"
    result = sealed.project.harness("compare", sealed.run_id, sealed.replay_id)
    assert result.returncode == 0, result.stderr


def test_a_note_edited_after_closing_does_not_break_the_seal(sealed: Sealed) -> None:
    client = sealed.project.client()
    before = client.get_run(sealed.run_id).data.tags.get(T.MLFLOW_RUN_NOTE)
    client.set_tag(sealed.run_id, T.MLFLOW_RUN_NOTE, "my own words, written in the UI")
    try:
        assert sealed.project.harness("compare", sealed.run_id, sealed.replay_id).returncode == 0
    finally:
        if before is None:
            client.delete_tag(sealed.run_id, T.MLFLOW_RUN_NOTE)
        else:
            client.set_tag(sealed.run_id, T.MLFLOW_RUN_NOTE, before)


@contextlib.contextmanager
def _param(s: Sealed, key: str, value: str) -> Iterator[str]:
    [(old,)] = s.sql("select value from params where run_uuid=? and key=?", s.run_id, key)
    s.sql("update params set value=? where run_uuid=? and key=?", value, s.run_id, key)
    try:
        yield f"param {key} ({old} -> {value})"
    finally:
        s.sql("update params set value=? where run_uuid=? and key=?", old, s.run_id, key)


@contextlib.contextmanager
def _tag(s: Sealed, key: str, value: str) -> Iterator[str]:
    client = s.project.client()
    old = client.get_run(s.run_id).data.tags[key]
    client.set_tag(s.run_id, key, value)
    try:
        yield f"tag {key} ({old} -> {value})"
    finally:
        client.set_tag(s.run_id, key, old)


@contextlib.contextmanager
def _sql_tag(s: Sealed, key: str, value: str) -> Iterator[str]:
    [(old,)] = s.sql("select value from tags where run_uuid=? and key=?", s.run_id, key)
    s.sql("update tags set value=? where run_uuid=? and key=?", value, s.run_id, key)
    try:
        yield f"tag {key} ({old} -> {value})"
    finally:
        s.sql("update tags set value=? where run_uuid=? and key=?", old, s.run_id, key)


@contextlib.contextmanager
def _mlflow_metric(s: Sealed) -> Iterator[str]:
    [(old,)] = s.sql("select value from metrics where run_uuid=? and key='loss' and step=2", s.run_id)
    s.sql("update metrics set value=0.5 where run_uuid=? and key='loss' and step=2", s.run_id)
    try:
        yield f"metric loss in MLflow at step 2 ({old!r} -> 0.5)"
    finally:
        s.sql("update metrics set value=? where run_uuid=? and key='loss' and step=2", old, s.run_id)


@contextlib.contextmanager
def _latest_metric(s: Sealed) -> Iterator[str]:
    # The value the MLflow UI shows in its runs table: its own table, beside the history.
    [(old,)] = s.sql("select value from latest_metrics where run_uuid=? and key='loss'", s.run_id)
    s.sql("update latest_metrics set value=0.5 where run_uuid=? and key='loss'", s.run_id)
    try:
        yield f"metric loss's latest value in MLflow ({old!r} -> 0.5)"
    finally:
        s.sql("update latest_metrics set value=? where run_uuid=? and key='loss'", old, s.run_id)


@contextlib.contextmanager
def _file(s: Sealed, path: str, edit) -> Iterator[bytes]:
    target = s.artifacts() / path
    old = target.read_bytes()
    target.write_bytes(edit(old))
    try:
        yield old
    finally:
        target.write_bytes(old)


@contextlib.contextmanager
def _series(s: Sealed) -> Iterator[str]:
    def loss(npz: Any) -> str:
        return f"values_{json.loads(str(npz['keys'])).index('loss')}"

    def swap(data: bytes) -> bytes:
        with np.load(io.BytesIO(data)) as npz:
            arrays = {k: npz[k] for k in npz.files}
            key = loss(npz)
        arrays[key] = arrays[key].copy()
        arrays[key][3] = 0.25
        out = io.BytesIO()
        np.savez_compressed(out, **arrays)
        return out.getvalue()

    with _file(s, T.ARTIFACT_SERIES, swap) as old:
        with np.load(io.BytesIO(old)) as npz:
            was = float(npz[loss(npz)][3])
        yield f"artifact {T.ARTIFACT_SERIES}: loss at step 3 ({was!r} -> 0.25)"


@contextlib.contextmanager
def _config(s: Sealed) -> Iterator[str]:
    with _file(s, T.ARTIFACT_CONFIG, lambda b: b.replace(b"lr: 0.01", b"lr: 0.5")):
        yield f"artifact {T.ARTIFACT_CONFIG}: train.lr (0.01 -> 0.5)"


@contextlib.contextmanager
def _artifact(s: Sealed) -> Iterator[str]:
    with _file(s, T.ARTIFACT_PATCH, lambda b: b + b"+one more line\n") as old:
        import hashlib

        new = hashlib.sha256(old + b"+one more line\n").hexdigest()
        yield f"artifact {T.ARTIFACT_PATCH} (sha256 {hashlib.sha256(old).hexdigest()[:12]} -> {new[:12]})"


TAMPERS = {
    "param": lambda s: _param(s, "train.lr", "0.5"),
    "harness tag": lambda s: _tag(s, T.SEED, "7"),
    "mlflow metric value": _mlflow_metric,
    "mlflow latest metric value": _latest_metric,
    "series.npz": _series,
    "config.yaml": _config,
    "artifact": _artifact,
    "harness.experiment.path": lambda s: _sql_tag(s, T.EXPERIMENT_PATH, "../another/repo"),
    "harness.git.dirty": lambda s: _tag(s, T.GIT_DIRTY, "false"),
}


@pytest.mark.parametrize("kind", TAMPERS)
def test_an_edited_record_is_refused_naming_the_edit(sealed: Sealed, kind: str) -> None:
    # compare reads the store without opening MLflow: a second each. Every command checks the same seal (below).
    with TAMPERS[kind](sealed) as what:
        sealed.refused("compare", sealed.run_id, sealed.replay_id, what=what)
    seal.check(Tracker(sealed.project.uri, writable=False), sealed.run_id)  # put back exactly: the seal holds again


COMMANDS = {
    "replay": lambda s: ["replay", s.run_id],
    "audit": lambda s: ["audit", s.run_id, "-k", "1"],
    "resume": lambda s: ["resume", s.run_id],
    "trace": lambda s: ["trace", s.run_id, "--step", "1"],
    "export": lambda s: ["export", s.run_id, "-o", str(s.bundle.with_name("again.tar.gz"))],
    "verify": lambda s: ["verify", str(_claims(s))],
}


def _claims(s: Sealed) -> Path:
    path = s.bundle.with_name("claims.yaml")
    path.write_text(f"claims:\n  - id: a\n    run: {s.run_id}\n    metric: loss\n    paper: 1.5\n")
    return path


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_that_reads_a_record_checks_its_seal_first(sealed: Sealed, command: str) -> None:
    with _param(sealed, "train.lr", "0.5") as what:
        sealed.refused(*COMMANDS[command](sealed), what=what)
    assert not sealed.bundle.with_name("again.tar.gz").exists()


def test_an_edited_replay_is_refused_by_compare(sealed: Sealed) -> None:
    client = sealed.project.client()
    client.set_tag(sealed.replay_id, T.VERDICT, "DIVERGED")
    try:
        sealed.refused("compare", sealed.run_id, sealed.replay_id, run_id=sealed.replay_id,
                       what=f"tag {T.VERDICT} (BITWISE -> DIVERGED)")
    finally:
        client.set_tag(sealed.replay_id, T.VERDICT, "BITWISE")


def test_an_export_leaves_out_a_replay_killed_while_its_verdict_was_written_and_says_so(sealed: Sealed) -> None:
    # As a replay killed between closing its run and sealing its verdict leaves it (tests/test_kills.py reaches this
    # only when a kill lands in that window): the seal still PENDING.
    client = sealed.project.client()
    value = client.get_run(sealed.replay_id).data.tags[T.SEAL]
    client.set_tag(sealed.replay_id, T.SEAL, value + "+pending")
    try:
        out = sealed.bundle.with_name("without-the-killed-replay.tar.gz")
        result = sealed.project.harness("export", sealed.run_id, "-o", str(out))
        assert result.returncode == 0, result.stderr
        assert (f"replay {sealed.replay_id} is left out of the bundle: its verdict was being written when the process "
                "writing it stopped") in result.stderr
        with tarfile.open(out) as bundle:
            names = bundle.getnames()
        assert not any(sealed.replay_id in name for name in names), names
        # Read on its own, the replay is still refused, with the way out.
        alone = sealed.project.harness("compare", sealed.run_id, sealed.replay_id)
        assert alone.returncode == 2 and "its report is incomplete" in alone.stderr, alone.stderr
    finally:
        client.set_tag(sealed.replay_id, T.SEAL, value)


def test_a_removed_seal_tag_is_refused_and_an_unsealed_run_is_accepted_with_a_warning(sealed: Sealed) -> None:
    client = sealed.project.client()
    value = client.get_run(sealed.run_id).data.tags[T.SEAL]
    manifest = sealed.artifacts() / T.ARTIFACT_SEAL
    kept = manifest.read_bytes()
    client.delete_tag(sealed.run_id, T.SEAL)
    try:
        sealed.refused("compare", sealed.run_id, sealed.replay_id, what=f"tag {T.SEAL} (removed)")
        manifest.unlink()  # neither tag nor manifest: a run recorded before seals existed
        result = sealed.project.harness("compare", sealed.run_id, sealed.replay_id)
        assert result.returncode == 0, result.stderr
        said = result.stderr.strip().splitlines()
        assert said[0] == (f"Warning: run {sealed.run_id} has no seal (recorded before harness sealed its runs): an edit "
                           "of its record after it closed cannot be detected.")
        assert len(said) == 1 or (len(said) == 2 and said[1].startswith("Curves (original and replay overlaid) in ")), said
    finally:
        manifest.write_bytes(kept)
        client.set_tag(sealed.run_id, T.SEAL, value)


def test_import_refuses_a_bundle_whose_record_was_edited_and_writes_nothing(sealed: Sealed, tmp_path: Path) -> None:
    # The attacker edits record.json and rewrites the bundle's manifest to match: only the seal can tell.
    unpacked = tmp_path / "unpacked"
    unpacked.mkdir()
    manifest = bundle.verify(sealed.bundle, unpacked)
    record_file = unpacked / bundle.RUN_DIR / bundle.RECORD
    record = json.loads(record_file.read_bytes())
    record["params"]["train.lr"] = "0.5"
    record_file.write_bytes(json.dumps(record, indent=1, sort_keys=True).encode())
    members = {p.relative_to(unpacked).as_posix(): bundle.Member(p.stat().st_size, bundle.sha256_file(p))
               for p in sorted(unpacked.rglob("*")) if p.is_file()}
    forged = tmp_path / "forged.tar.gz"
    with tarfile.open(forged, "w:gz") as tar:
        data = bundle.Manifest(manifest.format, manifest.run_id, manifest.replays, members, manifest.image).to_json()
        info = tarfile.TarInfo(bundle.MANIFEST)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
        for name in members:
            tar.add(unpacked / name, arcname=name)
    store = tmp_path / "other store"
    store.mkdir()
    uri = f"sqlite:///{store / 'mlflow.db'}"
    result = sealed.project.cli("import", str(forged), env={"MLFLOW_TRACKING_URI": uri})
    assert result.returncode == EXIT_USAGE, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"Error: run {sealed.run_id} (in the bundle) was changed after it was sealed: param train.lr (0.01 -> 0.5). "
        f"{FIX}")
    assert not (store / "mlflow.db").exists()  # refused before the store was even opened
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    # The intact bundle imports, and its copy is sealed again (its own tags, its carried code).
    result = sealed.project.harness("import", str(sealed.bundle), env={"MLFLOW_TRACKING_URI": uri})
    assert result.returncode == 0, result.stderr
    [copy] = [r for r in client.search_runs([e.experiment_id for e in client.search_experiments()])
              if r.data.tags.get(T.IMPORTED_FROM) == sealed.run_id]
    assert copy.data.tags[T.SEAL] != sealed.project.client().get_run(sealed.run_id).data.tags[T.SEAL]
    shutil.rmtree(store)


# --- signed attestations: a key the store does not hold ------------------------------------------------------

@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    base = tmp_path_factory.mktemp("keys")
    out = {}
    for name in ("signer", "other"):
        key = ed25519.Ed25519PrivateKey.generate()
        (base / f"{name}.pem").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        (base / f"{name}.pub.pem").write_bytes(key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
        out[name], out[f"{name}.pub"] = base / f"{name}.pem", base / f"{name}.pub.pem"
    return out


def test_export_signs_an_in_toto_attestation_that_verify_record_checks(sealed: Sealed, keys: dict[str, Path]) -> None:
    import base64

    out = sealed.bundle.with_name("signed.tar.gz")
    result = sealed.project.harness("export", sealed.run_id, "-o", str(out), "--sign", str(keys["signer"]))
    assert result.returncode == 0, result.stderr
    signed = out.with_name("signed.tar.gz.intoto.json")
    envelope = json.loads(signed.read_bytes())
    assert envelope["payloadType"] == "application/vnd.in-toto+json"
    statement = json.loads(base64.b64decode(envelope["payload"]))
    tags = sealed.project.client().get_run(sealed.run_id).data.tags
    assert statement["_type"] == "https://in-toto.io/Statement/v1"
    assert statement["subject"] == [{"name": f"{sealed.run_id}/weights", "digest": {"sha256": tags[T.FINGERPRINT]}}]
    assert statement["predicate"]["seal"] == tags[T.SEAL]

    def check(key: str = "signer.pub", attestation: Path = signed):
        return sealed.project.cli("verify-record", sealed.run_id, "--attestation", str(attestation),
                                      "--key", str(keys[key]))

    ok = check()
    assert ok.returncode == 0, ok.stderr
    assert ok.last_line.startswith(f"Run {sealed.run_id} is the attested run {sealed.run_id}, unchanged")
    # Through the API (the CLI's verbs are these functions): the same answer, typed; an attestation that cannot be
    # written is one line, not a traceback.
    held = harness.verify_record(harness.VerifyRecordOptions(sealed.run_id[:8], signed, keys["signer.pub"],
                                                             tracking_uri=sealed.project.uri))
    assert held.run_id == sealed.run_id and held.statement["subject"] == statement["subject"]
    nowhere = signed.parent / "no-such-folder" / "a.json"
    refused = sealed.project.cli("attest", sealed.run_id, "--key", str(keys["signer"]), "-o", str(nowhere))
    assert refused.returncode == EXIT_USAGE and not nowhere.parent.exists()
    assert refused.stderr == (f"Error: cannot write {nowhere}: No such file or directory. Pass a file in a folder "
                              "that exists and that you may write to.\n"), refused.stderr
    wrong = check("other.pub")
    assert wrong.returncode == EXIT_USAGE
    assert wrong.stderr.strip().splitlines() == [
        f"Error: {signed} is not signed by the key {keys['other.pub']} (or was altered after signing). "
        "Check it with the public key of whoever signed it."]
    forged = signed.with_name("forged.json")  # another subject, the signature kept
    statement["subject"][0]["digest"]["sha256"] = "0" * 64
    forged.write_text(json.dumps({**envelope, "payload": base64.b64encode(json.dumps(statement).encode()).decode()}))
    assert check(attestation=forged).stderr.strip().startswith(f"Error: {forged} is not signed by the key")
    with _param(sealed, "train.lr", "0.5") as what:  # an edit in the store, resealed or not, fails the check
        sealed.refused("verify-record", sealed.run_id, "--attestation", str(signed), "--key", str(keys["signer.pub"]),
                       what=what)
        client = sealed.project.client()
        resealed = seal.seal(Tracker(sealed.project.uri), sealed.run_id)  # the forger reseals the record
        try:
            result = check()
            assert result.returncode == EXIT_USAGE
            assert result.stderr.strip() == (
                f"Error: run {sealed.run_id} was resealed since it was attested (seal {resealed}, attested "
                f"{tags[T.SEAL]}): its record is not the one signed. Use an intact copy of the run.")
        finally:
            client.set_tag(sealed.run_id, T.SEAL, tags[T.SEAL])
    # the forger's manifest is still there: put the sealed one back by sealing the restored record
    seal.seal(Tracker(sealed.project.uri), sealed.run_id)
    assert sealed.project.client().get_run(sealed.run_id).data.tags[T.SEAL] == tags[T.SEAL]
    assert check().returncode == 0
