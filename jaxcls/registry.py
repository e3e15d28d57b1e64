"""Named choices (models, margins, optimizers, precisions, remat policies, data sources): one lookup, one error; and
the forms of a computation, one chosen per platform while tracing unless a ``with`` block forces one."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

from jax import lax


# The platform a function being traced will be lowered for, where its caller knows it (``lowered_for``): a form is then
# chosen while tracing, and the others are never traced. Unknown (None), the choice is staged with
# ``lax.platform_dependent``, whose every branch is traced and, under ``jax.vjp``, linearized (with BatchNorm's two
# backwards that was half the time of tracing a train step).
_LOWERED_FOR: contextvars.ContextVar[str | None] = contextvars.ContextVar("lowered for", default=None)


def platform_of(device) -> str:
    """The name ``lax.platform_dependent`` gives the platform of ``device``: cpu, cuda, rocm, tpu."""
    if device.platform != "gpu":
        return device.platform
    return "rocm" if "rocm" in device.client.platform_version.lower() else "cuda"


@contextlib.contextmanager
def lowered_for(mesh):
    """Within the block, functions traced are lowered for the platform of ``mesh``'s devices (a ``Mesh``; the program
    is placed on them), so each ``Forms.pick`` takes that platform's form. Not for a multi-platform ``jax.export``."""
    token = _LOWERED_FOR.set(platform_of(mesh.devices.flat[0]))
    try:
        yield
    finally:
        _LOWERED_FOR.reset(token)


def platform_dependent(*args, **per_platform: Callable):
    """``lax.platform_dependent(*args, **per_platform)``: in ``lowered_for``'s block the branch of its platform (or
    ``default``), called while tracing; elsewhere staged, every branch traced."""
    if (platform := _LOWERED_FOR.get()) is None:
        return lax.platform_dependent(*args, **per_platform)
    if (branch := per_platform.get(platform, per_platform.get("default"))) is None:
        raise ValueError(f"no branch for platform {platform!r} and no default: {sorted(per_platform)}")
    return branch(*args)


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
        program is lowered for (``by_platform["default"]`` on the others): the platform of ``lowered_for``'s block,
        else staged with ``lax.platform_dependent``, so that a compile-only GPU on a CPU machine, or each platform of
        a multi-platform ``jax.export``, gets its own. (Called where the computation is, so that the backward's ops
        name that line, not this one.)"""
        if (name := self.current()) is not None:
            return forms[name]
        if len(names := set(by_platform.values())) == 1:  # one form everywhere: nothing to stage
            return forms[names.pop()]
        return partial(platform_dependent, **{platform: forms[name] for platform, name in by_platform.items()})
