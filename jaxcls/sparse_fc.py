"""Sparse optimizers for the FC weight: update only the PartialFC-sampled rows.

Each class shard gathers its sampled rows of the weight and of the optimizer
state, updates them in float32 and scatters them back: the cost is proportional
to the sampled rows; every other row and its state stay untouched, bit for bit.

As in PLSC's sparse momentum, the state of a row that is not sampled simply
waits: no decay of its momentum, no weight decay, until it is sampled again
(arcface_torch instead decays every row every step). AdamW's bias correction
uses the global step count (as LazyAdam does).

Storage dtype is the weight's own (float32, bfloat16 or float16); the optimizer
state is stored in ``state_dtype`` (default: the weight's). The arithmetic is float32.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from jaxcls.mesh import DEFAULT_CLASS_AXES, row_spec, weight_spec


class SparseState(NamedTuple):
    """``slots``: per-row state arrays ``[C_pad, D]`` sharded like the weight; ``count``: steps taken."""

    slots: tuple
    count: jax.Array


# A row rule maps float32 (weight rows, slot rows, grads, lr, count) to (new weight rows, new slot rows).
RowRule = Callable[..., tuple]


class SparseOptimizer(NamedTuple):
    """``init(weight) -> SparseState``; ``update(weight, state, rows, grads, lr, mesh=, class_axes=)``."""

    num_slots: int
    rule: RowRule
    state_dtype: Any

    def init(self, weight: jax.Array) -> SparseState:
        dtype = weight.dtype if self.state_dtype is None else self.state_dtype
        slots = tuple(jnp.zeros_like(weight, dtype=dtype) for _ in range(self.num_slots))
        return SparseState(slots, jnp.zeros((), jnp.int32))

    def update(self, weight: jax.Array, state: SparseState, rows: jax.Array | None, grads: jax.Array, lr, *,
               mesh: Mesh, class_axes=DEFAULT_CLASS_AXES) -> tuple[jax.Array, SparseState]:
        """Apply one step to the rows ``rows`` (``[W·B]``, local indices, ``P(class_axes)``).

        ``grads`` ``[W·B, D]`` is the gradient w.r.t. the gathered rows (``P(class_axes, None)``).
        ``rows=None`` updates every row (``grads`` is then ``[C_pad, D]``), without gather or scatter.
        Returns the new weight and state; donate the old ones to update in place.
        """
        class_axes = tuple(class_axes)
        count = state.count + 1
        if rows is None:
            weight, slots = self.apply_rows(weight, state.slots, grads, lr, count)
            return weight, SparseState(slots, count)
        rows_spec, matrix_spec = row_spec(class_axes), weight_spec(class_axes)
        weight, slots = jax.shard_map(
            self._update_shard, mesh=mesh,
            in_specs=(matrix_spec, (matrix_spec,) * self.num_slots, rows_spec, matrix_spec, P(), P()),
            out_specs=(matrix_spec, (matrix_spec,) * self.num_slots),
        )(weight, state.slots, rows, grads, jnp.asarray(lr, jnp.float32), count)
        return weight, SparseState(slots, count)

    def apply_rows(self, weight, slots, grads, lr, count) -> tuple[jax.Array, tuple]:
        """The rule on rows ``weight`` / ``slots`` ``[R, D]`` in float32, results in their storage dtypes.

        ``count`` is the step number being taken (1 on the first step).
        """
        f32 = lambda x: x.astype(jnp.float32)
        new_w, new_slots = self.rule(f32(weight), tuple(map(f32, slots)), f32(grads), lr, count)
        return new_w.astype(weight.dtype), tuple(n.astype(s.dtype) for s, n in zip(slots, new_slots))

    def _update_shard(self, weight, slots, rows, grads, lr, count):
        """Inside shard_map: gather ``rows``, update in float32, scatter back in the storage dtypes."""
        new_w, new_slots = self.apply_rows(weight[rows], tuple(s[rows] for s in slots), grads, lr, count)
        weight = weight.at[rows].set(new_w, unique_indices=True)
        slots = tuple(s.at[rows].set(n, unique_indices=True) for s, n in zip(slots, new_slots))
        return weight, slots


def sgd(momentum: float = 0.9, weight_decay: float = 5e-4, state_dtype=None) -> SparseOptimizer:
    """SGD with momentum and L2 weight decay, as ``torch.optim.SGD`` and arcface_torch's defaults.

    ``g ← g + wd·w;  buf ← μ·buf + g;  w ← w − lr·buf``.
    """

    def rule(w, slots, g, lr, count):
        g = g + weight_decay * w
        buf = momentum * slots[0] + g
        return w - lr * buf, (buf,)

    return SparseOptimizer(1, rule, state_dtype)


def adamw(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.1,
          state_dtype=None) -> SparseOptimizer:
    """AdamW (decoupled weight decay), as ``optax.adamw`` / ``torch.optim.AdamW``, on the sampled rows."""

    def rule(w, slots, g, lr, count):
        mu = b1 * slots[0] + (1 - b1) * g
        nu = b2 * slots[1] + (1 - b2) * g * g
        t = count.astype(jnp.float32)
        step = (mu / (1 - b1**t)) / (jnp.sqrt(nu / (1 - b2**t)) + eps)
        return w - lr * (step + weight_decay * w), (mu, nu)

    return SparseOptimizer(2, rule, state_dtype)

