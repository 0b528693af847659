"""Secrets kept out of the record: which names and values look like credentials, their redaction, their return."""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping
from typing import Any

from harness.errors import HarnessError

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
# Values that are credentials whatever their key: the well-known token formats, conservatively.
_VALUE_RES = tuple(re.compile(p) for p in (
    r"sk-[A-Za-z0-9_-]{20,}",  # OpenAI, Anthropic (sk-ant-...)
    r"(ghp|gho|ghu|ghs|ghr)_[A-Za-z0-9]{30,}", r"github_pat_[A-Za-z0-9_]{30,}",
    r"glpat-[A-Za-z0-9_-]{20,}", r"hf_[A-Za-z0-9]{30,}",
    r"(AKIA|ASIA)[0-9A-Z]{16}", r"xox[abposr]-[A-Za-z0-9-]{10,}",
))
_TOKENISH = re.compile(r"[A-Za-z0-9+/=_-]{32,}")
PLACEHOLDER = re.compile(r"<redacted sha256:([0-9a-f]{16})>")


def env_name_is_secret(name: str) -> bool:
    upper = name.upper()
    return any(s in upper for s in _ENV_SUBSTRINGS) or any(w in _ENV_WORDS for w in upper.split("_"))


def key_is_secret(dotted: str) -> bool:
    """`train.api_key`, `hf_token`, `db.password`: the last part of the dotted key names a credential."""
    last = dotted.rsplit(".", 1)[-1].lower().replace("-", "_")
    return any(w in _KEY_WORDS for w in last.split("_")) or any(p in last for p in _KEY_PAIRS)


def value_is_secret(value: Any) -> bool:
    """A known token format, or a long high-entropy string with upper, lower and digits (not a hex digest)."""
    if not isinstance(value, str):
        return False
    if any(r.fullmatch(value) for r in _VALUE_RES):
        return True
    if not _TOKENISH.fullmatch(value) or not (re.search(r"[a-z]", value) and re.search(r"[A-Z]", value)
                                             and re.search(r"[0-9]", value)):
        return False
    counts = {c: value.count(c) for c in set(value)}
    entropy = -sum(n / len(value) * math.log2(n / len(value)) for n in counts.values())
    return entropy >= 4.5


def placeholder(value: Any) -> str:
    """What the record holds instead of a secret: a short hash, so that a config delta still sees a change."""
    return f"<redacted sha256:{hashlib.sha256(str(value).encode()).hexdigest()[:16]}>"


def _secret(key: str, value: Any) -> bool:
    if value is None or isinstance(value, bool) or value == "" or (isinstance(value, str) and PLACEHOLDER.fullmatch(value)):
        return False
    return key_is_secret(key) or value_is_secret(value)


def redact(container: Mapping[str, Any], prefix: str = "") -> tuple[dict[str, Any], list[str]]:
    """The resolved config (plain dict) with every secret replaced by its placeholder, and the dotted keys replaced."""
    keys: list[str] = []

    def walk(path: str, node: Any) -> Any:
        if isinstance(node, Mapping):
            return {k: walk(f"{path}.{k}" if path else str(k), v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(f"{path}.{i}", v) for i, v in enumerate(node)]
        if _secret(path, node):
            keys.append(path)
            return placeholder(node)
        return node

    return walk(prefix, container), keys


def redact_override(item: str) -> str:
    """`KEY=VALUE` as a record may show it (harness.replay.changes): a secret's value replaced by its placeholder."""
    key, sep, value = item.partition("=")
    return f"{key}={placeholder(value)}" if sep and _secret(key.lstrip("+~"), value) else item


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
    return (f"{shown} look{'s' if len(keys) == 1 else ''} like a secret: recorded as <redacted sha256:...> in params "
            "and config.yaml (the ranks get the real value); a replay needs it again, as KEY=VALUE or from "
            "the environment variable it was read from.")


def restore(
    container: dict[str, Any], overrides: list[str], sources: Mapping[str, str], environ: Mapping[str, str],
    run_id: str,
) -> tuple[dict[str, Any], list[str]]:
    """Put the real values back into a recorded config; returns it and the overrides left (those not secrets).

    A redacted key's value comes from a `KEY=VALUE` override, else from the environment variable the
    run read it from (`sources`: key -> variable, the tag harness.config.redacted). It must hash as recorded.
    """
    keys = redacted_keys(container)
    if not keys:
        return container, overrides
    given: dict[str, str] = {}
    rest = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if sep and key.lstrip("+~") in keys:
            given[key.lstrip("+~")] = value
        else:
            rest.append(item)
    for key in keys:
        node, parts = container, key.split(".")
        for part in parts[:-1]:
            node = node[int(part)] if isinstance(node, list) else node[part]
        last = int(parts[-1]) if isinstance(node, list) else parts[-1]
        recorded = node[last]
        var = sources.get(key)
        if key in given:
            value, origin = _typed(given[key]), f"{key}=..."
        elif var and var in environ:
            value, origin = environ[var], f"${var}"
        else:
            where = f"set ${var} as when it ran, or pass" if var else "pass it again:"
            raise HarnessError(
                f"{key} of run {run_id} is a secret the record does not hold ({recorded}); {where} "
                f"harness replay {run_id} {key}=VALUE."
            )
        if placeholder(value) != recorded:
            raise HarnessError(
                f"{origin} does not hash as run {run_id} recorded {key} ({placeholder(value)} instead of {recorded}). "
                f"Pass the value the run used: {key}=VALUE."
            )
        node[last] = value
    return container, rest


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
