"""The tile kernel (``jaxcls.losses.tiles``) on one shard's rows against dense float64 formulas."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcls.losses import tiles
from jaxcls.mesh import make_mesh, row_spec
from reference import MARGINS, margin_target, rel_err


def tile_walk(rng, tile):
    """A shard of R rows (some padding) visited in tiles of ``tile``, and a batch whose targets are partly here."""
    # D ≥ 8: in fewer dimensions random unit vectors often have |cos θ| ≈ 1, where the ArcFace derivative
    # 1/sin θ turns float32 rounding of cos θ into gradient error beyond the tolerance
    n, d, rows = int(rng.integers(3, 9)), int(rng.integers(8, 17)), int(rng.integers(max(tile, 3), 4 * tile + 3))
    e_n = np.asarray(tiles.l2_normalize(rng.normal(size=(n, d))))
    weight = rng.normal(size=(rows, d)).astype(np.float32)
    # up to 2 padding rows; 2 real rows at least (with one class every loss and gradient is exactly 0)
    valid = np.arange(rows) < rows - int(rng.integers(0, min(3, rows - 1)))
    targets = rng.integers(-1, int(valid.sum()), size=n).astype(np.int32)  # -1: the class lives elsewhere

    def tile_at(i):
        first, owned = tiles.tile_starts(rows, tile, i)
        return (jax.lax.dynamic_slice_in_dim(weight, first, tile), jax.lax.dynamic_slice_in_dim(valid, first, tile),
                first, owned)

    return e_n, weight, valid, targets, tile_at, tiles.num_tiles(rows, tile)


def dense_logits(e_n, weight, valid, targets, margin):
    """float64 margin logits ``[N, R]`` of the valid rows (others −inf) and each row's target logit (0 if absent)."""
    with jax.enable_x64(True):
        w = np.asarray(weight, np.float64)
        cos = np.asarray(e_n, np.float64) @ (w / np.linalg.norm(w, axis=1, keepdims=True)).T
        rows = np.arange(len(cos))
        t_logit = np.asarray(margin_target(cos[rows, np.maximum(targets, 0)], margin.s, margin.m1, margin.m2,
                                           margin.m3))
    logits = margin.s * cos
    logits[targets >= 0, targets[targets >= 0]] = t_logit[targets >= 0]
    logits[:, ~valid] = -np.inf
    return logits, np.where(targets >= 0, t_logit, 0.0)


@pytest.mark.parametrize("tile", [1, 3, 4])
@pytest.mark.parametrize("margin", ["arcface", "cosface", "combined"])
def test_online_stats_equal_dense_logsumexp(margin, tile, rng):
    e_n, weight, valid, targets, tile_at, n_tiles = tile_walk(rng, tile)
    def stats_at(e, i):
        w_tile, v_tile, first, owned = tile_at(i)
        return tiles.tile_statistics(e, w_tile, tiles.tile_columns(targets, v_tile, first, owned), MARGINS[margin])
    row_max, row_sum, target = jax.jit(lambda e: tiles.online_stats(e, n_tiles, lambda i: stats_at(e, i)))(e_n)
    logits, ref_target = dense_logits(e_n, weight, valid, targets, MARGINS[margin])
    ref_lse = np.log(np.sum(np.exp(logits - logits.max(1, keepdims=True)), 1)) + logits.max(1)
    assert rel_err(row_max + np.log(row_sum), ref_lse) < 1e-5
    assert rel_err(target, ref_target) < 1e-5


