"""One optimizer registry for both halves: the backbone's optax update and the FC's sparse row rule agree."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcls.optimizers import OPTIMIZERS, lr_schedule, make_optimizers


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_backbone_and_fc_rules_take_the_same_steps(name, rng):
    """Three steps of the backbone transformation (scaled by lr, as the train step does) on a matrix equal the
    sparse FC rule applied to every row of it."""
    tx, fc = make_optimizers(name, momentum=0.9, weight_decay=5e-4, clip=0.0)
    w = rng.normal(size=(6, 4)).astype(np.float32)
    dense, opt = jnp.asarray(w), tx.init(jnp.asarray(w))
    rows, slots = jnp.asarray(w), fc.init(jnp.asarray(w)).slots
    for count, lr in enumerate([0.1, 0.05, 0.2], start=1):
        g = jnp.asarray(rng.normal(size=w.shape).astype(np.float32))
        updates, opt = tx.update(g, opt, dense)
        dense = dense + lr * updates
        rows, slots = fc.apply_rows(rows, slots, g, lr, jnp.int32(count))
        np.testing.assert_allclose(rows, dense, rtol=1e-6, atol=1e-6)


def test_sgd_is_torch_sgd_with_l2_decay(rng):
    tx, _ = make_optimizers("sgd", momentum=0.9, weight_decay=0.1, clip=0.0)
    w, g = rng.normal(size=3), rng.normal(size=3)
    updates, _ = tx.update(jnp.asarray(g), tx.init(jnp.asarray(w)), jnp.asarray(w))
    np.testing.assert_allclose(updates, -(g + 0.1 * w), rtol=1e-6)  # first step: buf = g + wd·w


def test_clip_applies_to_the_backbone_only_when_positive():
    g = {"w": jnp.array([3.0, 4.0])}  # norm 5
    clipped, _ = make_optimizers("sgd", momentum=0.0, weight_decay=0.0, clip=1.0)
    free, _ = make_optimizers("sgd", momentum=0.0, weight_decay=0.0, clip=0.0)
    params = {"w": jnp.zeros(2)}
    np.testing.assert_allclose(clipped.update(g, clipped.init(params), params)[0]["w"], [-0.6, -0.8], rtol=1e-6)
    np.testing.assert_allclose(free.update(g, free.init(params), params)[0]["w"], [-3.0, -4.0])


def test_unknown_optimizer_lists_the_choices():
    with pytest.raises(ValueError, match=r"unknown optimizer 'lamb'; choose one of \['adamw', 'sgd'\]"):
        make_optimizers("lamb", momentum=0.9, weight_decay=0.0, clip=0.0)


def test_schedule_warms_up_linearly_then_decays_polynomially():
    f = lr_schedule(0.4, warmup_steps=10, total_steps=110, power=2.0)
    steps = np.array([0, 5, 10, 60, 110])
    expected = [0.0, 0.2, 0.4, 0.4 * 0.5**2, 0.0]
    np.testing.assert_allclose([float(f(s)) for s in steps], expected, atol=1e-7)
    assert float(jax.jit(f)(jnp.int32(35))) == pytest.approx(0.4 * (1 - 25 / 100) ** 2)
