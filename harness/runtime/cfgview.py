"""`ctx.cfg` as the training code sees it: every value as configured, but printed with its secrets redacted."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from harness.secrets import SCRUBBED, is_secret, secret_copies


def _shown(node: Any) -> str:
    """The node as OmegaConf prints it (a dict's or list's repr), secrets (harness/secrets.py) as <redacted>."""
    try:
        plain = OmegaConf.to_container(node, resolve=True)
    except Exception:  # an interpolation that does not resolve: printing must not fail, show it unresolved
        plain = OmegaConf.to_container(node, resolve=False)
    base = node._get_full_key(None) or ""
    root = node._get_root()
    try:  # copies of a secret held elsewhere in the config (an interpolation of it) are hidden too
        copies = secret_copies(OmegaConf.to_container(root, resolve=True))
    except Exception:
        copies = set()

    def walk(path: str, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: walk(f"{path}.{k}" if path else str(k), v) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(f"{path}.{i}" if path else str(i), v) for i, v in enumerate(value)]
        return SCRUBBED if is_secret(path, value) or (isinstance(value, str) and value in copies) else value

    return repr(walk(str(base), plain))


class DictView(DictConfig):
    """A DictConfig that prints redacted; attribute and item access return the real values. A deep copy is a view
    too (a config the code builds from it, OmegaConf.merge, to_container, is the code's own)."""

    def __repr__(self) -> str:
        return _shown(self)

    __str__ = __repr__

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return redacted_view(super().__deepcopy__(memo))


class ListView(ListConfig):
    __doc__ = DictView.__doc__

    def __repr__(self) -> str:
        return _shown(self)

    __str__ = __repr__

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return redacted_view(super().__deepcopy__(memo))


def redacted_view(cfg: Any) -> Any:
    """`cfg` (and every config node inside it) made to print redacted, in place; returns it.

    The class of each node is swapped rather than the config wrapped, so that `isinstance(cfg, DictConfig)`,
    OmegaConf's functions and attribute access work as before (OmegaConf's own __setattr__ would refuse it)."""

    def walk(node: Any) -> None:
        children: Any
        if isinstance(node, DictConfig):
            object.__setattr__(node, "__class__", DictView)
            children = node._content.values() if isinstance(node._content, dict) else ()
        elif isinstance(node, ListConfig):
            object.__setattr__(node, "__class__", ListView)
            children = node._content if isinstance(node._content, list) else ()
        else:
            return
        for child in children:
            walk(child)

    walk(cfg)
    return cfg
