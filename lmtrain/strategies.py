"""Strategy construction for ``conf/strategy/*.yaml``."""

from __future__ import annotations


def named(name: str) -> str:
    """A strategy Lightning knows by name (``auto``, ``single_device``, ``ddp``...), passed through."""
    return name
