"""``jaxcls.losses.rows_stats``: a tile's softmax statistics from rows picked by index, by the Pallas kernel (in Pallas'
interpreter here) and by XLA's form, against float64. (test_fc runs FCHead.step through the kernels too, and
test_gpu_target finds them in the step compiled for an H100.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcls.losses import rows_stats, tiles
from reference import MARGINS, aimed_at_targets, margin_target


def float64_statistics(e_n, rows, targets, valid, first, owned, margin):
    """(max, Σ exp(x − max), target logit) of the tile's margin logits, in float64 (masked columns left out)."""
    e, w = np.asarray(e_n, np.float64), np.asarray(rows, np.float64)
    cos = e @ (w / np.linalg.norm(w, axis=1, keepdims=True)).T
    columns = first + np.arange(w.shape[0])
    target = (np.asarray(targets)[:, None] == columns[None, :]) & (np.asarray(targets)[:, None] >= owned)
    with jax.enable_x64(True):
        target_logits = np.asarray(margin_target(cos, margin.s, margin.m1, margin.m2, margin.m3))
    logits = np.where(target, target_logits, margin.s * cos)
    kept = (columns >= owned)[None, :] & np.asarray(valid)[None, :]
    logits = np.where(kept, logits, -np.inf)
    high = logits.max(axis=1)
    return high, np.exp(logits - high[:, None]).sum(axis=1), np.where(target & kept, logits, 0).sum(axis=1)


@pytest.mark.parametrize("margin", ["arcface", "cosface", "sphereface"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_both_forms_give_the_tiles_float64_statistics(margin, dtype, rng, monkeypatch):
    monkeypatch.setattr(rows_stats, "BLOCK_DIM", 16)  # the products over two slices of the 32 dimensions
    c, d, n, t = int(rng.integers(200, 400)), 32, int(rng.integers(20, 70)), int(rng.integers(40, 100))
    margin = MARGINS[margin]
    weight = jnp.asarray(rng.normal(size=(c, d)), dtype)
    index = jnp.asarray(np.sort(rng.choice(c, t, replace=False)), jnp.int32)
    real = t - int(rng.integers(0, 5))
    valid = jnp.asarray(np.arange(t) < real)  # the last rows may be padding classes, which are no label
    first, owned = int(rng.integers(0, 1000)), 0
    owned = first + int(rng.integers(0, t // 2))  # the first columns belong to the previous tile
    column = rng.integers(0, real + 20, n)  # a real class of the tile, or one of the next tile's
    targets = np.where(rng.random(n) < 0.7, first + np.where(column < real, column, column + t - real), -1)
    rel = np.where((targets >= first) & (targets < first + real), targets - first, -1)
    # a few targets' cosines near -1 (past the margins' threshold angles) and +1
    e_n = jnp.asarray(aimed_at_targets(rng.normal(size=(n, d)), np.asarray(weight[index], np.float64), rel, rng),
                      dtype)
    targets = jnp.asarray(targets, jnp.int32)
    want = float64_statistics(e_n, weight[index], targets, valid, first, owned, margin)
    for form in ("xla", "pallas_interpret"):
        with rows_stats.forced(form):
            got = jax.jit(lambda w, i, v, f, o, e, t: rows_stats.tile_statistics_by_index(
                w, i, tiles.tile_columns(t, v, f, o), e, margin, lambda: w[i]))(
                weight, index, valid, jnp.int32(first), jnp.int32(owned), e_n, targets)
        high, total, target = (np.asarray(x, np.float64) for x in got)
        # compared through the log-sum-exp (the max is a shift): float32 cosines of s = 64 logits
        np.testing.assert_allclose(high + np.log(total), want[0] + np.log(want[1]), rtol=0, atol=2e-3, err_msg=form)
        np.testing.assert_allclose(target, want[2], rtol=0, atol=2e-3, err_msg=form)


def test_the_kernel_is_used_only_where_it_can_be(rng):
    def trace(form, d):
        weight, e_n = jnp.zeros((50, d)), jnp.zeros((8, d))
        index, valid, targets = jnp.arange(10), jnp.ones(10, bool), jnp.zeros(8, jnp.int32)
        with rows_stats.forced(form):
            where = tiles.tile_columns(targets, valid, jnp.int32(0), jnp.int32(0))
            return str(jax.make_jaxpr(lambda w, e: rows_stats.tile_statistics_by_index(
                w, index, where, e, MARGINS["arcface"], lambda: w[index]))(weight, e_n))
    assert "pallas_call" in trace("pallas_interpret", 32)
    assert "pallas_call" not in trace("pallas_interpret", 24)  # not a power of two
    assert "pallas_call" not in trace("pallas_interpret", 8)  # too narrow for Triton's products
    assert "pallas_call" not in trace("xla", 32)
