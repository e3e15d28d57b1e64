"""Combined angular margins (ArcFace, CosFace, SphereFace, AM-softmax).

With ``x = cos θ`` between a normalized embedding and its class centre, the
target logit is ``s · (cos(m1·θ + m2) − m3)`` and every other logit ``s · x``.

Beyond ``m1·θ + m2 = π`` the formula would turn back up (a larger angle giving a
*larger* target logit), so past the threshold angle ``θ* = (π − m2) / m1`` the
target logit continues linearly in ``x``: ``s · (x − m3 − (cos θ* + 1))``. That
is continuous at ``θ*`` and keeps the margin monotone with gradient ``s``.

Gradients are exact by default and finite everywhere: ``acos`` and ``sin θ``
use a guarded derivative ``1 / sqrt(max(1 − x², ε))`` so that ``x = ±1`` gives
a finite gradient. ``straight_through=True`` reproduces arcface_torch's margin
computed under ``no_grad`` (its ``CombinedMarginLoss`` since December 2022): the value is
``s · (cos(m1·θ + m2) − m3)`` at every angle, past π too, and the gradient that of ``s · x`` (no chain
factor through the margin), so no threshold is needed; every margin accepts it (for CosFace and AM-softmax
the two gradients coincide). Only samples more than ``θ*`` from their centre see the two forms' values differ.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

_EPS = 1e-6  # guard on 1 - x² in derivatives; float32 resolves x to ~6e-8


@jax.custom_jvp
def _safe_acos(x):
    return jnp.arccos(x)


@_safe_acos.defjvp
def _safe_acos_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return jnp.arccos(x), -t / jnp.sqrt(jnp.maximum(1.0 - x * x, _EPS))


@jax.custom_jvp
def _safe_sin_of_acos(x):
    """sin(acos x) = sqrt(1 − x²) with a finite derivative at x = ±1."""
    return jnp.sqrt(jnp.maximum(1.0 - x * x, 0.0))


@_safe_sin_of_acos.defjvp
def _safe_sin_of_acos_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return _safe_sin_of_acos(x), -x * t / jnp.sqrt(jnp.maximum(1.0 - x * x, _EPS))


@dataclasses.dataclass(frozen=True)
class CombinedMargin:
    """``s · (cos(m1·θ + m2) − m3)`` on the target, ``s · cos θ`` elsewhere.

    Frozen and hashable, so it can be a static argument of jitted functions.
    """

    s: float = 64.0
    m1: float = 1.0
    m2: float = 0.0
    m3: float = 0.0
    straight_through: bool = False

    def __post_init__(self):
        if self.s <= 0 or self.m1 <= 0:
            raise ValueError(f"margin needs s > 0 and m1 > 0, got s={self.s}, m1={self.m1}")
        if not 0 <= self.m2 < math.pi:
            raise ValueError(f"margin m2 must be in [0, π), got {self.m2}")

    @property
    def threshold_cos(self) -> float:
        """cos θ* where m1·θ* + m2 = π; below it the linear continuation applies."""
        return math.cos(min((math.pi - self.m2) / self.m1, math.pi))

    def target_logit(self, cos: jax.Array) -> jax.Array:
        """Margin target logit for ``cos`` (float32, any shape), clamped to [-1, 1] as torch clamps: the clamp's
        gradient is 1 on the closed interval, ±1 included (``jnp.clip`` halves it there), and 0 outside."""
        x = cos.astype(jnp.float32)
        x = jnp.where(jnp.abs(x) <= 1.0, x, jnp.sign(x))
        value = self._target_cos(x)
        if self.straight_through:
            value = x + jax.lax.stop_gradient(value - x)
        return self.s * value

    def _target_cos(self, x):
        if self.m1 == 1.0 and self.m2 == 0.0:  # CosFace / AM-softmax: exact, no acos
            return x - self.m3
        if self.m1 == 1.0:  # ArcFace family: cos(θ + m2) by the angle-sum identity
            cos_m = x * math.cos(self.m2) - _safe_sin_of_acos(x) * math.sin(self.m2)
        else:
            cos_m = jnp.cos(self.m1 * _safe_acos(x) + self.m2)
        if self.threshold_cos <= -1.0 or self.straight_through:  # never past π, or as arcface_torch: no threshold
            return cos_m - self.m3
        linear = x - (self.threshold_cos + 1.0)
        return jnp.where(x >= self.threshold_cos, cos_m, linear) - self.m3

    def logits(self, cos: jax.Array) -> jax.Array:
        """Non-target logits ``s · cos`` (keeps the dtype of ``cos``)."""
        return cos * jnp.asarray(self.s, cos.dtype)


def arcface(s: float = 64.0, m: float = 0.5, straight_through: bool = False) -> CombinedMargin:
    """Additive angular margin: ``s · cos(θ + m)``."""
    return CombinedMargin(s=s, m2=m, straight_through=straight_through)


def cosface(s: float = 64.0, m: float = 0.4, straight_through: bool = False) -> CombinedMargin:
    """Additive cosine margin: ``s · (cos θ − m)`` (its exact gradient already is the straight-through one)."""
    return CombinedMargin(s=s, m3=m, straight_through=straight_through)


def am_softmax(s: float = 30.0, m: float = 0.35, straight_through: bool = False) -> CombinedMargin:
    """AM-softmax: with normalized features this is CosFace; defaults from its paper."""
    return CombinedMargin(s=s, m3=m, straight_through=straight_through)


def sphereface(s: float = 64.0, m: float = 1.35, straight_through: bool = False) -> CombinedMargin:
    """Multiplicative angular margin: ``s · cos(m·θ)`` (normalized features, as in the anchors)."""
    return CombinedMargin(s=s, m1=m, straight_through=straight_through)


def combined(s: float = 64.0, m: tuple = (1.0, 0.5, 0.0), straight_through: bool = False) -> CombinedMargin:
    """``s · (cos(m1·θ + m2) − m3)`` from ``m = (m1, m2, m3)``, arcface_torch's ``margin_list``."""
    if not isinstance(m, (tuple, list)) or len(m) != 3:
        raise ValueError(f"margin 'combined' takes m = (m1, m2, m3), as arcface_torch's margin_list; got {m!r}")
    m1, m2, m3 = (float(value) for value in m)
    return CombinedMargin(s=s, m1=m1, m2=m2, m3=m3, straight_through=straight_through)


# name -> (s, m, straight_through) -> CombinedMargin; the config's margin.name
MARGINS = {"arcface": arcface, "cosface": cosface, "am_softmax": am_softmax, "sphereface": sphereface,
           "combined": combined}
