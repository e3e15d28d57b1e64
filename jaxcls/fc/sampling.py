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
    share = math.ceil(round(sample_rate * c_local, 6))  # 0.55 · 100 is 55.000000000000007 in floats: 55, not 56
    return min(c_local, max(share, min(c_local, global_batch)))


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
        scores = jax.random.uniform(jax.random.fold_in(key, shard), (c_local,))
        scores = jnp.where(first + jnp.arange(c_local) < num_classes, scores, -1.0)  # padding last
        local = labels - first
        positives = jnp.where((local >= 0) & (local < c_local), local, c_local)
        scores = scores.at[positives].set(2.0, mode="drop")
        rows = jnp.sort(lax.top_k(scores, budget)[1]).astype(jnp.int32)
    return ClassSample(rows, rows + first)


def gather_rows(weight: jax.Array, sample: ClassSample, *, mesh: Mesh, class_axes=DEFAULT_CLASS_AXES) -> jax.Array:
    """The sampled rows ``[W·B, D]`` of ``weight`` ``[C_pad, D]``, both ``P(class_axes, None)``; no communication."""
    return jax.shard_map(lambda w, rows: w[rows], mesh=mesh, in_specs=(weight_spec(class_axes), row_spec(class_axes)),
                         out_specs=weight_spec(class_axes))(weight, sample.rows)
