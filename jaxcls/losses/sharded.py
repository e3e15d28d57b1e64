"""The class-parallel margin loss: FC weight sharded over the class axes, never gathered.

One step's communication, with W devices in the class group, N the global batch,
D the embedding width and C the number of classes (see docs/loss.md):

* forward: all-gather the local ``[N/W_all, D]`` normalized embeddings and
  ``[N/W_all]`` labels over the class axes; ``pmax`` and two ``psum`` of ``[N]``
  float32 vectors; a scalar ``psum`` over the remaining data axes.
* backward: the transpose of the gather, a reduce-scatter of ``[N, D]``
  embedding gradients back to their owners; with ``class_axes=('class',)`` also
  an all-reduce of the ``[C/W, D]`` weight gradient over ``data``.

Nothing of size ``N × C`` ever crosses devices. The per-shard work is the tile kernel of
``jaxcls.losses.tiles`` (with ``chunk_size``, on CUDA GPUs, the row kernels of ``rows_stats`` and ``rows_backward``).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from jaxcls.losses import rows_backward, rows_stats, tiles
from jaxcls.losses.cross_entropy import combine_stats
from jaxcls.losses.margins import CombinedMargin
from jaxcls.mesh import (
    BATCH,
    BATCH_ROWS,
    DEFAULT_CLASS_AXES,
    class_shards,
    data_axes,
    on_cpu,
    padded_num_classes,
    row_spec,
    weight_sharding,
    weight_spec,
)
from jaxcls.precision import bitcast, bits_dtype
from jaxcls.registry import lowered_for


def init_weight(key, num_classes: int, dim: int, mesh: Mesh, class_axes=DEFAULT_CLASS_AXES,
                dtype=jnp.float32, stddev: float = 0.01) -> jax.Array:
    """A ``[C_pad, D]`` FC weight, created directly in its sharding (never whole on one device).

    ``C_pad = padded_num_classes(num_classes, class_shards(mesh, class_axes))``; the
    padding rows are zero, masked out of the loss and get zero gradient. Pass
    ``num_classes`` to the loss so that it knows which rows are real.
    """
    rows = padded_num_classes(num_classes, class_shards(mesh, class_axes))

    def make():
        w = stddev * jax.random.normal(key, (rows, dim), jnp.float32)
        return jnp.where(jnp.arange(rows)[:, None] < num_classes, w, 0.0).astype(dtype)

    return jax.jit(make, out_shardings=weight_sharding(mesh, class_axes))()


def sharded_margin_loss(embeddings: jax.Array, weight: jax.Array, labels: jax.Array, margin: CombinedMargin, *,
                        mesh: Mesh, class_axes=DEFAULT_CLASS_AXES, num_classes: int | None = None,
                        chunk_size: int | None = None, row_classes: jax.Array | None = None) -> jax.Array:
    """Mean margin softmax cross-entropy with the FC weight sharded over ``class_axes``.

    Args:
      embeddings: ``[N, D]`` backbone output, batch sharded ``P(('data', 'class'), None)``.
        Its dtype is the matmul compute dtype (float32, bfloat16 or float16).
      weight: ``[C_pad, D]`` class centres, ``P(class_axes, None)`` (see ``init_weight``); or, with
        ``row_classes``, a PartialFC sample of ``[R, D]`` rows (see ``jaxcls.fc.sampling``).
      labels: ``[N]`` int global class ids, sharded like the embeddings.
      margin: a ``CombinedMargin``.
      class_axes: ``('data', 'class')`` (every device holds ``C_pad / n_devices`` rows) or
        ``('class',)`` (the weight is replicated over ``data``; its gradient is then summed over ``data``).
      num_classes: the real C (default ``C_pad``); rows past it are padding.
      chunk_size: if set, logits are made and consumed ``chunk_size`` classes at a time
        (recomputed in the backward) so ``[N, C_local]`` is never held at once; the weight's gradient is then filled
        in place (on CPU a bfloat16 weight moves as its bits: compile with XLA:CPU's elemental emitter,
        ``compiler_options=precision.ELEMENTAL_EMITTER``, or its bitcasts are a copy).
      row_classes: ``[R]`` int32, ``P(class_axes)``: the global class id of each weight row, ascending
        within each shard (``>= num_classes`` for padding). ``None`` means the full weight.

    Returns:
      The scalar float32 mean loss over the global batch, replicated.

    Labels are checked on the host when concrete; under ``jit`` a label outside
    ``[0, num_classes)`` makes the returned loss and every gradient NaN (never a silent wrong value).
    """
    class_axes = tuple(class_axes)
    if num_classes is None:
        if row_classes is not None:
            raise ValueError("num_classes is required with row_classes")
        num_classes = weight.shape[0]
    tiles.check_inputs(embeddings, weight, labels, mesh, class_axes, num_classes, row_classes)
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if row_classes is None:
        row_classes = tiles.full_row_classes(weight.shape[0], mesh, class_axes)
    # the weight's gradient is filled tile by tile: on CPU as raw bits where XLA:CPU cannot scatter the dtype in place
    grad_dtype = bits_dtype(weight.dtype) if on_cpu(mesh) else jnp.dtype(weight.dtype)
    per_shard = partial(_per_shard_loss, margin=margin, class_axes=class_axes, num_classes=num_classes,
                        chunk_size=chunk_size, global_batch=embeddings.shape[0], grad_dtype=grad_dtype)
    with lowered_for(mesh):
        loss = jax.shard_map(per_shard, mesh=mesh,
                             in_specs=(BATCH_ROWS, weight_spec(class_axes), BATCH, row_spec(class_axes)),
                             out_specs=P())(embeddings, weight, labels.astype(jnp.int32), row_classes)
    invalid = jnp.any((labels < 0) | (labels >= num_classes))
    return loss * jnp.where(invalid, jnp.nan, 1.0)  # NaN, and so is every gradient (a select would give them 0)


def _per_shard_loss(embeddings, weight, labels, row_classes, *, margin, class_axes, num_classes, chunk_size, grad_dtype,
                    global_batch):
    """Inside shard_map: embeddings [N/W_all, D], weight [R_local, D], labels [N/W_all], row_classes [R_local]."""
    replica_axes = data_axes(class_axes)
    if replica_axes:  # weight replicated over data: mark it varying so its gradient is summed over data
        weight = lax.pcast(weight, replica_axes, to="varying")
    e_n = lax.all_gather(tiles.l2_normalize(embeddings).astype(embeddings.dtype), class_axes, tiled=True)
    targets = tiles.local_rows_of(lax.all_gather(labels, class_axes, tiled=True), row_classes)
    row_valid = row_classes < num_classes
    if chunk_size is None or chunk_size >= weight.shape[0]:
        losses = _whole_cross_entropy(e_n, weight, targets, row_valid, margin, class_axes)
    else:
        losses = _chunked_cross_entropy(e_n, weight, targets, row_valid, margin, class_axes, chunk_size, grad_dtype)
    total = jnp.sum(losses)
    if replica_axes:
        total = lax.psum(total, replica_axes)
    return total / global_batch


@partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _whole_cross_entropy(e_n, weight, targets, row_valid, margin, axis_name):
    """Per-example losses ``[N]`` from all ``[N, R_local]`` cosines at once. The forward keeps the GEMM's products
    ``e_n · w`` ``[N, R_local]`` float32 for the backward, which forms every gradient from them in one pass
    (``tiles.tile_grad_parts``), where autodiff wrote and re-read the logits, their gradient and the margin's."""
    return _whole_forward(e_n, weight, targets, row_valid, margin, axis_name)[0]


