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
A one-byte ``state_dtype`` (``int8`` or ``float8_e4m3fn``) stores each slot as that
``[C_pad, D]`` array and a float32 scale per row ``[C_pad, 1]`` (the row's largest
magnitude maps to the dtype's largest value): D + 4 bytes per row instead of 2·D for
bfloat16. The weight update uses the float32 state before it is rounded for storage.

A bfloat16 weight keeps 8 significant bits: rounded to nearest, an update below half its step (at millions of classes,
a sampled row's gradient near 1/C and its weight decay) is lost. ``weight_rounding="stochastic"`` rounds the new
weight rows up or down with the probabilities that make the stored value equal the float32 one in expectation; the
random bits are a hash of (class, column, step), so every mesh and every form of the fused step draw the same ones
and the state gains nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from jaxcls.mesh import DEFAULT_CLASS_AXES, on_cpu, row_spec, weight_spec
from jaxcls.precision import as_bits, bitcast


class SparseState(NamedTuple):
    """``slots``: per-row state arrays ``[C_pad, D]`` (and, for a one-byte state, each followed by its scales
    ``[C_pad, 1]``) sharded like the weight; ``count``: steps taken."""

    slots: tuple
    count: jax.Array


# A row rule maps float32 (weight rows, slot rows, grads, lr, count) to (new weight rows, new slot rows).
RowRule = Callable[..., tuple]


class SparseOptimizer(NamedTuple):
    """``init(weight) -> SparseState``; ``update(weight, state, rows, grads, lr, mesh=, class_axes=)``.
    ``weight_rounding``: how the new weight rows are stored, ``"nearest"`` or ``"stochastic"`` (bfloat16 weights)."""

    num_slots: int
    rule: RowRule
    state_dtype: Any
    weight_rounding: str = "nearest"
    check_state_dtype: Callable[[Any], None] = lambda dtype: None  # raises for a storage the rule cannot keep

    def init(self, weight: jax.Array) -> SparseState:
        """Zero slots, each its own array (a step may donate them all)."""
        dtype = weight.dtype if self.state_dtype is None else jnp.dtype(self.state_dtype)
        self.check_state_dtype(dtype)
        slots = []
        for _ in range(self.num_slots):
            slots.append(jnp.zeros_like(weight, dtype=dtype))
            if row_scaled(dtype):
                slots.append(jnp.zeros_like(weight[:, :1], dtype=jnp.float32))
        return SparseState(tuple(slots), jnp.zeros((), jnp.int32))

    def update(self, weight: jax.Array, state: SparseState, rows: jax.Array | None, grads: jax.Array, lr, *,
               mesh: Mesh, class_axes=DEFAULT_CLASS_AXES) -> tuple[jax.Array, SparseState]:
        """Apply one step to the rows ``rows`` (``[W·B]``, local indices, ``P(class_axes)``).

        ``grads`` ``[W·B, D]`` is the gradient w.r.t. the gathered rows (``P(class_axes, None)``).
        ``rows=None`` updates every row (``grads`` is then ``[C_pad, D]``), without gather or scatter.
        Returns the new weight and state; donate the old ones to update in place (on CPU a bfloat16 or 8-bit float
        array moves as its bits, in place under XLA:CPU's elemental emitter: ``precision.ELEMENTAL_EMITTER``).
        """
        class_axes = tuple(class_axes)
        count = state.count + 1
        if rows is None:
            classes = jnp.arange(weight.shape[0], dtype=jnp.int32)
            weight, slots = self.apply_rows(weight, state.slots, grads, lr, count, classes)
            return weight, SparseState(slots, count)
        rows_spec, matrix_spec = row_spec(class_axes), weight_spec(class_axes)
        slots_spec = (matrix_spec,) * len(state.slots)
        weight, slots = jax.shard_map(
            partial(self._update_shard, class_axes=class_axes, as_stored=as_bits if on_cpu(mesh) else lambda a: a),
            mesh=mesh,
            in_specs=(matrix_spec, slots_spec, rows_spec, matrix_spec, P(), P()),
            out_specs=(matrix_spec, slots_spec),
        )(weight, state.slots, rows, grads, jnp.asarray(lr, jnp.float32), count)
        return weight, SparseState(slots, count)

    def apply_rows(self, weight, slots, grads, lr, count, classes=None) -> tuple[jax.Array, tuple]:
        """The rule on rows ``weight`` ``[R, D]`` and the stored ``slots`` (of ``SparseState.slots``, rows ``R``)
        in float32, results in their storage dtypes.

        ``count`` is the step number being taken (1 on the first step); ``classes`` ``[R]`` int32 the rows' global
        indices, which stochastic rounding draws its bits from (needed only then).
        """
        check_weight_rounding(self.weight_rounding, weight.dtype)
        per_slot = len(slots) // self.num_slots
        stored = [slots[i:i + per_slot] for i in range(0, len(slots), per_slot)]
        new_w, new_slots = self.rule(weight.astype(jnp.float32), tuple(map(decode, stored)),
                                     grads.astype(jnp.float32), lr, count)
        if self.weight_rounding == "stochastic":
            if classes is None:
                raise ValueError("stochastic rounding draws its bits from the rows' classes: pass apply_rows(classes=)")
            new_w = stochastic_round(new_w, rounding_bits(classes, new_w.shape[-1], count))
        return new_w.astype(weight.dtype), tuple(a for n, s in zip(new_slots, stored) for a in encode(n, s[0].dtype))

    def _update_shard(self, weight, slots, rows, grads, lr, count, *, class_axes, as_stored):
        """Inside shard_map: gather ``rows``, update in float32, scatter back in the storage dtypes, the arrays held
        ``as_stored`` meanwhile (on CPU ``precision.as_bits``: XLA:CPU scatters into bfloat16 and 8-bit float arrays
        only by converting them whole)."""
        classes = rows + lax.axis_index(class_axes) * weight.shape[0]
        arrays, dtypes = tuple(map(as_stored, (weight, *slots))), tuple(a.dtype for a in (weight, *slots))
        old = tuple(bitcast(a[rows], t) for a, t in zip(arrays, dtypes))
        new_w, new_slots = self.apply_rows(old[0], old[1:], grads, lr, count, classes)
        weight, *slots = (bitcast(a.at[rows].set(bitcast(n, a.dtype), unique_indices=True), t)
                          for a, n, t in zip(arrays, (new_w, *new_slots), dtypes))
        return weight, tuple(slots)


WEIGHT_ROUNDINGS = ("nearest", "stochastic")


def check_weight_rounding(rounding: str, weight_dtype) -> None:
    """Refuse an unknown rounding, or stochastic rounding of a weight that is not bfloat16."""
    if rounding not in WEIGHT_ROUNDINGS:
        raise ValueError(f"unknown FC weight rounding {rounding!r}; choose one of {list(WEIGHT_ROUNDINGS)}")
    if rounding == "stochastic" and weight_dtype is not None and jnp.dtype(weight_dtype) != jnp.bfloat16:
        raise ValueError(f"stochastic rounding is for a bfloat16 FC weight, not {jnp.dtype(weight_dtype).name} "
                         "(a float32 weight rounds no update away; float16 is not supported): set fc_dtype=bfloat16 "
                         "or fc_weight_rounding=nearest")


def _mix(x: jax.Array) -> jax.Array:
    """A bijective avalanche of uint32 words (Wellons' lowbias32 hash)."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def rounding_bits(classes: jax.Array, dim: int, step: jax.Array) -> jax.Array:
    """Uniform uint32 words ``[R, dim]``, a hash of each entry's (class ``classes[r]``, column, ``step``): the same
    bits wherever a row is updated (any mesh, either form of the fused step), different at every step."""
    column = _mix(lax.broadcasted_iota(jnp.int32, (1, dim), 1).astype(jnp.uint32) + jnp.uint32(0x9E3779B9))
    row = _mix(classes.astype(jnp.uint32) ^ _mix(jnp.asarray(step).astype(jnp.uint32)))
    return _mix(row[:, None] ^ column)


def stochastic_round(x: jax.Array, bits: jax.Array) -> jax.Array:
    """Float32 ``x`` rounded to a bfloat16 value (returned as float32): its magnitude up with probability equal to
    the share of bfloat16's step that it lies above the lower neighbour, by adding 16 of ``bits`` (uint32, shaped as
    ``x``) to the low half of its float32 word and truncating. Unbiased; infinities and NaNs are left as they are."""
    word = lax.bitcast_convert_type(x, jnp.uint32)
    finite = (word & jnp.uint32(0x7F800000)) != jnp.uint32(0x7F800000)
    rounded = (word + (bits >> 16)) & jnp.uint32(0xFFFF0000)
    return lax.bitcast_convert_type(jnp.where(finite, rounded, word), jnp.float32)


def row_scaled(dtype) -> bool:
    """Whether a state in ``dtype`` is stored with a float32 scale per row (one-byte dtypes)."""
    return jnp.dtype(dtype).itemsize == 1


def encode(rows: jax.Array, dtype) -> tuple:
    """Float32 rows ``[R, D]`` as stored in ``dtype``: ``(rows,)`` rounded, or for a one-byte dtype ``(values
    [R, D], scales [R, 1])`` with each row's largest magnitude at the dtype's largest value (round to nearest)."""
    if not row_scaled(dtype):
        return (rows.astype(dtype),)
    top = float(jnp.finfo(dtype).max if jnp.issubdtype(dtype, jnp.floating) else jnp.iinfo(dtype).max)
    scale = jnp.max(jnp.abs(rows), axis=-1, keepdims=True) / top
    values = jnp.clip(rows / jnp.where(scale > 0, scale, 1.0), -top, top)
    if jnp.issubdtype(dtype, jnp.integer):
        values = round_half_even(values)
    return values.astype(dtype), scale


def round_half_even(x: jax.Array) -> jax.Array:
    """``jnp.round(x)`` (to the nearest integer, ties to even) from exact floor and compare steps: Pallas' Triton
    kernels have no ``round``, and XLA folds the ``x + 1.5·2²³ − 1.5·2²³`` trick away."""
    low = jnp.floor(x)
    above = x - low  # exact
    low_is_odd = low - 2 * jnp.floor(low / 2) != 0
    return jnp.where((above > 0.5) | ((above == 0.5) & low_is_odd), low + 1, low)


def decode(stored: tuple) -> jax.Array:
    """Float32 rows from ``encode``'s output."""
    values, *scale = stored
    return values.astype(jnp.float32) * scale[0] if scale else values.astype(jnp.float32)


def sgd(momentum: float = 0.9, weight_decay: float = 5e-4, state_dtype=None,
        weight_rounding: str = "nearest") -> SparseOptimizer:
    """SGD with momentum and L2 weight decay, as ``torch.optim.SGD`` and arcface_torch's defaults.

    ``g ← g + wd·w;  buf ← μ·buf + g;  w ← w − lr·buf``.
    """
    def rule(w, slots, g, lr, count):
        g = g + weight_decay * w
        buf = momentum * slots[0] + g
        return w - lr * buf, (buf,)

    return _checked(SparseOptimizer(1, rule, state_dtype, weight_rounding, _check_sgd_state))


def adamw(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.1,
          state_dtype=None, weight_rounding: str = "nearest") -> SparseOptimizer:
    """AdamW (decoupled weight decay), as ``optax.adamw`` / ``torch.optim.AdamW``, on the sampled rows.

    Its state (``state_dtype``, or the weight's where None) is float32. In a one-byte or float16 state a row's small
    second moments round to 0 (in float16 ``(1 − b2)·g²`` is below its smallest subnormal once ``|g| < 8e-3``) and
    its steps blow up (65× torch's at gradients of 1e-4). In bfloat16 (8 bits of precision) ``b2·ν`` rounds back to
    ``ν``, so ν never decays, and ``(1 − b2)·g²`` stops adding once it is below half a step of ν (after ~500 updates
    of a row): from ν = 0 and g = 1, 3,000 updates leave ν at 0.25 where float32 has 0.95.
    """
    def rule(w, slots, g, lr, count):
        mu = b1 * slots[0] + (1 - b1) * g
        nu = b2 * slots[1] + (1 - b2) * g * g
        t = count.astype(jnp.float32)
        step = (mu / (1 - b1**t)) / (jnp.sqrt(nu / (1 - b2**t)) + eps)
        return w - lr * (step + weight_decay * w), (mu, nu)

    return _checked(SparseOptimizer(2, rule, state_dtype, weight_rounding, _check_adamw_state))


def _checked(optimizer: SparseOptimizer) -> SparseOptimizer:
    """``optimizer``, its settings refused as it is made where they cannot work: a state dtype it was given (the
    weight's, where it keeps that, is checked by ``init``) and the weight rounding."""
    if optimizer.state_dtype is not None:
        optimizer.check_state_dtype(optimizer.state_dtype)
    check_weight_rounding(optimizer.weight_rounding, None)
    return optimizer


def _check_adamw_state(dtype) -> None:
    if jnp.dtype(dtype) != jnp.float32:
        raise ValueError(f"adamw cannot keep its FC state in {jnp.dtype(dtype).name} (its second moment rounds to 0 "
                         "or stops following the gradients there: use float32, fc_state_dtype=float32 in a config; a "
                         "run saved with one evaluates as it is, and goes on in a new workdir with --init_from "
                         "WORKDIR --init_fc); 16-bit and one-byte states are for sgd's momentum")


def _check_sgd_state(dtype) -> None:
    dtype = jnp.dtype(dtype)
    if not (jnp.issubdtype(dtype, jnp.floating) or dtype == jnp.int8):
        raise ValueError(f"sgd cannot keep its momentum in {dtype.name}: a floating dtype or int8 (scaled per row)")

