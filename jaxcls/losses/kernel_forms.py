"""What jaxcls's Pallas row kernels (``jaxcls.losses.rows_stats``, ``rows_backward``) share: their forms and how one is
chosen, the index they read rows by, their Triton settings."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pallas_triton

from jaxcls.losses.tiles import TileColumns
from jaxcls.registry import Forms

FORMS = ("xla", "pallas", "pallas_interpret")  # pallas_interpret: the kernel in Pallas' interpreter, any platform


def kernel_forms(what: str) -> Forms:
    return Forms(what, FORMS)


def run(forms: Forms, pallas, xla, *args, kernel_on_cuda: bool = True):
    """``xla(*args)`` or ``pallas(*args, interpret=…)``: the form ``forms`` is forced to, else by platform (the
    kernel on CUDA GPUs where ``kernel_on_cuda``, XLA's form elsewhere)."""
    named = {"xla": xla, "pallas": partial(pallas, interpret=False),
             "pallas_interpret": partial(pallas, interpret=True)}
    return forms.pick(named, {"cuda": "pallas" if kernel_on_cuda else "xla", "default": "xla"})(*args)


def pad_rows(x: jax.Array, block: int) -> jax.Array:
    """``x`` ``[T, ...]`` padded to a multiple of ``block`` rows by repeating its last row (a kernel that stores rows:
    each copy of a row then stores what the row stores)."""
    return jnp.pad(x, [(0, -x.shape[0] % block)] + [(0, 0)] * (x.ndim - 1), mode="edge")


def block_index(index: jax.Array, block: int) -> jax.Array:
    """``index`` ``[T]`` padded as ``pad_rows`` pads, as uint32 (never negative: no wrap-around arithmetic in the
    kernel)."""
    return pad_rows(index, block).astype(jnp.uint32)


def block_columns(where: TileColumns, block: int) -> TileColumns:
    """``where``'s columns padded to a multiple of ``block`` with columns that are no target and not kept (a kernel
    that sums over the rows counts each row once; a kernel that stores rows pads its columns with ``pad_rows``)."""
    pad = -where.columns.shape[0] % block
    return where._replace(columns=jnp.pad(where.columns, (0, pad), constant_values=-2),  # rel is never below -1
                          kept=jnp.pad(where.kept, (0, pad)))


def block_batch(block: int, e_n, rel, lse=None, g=None) -> tuple:
    """The batch padded to a multiple of ``block`` embeddings that take no part: zero embeddings, no target, and (for
    a gradient) an infinite log-sum-exp (probabilities 0) and zero weight. Returns the padded arrays given."""
    pad = -e_n.shape[0] % block
    padded = (jnp.pad(e_n, ((0, pad), (0, 0))), jnp.pad(rel, (0, pad), constant_values=-1))
    if lse is not None:
        padded += (jnp.pad(lse, (0, pad), constant_values=jnp.inf), jnp.pad(g, (0, pad)))
    return padded


def sliced_products(e_at, rows_at, d: int, width: int):
    """``(products [B, R] float32, the rows' squared norms [R] float32)`` of a block of embeddings and a block of
    rows, a slice of ``width`` of the ``d`` dimensions at a time: ``e_at(columns)`` and ``rows_at(columns)`` load
    ``[B, width]`` and ``[R, width]`` (a whole ``[·, D]`` operand would sit in registers)."""
    width = min(width, d)
    products = squares = None
    for k in range(d // width):
        columns = pl.ds(k * width, width)
        e, rows = e_at(columns), rows_at(columns).astype(jnp.float32)
        part = pallas_triton.dot(e, rows.astype(e.dtype), trans_b=True).astype(jnp.float32)
        square = jnp.sum(rows * rows, axis=1)
        products, squares = (part, square) if products is None else (products + part, squares + square)
    return products, squares


def compiler_params(interpret: bool, num_warps: int, num_stages: int):
    """Triton's settings (untuned: benchmarks/fc_kernels.py times others); none for the interpreter."""
    return None if interpret else pallas_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
