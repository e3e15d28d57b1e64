"""A tile's softmax statistics from the rows it picks by index, without writing a gathered copy of them.

``tile_statistics_by_index(weight, index, where, e_n, margin, gathered)`` is
``tiles.tile_statistics`` of the rows ``weight[index]``, in two forms chosen by platform (``registry.Forms``):

- ``"pallas"`` (CUDA GPUs): a Triton kernel; each program loads a block of ``BLOCK_ROWS`` rows by index, a
  ``BLOCK_BATCH`` block of the embeddings, forms the cosines (scaled by the rows' inverse norms), the margin logits
  and their statistics on chip and writes three ``[BLOCK_BATCH]`` vectors; XLA merges the blocks. XLA's form writes
  the gathered rows (with their norms) and the ``[N, T]`` float32 cosines to memory and reads both back.
- ``"xla"`` (every other platform, and rows or batches a Triton block does not fit): ``gathered()``, the rows as
  the caller reads them, through ``tiles.tile_statistics``. (Per-example statistics: rows replicated over mesh axes
  that hold other embeddings need nothing summed, so the kernel serves every layout.)

``forced(form)`` picks one while tracing; ``"pallas_interpret"`` runs the kernel in Pallas' interpreter (inside
``shard_map`` only with ``check_vma=False``), which is how the tests hold it to XLA's form and to float64.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxcls.losses import tiles
from jaxcls.losses.kernel_forms import (block_batch, block_columns, block_index, compiler_params, kernel_forms, run,
                                        sliced_products)
from jaxcls.losses.margins import CombinedMargin
from jaxcls.mesh import varying_like

BLOCK_ROWS = 32  # rows per program
BLOCK_BATCH = 64  # embeddings per program
BLOCK_DIM = 64  # the embedding dimension is multiplied in slices of this many
WARPS = 4  # Triton's warps per program
STAGES = 1  # Triton's software-pipelining stages of the program's loop
_FORM = kernel_forms("rows-statistics form")
forced = _FORM.forced  # forced(form): within the block, trace every statistics pass in that form (None: by platform)


def tile_statistics_by_index(weight, index, where: tiles.TileColumns, e_n, margin: CombinedMargin,
                             gathered: Callable[[], jax.Array]):
    """``tiles.tile_statistics`` of the rows ``weight[index]``: ``(max, Σ exp, target)`` ``[N]`` float32 of the tile of
    rows ``index`` (``[T]`` int32 local rows) of ``weight`` ``[C_local, D]``, whose columns stand as ``where`` says
    (``tiles.tile_columns``). ``gathered()`` gives ``weight[index]`` as the caller stores it (XLA's form)."""
    xla = lambda *args: tiles.tile_statistics(e_n, gathered(), where, margin)
    if not fits_a_block(weight, e_n):
        return xla()
    return run(_FORM, partial(_pallas_form, margin=margin), xla, weight, index, where, e_n)


def fits_a_block(weight, e_n) -> bool:
    """Triton blocks are powers of two, and its products need 16 or more along each side."""
    d = weight.shape[1]
    return d & (d - 1) == 0 and d >= 16 and e_n.shape[1] == d and jnp.issubdtype(weight.dtype, jnp.floating)


def _blocked(weight, index, where: tiles.TileColumns, e_n):
    """``(grid, in_specs, inputs)`` of this kernel's ``pallas_call``: a program per block of ``BLOCK_BATCH``
    embeddings and block of ``BLOCK_ROWS`` rows read by index, whose kernel takes ``(index, columns, kept, rel, e_n,
    weight)``, each padded to whole blocks (``block_index``, ``block_columns``, ``block_batch``)."""
    index, where = block_index(index, BLOCK_ROWS), block_columns(where, BLOCK_ROWS)
    e_n, rel = block_batch(BLOCK_BATCH, e_n, where.rel)
    rows = pl.BlockSpec((BLOCK_ROWS,), lambda b, r: (r,))
    embeddings = pl.BlockSpec((BLOCK_BATCH,), lambda b, r: (b,))
    in_specs = [rows] * 3 + [embeddings, pl.BlockSpec((BLOCK_BATCH, e_n.shape[1]), lambda b, r: (b, 0)),
                             pl.BlockSpec(weight.shape, lambda b, r: (0, 0))]
    grid = (e_n.shape[0] // BLOCK_BATCH, index.shape[0] // BLOCK_ROWS)  # a row block's batch blocks side by side
    return grid, in_specs, (index, where.columns, where.kept, rel, e_n, weight)


def _pallas_form(weight, index, where, e_n, *, margin, interpret: bool):
    grid, in_specs, inputs = _blocked(weight, index, where, e_n)
    batch_blocks, row_blocks = grid
    stats = pl.pallas_call(
        partial(_kernel, margin=margin),
        grid=grid, in_specs=in_specs,
        out_specs=[pl.BlockSpec((1, BLOCK_BATCH), lambda b, r: (r, b))] * 3,
        out_shape=[varying_like(e_n, (row_blocks, batch_blocks * BLOCK_BATCH), jnp.float32)] * 3,
        interpret=interpret, name="rows_stats",
        compiler_params=compiler_params(interpret, WARPS, STAGES),
    )(*inputs)
    merged = lax.reduce(tuple(stats), tuple(tiles.empty_stats(())), tiles.merge_stats, (0,))
    return tuple(s[:e_n.shape[0]] for s in merged)


def _kernel(index_ref, columns_ref, kept_ref, rel_ref, e_ref, weight_ref, max_ref, sum_ref, target_ref, *, margin):
    index = index_ref[...]
    products, squares = sliced_products(lambda columns: e_ref[:, columns],
                                        lambda columns: weight_ref[index, columns], e_ref.shape[1], BLOCK_DIM)
    cos = products * tiles.inverse_of_squares(squares)[None, :]
    where = tiles.TileColumns(rel_ref[...], columns_ref[...], kept_ref[...])
    statistics = tiles.statistics_of_cosines(cos, where, margin,
                                             reduce=tiles.stats_in_separate_reads)  # no platform choice in a kernel
    for ref, value in zip((max_ref, sum_ref, target_ref), statistics):
        ref[...] = value[None, :]
