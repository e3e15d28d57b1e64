"""The class-sharded FC head: weight, margin loss, PartialFC sampling and sparse update in one place.

A train step uses it as::

    sample, rows = head.select(key, weight, labels)          # rows: [W·B, D] (or the whole weight)
    loss, (g_params, g_rows) = value_and_grad(lambda p, r: head.loss(backbone(p, x), r, labels, sample),
                                              argnums=(0, 1))(params, rows)
    weight, fc_state = head.update(weight, fc_state, sample, g_rows, lr)

With ``sample_rate = 1`` no sampling, gather or scatter happens: the full weight is used and updated densely.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxcls.losses import CombinedMargin, init_weight, padded_num_classes, sharded_margin_loss
from jaxcls.losses.sharded import DEFAULT_CLASS_AXES, class_shards
from jaxcls.partial_fc import ClassSample, gather_rows, sample_budget, sample_classes
from jaxcls.sparse_fc import SparseOptimizer, SparseState


@dataclasses.dataclass(frozen=True)
class FCHead:
    """FC weight ``[C_pad, D]`` sharded ``P(class_axes, None)`` in storage ``dtype``, with its loss and optimizer."""

    mesh: Mesh
    num_classes: int
    dim: int
    margin: CombinedMargin
    optimizer: SparseOptimizer
    sample_rate: float = 1.0
    class_axes: tuple = DEFAULT_CLASS_AXES
    chunk_size: int | None = None
    dtype: Any = jnp.float32

    def __post_init__(self):
        sample_budget(1, 1, self.sample_rate)  # validates the rate

    @property
    def rows(self) -> int:
        return padded_num_classes(self.num_classes, class_shards(self.mesh, self.class_axes))

    def init(self, key) -> tuple[jax.Array, SparseState]:
        weight = init_weight(key, self.num_classes, self.dim, self.mesh, self.class_axes, self.dtype)
        return weight, self.optimizer.init(weight)

    def select(self, key, weight, labels) -> tuple[ClassSample | None, jax.Array]:
        """The PartialFC sample for ``labels`` and the weight rows the loss will see."""
        if self.sample_rate == 1.0:
            return None, weight
        sample = sample_classes(key, labels, mesh=self.mesh, num_classes=self.num_classes, num_rows=self.rows,
                                sample_rate=self.sample_rate, class_axes=self.class_axes)
        return sample, gather_rows(weight, sample, mesh=self.mesh, class_axes=self.class_axes)

    def loss(self, embeddings, weight_rows, labels, sample: ClassSample | None) -> jax.Array:
        """Scalar mean margin loss of ``embeddings`` ``[N, D]`` against the selected rows."""
        return sharded_margin_loss(embeddings, weight_rows, labels, self.margin, mesh=self.mesh,
                                   class_axes=self.class_axes, num_classes=self.num_classes,
                                   chunk_size=self.chunk_size,
                                   row_classes=None if sample is None else sample.classes)

    def update(self, weight, state, sample: ClassSample | None, grads, lr) -> tuple[jax.Array, SparseState]:
        """One optimizer step on the selected rows (all rows without sampling)."""
        return self.optimizer.update(weight, state, None if sample is None else sample.rows, grads, lr,
                                     mesh=self.mesh, class_axes=self.class_axes)
