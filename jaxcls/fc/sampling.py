"""PartialFC: class-centre sampling on each class shard.

Per shard, every positive class of the global batch that lives on the shard is kept and
the rest of a **static** budget is filled with distinct, uniformly random negatives
(``fold_in`` of the shard index, so every shard draws its own). The budget is

    B = min(C_local, max(⌈sample_rate · C_local⌉, min(C_local, N)))

with ``N`` the global batch: a shard can never hold more than ``min(C_local, N)``
positives, so they always fit and shapes stay static. A budget of ``C_local`` (always so
at ``sample_rate = 1``) takes every row, without drawing: exactly the full loss.

The trainer's fused step (``jaxcls.fc.FCHead.step``) reads and updates the sampled rows in
place, tile by tile. For user code the composable route is ``gather_rows`` → the loss on
those ``[W·B, D]`` rows (``sharded_margin_loss(..., row_classes=sample.classes)``) under
``jax.grad`` → ``jaxcls.fc.optimizers.SparseOptimizer.update``: no dense ``[C, D]`` gradient either way.
"""

from __future__ import annotations

import math
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from jaxcls.mesh import DEFAULT_CLASS_AXES, class_shards, row_spec, weight_spec


class ClassSample(NamedTuple):
    """Sampled rows, both ``[W·B]`` int32 sharded ``P(class_axes)``, ascending within each shard.

    ``rows``: index of each sampled row in its shard's local weight block.
    ``classes``: its global class id (``>= num_classes`` for padding rows), the ``row_classes`` of the loss.
    """

    rows: jax.Array
    classes: jax.Array


def check_sample_rate(sample_rate: float) -> None:
    """Raise ``ValueError`` unless ``0 < sample_rate <= 1``."""
    if not 0.0 < sample_rate <= 1.0:
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")


def sample_budget(c_local: int, global_batch: int, sample_rate: float) -> int:
    """Static per-shard number of sampled rows (see the module docstring)."""
    check_sample_rate(sample_rate)
    return min(c_local, max(math.ceil(sample_rate * c_local), min(c_local, global_batch)))


def sample_classes(key: jax.Array, labels: jax.Array, *, mesh: Mesh, num_classes: int, num_rows: int,
                   sample_rate: float, class_axes=DEFAULT_CLASS_AXES) -> ClassSample:
    """Draw each class shard's sample for the global batch ``labels`` ``[N]`` (batch sharded).

    ``num_rows`` is the full weight's padded row count. Identical on every replica of
    a shard (with ``class_axes=('class',)`` the data replicas agree), deterministic in ``key``.
    """
    class_axes = tuple(class_axes)
    shards = class_shards(mesh, class_axes)
    if num_rows % shards:
        raise ValueError(f"num_rows {num_rows} is not divisible by the {shards} class shards")
    c_local = num_rows // shards
    budget = sample_budget(c_local, labels.shape[0], sample_rate)
    per_shard = partial(_sample_shard, c_local=c_local, budget=budget, num_classes=num_classes,
                        class_axes=class_axes)
    # labels enter replicated (N int32 gathered by jit), so every shard sees the global batch and the
    # sample is invariant over the axes outside class_axes.
    spec = row_spec(class_axes)
    return jax.shard_map(per_shard, mesh=mesh, in_specs=(P(), P()),
                         out_specs=ClassSample(spec, spec))(key, labels.astype(jnp.int32))


def _sample_shard(key, labels, *, c_local, budget, num_classes, class_axes):
    shard = lax.axis_index(class_axes)
    first = shard * c_local
    if budget == c_local:  # every row: nothing to draw
        rows = jnp.arange(c_local, dtype=jnp.int32)
    else:
        rows = top_rows(draw_keys(jax.random.fold_in(key, shard), labels, first, c_local, num_classes), budget)
    return ClassSample(rows, rows + first)


