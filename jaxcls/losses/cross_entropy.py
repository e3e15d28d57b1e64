"""Softmax cross-entropy over logits whose class axis is split across devices.

For use inside ``shard_map``: each device holds the logits of its own classes
for the same rows. The forward needs one ``pmax`` and two ``psum`` of ``[N]``
vectors over the class axes; the backward, ``(softmax − onehot) · g``, needs no
communication at all. Statistics accumulate in float32 whatever the logits' dtype.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

AxisNames = str | tuple[str, ...]


def masked_fill_value(dtype) -> jax.Array:
    """The logit given to padding classes: the dtype's lowest finite value (exp → 0)."""
    return jnp.asarray(jnp.finfo(dtype).min, dtype)


def local_target(values: jax.Array, labels: jax.Array) -> jax.Array:
    """``values[i, labels[i]]`` as float32, 0 where ``labels[i] < 0`` (class not on this shard)."""
    picked = jnp.take_along_axis(values, jnp.maximum(labels, 0)[:, None], axis=1)[:, 0]
    return jnp.where(labels >= 0, picked.astype(jnp.float32), 0.0)


def combine_stats(row_max: jax.Array, row_sum: jax.Array, target: jax.Array, axis_name: AxisNames):
    """Global log-sum-exp and target logit from per-shard ``[N]`` statistics.

    ``row_sum`` is ``Σ exp(logit − row_max)`` over this shard's classes. Returns
    ``(lse, loss)`` with ``loss = lse − target_logit``, invariant over ``axis_name``.
    """
    global_max = lax.pmax(lax.stop_gradient(row_max), axis_name)
    total = lax.psum(row_sum * jnp.exp(row_max - global_max), axis_name)
    lse = jnp.log(total) + global_max
    return lse, lse - lax.psum(target, axis_name)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def class_parallel_cross_entropy(logits: jax.Array, labels: jax.Array, axis_name: AxisNames) -> jax.Array:
    """Per-example softmax cross-entropy with the class axis sharded over ``axis_name``.

    Args:
      logits: ``[N, C_local]`` (any float dtype) this device's classes for all N rows;
        padding classes should hold ``masked_fill_value(dtype)``.
      labels: ``[N]`` int, the target's index *within this shard*, or ``-1`` when
        the target class lives on another shard. Exactly one shard must own each row's target.
      axis_name: mesh axis name(s) over which the classes are split.

    Returns:
      ``[N]`` float32 losses, identical on every device of ``axis_name``.
    """
    return _forward(logits, labels, axis_name)[0]


def _forward(logits, labels, axis_name):
    x = logits.astype(jnp.float32)
    row_max = jnp.max(x, axis=1)
    row_sum = jnp.sum(jnp.exp(x - row_max[:, None]), axis=1)
    lse, loss = combine_stats(row_max, row_sum, local_target(x, labels), axis_name)
    return loss, (logits, labels, lse)


def _backward(axis_name, residuals, g):
    logits, labels, lse = residuals
    grad = softmax_minus_onehot(logits, labels, lse, column_offset=0) * g[:, None]
    return grad.astype(logits.dtype), None


def softmax_minus_onehot(logits: jax.Array, labels: jax.Array, lse: jax.Array, column_offset) -> jax.Array:
    """``exp(logits − lse) − onehot(labels − column_offset)`` in float32, ``[N, T]``."""
    probs = jnp.exp(logits.astype(jnp.float32) - lse[:, None])
    columns = lax.broadcasted_iota(jnp.int32, logits.shape, 1) + column_offset
    return probs - (columns == labels[:, None]).astype(jnp.float32)


class_parallel_cross_entropy.defvjp(_forward, _backward)
