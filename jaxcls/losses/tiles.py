"""The per-shard tile kernel shared by ``sharded_margin_loss`` and the fused ``FCHead.step``.

Inside ``shard_map`` each class shard holds some rows of the FC weight (all of its ``C_local`` rows, or
a PartialFC sample of them) and sees the whole gathered batch: ``e_n`` ``[N, D]`` L2-normalized
embeddings and ``targets`` ``[N]``, each label's row on this shard or -1. The rows are visited in tiles
of ``T``; tile ``i`` covers local rows ``[first, first + T)`` and *owns* those from ``owned`` on (the
last tile is shifted back to stay in bounds and overlaps its predecessor; ``tile_starts``):

* ``tile_columns``: where a tile's columns stand (``TileColumns``: each target's column, each column's number, the
  columns the tile owns that are real classes);
* ``margin_logits``: the margin logits ``[N, T]`` of one tile's cosines (the rows read as stored, their products
  with ``e_n`` scaled by each row's ``inverse_norms``: ``products_and_statistics``), non-owned and padding columns
  filled, and nothing ``[N, T]`` made but them, so that XLA keeps the per-row traffic low
  (``benchmarks/fc_bytes_per_row.py``);
* ``online_stats``: running max / sum of exp / target logit ``[N]`` over all tiles, one tile's at a time
  (``tile_statistics``, or ``jaxcls.losses.rows_stats``' kernel; ``merge_stats`` combines two); ``cross_entropy.
  combine_stats`` then makes the global log-sum-exp with one ``pmax`` and two ``psum``;
* ``tile_grad_parts``: given that log-sum-exp, one tile's gradients w.r.t. ``e_n`` and the tile's rows, the rows'
  left in two parts for an update to combine (``row_gradient``); ``cosine_grads``, the part of it that the kernels
  of ``jaxcls.losses.rows_backward`` recompute on chip, with the margin taken at each embedding's target cosine
  (``target_cosines``) where XLA forms it.

Outside ``shard_map``: ``check_inputs`` (shapes, sharding, labels, before any work), ``validate_labels``,
``full_row_classes`` (row ``r`` of the full weight is class ``r``) and ``l2_normalize``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding

from jaxcls.losses.cross_entropy import masked_fill_value
from jaxcls.losses.margins import CombinedMargin
from jaxcls.mesh import check_class_axes, class_shards, padded_num_classes, row_spec, weight_sharding
from jaxcls.registry import platform_dependent


NORM_EPS = 1e-12  # a norm below this counts as this (the rows of padding classes are zero)


def l2_normalize(x: jax.Array, eps: float = NORM_EPS) -> jax.Array:
    """Rows of ``x`` scaled to unit L2 norm, computed in float32."""
    return x.astype(jnp.float32) * inverse_norms(x, eps)[..., None]


def inverse_norms(x: jax.Array, eps: float = NORM_EPS) -> jax.Array:
    """``1 / ‖x_t‖`` of each row ``[T]`` of ``x`` ``[T, D]``, float32 (``l2_normalize``'s factors)."""
    x = x.astype(jnp.float32)
    return inverse_of_squares(jnp.sum(x * x, axis=-1), eps)


def inverse_of_squares(squares: jax.Array, eps: float = NORM_EPS) -> jax.Array:
    """``inverse_norms`` from the rows' squared norms (float32)."""
    return lax.rsqrt(jnp.maximum(squares, eps * eps))


def validate_labels(labels, num_classes: int) -> None:
    """Host-side check that every label is in ``[0, num_classes)``; raises ``ValueError`` naming the first bad one.

    For a global ``jax.Array`` each process checks the shards it holds (batch indices stay global).
    """
    if isinstance(labels, jax.Array) and not labels.is_fully_addressable:
        parts = [(s.index[0].start or 0, np.asarray(s.data)) for s in labels.addressable_shards]
    else:
        parts = [(0, np.asarray(labels))]
    for offset, part in sorted(parts, key=lambda p: p[0]):
        bad = np.flatnonzero((part < 0) | (part >= num_classes))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"label {int(part[i])} at batch index {offset + i} is outside [0, {num_classes}) "
                             f"({bad.size} bad labels in this batch)")


