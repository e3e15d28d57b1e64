"""Margin formulas (ArcFace, CosFace, SphereFace, AM-softmax, combined) against float64."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcls.losses import CombinedMargin, am_softmax, arcface, cosface, sphereface
from jaxcls.losses import margins as jaxcls_margins
from reference import MARGINS, margin_target, rel_err

def test_constructors_match_anchor_parameters():
    assert (arcface().s, arcface().m2) == (64.0, 0.5)
    assert (cosface().m3, sphereface().m1) == (0.4, 1.35)
    assert am_softmax(30.0, 0.35) == CombinedMargin(s=30.0, m3=0.35)


@pytest.mark.parametrize("name", sorted(MARGINS))
def test_target_logit_and_gradient_match_float64_formula(name, rng):
    margin = MARGINS[name]
    cos = rng.uniform(-0.999, 0.999, size=512).astype(np.float32)
    value, grad = jax.vmap(jax.value_and_grad(margin.target_logit))(jnp.asarray(cos))
    with jax.enable_x64(True):
        ref_fn = lambda c: margin_target(c, margin.s, margin.m1, margin.m2, margin.m3, margin.straight_through)
        ref_value, ref_grad = jax.vmap(jax.value_and_grad(ref_fn))(cos.astype(np.float64))
    assert rel_err(value, ref_value) < 1e-5
    if margin.straight_through:
        np.testing.assert_allclose(grad, margin.s)  # gradient of s·cos θ, no chain through the margin
    else:
        assert rel_err(grad, ref_grad) < 1e-4


@pytest.mark.parametrize("name", sorted(MARGINS))
def test_gradients_finite_at_the_edges(name):
    margin = MARGINS[name]
    edges = jnp.array([-1.0, -1.0 + 1e-7, -0.99, margin.threshold_cos, 0.0, 0.99, 1.0 - 1e-7, 1.0, 1.5, -1.5])
    grads = jax.vmap(jax.grad(margin.target_logit))(edges)
    assert np.all(np.isfinite(grads)), grads


@pytest.mark.parametrize("name", sorted(MARGINS))
def test_the_clamp_to_plus_minus_one_passes_the_whole_gradient_at_its_ends(name):
    """As torch's ``clamp`` (arcface_torch clamps the logits): at exactly ±1 the gradient is the margin's own there,
    not half of it; beyond, 0."""
    margin = MARGINS[name]
    for x in (-1.0, 1.0):
        own = jax.grad(lambda c: margin.s * margin._target_cos(c))(jnp.float32(x))
        if margin.straight_through:
            own = margin.s
        np.testing.assert_allclose(jax.grad(margin.target_logit)(jnp.float32(x)), own, rtol=1e-6)
    assert float(jax.grad(margin.target_logit)(jnp.float32(1.5))) == 0.0


@pytest.mark.parametrize("name", ["arcface", "sphereface", "combined"])
def test_continuous_and_monotone_past_pi(name):
    """Where m1·θ + m2 > π the target logit keeps falling as θ grows, without a jump."""
    margin = MARGINS[name]
    cos = jnp.linspace(-1.0, 1.0, 20001)
    logit = np.asarray(margin.target_logit(cos))
    assert np.all(np.diff(logit) > -1e-4), "target logit must not rise as the angle grows"
    assert np.max(np.abs(np.diff(logit))) < margin.s * 0.01, "no jump at the threshold"
    # The fallback region exists for these margins and uses slope s.
    t = margin.threshold_cos
    assert t > -1.0
    g = jax.grad(margin.target_logit)(jnp.float32((t - 1.0) / 2))
    assert math.isclose(float(g), margin.s, rel_tol=1e-5)


def test_cosface_is_exact_shift():
    cos = jnp.linspace(-1, 1, 101)
    np.testing.assert_allclose(cosface(s=10.0, m=0.4).target_logit(cos), 10.0 * (cos - 0.4), rtol=1e-6)


@pytest.mark.parametrize("kwargs", [dict(s=0.0), dict(m1=0.0), dict(m2=-0.1), dict(m2=4.0)])
def test_invalid_margin_parameters(kwargs):
    with pytest.raises(ValueError, match="margin"):
        CombinedMargin(**kwargs)


@pytest.mark.parametrize("name", sorted(jaxcls_margins.MARGINS))
def test_every_margin_honours_straight_through(name, rng):
    """The gradient is that of s·cos θ (for CosFace/AM-softmax it already was); the value is the exact form's up to
    the threshold angle and, past it, the formula's own (arcface_torch's), where the exact form goes on linearly."""
    exact, st = (jaxcls_margins.MARGINS[name](s=16.0, straight_through=flag) for flag in (False, True))
    cos = jnp.asarray(np.append(rng.uniform(-0.9999, 0.9999, size=254), [-1.0, 1.0]), jnp.float32)
    theta = np.arccos(np.asarray(cos, np.float64))
    formula = 16.0 * (np.cos(st.m1 * theta + st.m2) - st.m3)
    np.testing.assert_allclose(st.target_logit(cos), formula, rtol=1e-5, atol=1e-4)
    before = np.asarray(cos) >= exact.threshold_cos
    np.testing.assert_allclose(st.target_logit(cos)[before], exact.target_logit(cos)[before], rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(jax.vmap(jax.grad(st.target_logit))(cos), 16.0, rtol=1e-6)


def test_straight_through_arcface_past_pi_is_arcface_torchs_value():
    """At θ = 170°, m = 0.5: arcface_torch's s·cos(θ + m) = 64·cos(198.6°) = −60.64, above the exact form's
    linear continuation (−70.86): the value turns back up, as arcface_torch's does."""
    cos = jnp.float32(math.cos(math.radians(170.0)))
    assert float(arcface(straight_through=True).target_logit(cos)) == pytest.approx(
        64 * math.cos(math.radians(170.0) + 0.5), abs=1e-3)
    assert float(arcface().target_logit(cos)) == pytest.approx(64 * (float(cos) - (math.cos(math.pi - 0.5) + 1)),
                                                              abs=1e-3)
