"""The class-sharded FC head used by the trainer: margin loss, embedding gradient and sparse update fused.

``FCHead.step`` runs, per class shard, two passes over tiles of ``chunk_size`` (sampled) rows:

1. softmax statistics (online max / sum of exp), combined over the class axes with a ``pmax`` and two
   ``psum`` of ``[N]``: the loss;
2. per tile: the gradient w.r.t. the embeddings (accumulated) and w.r.t. the tile's rows, which are
   updated by the sparse optimizer and written back at once.

So no ``[N, C_local]`` logits, no ``[rows, D]`` gradient, no copy of the sampled rows and no dense
``[C, D]`` temporary is ever held: besides the (donated, updated in place) weight and optimizer slots, a
step needs ``O(N·chunk + chunk·D)`` memory. The gradient w.r.t. the embeddings goes back to the
backbone's own backward pass. The loss equals ``sharded_margin_loss`` and the update equals
``SparseOptimizer.update`` applied to its gradient (tested), which remain the composable pieces for
user code that wants plain autodiff.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from jaxcls import mesh as layout
from jaxcls.fc.optimizers import SparseOptimizer, SparseState, check_weight_rounding
from jaxcls.losses.rows_backward import tile_backward
from jaxcls.losses.rows_stats import tile_statistics_by_index
from jaxcls.fc.sampling import ClassSample, check_sample_rate, sample_classes
from jaxcls.losses import tiles
from jaxcls.losses.cross_entropy import combine_stats
from jaxcls.losses.margins import CombinedMargin
from jaxcls.losses.sharded import init_weight
from jaxcls.precision import ELEMENTAL_EMITTER, as_bits, bitcast, cpu_scatter_converts
from jaxcls.registry import lowered_for

DEFAULT_CHUNK = 65_536  # rows per tile: temporaries O(N·T + T·D), large enough to keep a GPU's matmuls busy


@dataclasses.dataclass(frozen=True)
class FCHead:
    """FC weight ``[C_pad, D]`` sharded ``P(class_axes, None)`` in storage ``dtype``, with its loss and optimizer.

    ``chunk_size``: rows per tile (``None``: one tile per shard, i.e. the whole ``[N, C_local]`` logits and
    a gathered copy of every row taking part: several times the FC's own memory, fine for small C only).
    """

    mesh: Mesh
    num_classes: int
    dim: int
    margin: CombinedMargin
    optimizer: SparseOptimizer
    sample_rate: float = 1.0
    class_axes: tuple = layout.DEFAULT_CLASS_AXES
    chunk_size: int | None = DEFAULT_CHUNK
    dtype: Any = jnp.float32

    def __post_init__(self):
        check_sample_rate(self.sample_rate)
        check_weight_rounding(self.optimizer.weight_rounding, self.dtype)
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ValueError(f"chunk_size must be positive, got {self.chunk_size}")

    @property
    def compiler_options(self) -> dict:
        """XLA options ``step`` needs on this mesh to update the weight and state in place: pass them to ``.compile()``
        or ``jax.jit(..., compiler_options=)`` where you compile a step yourself (``Run.compile_step`` does).

        On CPU, rows of a dtype XLA:CPU cannot scatter in place move as raw bits (``stored_as_bits``); XLA:CPU's
        fusion emitters (its default) write the whole-shard bitcasts at the step's two ends as copies, its elemental
        emitter makes them free."""
        dtypes = (self.dtype, self.optimizer.state_dtype or self.dtype)
        if any(stored_as_bits(self.mesh, d) for d in dtypes):
            return dict(ELEMENTAL_EMITTER)
        return {}

    @property
    def rows(self) -> int:
        return layout.padded_num_classes(self.num_classes, layout.class_shards(self.mesh, self.class_axes))

    def init(self, key) -> tuple[jax.Array, SparseState]:
        weight = init_weight(key, self.num_classes, self.dim, self.mesh, self.class_axes, self.dtype)
        return weight, self.optimizer.init(weight)

    def sample(self, key, labels) -> ClassSample:
        """The PartialFC sample for the global batch ``labels`` ``[N]`` (every row when the budget covers the shard)."""
        return sample_classes(key, labels, mesh=self.mesh, num_classes=self.num_classes, num_rows=self.rows,
                              sample_rate=self.sample_rate, class_axes=self.class_axes)

    def step(self, weight, state: SparseState, embeddings, labels, sample: ClassSample | None, lr, *,
             with_update: bool = True, keep_update=True):
        """Loss, embedding gradient and (if ``with_update``) one optimizer step on the sampled rows.

        Args:
          weight: ``[C_pad, D]`` ``P(class_axes, None)``; ``state`` its optimizer state. Donate both.
          embeddings: ``[N, D]`` backbone output, ``P(('data', 'class'), None)``, any float dtype (the
            matmul dtype); ``labels`` ``[N]`` int, sharded alike.
          sample: from ``sample`` (``None``: every row, as ``sample_rate=1``).
          with_update: static; ``False`` returns ``weight`` and ``state`` untouched (no update work is traced).
          keep_update: a traced scalar bool; where false the rows and state are left as they were (a skipped step). A
            non-finite embedding or loss skips the update too.

        Returns:
          ``(loss, d_embeddings, weight, state)``: the float32 mean loss over the global batch, the
          float32 gradient of the loss w.r.t. ``embeddings`` (same sharding), the new weight and state.
          A label outside ``[0, num_classes)``, or one ``sample`` lacks (drawn for other labels), makes the loss
          NaN and leaves the FC unchanged.
        """
        tiles.check_inputs(embeddings, weight, labels, self.mesh, self.class_axes, self.num_classes)
        row_classes = (tiles.full_row_classes(self.rows, self.mesh, self.class_axes) if sample is None
                       else sample.classes)
        labels = labels.astype(jnp.int32)
        labels_ok = jnp.all((labels >= 0) & (labels < self.num_classes))
        keep_update = jnp.asarray(keep_update, bool) & labels_ok
        matrix = layout.weight_spec(self.class_axes)
        slots = (matrix,) * len(state.slots)
        per_shard = partial(_step_shard, head=self, with_update=with_update, global_batch=embeddings.shape[0])
        with lowered_for(self.mesh):
            loss, d_emb, weight, new_slots, count = jax.shard_map(
                per_shard, mesh=self.mesh,
                in_specs=(layout.BATCH_ROWS, layout.BATCH, matrix, slots, layout.row_spec(self.class_axes), P(), P(),
                          P()),
                out_specs=(P(), layout.BATCH_ROWS, matrix, slots, P()),
            )(embeddings, labels, weight, state.slots, row_classes, jnp.asarray(lr, jnp.float32), state.count,
              keep_update)
        return jnp.where(labels_ok, loss, jnp.nan), d_emb, weight, SparseState(new_slots, count)


def _step_shard(emb, labels, weight, slots, row_classes, lr, count, keep_update, *, head: FCHead, with_update: bool,
                global_batch: int):
    """Inside shard_map: ``emb`` ``[N/W_all, D]``, ``labels`` ``[N/W_all]``, ``weight`` and ``slots``
    ``[C_local, D]``, ``row_classes`` ``[R]`` the ascending classes of the rows taking part (all C_local
    of this shard's classes without sampling)."""
    class_axes = head.class_axes
    shard_first = lax.axis_index(class_axes) * weight.shape[0]  # class of local row 0
    gather = lambda e: lax.all_gather(tiles.l2_normalize(e), class_axes, tiled=True)
    e_n32, pull = jax.vjp(gather, emb.astype(jnp.float32))
    e_n = e_n32.astype(emb.dtype)
    targets = tiles.local_rows_of(lax.all_gather(labels, class_axes, tiled=True), row_classes)
    num_rows = row_classes.shape[0]
    tile = min(head.chunk_size or num_rows, num_rows)

    def locate(i):  # tile i: its rows (local indices [T]) and where its columns stand
        first, owned = tiles.tile_starts(num_rows, tile, i)
        classes = lax.dynamic_slice_in_dim(row_classes, first, tile)
        # gather and scatter by index even when contiguous: XLA then updates in place (a select fused into a
        # dynamic-update-slice made it copy the whole array)
        return classes - shard_first, tiles.tile_columns(targets, classes < head.num_classes, first, owned)

    # On CPU bfloat16 and 8-bit float rows move as raw bits (``stored_as_bits``)
    dtypes = (weight.dtype, *(s.dtype for s in slots))
    bits = stores_bits(head.mesh)
    if bits:
        weight, *slots = map(as_bits, (weight, *slots))

    def stats_at(i):
        index, where = locate(i)
        return tile_statistics_by_index(weight, index, where, e_n, head.margin,
                                        lambda: bitcast(weight[index], dtypes[0]))

    n_tiles = tiles.num_tiles(num_rows, tile)
    lse, losses = combine_stats(*tiles.online_stats(e_n, n_tiles, stats_at), class_axes)
    g = jnp.full_like(lse, 1.0 / global_batch)
    # a non-finite embedding or loss never reaches the rows (the caller sees the loss non-finite); every shard
    # decides alike (replicas of the rows over data axes hold other samples)
    finite = jnp.all(jnp.isfinite(lse)) & jnp.all(jnp.isfinite(e_n32))
    # every target among the rows taking part, on one shard (a sample drawn for other labels misses some): else the
    # loss is NaN and the rows stay, as for a label outside [0, num_classes)
    sampled = lax.psum(jnp.sum(targets >= 0), class_axes) == targets.shape[0]
    finite, sampled = lax.pmin(jnp.stack([finite, sampled]).astype(jnp.int32), head.mesh.axis_names) > 0
    keep_update = keep_update & finite & sampled
    count = count + keep_update.astype(count.dtype) if with_update else count  # the optimizer's step number

    rule = optimizer_rule(head.optimizer, dtypes if bits else None)

    def backward(carry, i):
        d_e, arrays = carry
        index, where = locate(i)
        # rows the tile does not own (overlap with the previous tile) or padding stay as they are
        update = (keep_update & where.kept, rule, lr, count, shard_first) if with_update else ()
        d_e_tile, arrays = tile_backward(arrays, index, where, e_n, lse, g, head.margin,
                                         lambda: bitcast(arrays[0][index], dtypes[0]), *update)
        return (d_e + d_e_tile, arrays), None

    (d_e, (weight, *slots)), _ = lax.scan(backward, (jnp.zeros_like(e_n32), (weight, *slots)), jnp.arange(n_tiles))
    total = jnp.sum(losses)
    if layout.data_axes(class_axes):
        total = lax.psum(total, layout.data_axes(class_axes))
    weight, *slots = (bitcast(a, t) for a, t in zip((weight, *slots), dtypes))
    return total / global_batch * jnp.where(sampled, 1.0, jnp.nan), pull(d_e)[0], weight, tuple(slots), count


def stores_bits(mesh: Mesh) -> bool:
    """Whether the step moves some dtypes' rows as raw bits on ``mesh`` (``stored_as_bits``): on CPU."""
    return layout.on_cpu(mesh)


def stored_as_bits(mesh: Mesh, dtype) -> bool:
    """Whether ``FCHead.step`` moves rows of ``dtype`` as raw bits on ``mesh``: on CPU, those of the dtypes XLA:CPU
    scatters into only by converting the whole array (``precision.cpu_scatter_converts``: bfloat16, 8-bit floats)."""
    return stores_bits(mesh) and cpu_scatter_converts(dtype)


def optimizer_rule(optimizer: SparseOptimizer, dtypes: tuple | None = None):
    """``rows_backward.tile_backward``'s rule for ``optimizer``: ``(rows, (product, radial), index, lr, count,
    shard_first)`` → new rows, where ``rows`` are the weight's and the slots' ``[T, …]`` as stored (as raw bits where
    ``dtypes`` names their dtypes, on CPU), ``index`` their local indices and ``shard_first`` the class of local row
    0. The rows' gradient is formed from ``tiles.tile_grad_parts``' two parts and rounded to the weight's dtype as
    the autodiff route rounds it."""

    def rule(rows, row_grad, index, lr, count, shard_first):
        weight, *slots = rows if dtypes is None else (bitcast(r, t) for r, t in zip(rows, dtypes))
        grads = tiles.row_gradient(weight, *row_grad).astype(weight.dtype)
        new_weight, new_slots = optimizer.apply_rows(weight, slots, grads, lr, count, index + shard_first)
        return (new_weight, *new_slots) if dtypes is None else tuple(map(as_bits, (new_weight, *new_slots)))

    return rule