def check_inputs(embeddings, weight, labels, mesh: Mesh, class_axes, num_classes: int, row_classes=None) -> None:
    """Raise ``ValueError`` naming the first inconsistency of a loss or FC step's inputs, before any work.

    ``weight`` is the full ``[C_pad, D]`` weight, or with ``row_classes`` ``[R]`` a sample of ``R`` rows.
    Labels are checked when concrete (under ``jit`` the loss turns NaN instead).
    """
    class_axes = check_class_axes(mesh, class_axes)
    shards = class_shards(mesh, class_axes)
    if embeddings.ndim != 2 or weight.ndim != 2 or labels.shape != embeddings.shape[:1]:
        raise ValueError(f"expected embeddings [N, D], weight [C, D], labels [N]; got "
                         f"{embeddings.shape}, {weight.shape}, {labels.shape}")
    n, d = embeddings.shape
    if n % mesh.size:
        raise ValueError(f"batch size {n} is not divisible by the {mesh.size} devices of the mesh {dict(mesh.shape)}")
    if weight.shape[1] != d:
        raise ValueError(f"embeddings have D={d} but the weight has D={weight.shape[1]}")
    if row_classes is not None:
        if row_classes.shape != weight.shape[:1] or weight.shape[0] % shards:
            raise ValueError(f"sampled weight {weight.shape} and row_classes {row_classes.shape} must have the "
                             f"same number of rows, divisible by the {shards} class shards")
    else:
        rows = padded_num_classes(num_classes, shards)
        if weight.shape != (rows, d):
            raise ValueError(f"weight has shape {weight.shape}; for num_classes={num_classes}, D={d} and "
                             f"{shards} class shards it must be [{rows}, {d}] (see init_weight)")
    if isinstance(weight, jax.Array) and not isinstance(weight, jax.core.Tracer):
        want = weight_sharding(mesh, class_axes)
        if not weight.sharding.is_equivalent_to(want, weight.ndim):
            raise ValueError(f"weight sharding {weight.sharding} does not match {want.spec} on this mesh; "
                             "place it with jax.device_put(weight, weight_sharding(mesh, class_axes))")
    if not isinstance(labels, jax.core.Tracer):
        validate_labels(labels, num_classes)


def full_row_classes(rows: int, mesh: Mesh, class_axes) -> jax.Array:
    """``arange(rows)`` int32 sharded ``P(class_axes)``: row ``r`` of the full weight is class ``r``."""
    return lax.with_sharding_constraint(jnp.arange(rows, dtype=jnp.int32), NamedSharding(mesh, row_spec(class_axes)))


def local_rows_of(labels: jax.Array, row_classes: jax.Array) -> jax.Array:
    """For each label ``[N]``, its row in this shard's ascending ``row_classes`` ``[R]``, or -1 if absent."""
    pos = jnp.minimum(jnp.searchsorted(row_classes, labels), row_classes.shape[0] - 1)
    return jnp.where(row_classes[pos] == labels, pos, -1).astype(jnp.int32)


def tile_starts(num_rows: int, tile: int, i):
    """``(first, owned)`` of tile ``i``: it covers ``[first, first + tile)``, shifted back to stay within
    ``num_rows``, and owns the rows from ``owned = i·tile`` on."""
    return jnp.minimum(i * tile, num_rows - tile), i * tile


