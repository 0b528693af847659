"""Which recorded config values differ between two runs, and whether each can change the result."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from harness import tags
from harness.config import flatten

# Keys that decide how a run is recorded, watched or judged, not what it computes.
_NO_EFFECT_KEYS: frozenset[str] = frozenset(
    {"flush_interval_s", "heartbeat_s", "timeout_s", "executor", "fingerprint_every", "checkpoint_every",
     "rendezvous_timeout_s"}
)
# slurm.*: which nodes and resources; the ranks' arithmetic is the same (world_size and backend decide it).
# data.*: where the data was declared to be; its bytes decide, and the data delta (compare.py) compares them.
_NO_EFFECT_PREFIXES: tuple[str, ...] = ("replay.", "record.", "slurm.", "data.")

# "auto" in a config is resolved at launch and recorded as a tag; a replay pins it to that value,
# so "auto" -> "cpu" is no change when the original did run on cpu.
_RESOLVED_BY: dict[str, str] = {"device": tags.DEVICE, "backend": tags.BACKEND}


@dataclass
class ConfigChange:
    """One dotted config key whose value differs (None: absent from that run's config)."""

    key: str
    a: str | None
    b: str | None
    affects_result: bool

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "a": self.a, "b": self.b, "affects_result": self.affects_result}


def affects_result(key: str) -> bool:
    return key not in _NO_EFFECT_KEYS and not key.startswith(_NO_EFFECT_PREFIXES)


def _effective(config: Mapping[str, Any], facts: Mapping[str, str]) -> dict[str, str]:
    flat = flatten(config)
    for key, tag in _RESOLVED_BY.items():
        if flat.get(key) == "auto" and tag in facts:
            flat[key] = facts[tag]
    return flat


def config_delta(
    config_a: Mapping[str, Any], config_b: Mapping[str, Any],
    facts_a: Mapping[str, str] | None = None, facts_b: Mapping[str, str] | None = None,
) -> list[ConfigChange]:
    """Every differing key, sorted; empty when either run recorded no config (nothing to hold against)."""
    if not config_a or not config_b:
        return []
    fa, fb = _effective(config_a, facts_a or {}), _effective(config_b, facts_b or {})
    return [
        ConfigChange(key, fa.get(key), fb.get(key), affects_result(key))
        for key in sorted(fa.keys() | fb.keys())
        if fa.get(key) != fb.get(key)
    ]
