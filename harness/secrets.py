"""What looks like a credential: names, values, token shapes, URL passwords; and text with them scrubbed out.

One set of rules for everything harness stores or prints: config values (record/redaction.py), the variables
it records (harness.var.*), the lines of an uncommitted patch, and every message carrying outside text.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Variable names (harness.var.*): any of these substrings, or one of the `_`-separated words below
# (TORCH_HUB_PAT, but not PATH), marks a credential.
_ENV_SUBSTRINGS = ("TOKEN", "SECRET", "KEY", "PASSWORD", "PASSWD", "PASSPHRASE", "CREDENTIAL", "AUTH", "PRIVATE")
_ENV_WORDS = frozenset({"PAT", "PASS"})
# Config keys are matched by whole words only: ML configs are full of `max_tokens`, `key_dim`, `tokenizer`.
_KEY_WORDS = frozenset({
    "token", "secret", "password", "passwd", "passphrase", "pat", "credential", "credentials", "apikey", "pwd",
})
_KEY_PAIRS = ("api_key", "private_key", "access_key", "secret_key", "auth_key", "auth_token", "access_token",
              "client_secret", "signing_key", "encryption_key")

# The well-known token formats, conservatively (each provider's documented prefix and a length no prose reaches).
TOKEN_SHAPES: tuple[tuple[str, str], ...] = (
    ("GitHub token", r"gh[pousr]_[A-Za-z0-9]{30,}"),
    ("GitHub token", r"github_pat_[A-Za-z0-9_]{30,}"),
    ("GitLab token", r"glpat-[A-Za-z0-9_-]{20,}"),
    ("Hugging Face token", r"hf_[A-Za-z0-9]{30,}"),
    ("OpenAI/Anthropic key", r"sk-(?=[A-Za-z0-9_-]*[0-9])[A-Za-z0-9_-]{32,}"),  # not a long `sk-learn-...` name
    ("Stripe key", r"(?:sk|rk)_(?:live|test)_[A-Za-z0-9]{16,}"),
    ("AWS access key id", r"(?:AKIA|ASIA)[0-9A-Z]{16}"),
    ("Slack token", r"xox[abposre]-[A-Za-z0-9-]{10,}"),
    ("Google API key", r"AIza[0-9A-Za-z_-]{35}"),
    ("npm token", r"npm_[A-Za-z0-9]{36}"),
    ("PyPI token", r"pypi-AgE[A-Za-z0-9_-]{50,}"),
    ("JSON web token", r"eyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"),
    ("private key", r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----"),
)
_SHAPES = tuple((name, re.compile(rf"(?<![A-Za-z0-9_]){pattern}")) for name, pattern in TOKEN_SHAPES)
# The keys providers print in their own documentation, which test fixtures copy: they open no account anywhere.
DOCUMENTED_EXAMPLES = frozenset({
    "AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",  # AWS's IAM and CLI guides
    "AKIAI44QH8DHBEXAMPLE", "je7MtGbClwBF/2Zp9Utk/h3yCo8nvbEXAMPLEKEY",  # AWS's second example pair
})
# A line that says of itself it holds no secret (a fixture, a test's fake token): `# harness: not-a-secret` as a
# trailing comment, in any comment syntax (#, //, --, ;, /*).
NOT_A_SECRET = "harness: not-a-secret"
_MARKED = re.compile(r"(?:#|//|--|;|/\*)\s*harness:\s*not-a-secret\b")
# scheme://user:password@host: the password is what must go (a user alone, git@host, is no secret). A password
# that is a variable reference (${DB_PASS}, $PASS, %(pw)s, <password>) is not a literal one.
URL_PASSWORD = re.compile(r"(?P<head>(?<![A-Za-z0-9+.-])[A-Za-z][A-Za-z0-9+.-]*://[^\s/@:]*:)(?P<pw>[^\s/@]+)(?P<at>@)")
_NOT_LITERAL = re.compile(r"^(?:\$|%|<|\{|\*+$)")
_TOKENISH = re.compile(r"[A-Za-z0-9+/=_-]{32,}")
SCRUBBED = "<redacted>"


def env_name_is_secret(name: str) -> bool:
    upper = name.upper()
    return any(s in upper for s in _ENV_SUBSTRINGS) or any(w in _ENV_WORDS for w in upper.split("_"))


def key_is_secret(dotted: str) -> bool:
    """`train.api_key`, `hf_token`, `db.password`, `token_list.0`: the last named part of the dotted key (a list's
    elements share their list's key) names a credential."""
    parts = [p for p in dotted.split(".") if not p.isdigit()]
    last = parts[-1].lower().replace("-", "_") if parts else ""
    return any(w in _KEY_WORDS for w in last.split("_")) or any(p in last for p in _KEY_PAIRS)


def token_shape(text: str) -> str | None:
    """The name of the first known token format found anywhere in `text`, None when none is."""
    return next((name for name, rx in _SHAPES if rx.search(text)), None)


def url_password(text: str) -> bool:
    """`text` holds a URL with a literal password (scheme://user:pw@host)."""
    return any(not _NOT_LITERAL.match(m["pw"]) for m in URL_PASSWORD.finditer(text))


def value_is_secret(value: Any) -> bool:
    """A known token format, a URL with a password, or a long high-entropy string with upper, lower and digits
    (not a hex digest)."""
    if not isinstance(value, str):
        return False
    if token_shape(value) or url_password(value):
        return True
    if not _TOKENISH.fullmatch(value) or not (re.search(r"[a-z]", value) and re.search(r"[A-Z]", value)
                                             and re.search(r"[0-9]", value)):
        return False
    counts = {c: value.count(c) for c in set(value)}
    entropy = -sum(n / len(value) * math.log2(n / len(value)) for n in counts.values())
    return entropy >= 4.5


def is_secret(key: str, value: Any) -> bool:
    """A config value to keep out of the record and the logs: its key names a credential, or the value looks like
    one (None, booleans and "" are settings whatever their key)."""
    if value is None or isinstance(value, bool) or value == "":
        return False
    return key_is_secret(key) or value_is_secret(value)


def secret_copies(plain: Any, prefix: str = "") -> set[str]:
    """The secrets (is_secret) among the string values of a plain config (dicts and lists). The same string under
    any other key is a copy of one (`url: ${train.api_key}` resolved) and must be hidden as well."""
    found: set[str] = set()

    def walk(path: str, node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{path}.{k}" if path else str(k), v)
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(f"{path}.{i}" if path else str(i), v)
        elif isinstance(node, str) and len(node) >= 4 and is_secret(path, node):
            found.add(node)

    walk(prefix, plain)
    return found


def scrub(text: str) -> str:
    """`text` as it may be stored or printed: URL passwords and known token formats replaced by <redacted>."""
    text = URL_PASSWORD.sub(lambda m: m["head"] + (m["pw"] if _NOT_LITERAL.match(m["pw"]) else SCRUBBED) + m["at"],
                            text)
    for _, rx in _SHAPES:
        text = rx.sub(SCRUBBED, text)
    return text


# --- secrets in source lines (the uncommitted patch) ----------------------------------------------------
# NAME = "literal", NAME: 'literal', "name": "literal", NAME=literal (env, shell, YAML, INI): a name that ends in a
# credential word, given a literal value. `password = os.environ[...]`, `token = None`, `secret = cfg.secret`
# are expressions, not literals: in code only a quoted string counts.
_ASSIGN = re.compile(
    r"""(?<![A-Za-z0-9_.-])(?P<name>[A-Za-z_][A-Za-z0-9_.-]*)["']?\s*(?::\s*[A-Za-z_][\w\[\], .|]*)?(?P<op>:=|=|:)\s*"""
    r"""(?:(?P<q>["'])(?P<quoted>[^"'\n]*)(?P=q)|(?P<bare>[^\s"'#;,]+))"""
)
# Files whose bare words are expressions (Python, and the like); everywhere else (.env, shell, YAML, INI, TOML,
# untyped files such as config.local) a bare value is a literal.
_CODE_SUFFIXES = frozenset({
    ".py", ".pyi", ".pyx", ".ipynb", ".js", ".mjs", ".ts", ".tsx", ".go", ".java", ".kt", ".scala", ".rb", ".rs",
    ".c", ".h", ".cc", ".cpp", ".hpp", ".cu", ".cuh", ".jl", ".r", ".lua", ".swift", ".cs", ".php",
})
_NON_SECRET_WORDS = frozenset({"none", "null", "nil", "true", "false", "~", "undefined", "required", "optional"})


def _name_is_secret(name: str) -> bool:
    """A name that ends in a credential word (DB_PASSWORD, hf_token, api_key): `token_type`, `max_tokens`,
    `password_file` do not."""
    last = name.rsplit(".", 1)[-1].lower().replace("-", "_")
    return last.split("_")[-1] in _KEY_WORDS or last.endswith(_KEY_PAIRS)


def _literal(value: str) -> bool:
    v = value.strip()
    if not v or v.lower() in _NON_SECRET_WORDS or _NOT_LITERAL.match(v) or len(set(v)) == 1:
        return False
    return not re.fullmatch(r"[-+]?[0-9_.]+", v)  # a number is a setting, not a credential


@dataclass(frozen=True)
class Finding:
    """A secret in a line: what kind of secret, and the text to cut from the line (the value, at `start`)."""

    kind: str
    value: str
    start: int


def in_line(line: str, path: str) -> Finding | None:
    """The first secret in one line of the file at `path` (its suffix says whether bare words are literals); a
    documented example key is none, and a line marked `# harness: not-a-secret` holds none."""
    if _MARKED.search(line):
        return None
    for name, rx in _SHAPES:
        for match in rx.finditer(line):
            if match[0] not in DOCUMENTED_EXAMPLES:
                return Finding(name, match[0], match.start())
    for match in URL_PASSWORD.finditer(line):
        if not _NOT_LITERAL.match(match["pw"]):
            return Finding("password in a URL", match["pw"], match.start("pw"))
    code = os.path.splitext(path)[1].lower() in _CODE_SUFFIXES
    for match in _ASSIGN.finditer(line):
        if not _name_is_secret(match["name"]):
            continue
        if match["q"] is not None and _literal(match["quoted"]) and match["quoted"] not in DOCUMENTED_EXAMPLES:
            return Finding(f"literal {match['name']}", match["quoted"], match.start("quoted"))
        if match["bare"] is not None and not code and match["op"] != ":=" and _literal(match["bare"]) \
                and match["bare"] not in DOCUMENTED_EXAMPLES:
            return Finding(f"literal {match['name']}", match["bare"], match.start("bare"))
    return None


# --- secrets in a whole file, in whatever encoding it is in ------------------------------------------------
# git calls a file binary when it holds a NUL: UTF-16 and UTF-32 text (what PowerShell and Windows editors write),
# UTF-8 with NULs, and real binaries. Each is read as what it is: text decoded by its byte-order mark, UTF-8 as
# UTF-8, anything else for token shapes alone (a binary has no lines, and no `name = value`).
_BOMS = ((b"\xff\xfe\x00\x00", "utf-32-le"), (b"\x00\x00\xfe\xff", "utf-32-be"), (b"\xef\xbb\xbf", "utf-8-sig"),
         (b"\xff\xfe", "utf-16-le"), (b"\xfe\xff", "utf-16-be"))


def file_text(data: bytes) -> str | None:
    """`data` as text when it is text (a byte-order mark's encoding, else UTF-8; NULs read as spaces), else None."""
    for bom, encoding in _BOMS:
        if data.startswith(bom):
            try:
                return data[len(bom):].decode(encoding.replace("-sig", "")).replace("\0", " ")
            except UnicodeDecodeError:
                return None
    try:
        return data.decode("utf-8").replace("\0", " ")
    except UnicodeDecodeError:
        return None


def in_file(data: bytes, path: str, known: dict[str, str] | None = None) -> list[tuple[int, Finding]]:
    """(line number, finding) of the secrets in a file's bytes: a text file line by line as in_line reads it, a
    binary (line 0) for token shapes and the `known` values (kind -> value: what harness itself holds secret) in
    its bytes as they are and with NULs left out (the ASCII inside UTF-16 or UTF-32 without a byte-order mark)."""
    text = file_text(data)
    found: list[tuple[int, Finding]] = []
    if text is not None:
        for number, line in enumerate(text.split("\n"), 1):  # lines as git counts them
            hit = in_line(line, path)
            if hit is not None:
                found.append((number, hit))
        found += [(text.count("\n", 0, hit.start) + 1, hit) for hit in known_in(text, known)]
    stripped = data.replace(b"\0", b"").decode("latin-1")
    bom = any(data.startswith(mark) for mark, _ in _BOMS)
    views = [data.decode("latin-1"), stripped] if text is None else [stripped] if b"\0" in data and not bom else []
    for view in views:
        found += [(0, hit) for hit in known_in(view, known)]  # a key's copy is one, marked or not
        for line in view.split("\n"):
            if _MARKED.search(line):
                continue
            for name, rx in _SHAPES:
                found += [(0, Finding(name, m[0], m.start())) for m in rx.finditer(line) if m[0] not in DOCUMENTED_EXAMPLES]
    seen: dict[tuple[str, str], tuple[int, Finding]] = {}
    for number, hit in found:  # one finding per secret: the first line it is on
        seen.setdefault((hit.kind, hit.value), (number, hit))
    return list(seen.values())


def known_in(text: str, known: dict[str, str] | None) -> list[Finding]:
    """The `known` secret values (kind -> value) that `text` holds."""
    return [Finding(kind, value, text.index(value)) for kind, value in (known or {}).items() if value and value in text]


# --- the secret values harness knows of a run, scrubbed from what it stores of the ranks' output --------------
def known_values(config: Any, environ: Mapping[str, str]) -> set[str]:
    """Every secret value harness knows of a run: the config's secrets and their copies (secret_copies), and the
    values of the variables whose names mark a credential. A value that names an existing file is where a secret
    lies (GOOGLE_APPLICATION_CREDENTIALS), not one; a short word or a number is too common to cut from text."""
    values = secret_copies(config)
    for name, value in environ.items():
        if env_name_is_secret(name) and len(value) >= 6 and not value.isdigit() and value.lower() not in _NON_SECRET_WORDS \
                and not (os.path.isabs(value) and os.path.exists(value)):
            values.add(value)
    return values


def scrub_known(text: str, values: set[str]) -> str:
    """`text` with each of `values` (longest first: a secret may hold a shorter one) and everything scrub() finds
    replaced by <redacted>."""
    for value in sorted(values, key=len, reverse=True):
        text = text.replace(value, SCRUBBED)
    return scrub(text)
