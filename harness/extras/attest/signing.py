"""Signed attestations of a sealed run: an in-toto Statement whose subject is the final weights' digest, in a
DSSE envelope signed with an ed25519 key the tracking store does not hold.

The seal (harness/record/seal.py) shows an edit made without harness; whoever can write the store can still reseal a
forged record. An attestation signed with a key kept elsewhere cannot be remade that way: `verify_record`
checks the signature, that the run's seal is the one attested, that the seal holds, and that the weights'
digest is the attested subject. Keys are PEM files (`openssl genpkey -algorithm ed25519`), read with the
`cryptography` package.
"""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path
from typing import Any

from harness import tags as T
from harness.errors import HarnessError, RunRefused, UsageError
from harness.record import seal

PAYLOAD_TYPE = "application/vnd.in-toto+json"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://harness.invalid/attestation/sealed-run/v1"  # harness's own predicate: the fields below


def _pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE's pre-authentication encoding: what is signed, so a payload cannot pass for another type."""
    kind = payload_type.encode()
    return b"DSSEv1 %d %s %d %s" % (len(kind), kind, len(payload), payload)


def _crypto() -> Any:
    try:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError:
        raise HarnessError("signing needs the `cryptography` package, which is not installed. "
                           "Install it: pip install cryptography.") from None
    return serialization, ed25519


def _key(path: Path, private: bool) -> Any:
    serialization, ed25519 = _crypto()
    kind = "private" if private else "public"
    try:
        data = path.read_bytes()
        key = (serialization.load_pem_private_key(data, password=None) if private
               else serialization.load_pem_public_key(data))
    except (OSError, ValueError, TypeError) as err:
        raise UsageError(f"cannot read the {kind} key {path}: {err}. Pass an unencrypted ed25519 PEM key "
                           "(openssl genpkey -algorithm ed25519 -out key.pem; openssl pkey -in key.pem -pubout).") from None
    wanted = ed25519.Ed25519PrivateKey if private else ed25519.Ed25519PublicKey
    if not isinstance(key, wanted):
        raise UsageError(f"the {kind} key {path} is not an ed25519 key. Make one: openssl genpkey -algorithm ed25519.")
    return key


def _keyid(public: Any) -> str:
    serialization, _ = _crypto()
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()


def statement(run: Any) -> dict[str, Any]:
    """The in-toto Statement of a sealed run (a tracking.RunSummary)."""
    weights = run.tags.get(T.FINGERPRINT)
    if not weights:
        raise RunRefused(f"run {run.run_id} recorded no final weights' digest ({T.FINGERPRINT}): there is no "
                           "subject to attest. Attest a run that trained (ctx.ddp or ctx.watch_optimizer).")
    if not run.tags.get(T.SEAL):
        raise RunRefused(f"run {run.run_id} has no seal (recorded before harness sealed its runs); only a sealed "
                           "run can be attested. Record it again with `harness run`.")
    return {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": f"{run.run_id}/weights", "digest": {"sha256": weights}}],
        "predicateType": PREDICATE_TYPE,
        "predicate": {
            "run_id": run.run_id, "experiment": run.experiment, "status": run.status, "seal": run.tags[T.SEAL],
            "fingerprint_of": run.tags.get(T.FINGERPRINT_OF), "git_commit": run.tags.get(T.GIT_COMMIT),
            "harness_version": run.tags.get(T.VERSION),
        },
    }


def sign(tracker: Any, run_id: str, key_path: Path) -> bytes:
    """A DSSE envelope (JSON) of the run's Statement, signed with the ed25519 private key at `key_path`."""
    key = _key(key_path, private=True)
    run_id = tracker.resolve_id(run_id)
    seal.check(tracker, run_id)
    payload = json.dumps(statement(tracker.harness_run(run_id)), sort_keys=True, separators=(",", ":")).encode()
    envelope = {
        "payloadType": PAYLOAD_TYPE,
        "payload": base64.b64encode(payload).decode(),
        "signatures": [{"keyid": _keyid(key.public_key()), "sig": base64.b64encode(key.sign(_pae(PAYLOAD_TYPE, payload))).decode()}],
    }
    return json.dumps(envelope, indent=1).encode() + b"\n"


def verify_record(tracker: Any, run_id: str, attestation: Path, key_path: Path) -> dict[str, Any]:
    """The attested Statement when `attestation` is signed by the key at `key_path` and the run is the one it
    attests, sealed and unchanged; else HarnessError saying which."""
    from cryptography.exceptions import InvalidSignature

    public = _key(key_path, private=False)
    run_id = tracker.resolve_id(run_id)
    try:
        envelope = json.loads(attestation.read_bytes())
        payload = base64.b64decode(envelope["payload"], validate=True)
        signatures = [base64.b64decode(s["sig"], validate=True) for s in envelope["signatures"]]
        payload_type = envelope["payloadType"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UsageError(f"{attestation} is not a DSSE envelope ({err}). Pass the file `harness attest` or "
                           "`harness export --sign` wrote.") from None
    valid = False
    for sig in signatures:
        try:
            public.verify(sig, _pae(payload_type, payload))
            valid = True
            break
        except InvalidSignature:
            continue
    if not valid:
        raise HarnessError(f"{attestation} is not signed by the key {key_path} (or was altered after signing). "
                           "Check it with the public key of whoever signed it.")
    doc = json.loads(payload)
    if doc.get("_type") != STATEMENT_TYPE or doc.get("predicateType") != PREDICATE_TYPE or payload_type != PAYLOAD_TYPE:
        raise UsageError(f"{attestation} is not a harness attestation (predicateType {doc.get('predicateType')}).")
    run = tracker.harness_run(run_id)
    attested = doc["predicate"]["run_id"]
    copy = run.tags.get(T.IMPORTED_FROM) == attested
    if attested != run_id and not copy:
        raise UsageError(f"{attestation} attests run {attested}, not {run_id}. Pass the run it names.")
    seal.check(tracker, run_id)
    # An imported copy is sealed again in its store (its own tags); its weights are still the subject.
    if not copy and run.tags.get(T.SEAL) != doc["predicate"]["seal"]:
        raise RunRefused(f"run {run_id} was resealed since it was attested (seal {run.tags.get(T.SEAL)}, attested "
                           f"{doc['predicate']['seal']}): its record is not the one signed. Use an intact copy of the run.")
    weights = doc["subject"][0]["digest"]["sha256"]
    if run.tags.get(T.FINGERPRINT) != weights:
        raise RunRefused(f"run {run_id}'s final weights ({T.FINGERPRINT} {run.tags.get(T.FINGERPRINT)}) are not the "
                           f"attested ones ({weights}). Use an intact copy of the run.")
    return doc