@pytest.mark.parametrize("tile", [1, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_tile_grads_sum_to_the_dense_gradient(tile, rng):
    """Σ over tiles of ``tile_grad_parts`` (the rows' parts combined by ``row_gradient``) = d/d(e_n, W) of
    Σ g·(lse − target) with the lse held fixed, as in the kernel."""
    margin = MARGINS["arcface"]
    e_n, weight, valid, targets, tile_at, n_tiles = tile_walk(rng, tile)
    g = rng.uniform(0.5, 2.0, size=len(e_n)).astype(np.float32)
    logits, _ = dense_logits(e_n, weight, valid, targets, margin)
    lse = (np.log(np.sum(np.exp(logits - logits.max(1, keepdims=True)), 1)) + logits.max(1)).astype(np.float32)
    @jax.jit
    def grads_of_tile(i):
        w_tile, v_tile, first, owned = tile_at(i)
        where = tiles.tile_columns(targets, v_tile, first, owned)
        d_e, *row_grad = tiles.tile_grad_parts(jnp.asarray(e_n), w_tile, where, margin, lse, g)
        return d_e, tiles.row_gradient(w_tile, *row_grad)

    d_e, d_w = np.zeros(e_n.shape), np.zeros(weight.shape)
    for i in range(n_tiles):
        de, dw = grads_of_tile(i)
        first = int(tiles.tile_starts(len(weight), tile, i)[0])
        d_e += np.asarray(de)
        d_w[first:first + tile] += np.asarray(dw)

    def loss(e, w):  # float64: softmax cross-entropy of the valid columns; the lse's own gradient is the softmax
        with jax.enable_x64(True):
            wn = w / jnp.linalg.norm(w, axis=1, keepdims=True)
            cos = e @ wn.T
            rows = jnp.arange(cos.shape[0])
            t = margin_target(cos[rows, jnp.maximum(targets, 0)], margin.s, margin.m1, margin.m2, margin.m3)
            lg = (margin.s * cos).at[rows, jnp.maximum(targets, 0)].set(
                jnp.where(targets >= 0, t, margin.s * cos[rows, jnp.maximum(targets, 0)]))
            lg = jnp.where(valid[None, :], lg, -jnp.inf)
            return jnp.sum(g * (jax.nn.logsumexp(lg, axis=1) - jnp.where(targets >= 0, t, 0.0)))

    with jax.enable_x64(True):
        ref_e, ref_w = jax.grad(loss, argnums=(0, 1))(np.asarray(e_n, np.float64), np.asarray(weight, np.float64))
    assert rel_err(d_e, ref_e) < 1e-4
    assert rel_err(d_w[valid], np.asarray(ref_w)[valid]) < 1e-4
    assert np.all(d_w[~valid] == 0)


@pytest.mark.parametrize("rows,tile", [(10, 3), (9, 3), (7, 7), (5, 1), (100, 33)])
def test_tiles_own_every_row_once_and_stay_in_bounds(rows, tile):
    owned_by = np.zeros(rows, int)
    for i in range(tiles.num_tiles(rows, tile)):
        first, owned = map(int, tiles.tile_starts(rows, tile, i))
        assert 0 <= first and first + tile <= rows and first <= owned
        owned_by[owned:first + tile] += 1
    assert np.all(owned_by == 1), owned_by


def test_local_rows_of(rng):
    row_classes = np.sort(rng.choice(1000, size=50, replace=False)).astype(np.int32)
    labels = np.concatenate([rng.choice(row_classes, 20), rng.integers(0, 1000, 20)]).astype(np.int32)
    got = np.asarray(tiles.local_rows_of(labels, row_classes))
    for label, row in zip(labels, got):
        assert (row_classes[row] == label) if label in row_classes else row == -1


def test_full_row_classes_are_sharded_row_ids():
    mesh = make_mesh(2, 4)
    ids = jax.jit(lambda: tiles.full_row_classes(16, mesh, ("class",)))()
    np.testing.assert_array_equal(ids, np.arange(16))
    assert ids.sharding.spec == row_spec(("class",))


def test_validate_labels_names_the_first_bad_label():
    tiles.validate_labels(np.array([0, 4, 2]), 5)
    with pytest.raises(ValueError, match=r"label 7 at batch index 2 is outside \[0, 5\) \(2 bad labels"):
        tiles.validate_labels(np.array([0, 1, 7, -1]), 5)


@pytest.mark.parametrize("dtype, name, grad_name", [(jnp.bfloat16, "bf16", "bf16"), (jnp.float16, "f16", "f32"),
                                                    (jnp.float32, "f32", "f32")])
def test_cosines_gradients_multiply_in_the_operand_dtype(dtype, name, grad_name, rng):
    """``cosines``: float32 products of ``dtype`` operands, and gradients whose two products also take ``dtype``
    operands (float32 for float16), equal to float64 ``g @ w`` and ``gᵀ @ e`` within the operands' rounding."""
    n, t, d = (int(x) for x in rng.integers(4, 33, size=3))
    e, w, g = (rng.normal(size=shape) for shape in ((n, d), (t, d), (n, t)))

    def grads(e, w, g):
        cos, pullback = jax.vjp(tiles.cosines, e, w)
        return cos, *pullback(g)

    args = (jnp.asarray(e, dtype), jnp.asarray(w, dtype), jnp.asarray(g, jnp.float32))
    hlo = jax.jit(grads).lower(*args).as_text()
    products = [line for line in hlo.splitlines() if "dot_general" in line]
    assert len(products) == 3, hlo
    operands = [line.rsplit(":", 1)[1].split("->")[0] for line in products]  # "(tensor<4x8xbf16>, tensor<...>)"
    assert [o.count(f"x{name}>") for o in operands[:1]] + [o.count(f"x{grad_name}>") for o in operands[1:]] == [2] * 3
    cos, d_e, d_w = jax.jit(grads)(*args)
    assert cos.dtype == jnp.float32 and d_e.dtype == dtype and d_w.dtype == dtype
    tol = {jnp.bfloat16: 2e-2, jnp.float16: 2e-3, jnp.float32: 1e-5}[dtype]
    e64, w64 = (np.asarray(jnp.asarray(x, dtype), np.float64) for x in (e, w))  # the operands as rounded
    assert rel_err(cos, e64 @ w64.T) < tol
    assert rel_err(np.asarray(d_e, np.float64), g @ w64) < tol
    assert rel_err(np.asarray(d_w, np.float64), g.T @ e64) < tol


@pytest.mark.parametrize("stats", [tiles.stats_in_one_read, tiles.stats_in_separate_reads])
def test_both_forms_of_the_tile_statistics_equal_float64(stats, rng):
    """Each row's (max, Σ exp(x − max), its target logit), the logits partly masked (a whole row too: its max is the
    fill value and each masked logit counts once, which any real logit of another tile or shard then outweighs)."""
    n, t = int(rng.integers(2, 9)), int(rng.integers(1, 70))
    logits = rng.normal(scale=20, size=(n, t)).astype(np.float32)
    fill = np.finfo(np.float32).min
    logits[rng.random((n, t)) < 0.3] = fill
    target = rng.integers(0, t, n)  # each row's target column, a kept logit, or none (-1)
    target[rng.random(n) < 0.3] = -1
    logits[target >= 0, target[target >= 0]] = rng.normal(scale=20, size=(target >= 0).sum())
    picked = np.where(np.arange(t) == target[:, None], logits, 0).astype(np.float32)
    logits[0], picked[0] = fill, 0
    high, total, target_logit = jax.jit(stats)(jnp.asarray(logits), jnp.asarray(picked))
    x = logits.astype(np.float64)
    want_high = x.max(axis=1)
    want_total = np.exp(x - want_high[:, None]).sum(axis=1)
    np.testing.assert_array_equal(high, want_high.astype(np.float32))
    np.testing.assert_allclose(total, want_total, rtol=1e-5)
    np.testing.assert_allclose(target_logit, picked.astype(np.float64).sum(axis=1), rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("margin", list(MARGINS))
def test_the_margin_at_each_target_gives_the_elementwise_gradients(margin, rng):
    """``cosine_grads`` with the margin taken at each embedding's target cosine (``target_cos``, as XLA's form runs
    it) equals the margin at every element (the kernels' form), for targets at ±1, beyond 1 and on both sides of the
    threshold angle; a row whose target is not in the tile ignores its ``target_cos`` (NaN here), and columns not kept
    get no gradient."""
    margin = MARGINS[margin]
    n, t = 8, 12
    threshold = margin.threshold_cos
    target_values = np.float32([1.0, -1.0, 1.0000001, threshold + 1e-3, threshold - 1e-3, 0.3, -0.2])
    cos = rng.uniform(-1.0, 1.0, size=(n, t)).astype(np.float32)
    rel = rng.permutation(t)[:n].astype(np.int32)
    rel[-1] = -1  # its class lives in another tile
    cos[np.arange(n - 1), rel[:-1]] = target_values
    inverse = rng.uniform(0.5, 2.0, size=t).astype(np.float32)
    products = cos / inverse[None, :]
    kept = rng.uniform(size=t) < 0.7
    kept[rel[:-1]] = True
    where = tiles.TileColumns(jnp.asarray(rel), jnp.arange(t, dtype=jnp.int32), jnp.asarray(kept))
    logits = np.asarray(tiles.margin_logits(jnp.asarray(cos), where, margin))  # this tile's; others add to the lse
    lse = (np.log(np.sum(np.exp(logits - logits.max(1, keepdims=True)), 1)) + logits.max(1)
           + rng.uniform(0.0, 3.0, size=n)).astype(np.float32)
    g = rng.uniform(0.5, 2.0, size=n).astype(np.float32)
    target_cos = np.where(rel >= 0, (products * inverse[None, :])[np.arange(n), np.maximum(rel, 0)], np.nan)
    grads = jax.jit(lambda tc: tiles.cosine_grads(products, inverse, where, margin, lse, g, tc))
    each_target, every_element = grads(target_cos.astype(np.float32)), grads(None)
    for a, b in zip(each_target, every_element):  # the same operations: equal up to how XLA orders the batch's sum
        assert np.all(np.isfinite(a)) and rel_err(a, b) < 1e-6, rel_err(a, b)
    assert np.all(np.asarray(each_target[0])[:, ~kept] == 0)
