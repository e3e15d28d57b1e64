"""Precision policies and dynamic loss scaling for float16.

Parameters and optimizer state are float32; the backbone computes in ``compute_dtype``; BatchNorm
statistics, the FC softmax and the loss are float32. float16 needs dynamic loss scaling: the loss is
multiplied by ``scale`` before differentiation and the gradients divided by it; a step whose gradients
are not all finite is skipped (parameters, optimizer state and BatchNorm statistics unchanged) and the
scale halved; after ``growth_interval`` finite steps in a row the scale doubles.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxcls.registry import lookup

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# the FC optimizer state's storage: "same" as the FC weight's, or a dtype (int8 with a scale per row:
# fc.optimizers.encode also takes float8_e4m3fn, which the trainer does not offer: int8 is the one checked by
# training, docs/partial_fc.md)
FC_STATE_DTYPES = {"same": None, **DTYPES, "int8": jnp.int8}


def cpu_scatter_converts(dtype) -> bool:
    """Whether XLA:CPU writes rows into a ``dtype`` array (a scatter) only by converting the whole array to float32 and
    back: bfloat16 and the 8-bit floats. Float32, float16 and integer arrays it updates in place, as GPUs do every
    dtype. On CPUs the FC step, the chunked loss and the sparse update move such rows as their bits (``as_bits``),
    in place only with ``ELEMENTAL_EMITTER``."""
    dtype = jnp.dtype(dtype)
    return bool(jnp.issubdtype(dtype, jnp.floating)) and dtype.itemsize < 4 and dtype != jnp.float16


# XLA:CPU's elemental emitter, as compile options: its fusion emitters (the default) write a whole-array bitcast as a
# copy, this emitter as nothing, so a program that moves rows as bits updates them in place only with it
ELEMENTAL_EMITTER = {"xla_cpu_use_fusion_emitters": False}


def bits_dtype(dtype):
    """The unsigned integer of ``dtype``'s size where ``cpu_scatter_converts(dtype)``, else ``dtype`` itself."""
    dtype = jnp.dtype(dtype)
    return jnp.dtype({1: jnp.uint8, 2: jnp.uint16}[dtype.itemsize]) if cpu_scatter_converts(dtype) else dtype


def as_bits(x: jax.Array) -> jax.Array:
    """``x`` as ``bits_dtype(x.dtype)``: its bits where XLA:CPU cannot scatter into its dtype in place."""
    return bitcast(x, bits_dtype(x.dtype))


def bitcast(x: jax.Array, dtype) -> jax.Array:
    """``x`` as ``dtype`` of its size, bit for bit (nothing where it already is one)."""
    return x if x.dtype == dtype else lax.bitcast_convert_type(x, dtype)


def compute_dtype(name: str):
    """The dtype named ``name`` (float32 | bfloat16 | float16), for ``precision`` and ``fc_dtype``."""
    return lookup(DTYPES, name, "precision")


class ScaleState(NamedTuple):
    scale: jax.Array  # float32 scalar
    good_steps: jax.Array  # int32 scalar: finite steps since the last change


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    """torch.cuda.amp.GradScaler semantics (arcface_torch uses ``growth_interval=100``)."""

    initial_scale: float = 2.0**16
    growth_interval: int = 100
    factor: float = 2.0
    enabled: bool = True

    def init(self) -> ScaleState:
        return ScaleState(jnp.float32(self.initial_scale if self.enabled else 1.0), jnp.int32(0))

    def scale_loss(self, loss, state: ScaleState):
        return loss * state.scale if self.enabled else loss

    def unscale(self, grads, state: ScaleState):
        if not self.enabled:
            return grads
        return jax.tree.map(lambda g: (g.astype(jnp.float32) / state.scale).astype(g.dtype), grads)

    def adjust(self, state: ScaleState, finite) -> ScaleState:
        """Next state after a step whose gradients were (not) all finite."""
        if not self.enabled:
            return state
        grow = finite & (state.good_steps + 1 >= self.growth_interval)
        grown = state.scale * self.factor  # kept only where finite, as torch's GradScaler (an inf scale stays inf)
        scale = jnp.where(finite, jnp.where(grow & jnp.isfinite(grown), grown, state.scale), state.scale / self.factor)
        good = jnp.where(finite & ~grow, state.good_steps + 1, 0)
        return ScaleState(scale.astype(jnp.float32), good.astype(jnp.int32))


def all_finite(tree) -> jax.Array:
    """True when every element of every floating-point leaf is finite (other leaves, e.g. PRNG keys, don't count)."""
    checks = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(checks)) if checks else jnp.bool_(True)


def select_tree(pred, on_true, on_false):
    """``on_true`` where ``pred`` (a scalar) else ``on_false``, leaf by leaf."""
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)
