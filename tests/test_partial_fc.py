"""PartialFC sampling, the sampled loss, sparse FC optimizers, compact state and FC checkpoints."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from scipy import stats

from conftest import MESH_SHAPES
from jaxcls import batch_sharding, checkpoint, make_mesh
from jaxcls.losses import arcface, class_shards, cosface, init_weight, sharded_margin_loss, weight_sharding
from jaxcls.partial_fc import gather_rows, sample_budget, sample_classes
from jaxcls.sparse_fc import SparseState, adamw, sgd
from reference import rel_err, value_and_grads


def draw(rng, mesh, c, n, rate, class_axes=("data", "class"), key=None):
    rows = init_weight(jax.random.key(0), c, 4, mesh, class_axes).shape[0]
    labels = jax.device_put(rng.integers(0, c, size=n).astype(np.int32), batch_sharding(mesh))
    key = jax.random.key(int(rng.integers(2**31))) if key is None else key
    f = jax.jit(partial(sample_classes, mesh=mesh, num_classes=c, num_rows=rows, sample_rate=rate,
                        class_axes=class_axes))
    return labels, f(key, labels), rows


def test_budget_rule():
    assert sample_budget(1000, 64, 0.1) == 100
    assert sample_budget(1000, 512, 0.1) == 512  # positives could fill 512 rows
    assert sample_budget(100, 512, 0.1) == 100
    assert sample_budget(1000, 64, 1.0) == 1000
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="sample_rate"):
            sample_budget(1000, 64, bad)


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
    full = sharded_margin_loss(emb, weight, labels, cosface(), mesh=mesh, num_classes=c)
    sampled = sharded_margin_loss(emb, gather_rows(weight, sample, mesh=mesh), labels, cosface(), mesh=mesh,
                                  num_classes=c, row_classes=sample.classes)
    assert float(full) == float(sampled)


def optax_reference(name, w_rows, slots, g_rows, lr, count):
    """The same step by optax on the sampled rows alone, as dense parameters."""
    if name == "sgd":
        tx = optax.chain(optax.add_decayed_weights(5e-4), optax.sgd(lr, momentum=0.9))
        state = (optax.EmptyState(), (optax.TraceState(trace=slots[0]), optax.EmptyState()))
        updates, state = tx.update(g_rows, state, w_rows)
        return optax.apply_updates(w_rows, updates), (state[1][0].trace,)
    tx = optax.adamw(lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1)
    state = (optax.ScaleByAdamState(count=jnp.int32(count), mu=slots[0], nu=slots[1]), optax.EmptyState(),
             optax.EmptyState())
    updates, state = tx.update(g_rows, state, w_rows)
    return optax.apply_updates(w_rows, updates), (state[0].mu, state[0].nu)


@pytest.mark.parametrize("name", ["sgd", "adamw"])
@pytest.mark.parametrize("mesh_shape", [(1, 8), (4, 2)], ids=str)
def test_sparse_update_equals_optax_on_sampled_rows_and_leaves_others(mesh_shape, name, rng):
    mesh = make_mesh(*mesh_shape)
    c, d, n = 8 * 25 - 5, 8, 16
    opt = {"sgd": sgd(), "adamw": adamw()}[name]
    labels, sample, rows = draw(rng, mesh, c, n, 0.2)
    weight = init_weight(jax.random.key(int(rng.integers(2**31))), c, d, mesh, stddev=1.0)
    state = opt.init(weight)
    random_like = lambda x: jax.device_put(rng.normal(size=x.shape).astype(np.float32) ** 2, x.sharding)
    state = SparseState(tuple(random_like(s) for s in state.slots), jnp.int32(int(rng.integers(0, 50))))
    grads = random_like(gather_rows(weight, sample, mesh=mesh))
    lr = float(rng.uniform(0.01, 0.5))
    step = jax.jit(partial(opt.update, mesh=mesh), donate_argnums=())
    new_w, new_state = step(weight, state, sample.rows, grads, lr)

    # Global row index of each sampled row.
    c_local = rows // mesh.size
    global_rows = np.asarray(sample.rows) + np.repeat(np.arange(mesh.size) * c_local, len(sample.rows) // mesh.size)
    w_rows = np.asarray(weight)[global_rows]
    slots = tuple(np.asarray(s)[global_rows] for s in state.slots)
    ref_w, ref_slots = optax_reference(name, w_rows, slots, np.asarray(grads), lr, int(state.count))
    np.testing.assert_allclose(np.asarray(new_w)[global_rows], ref_w, rtol=2e-6, atol=1e-6)  # f32 cancellation in w − lr·buf
    for new, ref in zip(new_state.slots, ref_slots):
        np.testing.assert_allclose(np.asarray(new)[global_rows], ref, rtol=2e-6, atol=1e-6)  # f32 cancellation in w − lr·buf
    untouched = np.setdiff1d(np.arange(rows), global_rows)
    assert np.array_equal(np.asarray(new_w)[untouched], np.asarray(weight)[untouched])
    for new, old in zip(new_state.slots, state.slots):
        assert np.array_equal(np.asarray(new)[untouched], np.asarray(old)[untouched])
    assert int(new_state.count) == int(state.count) + 1


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_dense_update_equals_update_of_every_row(name, rng):
    mesh = make_mesh(2, 4)
    opt = {"sgd": sgd(), "adamw": adamw()}[name]
    weight = init_weight(jax.random.key(int(rng.integers(2**31))), 8 * 6, 8, mesh, stddev=1.0)
    state = opt.init(weight)
    grads = jax.device_put(rng.normal(size=weight.shape).astype(np.float32), weight.sharding)
    every_row = jax.device_put(np.tile(np.arange(6, dtype=np.int32), 8), jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec(("data", "class"))))
    step = jax.jit(partial(opt.update, mesh=mesh))
    dense, sparse = step(weight, state, None, grads, 0.1), step(weight, state, every_row, grads, 0.1)
    for a, b in zip(jax.tree.leaves(dense), jax.tree.leaves(sparse)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_compact_state_updates_in_float32_and_stores_rounded(dtype, rng):
    mesh = make_mesh(2, 4)
    c, d = 8 * 20, 8
    labels, sample, rows = draw(rng, mesh, c, 16, 0.1)
    weight = init_weight(jax.random.key(0), c, d, mesh, dtype=dtype, stddev=1.0)
    opt = sgd(state_dtype=dtype)
    state = opt.init(weight)
    assert weight.dtype == dtype and state.slots[0].dtype == dtype and weight.sharding == state.slots[0].sharding
    grads = jax.device_put(rng.normal(size=(len(sample.rows), d)).astype(np.float32), weight.sharding)
    new_w, new_state = jax.jit(partial(opt.update, mesh=mesh))(weight, state, sample.rows, grads, 0.1)
    assert new_w.dtype == dtype and new_state.slots[0].dtype == dtype
    c_local = rows // 8
    global_rows = np.asarray(sample.rows) + np.repeat(np.arange(8) * c_local, len(sample.rows) // 8)
    w32 = np.asarray(weight.astype(jnp.float32))[global_rows]
    g = np.asarray(grads) + 5e-4 * w32
    expected = (w32 - 0.1 * g).astype(dtype)  # float32 arithmetic, one rounding to the storage dtype
    np.testing.assert_array_equal(np.asarray(new_w)[global_rows], expected)
    np.testing.assert_array_equal(np.asarray(new_state.slots[0])[global_rows], g.astype(dtype))


@pytest.mark.parametrize("target", [(2, 4, 8), (1, 4, 4), (1, 3, 3)], ids=["(2,4)", "4 devices", "3 devices"])
def test_fc_checkpoint_restores_onto_another_mesh(target, tmp_path, rng):
    c, d = 37, 8  # padded to 40 rows on 8 shards, 40 on 4, 39 on 3
    mesh = make_mesh(1, 8)
    weight = init_weight(jax.random.key(1), c, d, mesh, dtype=jnp.bfloat16, stddev=1.0)
    state = adamw(state_dtype=jnp.bfloat16).init(weight)
    real_rows = (np.arange(weight.shape[0]) < c)[:, None]  # padding rows hold zeros, as in training
    state = SparseState(tuple(jax.device_put((rng.normal(size=s.shape) * real_rows).astype(s.dtype), s.sharding)
                              for s in state.slots), jnp.int32(17))
    tree = {"weight": weight, "opt": state, "num_classes": jnp.int32(c)}
    checkpoint.save(tmp_path / "fc", tree)

    data, classes, n = target
    new_mesh = make_mesh(data, classes, devices=jax.devices()[:n])
    new_weight = init_weight(jax.random.key(9), c, d, new_mesh, dtype=jnp.bfloat16)
    abstract = checkpoint.abstract_like({"weight": new_weight, "opt": adamw(state_dtype=jnp.bfloat16).init(new_weight),
                                         "num_classes": jnp.int32(0)})
    restored = checkpoint.restore(tmp_path / "fc", abstract)
    checkpoint.check_num_classes(restored["num_classes"], c)
    assert restored["weight"].sharding.is_equivalent_to(weight_sharding(new_mesh), 2)
    for old, new in zip(jax.tree.leaves(tree), jax.tree.leaves(restored)):
        if old.ndim == 2:
            np.testing.assert_array_equal(np.asarray(new)[:c], np.asarray(old)[:c])
            assert np.all(np.asarray(new)[c:] == 0)
        else:
            assert int(new) == int(old)
    with pytest.raises(ValueError, match="37 classes, the config asks for 40"):
        checkpoint.check_num_classes(restored["num_classes"], 40)
