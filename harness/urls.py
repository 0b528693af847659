"""URLs made safe to store and print: credentials never leave the machine in a tag or a message."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit


def strip_credentials(url: str) -> str:
    """https://user:token@host/x -> https://host/x; scp-style git@host:x is left as is."""
    parts = urlsplit(url)
    if parts.scheme and "@" in parts.netloc:
        host = parts.netloc.rsplit("@", 1)[1]
        return urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment))
    return url