DRAW_BITS = 23  # the random bits of a class's key: those of a float32 jax.random.uniform draw
POSITIVE_KEY = 2**DRAW_BITS + 1  # above every draw: the batch's classes are always in
PADDING_KEY = 0  # below every draw: padding rows are the last to be taken


def draw_keys(key, labels, first: int, c_local: int, num_classes: int) -> jax.Array:
    """Each of a shard's ``c_local`` classes (from ``first`` on) its key ``[c_local]`` int32: ``1 + `` 23 random bits
    for a real class, ``POSITIVE_KEY`` for a class of ``labels`` ``[N]``, ``PADDING_KEY`` past ``num_classes``.

    The random keys order the classes, ties included, as ``jax.random.uniform(key, (c_local,))`` does (its float32 is
    ``1.bits[9:] − 1``): the sample is the one an earlier jaxcls drew from those floats by ``lax.top_k``.
    """
    bits = jax.random.bits(key, (c_local,), jnp.uint32)
    keys = lax.shift_right_logical(bits, jnp.uint32(32 - DRAW_BITS)).astype(jnp.int32) + 1
    keys = jnp.where(first + jnp.arange(c_local) < num_classes, keys, PADDING_KEY)
    local = labels - first
    return keys.at[jnp.where((local >= 0) & (local < c_local), local, c_local)].set(POSITIVE_KEY, mode="drop")


KEY_DIGIT = 4  # top_rows finds the threshold key this many bits at a time


def top_rows(keys: jax.Array, count: int) -> jax.Array:
    """The indices ``[count]`` int32, ascending, of the ``count`` largest of ``keys`` ``[C]`` (int32 in ``[0,
    2^24)``), ties taken lowest index first: ``jnp.sort(lax.top_k(keys, count)[1])``, without sorting.

    ``lax.top_k`` over a PartialFC shard's classes compiled for a GPU is a bitonic sort of every ``(key, index)``
    pair: 120 passes over 36.9M of them (16 B each way), against about 0.1 GB read and written in all here. The
    threshold (the ``count``-th largest key) is found ``KEY_DIGIT`` bits at a time, each digit by counting the keys
    at or above each of its values (6 reads of ``keys``); the ties at it are ranked by a prefix sum and the rows
    placed by another, in order.
    """
    if not 0 < count <= keys.shape[0]:
        raise ValueError(f"cannot take the {count} largest of {keys.shape[0]} keys")
    threshold = jnp.int32(0)  # invariant: at least `count` keys are at or above it
    for shift in range(24 - KEY_DIGIT, -1, -KEY_DIGIT):
        steps = jnp.arange(1, 2**KEY_DIGIT, dtype=jnp.int32) << shift
        at_or_above = jnp.sum(keys[:, None] >= threshold + steps, axis=0, dtype=jnp.int32)  # falls with the step
        threshold = threshold + (jnp.sum(at_or_above >= count, dtype=jnp.int32) << shift)
    above, tie = keys > threshold, keys == threshold
    quota = count - jnp.sum(above, dtype=jnp.int32)  # of the ties, the first this many
    taken = above | (tie & (jnp.cumsum(tie, dtype=jnp.int32) <= quota))
    index = jnp.arange(keys.shape[0], dtype=jnp.int32)
    place = jnp.where(taken, jnp.cumsum(taken, dtype=jnp.int32) - 1, count + index)  # the rest: dropped, distinct
    return jnp.zeros(count, jnp.int32).at[place].set(index, mode="drop", unique_indices=True)


def gather_rows(weight: jax.Array, sample: ClassSample, *, mesh: Mesh, class_axes=DEFAULT_CLASS_AXES) -> jax.Array:
    """The sampled rows ``[W·B, D]`` of ``weight`` ``[C_pad, D]``, both ``P(class_axes, None)``; no communication."""
    return jax.shard_map(lambda w, rows: w[rows], mesh=mesh, in_specs=(weight_spec(class_axes), row_spec(class_axes)),
                         out_specs=weight_spec(class_axes))(weight, sample.rows)
