"""The class-parallel margin loss: FC weight sharded over the class axes, never gathered.

One step's communication, with W devices in the class group, N the global batch,
D the embedding width and C the number of classes (see docs/loss.md):

* forward: all-gather the local ``[N/W_all, D]`` normalized embeddings and
  ``[N/W_all]`` labels over the class axes; ``pmax`` and two ``psum`` of ``[N]``
  float32 vectors; a scalar ``psum`` over the remaining data axes.
* backward: the transpose of the gather, a reduce-scatter of ``[N, D]``
  embedding gradients back to their owners; with ``class_axes=('class',)`` also
  an all-reduce of the ``[C/W, D]`` weight gradient over ``data``.

Nothing of size ``N × C`` ever crosses devices.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxcls.losses.cross_entropy import (
    class_parallel_cross_entropy,
    combine_stats,
    local_target,
    masked_fill_value,
    softmax_minus_onehot,
)
from jaxcls.losses.margins import CombinedMargin
from jaxcls.mesh import AXES

DEFAULT_CLASS_AXES = AXES


def l2_normalize(x: jax.Array, eps: float = 1e-12) -> jax.Array:
    """Rows of ``x`` scaled to unit L2 norm, computed in float32."""
    x = x.astype(jnp.float32)
    return x * lax.rsqrt(jnp.maximum(jnp.sum(x * x, axis=-1, keepdims=True), eps * eps))


def class_shards(mesh: Mesh, class_axes=DEFAULT_CLASS_AXES) -> int:
    """Number of devices the class axis of the weight is split into."""
    return math.prod(mesh.shape[a] for a in class_axes)


def padded_num_classes(num_classes: int, shards: int) -> int:
    """Rows of a weight holding ``num_classes`` split evenly into ``shards`` (padding at the end)."""
    return -(-num_classes // shards) * shards


def weight_sharding(mesh: Mesh, class_axes=DEFAULT_CLASS_AXES) -> NamedSharding:
    """``P(class_axes, None)``: rows split over the class axes, replicated over the rest."""
    return NamedSharding(mesh, P(tuple(class_axes), None))


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


def validate_labels(labels, num_classes: int) -> None:
    """Host-side check that every label is in ``[0, num_classes)``; raises ``ValueError`` naming the first bad one."""
    labels = np.asarray(labels)
    bad = np.flatnonzero((labels < 0) | (labels >= num_classes))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"label {int(labels[i])} at batch index {i} is outside [0, {num_classes}) "
                         f"({bad.size} bad labels in this batch)")


def check_inputs(embeddings, weight, labels, mesh, class_axes, num_classes, row_classes):
    for a in class_axes:
        if a not in mesh.axis_names:
            raise ValueError(f"class axis {a!r} is not a mesh axis {mesh.axis_names}")
    n_dev = mesh.size
    shards = class_shards(mesh, class_axes)
    if embeddings.ndim != 2 or weight.ndim != 2 or labels.shape != embeddings.shape[:1]:
        raise ValueError(f"expected embeddings [N, D], weight [C, D], labels [N]; got "
                         f"{embeddings.shape}, {weight.shape}, {labels.shape}")
    n, d = embeddings.shape
    if n % n_dev:
        raise ValueError(f"batch size {n} is not divisible by the {n_dev} devices of the mesh {dict(mesh.shape)}")
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


def sharded_margin_loss(embeddings: jax.Array, weight: jax.Array, labels: jax.Array, margin: CombinedMargin, *,
                        mesh: Mesh, class_axes=DEFAULT_CLASS_AXES, num_classes: int | None = None,
                        chunk_size: int | None = None, row_classes: jax.Array | None = None) -> jax.Array:
    """Mean margin softmax cross-entropy with the FC weight sharded over ``class_axes``.

    Args:
      embeddings: ``[N, D]`` backbone output, batch sharded ``P(('data', 'class'), None)``.
        Its dtype is the matmul compute dtype (float32, bfloat16 or float16).
      weight: ``[C_pad, D]`` class centres, ``P(class_axes, None)`` (see ``init_weight``); or, with
        ``row_classes``, a PartialFC sample of ``[R, D]`` rows (see ``jaxcls.partial_fc``).
      labels: ``[N]`` int global class ids, sharded like the embeddings.
      margin: a ``CombinedMargin``.
      class_axes: ``('data', 'class')`` (every device holds ``C_pad / n_devices`` rows) or
        ``('class',)`` (the weight is replicated over ``data``; its gradient is then summed over ``data``).
      num_classes: the real C (default ``C_pad``); rows past it are padding.
      chunk_size: if set, logits are made and consumed ``chunk_size`` classes at a time
        (recomputed in the backward) so ``[N, C_local]`` is never held at once.
      row_classes: ``[R]`` int32, ``P(class_axes)``: the global class id of each weight row, ascending
        within each shard (``>= num_classes`` for padding). ``None`` means the full weight.

    Returns:
      The scalar float32 mean loss over the global batch, replicated.

    Labels are checked on the host when concrete; under ``jit`` a label outside
    ``[0, num_classes)`` makes the returned loss NaN (never a silent wrong loss).
    """
    class_axes = tuple(class_axes)
    if num_classes is None:
        if row_classes is not None:
            raise ValueError("num_classes is required with row_classes")
        num_classes = weight.shape[0]
    check_inputs(embeddings, weight, labels, mesh, class_axes, num_classes, row_classes)
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if row_classes is None:
        row_classes = full_row_classes(weight.shape[0], mesh, class_axes)
    per_shard = partial(_per_shard_loss, margin=margin, class_axes=class_axes, num_classes=num_classes,
                        chunk_size=chunk_size, global_batch=embeddings.shape[0])
    loss = jax.shard_map(per_shard, mesh=mesh, in_specs=(P(AXES, None), P(class_axes, None), P(AXES), P(class_axes)),
                         out_specs=P())(embeddings, weight, labels.astype(jnp.int32), row_classes)
    invalid = jnp.any((labels < 0) | (labels >= num_classes))
    return jnp.where(invalid, jnp.nan, loss)


def full_row_classes(rows: int, mesh: Mesh, class_axes) -> jax.Array:
    """``arange(rows)`` sharded ``P(class_axes)``: row r of the full weight is class r."""
    return jax.lax.with_sharding_constraint(jnp.arange(rows, dtype=jnp.int32), NamedSharding(mesh, P(class_axes)))


def local_rows_of(labels: jax.Array, row_classes: jax.Array) -> jax.Array:
    """For each label, its row in the ascending ``row_classes`` of this shard, or -1 if absent."""
    pos = jnp.minimum(jnp.searchsorted(row_classes, labels), row_classes.shape[0] - 1)
    return jnp.where(row_classes[pos] == labels, pos, -1).astype(jnp.int32)


def _per_shard_loss(embeddings, weight, labels, row_classes, *, margin, class_axes, num_classes, chunk_size,
                    global_batch):
    """Inside shard_map: embeddings [N/W_all, D], weight [R_local, D], labels [N/W_all], row_classes [R_local]."""
    data_axes = tuple(a for a in AXES if a not in class_axes)
    if data_axes:  # weight replicated over data: mark it varying so its gradient is summed over data
        weight = lax.pcast(weight, data_axes, to="varying")
    e_n = lax.all_gather(l2_normalize(embeddings).astype(embeddings.dtype), class_axes, tiled=True)
    labels = lax.all_gather(labels, class_axes, tiled=True)
    local_labels = local_rows_of(labels, row_classes)
    row_valid = row_classes < num_classes
    if chunk_size is None or chunk_size >= weight.shape[0]:
        logits, tile_labels = _tile_logits(e_n, weight, local_labels, row_valid, 0, 0, margin)
        losses = class_parallel_cross_entropy(logits, tile_labels, class_axes)
    else:
        losses = _chunked_cross_entropy(e_n, weight, local_labels, row_valid, margin, class_axes, chunk_size)
    total = jnp.sum(losses)
    if data_axes:
        total = lax.psum(total, data_axes)
    return total / global_batch


def _tile_logits(e_n, w_tile, labels, valid, first_col, owned_from, margin):
    """Margin logits ``[N, T]`` float32 of the class tile starting at local column ``first_col``.

    ``valid`` ``[T]`` marks real classes; columns before ``owned_from`` (a tile
    overlapping its predecessor) and invalid ones get the fill value. Returns
    ``(logits, labels within the tile or -1)``.
    """
    w_n = l2_normalize(w_tile).astype(e_n.dtype)
    cos = jnp.dot(e_n, w_n.T, preferred_element_type=jnp.float32)
    tile = cos.shape[1]
    rel = labels - first_col
    rel = jnp.where((labels >= owned_from) & (rel >= 0) & (rel < tile), rel, -1)
    columns = first_col + lax.broadcasted_iota(jnp.int32, cos.shape, 1)
    is_target = columns == (rel + first_col)[:, None]
    logits = jnp.where(is_target, margin.target_logit(local_target(cos, rel))[:, None], margin.logits(cos))
    owned = (columns >= owned_from) & valid[None, :]
    return jnp.where(owned, logits, masked_fill_value(jnp.float32)), rel


def tile_starts(c_local: int, tile: int, i):
    """Tile ``i`` covers ``[first, first + tile)``, shifted back to stay in bounds; it owns columns from ``i·tile``."""
    return jnp.minimum(i * tile, c_local - tile), i * tile


@partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _chunked_cross_entropy(e_n, weight, labels, row_valid, margin, axis_name, chunk_size):
    """Per-example losses ``[N]`` like the unchunked path, holding one ``[N, chunk]`` tile at a time."""
    return _chunked_forward(e_n, weight, labels, row_valid, margin, axis_name, chunk_size)[0]


def _tile(weight, row_valid, first, chunk_size):
    return (lax.dynamic_slice_in_dim(weight, first, chunk_size),
            lax.dynamic_slice_in_dim(row_valid, first, chunk_size))


def online_stats(e_n, labels, n_tiles, tile_at, margin):
    """Per-shard softmax statistics ``(row_max, row_sum, target)`` ``[N]`` over class tiles, one at a time.

    ``tile_at(i)`` returns ``(w_tile [T, D], valid [T], first, owned)`` for tile ``i`` (see ``_tile_logits``).
    """

    def step(carry, i):
        row_max, row_sum, target = carry
        w_tile, valid, first, owned = tile_at(i)
        logits, rel = _tile_logits(e_n, w_tile, labels, valid, first, owned, margin)
        new_max = jnp.maximum(row_max, jnp.max(logits, axis=1))
        row_sum = row_sum * jnp.exp(row_max - new_max) + jnp.sum(jnp.exp(logits - new_max[:, None]), axis=1)
        return (new_max, row_sum, target + local_target(logits, rel)), None

    zeros = jnp.zeros_like(e_n[:, 0], jnp.float32)  # zeros_like keeps e_n's varying mesh axes
    init = (zeros + masked_fill_value(jnp.float32), zeros, zeros)
    return lax.scan(step, init, jnp.arange(n_tiles))[0]


def tile_grads(e_n, w_tile, labels, valid, first, owned, margin, lse, g):
    """Gradients ``(d e_n [N, D], d w_tile [T, D])`` of ``Σ g·loss`` through one class tile, given the global ``lse``."""
    tile_fn = lambda e, w: _tile_logits(e, w, labels, valid, first, owned, margin)
    logits, pullback, rel = jax.vjp(tile_fn, e_n, w_tile, has_aux=True)
    return pullback(softmax_minus_onehot(logits, rel, lse, 0) * g[:, None])


def _chunked_forward(e_n, weight, labels, row_valid, margin, axis_name, chunk_size):
    c_local = weight.shape[0]

    def tile_at(i):
        first, owned = tile_starts(c_local, chunk_size, i)
        return *_tile(weight, row_valid, first, chunk_size), first, owned

    stats = online_stats(e_n, labels, -(-c_local // chunk_size), tile_at, margin)
    lse, loss = combine_stats(*stats, axis_name)
    return loss, (e_n, weight, labels, row_valid, lse)


def _chunked_backward(margin, axis_name, chunk_size, residuals, g):
    e_n, weight, labels, row_valid, lse = residuals
    c_local = weight.shape[0]

    def step(carry, i):
        d_e, d_w = carry
        first, owned = tile_starts(c_local, chunk_size, i)
        w_tile, valid = _tile(weight, row_valid, first, chunk_size)
        d_e_tile, d_w_tile = tile_grads(e_n, w_tile, labels, valid, first, owned, margin, lse, g)
        d_w = lax.dynamic_update_slice_in_dim(d_w, lax.dynamic_slice_in_dim(d_w, first, chunk_size) + d_w_tile,
                                              first, axis=0)
        return (d_e + d_e_tile.astype(jnp.float32), d_w), None

    init = (jnp.zeros_like(e_n, jnp.float32), jnp.zeros_like(weight, jnp.float32))
    n_tiles = -(-c_local // chunk_size)
    (d_e, d_w), _ = lax.scan(step, init, jnp.arange(n_tiles))
    return d_e.astype(e_n.dtype), d_w.astype(weight.dtype), None, None


_chunked_cross_entropy.defvjp(_chunked_forward, _chunked_backward)
