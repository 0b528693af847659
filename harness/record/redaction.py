"""Secrets kept out of the record: config values replaced by keyed digests, secrets cut from the code patch, and
the values put back for a replay. What looks like a credential is decided in harness/secrets.py."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import os
import re
import secrets as random
import zlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.errors import HarnessError, SecretRefused
from harness.secrets import in_file, in_line, is_secret, known_in, scrub, secret_copies, token_shape
from harness.store.uris import KEY_DIR_ENV, key_dir, key_file

# What the record holds instead of a secret: a keyed digest (HMAC-SHA256 under the store's own random key,
# key_file) so that two runs of one store with the same secret compare equal, but a guess ("hunter2") cannot
# be checked against it by anyone who lacks the key. `sha256:` is the unkeyed form of records made before.
PLACEHOLDER = re.compile(r"<redacted (sha256|hmac-([0-9a-f]{8})):([0-9a-f]{16})>")


class Key:
    """A store's redaction key: 32 random bytes, and the short id its placeholders carry."""

    def __init__(self, secret: bytes) -> None:
        self.secret = secret
        self.id = hashlib.sha256(b"harness redaction key id\0" + secret).hexdigest()[:8]

    def digest(self, value: Any) -> str:
        return hmac.new(self.secret, str(value).encode(), hashlib.sha256).hexdigest()[:16]


