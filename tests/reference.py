"""Plain dense float64 references, written from the formulas and nothing else."""

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxcls.losses import CombinedMargin, arcface, cosface, sphereface

MARGINS = {  # every margin family the tests run, ArcFace both exact and straight-through
    "arcface": arcface(),
    "arcface_st": arcface(straight_through=True),
    "cosface": cosface(),
    "sphereface": sphereface(),
    "combined": CombinedMargin(s=64.0, m1=1.0, m2=0.3, m3=0.2),
}


def margin_target(cos, s, m1, m2, m3, straight_through=False):
    """s·(cos(m1·θ + m2) − m3); past m1·θ + m2 = π, linear in cos (continuous at the threshold), except in the
    straight-through form (arcface_torch's, whose value is the formula's at every angle)."""
    theta = jnp.arccos(jnp.where(jnp.abs(cos) <= 1.0, cos, jnp.sign(cos)))  # torch's clamp: gradient 1 at ±1
    threshold = min((math.pi - m2) / m1, math.pi)
    linear = cos - (math.cos(threshold) + 1.0)
    value = jnp.where((m1 * theta + m2 <= math.pi) | straight_through, jnp.cos(m1 * theta + m2), linear)
    return s * (value - m3)


def dense_margin_loss(embeddings, weight, labels, s, m1, m2, m3, straight_through=False):
    """Mean margin softmax cross-entropy over all C = weight.shape[0] classes."""
    e = embeddings / jnp.linalg.norm(embeddings, axis=1, keepdims=True)
    w = weight / jnp.linalg.norm(weight, axis=1, keepdims=True)
    cos = e @ w.T
    rows = jnp.arange(cos.shape[0])
    target_cos = cos[rows, labels]
    target = margin_target(target_cos, s, m1, m2, m3, straight_through)
    if straight_through:
        target = s * target_cos + jax.lax.stop_gradient(target - s * target_cos)
    logits = (s * cos).at[rows, labels].set(target)
    return jnp.mean(jax.nn.logsumexp(logits, axis=1) - target)


def value_and_grads(embeddings, weight, labels, margin):
    """Loss and (d/d embeddings, d/d weight) in float64 for a ``CombinedMargin``."""
    with jax.enable_x64(True):
        f = lambda e, w: dense_margin_loss(e, w, labels, margin.s, margin.m1, margin.m2, margin.m3,
                                           margin.straight_through)
        loss, grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(np.asarray(embeddings, np.float64),
                                                            np.asarray(weight, np.float64))
        return float(loss), tuple(np.asarray(g) for g in grads)


def rel_err(actual, expected):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-30))


def sgd_step(w, slots, g, lr, count, momentum=0.9, weight_decay=5e-4):
    """torch.optim.SGD with momentum and L2 decay on float64 rows."""
    buf = momentum * slots[0] + g + weight_decay * w
    return w - lr * buf, (buf,)


def adamw_step(w, slots, g, lr, count, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1):
    """torch.optim.AdamW on float64 rows; ``count`` is the step being taken (1 first)."""
    mu = b1 * slots[0] + (1 - b1) * g
    nu = b2 * slots[1] + (1 - b2) * g * g
    step = (mu / (1 - b1**count)) / (np.sqrt(nu / (1 - b2**count)) + eps)
    return w - lr * (step + weight_decay * w), (mu, nu)


def aimed_at_targets(e, rows, rel, rng, signs=(-1.0, -1.0, 1.0)):
    """``e`` ``[n, d]`` with its first embeddings whose target row is among ``rows`` (``rel`` ≥ 0: the row) turned to
    ``sign ×`` that row plus some noise, then every row normalized: target cosines of about ±0.98 (past every
    margin's threshold angle, and near +1), which random embeddings in 32 dimensions never come near; 0.02 from ±1,
    where the clamp's gradient steps, so that 16-bit rounding does not take them over it."""
    e = np.array(e, np.float64)
    for k, sign in zip(np.flatnonzero(rel >= 0)[:len(signs)], signs):
        w = rows[rel[k]] / np.linalg.norm(rows[rel[k]])
        e[k] = sign * w + 0.2 * rng.normal(size=w.shape) / np.sqrt(w.size)
    return e / np.linalg.norm(e, axis=1, keepdims=True)
