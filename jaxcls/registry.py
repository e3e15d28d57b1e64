"""Named choices (models, margins, optimizers, precisions, remat policies, data sources): one lookup, one error; and
the forms of a computation, one chosen per platform while tracing unless a ``with`` block forces one."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

from jax import lax


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

    def pick(self, forms: Mapping[str, Callable], by_platform: Mapping[str, str]) -> Callable:
        """What to call: ``forms[name]`` for the form forced, else for ``by_platform[p]`` on each platform ``p`` a
        program is lowered for (``by_platform["default"]`` on the others), staged with ``lax.platform_dependent``: a
        compile-only GPU on a CPU machine, or each platform of a multi-platform ``jax.export``, gets its own. (Called
        where the computation is, so that the backward's ops name that line, not this one.)"""
        if (name := self.current()) is not None:
            return forms[name]
        if len(names := set(by_platform.values())) == 1:  # one form everywhere: nothing to stage
            return forms[names.pop()]
        return partial(lax.platform_dependent, **{platform: forms[name] for platform, name in by_platform.items()})
