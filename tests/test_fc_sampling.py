"""PartialFC class-centre sampling and the loss on sampled rows."""


import jax
import numpy as np
import pytest
from scipy import stats

from conftest import MESH_SHAPES
from jaxcls import batch_sharding, class_shards, make_mesh
from jaxcls.losses import arcface, cosface, init_weight, sharded_margin_loss
from jaxcls.fc.sampling import check_sample_rate, gather_rows, sample_budget, sample_classes
from problems import draw
from reference import rel_err, value_and_grads


def test_budget_rule():
    assert sample_budget(1000, 64, 0.1) == 100
    assert sample_budget(1000, 512, 0.1) == 512  # positives could fill 512 rows
    assert sample_budget(100, 512, 0.1) == 100
    assert sample_budget(1000, 64, 1.0) == 1000
    # ⌈rate · C_local⌉ of the decimal rate, not of its float product (0.55 · 100 = 55.000000000000007)
    assert [sample_budget(c, 1, rate) for c, rate in [(100, 0.55), (100, 0.07), (25, 0.28), (1500, 0.67),
                                                       (93431, 0.1)]] == [55, 7, 7, 1005, 9344]
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match=rf"sample_rate must be in \(0, 1\], got {bad}"):
            sample_budget(1000, 64, bad)
        with pytest.raises(ValueError, match="sample_rate must be in"):
            check_sample_rate(bad)


@pytest.mark.parametrize("class_axes", [("data", "class"), ("class",)], ids=["all_devices", "class_only"])
@pytest.mark.parametrize("mesh_shape", MESH_SHAPES, ids=str)
def test_positives_always_present_negatives_distinct(mesh_shape, class_axes, rng):
    mesh = make_mesh(*mesh_shape)
    shards = class_shards(mesh, class_axes)
    c = shards * int(rng.integers(20, 60)) - int(rng.integers(0, shards))
    labels, sample, rows = draw(rng, mesh, c, 8 * int(rng.integers(1, 4)), 0.2, class_axes)
    c_local = rows // shards
    budget = sample_budget(c_local, labels.shape[0], 0.2)
    per_shard = np.asarray(sample.classes).reshape(shards, budget)
    local_rows = np.asarray(sample.rows).reshape(shards, budget)
    for s in range(shards):
        assert np.all(np.diff(per_shard[s]) > 0), "sorted and distinct"
        np.testing.assert_array_equal(per_shard[s], local_rows[s] + s * c_local)
        own = {int(y) for y in np.asarray(labels) if s * c_local <= y < (s + 1) * c_local}
        assert own <= set(per_shard[s].tolist()), "every positive on the shard is sampled"
        assert np.all(per_shard[s] < c) or budget > c - s * c_local, "padding only when real rows run out"


def test_negatives_uniform_and_different_per_shard():
    """Chi-square over many draws (fixed seed): negatives are uniform over the non-positive classes."""
    mesh = make_mesh(1, 8)
    c, n, rate = 8 * 40, 8, 0.25
    labels = jax.device_put(np.arange(n, dtype=np.int32) * 40, batch_sharding(mesh))  # one positive per shard
    f = jax.jit(jax.vmap(lambda k: sample_classes(k, labels, mesh=mesh, num_classes=c, num_rows=c,
                                                  sample_rate=rate).classes))
    draws = np.asarray(f(jax.random.split(jax.random.key(1234), 400))).reshape(400, 8, 10)
    for s in range(8):
        negatives = draws[:, s, :][draws[:, s, :] != 40 * s].ravel()
        counts = np.bincount(negatives - 40 * s, minlength=40)[1:]  # class 0 of the shard is the positive
        assert stats.chisquare(counts).pvalue > 1e-3, counts
    assert len({tuple(draws[0, s] - 40 * s) for s in range(8)}) == 8, "each shard draws its own sample"


@pytest.mark.parametrize("chunk_size", [None, 5])
@pytest.mark.parametrize("mesh_shape", [(1, 8), (2, 4)], ids=str)
def test_sampled_loss_equals_restricted_dense_reference(mesh_shape, chunk_size, rng):
    mesh = make_mesh(*mesh_shape)
    c, d, n = 8 * int(rng.integers(10, 30)) - 3, int(rng.integers(4, 17)), 16
    labels, sample, rows = draw(rng, mesh, c, n, 0.3)
    weight = init_weight(jax.random.key(int(rng.integers(2**31))), c, d, mesh, stddev=1.0)
    emb = jax.device_put(rng.normal(size=(n, d)).astype(np.float32), batch_sharding(mesh))
    margin = arcface()
    sampled_w = gather_rows(weight, sample, mesh=mesh)
    loss_fn = lambda e, w: sharded_margin_loss(e, w, labels, margin, mesh=mesh, num_classes=c,
                                               row_classes=sample.classes, chunk_size=chunk_size)
    loss, (g_e, g_w) = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1)))(emb, sampled_w)

    classes = np.asarray(sample.classes)
    real = classes < c
    subset = classes[real]  # the restricted problem: only the sampled real classes
    remapped = np.searchsorted(subset, np.asarray(labels))
    ref_loss, (ref_g_e, ref_g_w) = value_and_grads(emb, np.asarray(sampled_w)[real], remapped, margin)
    assert rel_err(loss, ref_loss) < 1e-5
    assert rel_err(g_e, ref_g_e) < 1e-5
    assert rel_err(np.asarray(g_w)[real], ref_g_w) < 1e-5
    assert np.all(np.asarray(g_w)[~real] == 0)


def test_sample_rate_one_is_the_full_loss(rng):
    mesh = make_mesh(2, 4)
    c, d, n = 61, 8, 16
    labels, sample, rows = draw(rng, mesh, c, n, 1.0)
    np.testing.assert_array_equal(np.asarray(sample.classes), np.arange(rows))
    weight = init_weight(jax.random.key(3), c, d, mesh, stddev=1.0)
    emb = jax.device_put(rng.normal(size=(n, d)).astype(np.float32), batch_sharding(mesh))
    full = jax.jit(lambda e, w, y: sharded_margin_loss(e, w, y, cosface(), mesh=mesh, num_classes=c))
    sampled = jax.jit(lambda e, w, y, smp: sharded_margin_loss(e, gather_rows(w, smp, mesh=mesh), y, cosface(),
                                                               mesh=mesh, num_classes=c, row_classes=smp.classes))
    assert float(full(emb, weight, labels)) == float(sampled(emb, weight, labels, sample))