def store_key(uri: str) -> Key:
    """The redaction key of the store at `uri`, created on first use (never in the store itself: see key_file)."""
    path = key_file(uri)
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        return _read_key(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            with os.fdopen(fd, "w") as fh:
                fh.write(random.token_hex(32) + "\n")
            with contextlib.suppress(FileExistsError):  # a concurrent first run made it: the first one wins
                os.link(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    except OSError as err:
        raise HarnessError(
            f"cannot make the store's redaction key '{path}' ({err.strerror or err}); the record needs it to hide "
            f"the config's secrets. Make its folder writable, or set {KEY_DIR_ENV} to a writable folder (remote stores)."
        ) from None
    return _read_key(path)


def _read_key(path: Path) -> Key:
    try:
        text = path.read_text().strip()
    except (FileNotFoundError, NotADirectoryError):
        raise
    except OSError as err:
        raise HarnessError(f"cannot read the store's redaction key '{path}' ({err.strerror or err}). "
                           "Give this user read access to it (it is the store's, mode 0600).") from None
    if not re.fullmatch(r"[0-9a-f]{64}", text):
        raise HarnessError(
            f"'{path}' is not a harness redaction key (64 hex digits). Restore it from a backup, or remove it "
            "(the runs recorded with it can then no longer check a secret given to their replay)."
        )
    return Key(bytes.fromhex(text))


KEY_COPY = "a copy of a store's redaction key"


def known_keys(uri: str) -> dict[str, str]:
    """The redaction keys a code record must never hold, as kind -> hex: the key of the store at `uri` (never made
    here) and each key under the key folder ($HARNESS_KEY_DIR), recognised by their content whatever a copy's name."""
    found: dict[str, str] = {}
    folder = key_dir()
    for path in [key_file(uri), *sorted(folder.glob("*.key") if folder.is_dir() else ())]:
        with contextlib.suppress(OSError, HarnessError):
            found[f"{KEY_COPY} ({path.name})"] = _read_key(path).secret.hex()
    return found


def placeholder(value: Any, key: Key) -> str:
    """What the record holds instead of a secret: its keyed digest, so that a config delta still sees a change."""
    return f"<redacted hmac-{key.id}:{key.digest(value)}>"


def _matches(value: Any, recorded: str, key: Key) -> bool | None:
    """Whether `value` is the secret `recorded` stands for; None when this store's key cannot tell (a run
    imported from another store)."""
    match = PLACEHOLDER.fullmatch(recorded)
    if match is None:
        return None
    if match[1] == "sha256":
        return hashlib.sha256(str(value).encode()).hexdigest()[:16] == match[3]
    if match[2] != key.id:
        return None
    return hmac.compare_digest(key.digest(value), match[3])


def _secret(key: str, value: Any) -> bool:
    return not (isinstance(value, str) and PLACEHOLDER.fullmatch(value)) and is_secret(key, value)


def redact(container: Mapping[str, Any], key: Key | None, prefix: str = "") -> tuple[dict[str, Any], list[str]]:
    """The resolved config (plain dict) with every secret replaced by its placeholder, and the dotted keys replaced.
    With `key` None only the keys are wanted: the secrets are replaced by "<redacted>"."""
    keys: list[str] = []
    copies = secret_copies(dict(container), prefix)

    def walk(path: str, node: Any) -> Any:
        if isinstance(node, Mapping):
            return {k: walk(f"{path}.{k}" if path else str(k), v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(f"{path}.{i}", v) for i, v in enumerate(node)]
        if _secret(path, node) or (isinstance(node, str) and node in copies):
            keys.append(path)
            return placeholder(node, key) if key is not None else "<redacted>"
        return node

    return walk(prefix, container), keys


def redact_override(item: str, key: Key) -> str:
    """`KEY=VALUE` as a record may show it (harness.replay.changes): a secret's value replaced by its placeholder."""
    name, sep, value = item.partition("=")
    return f"{name}={placeholder(value, key)}" if sep and _secret(name.lstrip("+~"), value) else item


def redacted_keys(container: Mapping[str, Any]) -> list[str]:
    """Dotted keys of a recorded config that hold a placeholder."""
    found: list[str] = []

    def walk(path: str, node: Any) -> None:
        if isinstance(node, Mapping):
            for k, v in node.items():
                walk(f"{path}.{k}" if path else str(k), v)
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(f"{path}.{i}", v)
        elif isinstance(node, str) and PLACEHOLDER.fullmatch(node):
            found.append(path)

    walk("", container)
    return found


def warning(keys: list[str]) -> str:
    shown = ", ".join(keys)
    return (f"{shown} look{'s' if len(keys) == 1 else ''} like a secret: recorded as <redacted hmac-...> (a digest "
            "keyed by the store) in params and config.yaml (the ranks get the real value; print(ctx.cfg) shows it "
            "redacted); a replay needs it again, as KEY=VALUE or from the environment variable it was read from.")


def restore(
    container: dict[str, Any], overrides: list[str], sources: Mapping[str, str], environ: Mapping[str, str],
    run_id: str, key: Key, command: str = "replay",
) -> tuple[dict[str, Any], list[str]]:
    """Put the real values back into a recorded config; returns it and the overrides left (those not secrets).
    `command`: the harness command that re-executes the run (replay, calibrate), named in the refusal.

    A redacted key's value comes from a `KEY=VALUE` override, else from the environment variable the
    run read it from (`sources`: key -> variable, the tag harness.config.redacted). It must digest as recorded
    under this store's key; a run imported from another store (another key) cannot be checked here, and its value
    is used as given.
    """
    keys = redacted_keys(container)
    if not keys:
        return container, overrides
    given: dict[str, str] = {}
    rest = []
    for item in overrides:
        name, sep, value = item.partition("=")
        if sep and name.lstrip("+~") in keys:
            given[name.lstrip("+~")] = value
        else:
            rest.append(item)
    found: dict[str, Any] = {}  # placeholder -> the value given for it: a copy of a secret needs no second telling
    for name in keys:
        got = _given_value(container, name, given, sources, environ, run_id, key)
        if got is not None:
            node, last = _at(container, name)
            found[node[last]] = got[0]
    for name in keys:
        node, last = _at(container, name)
        recorded = node[last]
        if recorded not in found:  # neither given nor a copy of one given: the refusal, by name
            _given_value(container, name, given, sources, environ, run_id, key, required=True, command=command)
        node[last] = found[recorded]
    return container, rest


def _at(container: Any, name: str) -> tuple[Any, Any]:
    """(the list or mapping holding the dotted key `name`, its index or key there)."""
    node, parts = container, name.split(".")
    for part in parts[:-1]:
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node, int(parts[-1]) if isinstance(node, list) else parts[-1]


def _given_value(
    container: Any, name: str, given: Mapping[str, str], sources: Mapping[str, str], environ: Mapping[str, str],
    run_id: str, key: Key, required: bool = False, command: str = "replay",
) -> tuple[Any] | None:
    """(the value given for the redacted key `name`,) from KEY=VALUE or its variable, checked against the record;
    None when none is given (with `required`, the refusal instead)."""
    node, last = _at(container, name)
    recorded = node[last]
    var = sources.get(name)
    if name in given:
        value, origin = _typed(given[name]), f"{name}=..."
    elif var and var in environ:
        value, origin = environ[var], f"${var}"
    elif required:
        where = f"set ${var} as when it ran, or pass" if var else "pass it again:"
        raise SecretRefused(
            f"{name} of run {run_id} is a secret the record does not hold ({recorded}); {where} "
            f"harness {command} {run_id} {name}=VALUE."
        )
    else:
        return None
    if _matches(value, recorded, key) is False:
        raise SecretRefused(
            f"{origin} is not the value run {run_id} recorded for {name} (its digest differs from {recorded}). "
            f"Pass the value the run used: {name}=VALUE."
        )
    return (value,)


def _typed(text: str) -> Any:
    """An override's value as OmegaConf reads it (`1234` an int), so that it hashes like the resolved original."""
    from omegaconf import OmegaConf

    container = OmegaConf.to_container(OmegaConf.from_dotlist([f"v={text}"]))
    assert isinstance(container, dict)  # from_dotlist makes a mapping
    return container["v"]


def env_sources(raw: Mapping[Any, Any], keys: list[str]) -> dict[str, str]:
    """key -> NAME for the redacted keys whose unresolved value was exactly `${oc.env:NAME}` (or with a default)."""
    out = {}
    for key in keys:
        node: Any = raw
        try:
            for part in key.split("."):
                node = node[int(part)] if isinstance(node, list) else node[part]
        except (KeyError, IndexError, ValueError, TypeError):
            continue
        match = re.fullmatch(r"\$\{oc\.env:([A-Za-z_][A-Za-z0-9_]*)(,[^}]*)?\}", str(node))
        if match:
            out[key] = match[1]
    return out


def format_sources(keys: list[str], sources: Mapping[str, str]) -> str:
    """The tag harness.config.redacted: `train.api_key, train.aws=$AWS_SECRET_ACCESS_KEY`."""
    return ", ".join(f"{k}=${sources[k]}" if k in sources else k for k in keys)


def parse_sources(tag: str | None) -> dict[str, str]:
    out = {}
    for item in (tag or "").split(", "):
        key, sep, var = item.partition("=$")
        if sep:
            out[key] = var
    return out


# --- secrets in the uncommitted patch ----------------------------------------------------------------------


@dataclass(frozen=True)
class PatchSecret:
    """A secret in the code patch: the file, its line number in the new file (0: in a binary file's bytes, or in
    the file's name), what it is; `cuttable` False when --allow-secret-in-diff cannot cut it out (a file name, a
    binary file, a copy of a key harness itself keeps)."""

    path: str
    line: int
    kind: str
    value: str
    cuttable: bool = True

    def where(self) -> str:
        return f"'{self.path}'{f' line {self.line}' if self.line else ''} ({self.kind})"


def _added_lines(lines: list[bytes]) -> Iterator[tuple[int, str, int]]:
    """(index in `lines`, file path, line number in the new file) of each line a patch adds; binary hunks hold no
    lines to read (binary_files reads them)."""
    path, line_no, header, binary = "", 0, False, False
    for index, raw in enumerate(lines):
        if raw.startswith(b"diff --git "):
            path, line_no, header, binary = "", 0, True, False
        elif binary:
            continue
        elif raw.startswith(b"GIT binary patch"):
            binary = True
        elif header and raw.startswith(b"+++ "):
            name = _unquote(raw[4:])
            path = name[2:] if name != "/dev/null" else ""
        elif raw.startswith(b"@@ "):
            header = False
            match = re.match(rb"@@ -\d+(?:,\d+)? \+(\d+)", raw)
            line_no = int(match[1]) if match else 0
        elif header or not path:
            continue
        elif raw.startswith(b"+"):
            yield index, path, line_no
            line_no += 1
        elif raw.startswith(b" "):
            line_no += 1


def _header_path(raw: bytes) -> str:
    """The new path of a `diff --git a/P b/P` line (a patch without renames names each file twice; a binary hunk
    has no ---/+++ lines to name it)."""
    rest = raw[len(b"diff --git "):]
    if rest.startswith(b'"'):  # C-quoted: the second name follows the first's closing quote
        match = re.match(rb'"(?:[^"\\]|\\.)*" (.*)', rest)
        return _unquote(match[1])[2:] if match else ""
    return _unquote(rest[(len(rest) + 1) // 2:])[2:]


def _paths(lines: list[bytes]) -> Iterator[str]:
    """Every path a patch names (the old and new name of each file)."""
    for raw in lines:
        if raw.startswith(b"diff --git "):
            yield _header_path(raw)
        elif raw.startswith((b"--- ", b"+++ ")) and _unquote(raw[4:]) != "/dev/null":
            yield _unquote(raw[4:])[2:]


def _binary_files(lines: list[bytes]) -> Iterator[tuple[str, bytes, bool]]:
    """(path, bytes, whole) of each binary hunk's new side: the whole file for a `literal` hunk, the bytes a `delta`
    hunk inserts into the old file (whole False: what it adds, without what it keeps)."""
    path = ""
    index = 0
    while index < len(lines):
        raw = lines[index]
        index += 1
        if raw.startswith(b"diff --git "):
            path = _header_path(raw)
        elif raw == b"GIT binary patch" and index < len(lines):
            kind, _, _ = lines[index].partition(b" ")
            index += 1
            data = bytearray()
            while index < len(lines) and lines[index]:
                data += _base85_line(lines[index])
                index += 1
            with contextlib.suppress(zlib.error, ValueError):
                raw_data = zlib.decompress(bytes(data))
                yield (path or "?", raw_data, True) if kind == b"literal" else (path or "?", _delta_inserts(raw_data), False)


def _base85_line(line: bytes) -> bytes:
    """One line of a git binary hunk: its length (A-Z 1-26, a-z 27-52 bytes), then base85 in groups of five."""
    first = chr(line[0])
    size = ord(first) - ord("A") + 1 if first.isupper() else ord(first) - ord("a") + 27
    return base64.b85decode(line[1:].rstrip(b"\r"))[:size]


def _delta_inserts(delta: bytes) -> bytes:
    """The literal bytes a git delta inserts (its copies come from the old file), one insert a line."""
    pos = 0
    for _ in range(2):  # the old and the new size, as varints
        while pos < len(delta) and delta[pos] & 0x80:
            pos += 1
        pos += 1
    out = []
    while pos < len(delta):
        op = delta[pos]
        pos += 1
        if op & 0x80:  # a copy: its offset and size bytes, one for each bit set
            pos += bin(op & 0x7F).count("1")
        elif op:
            out.append(delta[pos:pos + op])
            pos += op
    return b"\n".join(out)


def patch_secrets(patch: bytes, known: dict[str, str] | None = None) -> list[PatchSecret]:
    """The secrets the patch adds (tracked edits and untracked files alike), by the rules config values get
    (harness/secrets.py): on its added lines, in its binary hunks (UTF-16 text, binaries), in its file names; and
    the `known` values (kind -> value: a store's redaction key) wherever they lie."""
    lines = patch.split(b"\n")
    found = []
    for name in dict.fromkeys(_paths(lines)):
        hit = in_line(name, "")
        if hit is not None and (token_shape(hit.value) or hit.kind == "password in a URL"):
            found.append(PatchSecret(scrub(name), 0, f"{hit.kind} in the file name", hit.value, cuttable=False))
    for index, path, line_no in _added_lines(lines):
        text = lines[index][1:].decode(errors="surrogateescape")
        hit = in_line(text, path)
        if hit is not None:
            found.append(PatchSecret(path, line_no, hit.kind, hit.value))
        found += [PatchSecret(path, line_no, h.kind, h.value, cuttable=False) for h in known_in(text, known)]
    for path, data, whole in _binary_files(lines):
        what = "" if whole else ", in its binary change"
        for line_no, hit in in_file(data, path, known):
            found.append(PatchSecret(path, line_no if whole else 0, hit.kind + what, hit.value, cuttable=False))
    return found


_ESCAPES = {b"a": b"\a", b"b": b"\b", b"t": b"\t", b"n": b"\n", b"v": b"\v", b"f": b"\f", b"r": b"\r"}


def _unquote(name: bytes) -> str:
    """A path as git writes it in a patch header: C-quoted ("a/tab\\there") when it holds odd bytes."""
    if len(name) >= 2 and name[:1] == name[-1:] == b'"':
        name = re.sub(rb"\\([0-7]{3}|.)", lambda m: bytes([int(m[1], 8)]) if len(m[1]) == 3
                      else _ESCAPES.get(m[1], m[1]), name[1:-1])
    return name.decode(errors="replace")


def shipped_secrets(changes: Iterable[tuple[str, str, bytes]], known: dict[str, str] | None = None) -> list[str]:
    """Where the commits a code bundle ships (commit, message, patch: systems/gitbundle.shipped_changes) hold
    secrets, one `commit 1a2b3c4d5e6f 'path' line 3 (kind)` each: in what a commit adds, in its file names, in
    its message."""
    found = []
    for commit, message, patch in changes:
        for hit in patch_secrets(patch, known):
            found.append(f"commit {commit[:12]} {hit.where()}")
        for number, line in enumerate(message.splitlines(), 1):
            in_message = in_line(line, "") or next(iter(known_in(line, known)), None)
            if in_message is not None:
                found.append(f"commit {commit[:12]} message line {number} ({in_message.kind})")
    return list(dict.fromkeys(found))


def uncuttable_refusal(found: list[PatchSecret]) -> str:
    """The one line a patch is refused with when a secret in it cannot be cut out, --allow-secret-in-diff or not."""
    shown = ", ".join(f.where() for f in found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
    return (f"{shown} {'is a secret' if len(found) == 1 else 'are secrets'} in the uncommitted changes that cannot "
            "be cut from the stored patch (a file's name, a binary or UTF-16 file, a copy of a store's redaction "
            "key), not even with --allow-secret-in-diff. Rename the file, delete the copy, add it to .gitignore, "
            "or save a text file as UTF-8; a line that holds no secret can be marked `# harness: not-a-secret`.")


def patch_refusal(found: list[PatchSecret]) -> str:
    """The one line `harness run` and `harness check` refuse a patch holding secrets with."""
    shown = ", ".join(f.where() for f in found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
    return (f"{shown} {'holds a secret' if len(found) == 1 else 'hold secrets'} in the uncommitted changes, which "
            "a run stores with its code (git/uncommitted.patch). Read it from an environment variable instead "
            "(os.environ[...], ${oc.env:NAME} in the config), keep it in a file listed in .gitignore, commit it "
            "elsewhere if it is no secret, or pass --allow-secret-in-diff to store the patch with it redacted "
            "(the run is then tagged as having an inexact patch).")


PATCH_REDACTED = "<redacted>"


def redact_patch(patch: bytes) -> bytes:
    """The patch with each secret cut from the lines it adds (a fixed mark, no digest: the patch a replay applies
    is then not the code that ran, and the record says so). Only added lines change: the patch still applies."""
    lines = patch.split(b"\n")
    for index, path, _ in _added_lines(lines):
        text = lines[index][1:].decode(errors="surrogateescape")
        for _ in range(100):  # each pass cuts one secret; a line holds a few at most
            hit = in_line(text, path)
            if hit is None:
                break
            text = text[:hit.start] + PATCH_REDACTED + text[hit.start + len(hit.value):]
        lines[index] = b"+" + text.encode(errors="surrogateescape")
    return b"\n".join(lines)
