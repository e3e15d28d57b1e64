"""What jaxcls's Pallas row kernels (``jaxcls.fc.rows_stats``, ``rows_update``) share: their forms and how one is
chosen, the index they read rows by, their Triton settings."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as pallas_triton

from jaxcls.registry import Forms

FORMS = ("xla", "pallas", "pallas_interpret")  # pallas_interpret: the kernel in Pallas' interpreter, any platform


def kernel_forms(what: str) -> Forms:
    return Forms(what, FORMS)


def run(forms: Forms, pallas, xla, *args):
    """``xla(*args)`` or ``pallas(*args, interpret=…)``: the form ``forms`` is forced to, else by platform (the
    kernel on CUDA GPUs, XLA's form elsewhere, staged with ``lax.platform_dependent``)."""
    form = forms.current()
    if form == "xla":
        return xla(*args)
    if form is not None:
        return pallas(*args, interpret=form == "pallas_interpret")
    return lax.platform_dependent(*args, cuda=partial(pallas, interpret=False), default=xla)


def block_index(index: jax.Array, block: int) -> jax.Array:
    """``index`` ``[T]`` padded to a multiple of ``block`` by repeating its last entry, as uint32 (never negative: no
    wrap-around arithmetic in the kernel)."""
    return jnp.pad(index, (0, -index.shape[0] % block), mode="edge").astype(jnp.uint32)


def compiler_params(interpret: bool):
    """Triton's settings (untuned: no GPU has timed them yet); none for the interpreter."""
    return None if interpret else pallas_triton.CompilerParams(num_warps=4, num_stages=1)