def _whole_forward(e_n, weight, targets, row_valid, margin, axis_name):
    where = tiles.tile_columns(targets, row_valid, 0, 0)
    products, stats = tiles.products_and_statistics(e_n, weight, where, margin)
    lse, loss = combine_stats(*stats, axis_name)
    return loss, (e_n, weight, where, products, lse)


def _whole_backward(margin, axis_name, residuals, g):
    e_n, weight, where, products, lse = residuals
    d_e, *row_grad = tiles.tile_grad_parts(e_n, weight, where, margin, lse, g, products)
    return d_e, tiles.row_gradient(weight, *row_grad).astype(weight.dtype), None, None


_whole_cross_entropy.defvjp(_whole_forward, _whole_backward)


def _tile(weight, targets, row_valid, i, chunk_size, dtype):
    """Tile ``i`` of a contiguous weight block: ``(its rows' local indices [T], where its columns stand, its rows as
    ``dtype``: a function)``."""
    first, owned = tiles.tile_starts(weight.shape[0], chunk_size, i)
    where = tiles.tile_columns(targets, lax.dynamic_slice_in_dim(row_valid, first, chunk_size), first, owned)
    return (first + jnp.arange(chunk_size, dtype=jnp.int32), where,
            lambda: bitcast(lax.dynamic_slice_in_dim(weight, first, chunk_size), dtype))


@partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _chunked_cross_entropy(e_n, weight, targets, row_valid, margin, axis_name, chunk_size, grad_dtype):
    """Per-example losses ``[N]`` like the unchunked path, holding one ``[N, chunk]`` tile at a time (on a CUDA GPU
    in the kernels of ``jaxcls.losses.rows_stats`` and ``rows_backward``, which keep it on chip). The weight's
    gradient is written in ``grad_dtype``: the weight's, or on CPU its bits (``precision.bits_dtype``)."""
    return _chunked_forward(e_n, weight, targets, row_valid, margin, axis_name, chunk_size, grad_dtype)[0]


def _chunked_forward(e_n, weight, targets, row_valid, margin, axis_name, chunk_size, grad_dtype):
    n_tiles = tiles.num_tiles(weight.shape[0], chunk_size)
    stored = bitcast(weight, grad_dtype)  # the weight as its gradient is stored: itself, or on CPU maybe its bits

    def stats_at(i):
        index, where, rows = _tile(stored, targets, row_valid, i, chunk_size, weight.dtype)
        return rows_stats.tile_statistics_by_index(stored, index, where, e_n, margin, rows)

    stats = tiles.online_stats(e_n, n_tiles, stats_at)
    lse, loss = combine_stats(*stats, axis_name)
    return loss, (e_n, weight, targets, row_valid, lse)


def _chunked_backward(margin, axis_name, chunk_size, grad_dtype, residuals, g):
    """Each row's gradient is written once, by the tile that owns it, in the weight's dtype."""
    e_n, weight, targets, row_valid, lse = residuals
    stored = bitcast(weight, grad_dtype)  # as in the forward
    write = partial(_write_gradient, dtype=weight.dtype)

    def step(carry, i):
        d_e, d_w = carry
        index, where, rows = _tile(stored, targets, row_valid, i, chunk_size, weight.dtype)
        d_e_tile, (_, d_w) = rows_backward.tile_backward((stored, d_w), index, where, e_n, lse, g, margin, rows,
                                                         where.kept, write, reads=1)
        return (d_e + d_e_tile, d_w), None

    init = (jnp.zeros_like(e_n, jnp.float32), jnp.zeros_like(weight, grad_dtype))
    (d_e, d_w), _ = lax.scan(step, init, jnp.arange(tiles.num_tiles(weight.shape[0], chunk_size)))
    return d_e.astype(e_n.dtype), bitcast(d_w, weight.dtype), None, None


def _write_gradient(rows, row_grad, index, *, dtype):
    """``rows_backward``'s rule that writes the rows' gradient (``rows``: the weight's and the gradient's as stored,
    ``dtype`` the weight's)."""
    weight = bitcast(rows[0], dtype)
    return (bitcast(tiles.row_gradient(weight, *row_grad).astype(dtype), rows[1].dtype),)


_chunked_cross_entropy.defvjp(_chunked_forward, _chunked_backward)
