"""Named choices (models, margins, optimizers, precisions, remat policies, data sources): one lookup, one error."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def lookup(table: Mapping[str, Any], name: str, what: str) -> Any:
    """``table[name]``; an unknown name raises ``ValueError`` listing the valid ones."""
    if name not in table:
        raise ValueError(f"unknown {what} {name!r}; choose one of {sorted(table)}")
    return table[name]