def num_tiles(num_rows: int, tile: int) -> int:
    return -(-num_rows // tile)


@jax.custom_vjp
def cosines(e_n: jax.Array, w_n: jax.Array) -> jax.Array:
    """``e_n @ w_nᵀ`` ``[N, T]`` float32 from operands ``[N, D]``, ``[T, D]`` of one dtype, accumulated in float32.

    Its gradients multiply in the operands' dtype too (the float32 cotangent rounded to it; plain autodiff would
    run them on float32 operands, at a fraction of a GPU's bfloat16 rate), except for float16, whose range
    would flush softmax probabilities under 6e-8 to zero: those stay float32.
    """
    return jnp.dot(e_n, w_n.T, preferred_element_type=jnp.float32)


def _cosines_fwd(e_n, w_n):
    return cosines(e_n, w_n), (e_n, w_n)


def gradient_product_dtype(e_dtype):
    """The dtype ``cosines``' gradients multiply in: the embeddings', float16's in float32 (see ``cosines``)."""
    return jnp.dtype(jnp.float32 if e_dtype == jnp.float16 else e_dtype)


def cosines_pullback(e_n, w_n, g):
    """``cosines``' gradients ``(d e_n [N, D] in e_n's dtype, d w_n [T, D] in gradient_product_dtype)`` for the
    cotangent ``g`` ``[N, T]`` float32: for a caller that holds the products already (``tile_grad_parts``). The rows'
    part stays in the dtype it is multiplied in: float16's would overflow under a loss scale."""
    dtype = gradient_product_dtype(e_n.dtype)
    # autodiff of the product in `dtype` transposes it, summing over the mesh axes where an operand is replicated
    product = lambda e, w: jnp.dot(e, w.T, preferred_element_type=dtype)
    _, pullback = jax.vjp(product, e_n.astype(dtype), w_n.astype(dtype))
    d_e, d_w = pullback(g.astype(dtype))
    return d_e.astype(e_n.dtype), d_w


def _cosines_bwd(residuals, g):
    d_e, d_w = cosines_pullback(*residuals, g)
    return d_e, d_w.astype(residuals[1].dtype)  # a custom VJP's cotangent has its primal's dtype


cosines.defvjp(_cosines_fwd, _cosines_bwd)


class TileColumns(NamedTuple):
    """Where a tile's ``T`` columns stand: ``rel`` ``[N]`` each target's column in the tile (-1: none, or one the tile
    does not own), ``columns`` ``[T]`` int32 each column's own number (``arange(T)``; a kernel that pads the tile
    gives its padding other numbers), ``kept`` ``[T]`` bool the columns the tile owns that are real classes."""

    rel: jax.Array
    columns: jax.Array
    kept: jax.Array


def tile_columns(targets, valid, first, owned) -> TileColumns:
    """``TileColumns`` of the tile covering local rows ``[first, first + T)`` (``T = valid.shape[0]``) that owns those
    from ``owned`` on: ``targets`` ``[N]`` local rows or -1, ``valid`` ``[T]`` real classes."""
    columns = jnp.arange(valid.shape[0], dtype=jnp.int32)
    rel = targets - first
    rel = jnp.where((targets >= owned) & (rel >= 0) & (rel < valid.shape[0]), rel, -1)
    return TileColumns(rel.astype(jnp.int32), columns, valid & (columns >= owned - first))


def margin_logits(cos, where: TileColumns, margin: CombinedMargin, target=None):
    """Margin logits ``[N, T]`` float32 of a tile's cosines ``[N, T]``, the columns the tile does not keep (overlap
    with the previous tile, padding) filled (exp → 0): columns compared as ``[T]`` and ``[N]`` vectors (no
    ``[N, T]`` index array), the margin's target logit computed elementwise and selected (no ``[N]`` pick whose
    gradient scatters into an ``[N, T]`` array), or given as ``target`` (broadcast to ``[N, T]``; ``cosine_grads``
    gives one per embedding, ``[N, 1]``)."""
    is_target = where.columns[None, :] == where.rel[:, None]
    target = margin.target_logit(cos) if target is None else target
    logits = jnp.where(is_target, target, margin.logits(cos))
    return jnp.where(where.kept[None, :], logits, masked_fill_value(jnp.float32))


def tile_statistics(e_n, w_tile, where: TileColumns, margin: CombinedMargin):
    """Softmax statistics ``(max, Σ exp(x − max), target logit)`` ``[N]`` float32 of one tile's margin logits."""
    return products_and_statistics(e_n, w_tile, where, margin)[1]


def products_and_statistics(e_n, w_tile, where: TileColumns, margin: CombinedMargin):
    """``(products, statistics)``: the tile's products ``e_n · w`` ``[N, T]`` float32 with its rows as stored (their
    cosines times each row's inverse norm ``[T]``: no normalized ``[T, D]`` copy is written), and ``tile_statistics``
    from them, the margin taken at each embedding's target cosine (``target_cosines``) so that the pass over the
    ``[N, T]`` cosines is plain ``s·cos`` (evaluated at every element, ArcFace's margin made XLA:GPU write the
    logits for the reduction to read)."""
    rows, _, inverse, target_cos = tile_operands(e_n, w_tile, where)
    products = cosines(e_n, rows)
    return products, statistics_of_cosines(products * inverse[None, :], where, margin, target_cos=target_cos)


def tile_operands(e_n, w_tile, where: TileColumns):
    """``(rows, squares, inverse, target_cos)``, what both passes over a tile take from its rows ``w_tile`` ``[T, D]``
    as stored: the rows as ``cosines`` multiplies them (in ``e_n``'s dtype), their squared and inverse norms ``[T]``
    and each embedding's target cosine ``[N]`` (``target_cosines``)."""
    w32, squares, inverse = row_norms(w_tile)
    rows = w32.astype(e_n.dtype)
    return rows, squares, inverse, target_cosines(e_n, rows, inverse, where)


def statistics_of_cosines(cos, where: TileColumns, margin: CombinedMargin, reduce=None, target_cos=None):
    """``tile_statistics`` from the tile's cosines ``[N, T]``, reduced by ``reduce`` (default ``tile_stats``); the
    margin at each embedding's target cosine ``target_cos`` ``[N]`` if given (as ``cosine_grads`` takes it), else at
    every element."""
    target = None if target_cos is None else margin.target_logit(target_cos)[:, None]
    logits = margin_logits(cos, where, margin, target)
    picked = jnp.where(where.columns[None, :] == where.rel[:, None], logits, 0.0)
    return (reduce or tile_stats)(logits, picked)


def online_stats(e_n, n_tiles: int, stats_at: Callable[[jax.Array], tuple]):
    """This shard's softmax statistics ``(row_max, row_sum, target_logit)``, each ``[N]`` float32: those of each
    tile, ``stats_at(i)`` (e.g. ``tile_statistics``), merged tile by tile."""
    step = lambda carry, i: (merge_stats(carry, stats_at(i)), None)
    zeros = jnp.zeros_like(e_n[:, 0], jnp.float32)  # zeros_like keeps e_n's varying mesh axes
    return lax.scan(step, tuple(s + zeros for s in empty_stats(())), jnp.arange(n_tiles))[0]


def empty_stats(shape):
    """The statistics of no logits (the identity of ``merge_stats``), float32 of ``shape``."""
    zero = jnp.zeros(shape, jnp.float32)
    return zero + masked_fill_value(jnp.float32), zero, zero


def merge_stats(a, b):
    """Softmax statistics ``(max, Σ exp(x − max), target)`` of two sets of logits → those of their union."""
    high = jnp.maximum(a[0], b[0])
    return high, a[1] * jnp.exp(a[0] - high) + b[1] * jnp.exp(b[0] - high), a[2] + b[2]


def tile_stats(logits, picked):
    """``(max, Σ exp(x − max), Σ picked)`` ``[N]`` over each row of ``logits`` ``[N, T]`` float32. Beyond CPUs in one
    read of the logits (``stats_in_one_read``); XLA:CPU runs that ~2× slower than separate reductions
    (``benchmarks/loss.py --cpu``), so there it gets those."""
    return platform_dependent(logits, picked, cpu=stats_in_separate_reads, default=stats_in_one_read)


def stats_in_one_read(logits, picked):
    """``tile_stats`` as one variadic reduction, each logit entering as the statistics of itself alone."""
    return lax.reduce((logits, jnp.ones_like(logits), picked), empty_stats(()), merge_stats, (1,))


def stats_in_separate_reads(logits, picked):
    """``tile_stats`` as three reductions, the second after the first."""
    high = jnp.max(logits, axis=1)
    return high, jnp.sum(jnp.exp(logits - high[:, None]), axis=1), jnp.sum(picked, axis=1)


def tile_grad_parts(e_n, w_tile, where: TileColumns, margin: CombinedMargin, lse, g, products=None):
    """Gradients of ``Σ_n g[n]·loss[n]`` through one tile, given the global log-sum-exp ``lse`` ``[N]``: ``(d e_n
    [N, D], product, radial)``, the gradient w.r.t. the rows (``w_tile`` ``[T, D]`` as stored) left in two parts,
    ``row_gradient(w_tile, product, radial)``, so that an update can form it where it reads the rows.
    ``products``: the tile's ``cosines(e_n, rows)`` ``[N, T]`` where a forward kept them; recomputed if ``None``.

    ``cos = (e_n · w) · r`` with ``r = 1/‖w‖``: ``∂/∂w = product − radial·w``, where ``product = (∂/∂cos · r)ᵀ e_n``
    ``[T, D]`` (in ``gradient_product_dtype``, as ``cosines`` multiplies) and ``radial = r³ Σ_n ∂/∂cos · (e_n · w)``
    ``[T]`` float32, the derivative of the norm (a projection: the row gradient has no component along the row).
    """
    rows, squares, inverse, target_cos = tile_operands(e_n, w_tile, where)
    products = cosines(e_n, rows) if products is None else products
    d_products, d_inverse = cosine_grads(products, inverse, where, margin, lse, g, target_cos)
    d_e, product = cosines_pullback(e_n, rows, d_products)
    return d_e, product, radial_part(d_inverse, inverse, squares)


def cosine_grads(products, inverse, where: TileColumns, margin: CombinedMargin, lse, g, target_cos=None):
    """Gradients of ``Σ_n g[n]·loss[n]`` (given the global log-sum-exp ``lse`` ``[N]``) w.r.t. a tile's unscaled
    products ``e_n · w`` ``[N, T]`` and its rows' inverse norms ``[T]`` (summed over the batch), float32.

    The margin's target logit and its slope come from ``target_cos`` ``[N]`` (each embedding's target cosine, where
    the tile holds the target), so that the ``[N, T]`` pass is plain ``s·cos`` and XLA fuses it into the reduction
    and the rounding that read it (an ArcFace or SphereFace margin evaluated at every element made XLA:GPU write
    and re-read an ``[N, T]`` float32 array between them); without it, at every element (inside a kernel, on chip).
    """
    # autodiff sums each row's part over the batch and over the mesh axes where the rows are replicated
    cos, pull = jax.vjp(lambda p, r: p * r[None, :], products, inverse)
    is_target = where.columns[None, :] == where.rel[:, None]
    at = cos if target_cos is None else target_cos[:, None]
    target, slope = jax.jvp(margin.target_logit, (at,), (jnp.ones_like(at),))
    logits = margin_logits(cos, where, margin, target)
    d_logits = (jnp.exp(logits - lse[:, None]) - is_target.astype(jnp.float32)) * g[:, None]
    return pull(jnp.where(where.kept[None, :], d_logits * jnp.where(is_target, slope, margin.s), 0.0))


def target_cosines(e_n, rows, inverse, where: TileColumns):
    """Each embedding's cosine ``[N]`` float32 with its target's row in the tile (``where.rel``; anything where the
    tile has none), from the operands ``cosines`` multiplies (the rows ``[T, D]`` in ``e_n``'s dtype) and the rows'
    inverse norms ``[T]``: the same products, summed in float32 in another order than the GEMM's (and, with
    float32 operands, unrounded where a GPU's GEMM may round them to TF32: the two then differ by that rounding, as
    the forward's statistics and the backward's GEMM already may)."""
    at = jnp.maximum(where.rel, 0)
    return jnp.sum(e_n.astype(jnp.float32) * rows[at].astype(jnp.float32), axis=-1) * inverse[at]


def row_norms(w_tile):
    """``(rows as float32 [T, D], their squared norms [T], inverse norms [T])`` of a tile's rows as stored."""
    w32 = w_tile.astype(jnp.float32)
    squares = jnp.sum(w32 * w32, axis=-1)
    return w32, squares, inverse_of_squares(squares)


def radial_part(d_inverse, inverse, squares):
    """``tile_grad_parts``' ``radial`` ``[T]`` from ``∂/∂r``, ``r`` and the rows' squared norms (a row shorter than
    ``NORM_EPS`` has a constant ``r``: no radial part)."""
    return jnp.where(squares < NORM_EPS**2, 0.0, d_inverse * inverse**3)


def row_gradient(rows, product, radial):
    """The gradient w.r.t. the rows ``[T, D]`` as stored from ``tile_grad_parts``' two parts: float32."""
    return product.astype(jnp.float32) - radial[:, None] * rows.astype(jnp.float32)
