"""Named choices (models, margins, optimizers, precisions, remat policies, data sources): one lookup, one error; and
the forms of a computation, one chosen per platform while tracing unless a ``with`` block forces one."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Mapping
from typing import Any


def lookup(table: Mapping[str, Any], name: str, what: str) -> Any:
    """``table[name]``; an unknown name raises ``ValueError`` listing the valid ones."""
    if name not in table:
        raise ValueError(f"unknown {what} {name!r}; choose one of {sorted(table)}")
    return table[name]


class Forms:
    """The forms ``names`` of one computation (``what`` names it in errors).

    ``with forms.forced(name):`` makes ``forms.current()`` return ``name`` inside the block (``None``: choose by
    platform, the default). It acts while a function is traced: a ``jit`` traced before (and cached) keeps the form
    it was traced with.
    """

    def __init__(self, what: str, names: tuple[str, ...]):
        self.what, self.names = what, names
        self._forced: contextvars.ContextVar[str | None] = contextvars.ContextVar(what, default=None)

    @contextlib.contextmanager
    def forced(self, name: str | None):
        if name is not None and name not in self.names:
            raise ValueError(f"unknown {self.what} {name!r}: expected one of {', '.join(self.names)}")
        token = self._forced.set(name)
        try:
            yield
        finally:
            self._forced.reset(token)

    def current(self) -> str | None:
        return self._forced.get()
