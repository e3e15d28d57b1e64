"""``jaxcls.losses.rows_backward``: a tile's embedding gradient and the rows' gradient or optimizer step, by the Pallas
kernels (run by Pallas' interpreter here) and by XLA's form, against float64. (test_fc runs FCHead.step through the
kernels too, test_sharded holds the chunked loss to float64 in XLA's form, and test_gpu_target finds the kernels in
the step compiled for an H100.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcls.fc.head import optimizer_rule
from jaxcls.fc.optimizers import adamw, decode, encode, sgd
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxcls.losses import kernel_forms, rows_backward, tiles
from reference import MARGINS, adamw_step, aimed_at_targets, margin_target, rel_err, sgd_step

# each form: (the form forced, its variant, rows_backward.VARIANTS): XLA's form, the kernels (interpreted), and the
# update kernel alone on XLA's GEMMs
VARIANTS = {"xla": ("xla", None), "pallas_interpret": ("pallas_interpret", "pallas"),
            "update_kernel_interpret": ("pallas_interpret", "pallas_update")}
FORMS = tuple(VARIANTS)


def draw_tile(rng, dtype):
    """A weight ``[c, 32]`` as stored, a tile of ``t`` of its rows (sorted, distinct; the last may be padding
    classes, the first owned by the previous tile) and a batch of ``n`` normalized embeddings whose targets lie in
    the tile, beyond it or elsewhere; the last real row is a target. ``t`` is no multiple of the update kernel's 16
    rows, so its padding copies the last row, which in half the draws is a real class whose copies must store what
    it stores; ``n`` is rarely a multiple of the kernels' blocks of embeddings."""
    c, d, n, t = int(rng.integers(150, 300)), 32, int(rng.integers(20, 70)), 16 * int(rng.integers(1, 4)) + int(
        rng.integers(1, 16))
    weight = jnp.asarray(rng.normal(size=(c, d)), dtype)
    index = jnp.asarray(np.sort(rng.choice(c, t, replace=False)), jnp.int32)
    real = t - (0 if rng.random() < 0.5 else int(rng.integers(1, 4)))
    first = int(rng.integers(0, 1000))
    owned = first + int(rng.integers(0, t // 3))
    column = rng.integers(0, real + 20, n)  # a real class of the tile, or one of the next tile's
    targets = np.where(rng.random(n) < 0.8, first + np.where(column < real, column, column + t - real), -1)
    targets[0] = first + real - 1
    where = tiles.tile_columns(jnp.asarray(targets, jnp.int32), jnp.arange(t) < real, first, owned)
    # a few targets' cosines near -1 (past the margins' threshold angles) and +1
    e = aimed_at_targets(rng.normal(size=(n, d)), np.asarray(weight[index], np.float64), np.asarray(where.rel), rng)
    return weight, index, where, jnp.asarray(e, dtype)


def float64_loss(margin, where, lse, g):
    """``Σ_n g[n]·(Σ_kept exp(logit − lse[n]) − target logit)`` of ``e_n`` and the tile's rows, in float64: with the
    log-sum-exp held, its gradient w.r.t. the logits is the kernels' ``g·(softmax − onehot)``."""
    rel, kept = np.asarray(where.rel), np.asarray(where.kept)

    def loss(e, w):
        cos = e @ (w / jnp.linalg.norm(w, axis=1, keepdims=True)).T
        picked = cos[jnp.arange(len(rel)), np.maximum(rel, 0)]
        target = jnp.where(rel >= 0, margin_target(picked, margin.s, margin.m1, margin.m2, margin.m3), 0.0)
        is_target = np.arange(cos.shape[1])[None, :] == rel[:, None]
        logits = jnp.where(is_target, target[:, None], margin.s * cos)
        return jnp.sum(g * (jnp.sum(jnp.where(kept[None, :], jnp.exp(logits - lse[:, None]), 0.0), axis=1) - target))

    return loss


def tile_lse(e_n, rows, margin, where, rng):
    """A log-sum-exp ``[N]`` as other tiles would leave it: this tile's own, plus up to ~3 more."""
    e, w = np.asarray(e_n, np.float64), np.asarray(rows, np.float64)
    cos = e @ (w / np.linalg.norm(w, axis=1, keepdims=True)).T
    logits = np.where(np.asarray(where.kept)[None, :], margin.s * cos, -np.inf)
    return np.logaddexp(np.logaddexp.reduce(logits, axis=1), margin.s * rng.uniform(0.0, 1.0, len(e)))


def backward(form, arrays, index, where, e_n, lse, g, margin, *update, reads=0):
    """``tile_backward`` jitted in ``form``; ``update``: ``(keep, rule, *scalars)`` or nothing."""
    keep, rule, *scalars = update or (None, None)
    forced, variant = VARIANTS[form]
    with rows_backward.forced(forced), rows_backward.variant(variant):
        step = jax.jit(lambda arrays, e_n, keep, scalars: rows_backward.tile_backward(
            arrays, index, where, e_n, lse, g, margin, lambda: arrays[0][index],
            *(() if keep is None else (keep, rule, *scalars)), reads=reads))
        return step(arrays, e_n, keep, scalars)


def gradient_rule(rows, row_grad, index):
    """A rule that reads the weight and writes the rows' gradient into the second array (as sharded_margin_loss'
    backward does)."""
    return (tiles.row_gradient(rows[0], *row_grad),)


def random_keep(rng, where):
    """Most of the kept columns, always the last (the row that the update kernel's padding copies)."""
    return (jnp.asarray(rng.random(where.kept.shape[0]) < 0.8).at[-1].set(True)) & where.kept


# every margin family in float32 and every compute dtype with ArcFace (the margin acts on float32 products whatever
# the operands' dtype: tiles.cosine_grads); and one case whose shares of rows take several blocks each (programs=2)
PROGRAMS = rows_backward.GRAD_PROGRAMS  # the kernel's own number of programs
GRADIENT_CASES = ([(margin, jnp.float32, PROGRAMS) for margin in ("arcface", "cosface", "sphereface")]
                  + [("arcface", dtype, PROGRAMS) for dtype in (jnp.bfloat16, jnp.float16)]
                  + [("arcface", jnp.bfloat16, 2)])


@pytest.mark.parametrize("margin,dtype,programs", GRADIENT_CASES, ids=lambda v: getattr(v, "__name__", str(v)))
def test_every_form_gives_the_float64_gradients_of_the_embeddings_and_the_kept_rows(margin, dtype, programs, rng,
                                                                                   monkeypatch):
    monkeypatch.setattr(rows_backward, "GRAD_PROGRAMS", programs)
    for name in ("GRAD_BLOCK_DIM", "UPDATE_BLOCK_DIM"):  # the products over two slices of the 32 dimensions
        monkeypatch.setattr(rows_backward, name, 16)
    margin = MARGINS[margin]
    weight, index, where, e_n = draw_tile(rng, dtype)
    lse = tile_lse(e_n, weight[index], margin, where, rng)
    g = rng.uniform(0.5, 2.0, len(e_n))
    keep = random_keep(rng, where)
    with jax.enable_x64(True):
        want_e, want_w = jax.grad(float64_loss(margin, where, lse, g), argnums=(0, 1))(
            np.asarray(e_n, np.float64), np.asarray(weight[index], np.float64))
    rows, kept = np.asarray(index), np.asarray(keep)
    # float32 cosines of s = 64 logits, or 16-bit embeddings and rows (bfloat16: 8 bits) rounded once per tile
    tolerance = {jnp.float32: 1e-4, jnp.bfloat16: 3e-2, jnp.float16: 5e-3}[dtype]
    for form in FORMS:
        sink = jnp.zeros(weight.shape, jnp.float32)
        d_e, (same, grads) = backward(form, (weight, sink), index, where, e_n, jnp.asarray(lse, jnp.float32),
                                      jnp.asarray(g, jnp.float32), margin, keep, gradient_rule, reads=1)
        assert d_e.dtype == jnp.float32 and rel_err(np.asarray(d_e), want_e) < tolerance, form
        assert rel_err(np.asarray(grads)[rows[kept]], np.asarray(want_w)[kept]) < tolerance, form
        untouched = np.setdiff1d(np.arange(len(weight)), rows[kept])
        assert np.all(np.asarray(grads)[untouched] == 0) and np.array_equal(same, weight), form
        d_e_alone, unchanged = backward(form, (weight,), index, where, e_n, jnp.asarray(lse, jnp.float32),
                                        jnp.asarray(g, jnp.float32), margin)
        np.testing.assert_array_equal(d_e_alone, d_e, err_msg=form)
        assert np.array_equal(unchanged[0], weight), form


# (optimizer, weight dtype, state dtype, weight rounding)
CASES = [("sgd", jnp.float32, jnp.float32, "nearest"), ("sgd", jnp.bfloat16, jnp.bfloat16, "nearest"),
         ("sgd", jnp.bfloat16, jnp.int8, "nearest"), ("adamw", jnp.float32, jnp.float32, "nearest"),
         ("sgd", jnp.bfloat16, jnp.bfloat16, "stochastic")]
STEPS = {"sgd": (sgd, sgd_step), "adamw": (adamw, adamw_step)}


def as_float64(arrays, per_slot):
    """Weight and decoded slots as float64 numpy."""
    weight, *slots = arrays
    return [np.asarray(weight, np.float64)] + [np.asarray(decode(tuple(slots[i:i + per_slot])), np.float64)
                                               for i in range(0, len(slots), per_slot)]


def stored_neighbours(grads, dtype):
    """``grads`` (float64) rounded to ``dtype``, and its neighbour on the float64 value's other side (the same value
    where the rounding is exact)."""
    near = jnp.asarray(grads, dtype)
    rounded = np.asarray(near, np.float64)
    beyond = np.where(grads > rounded, np.inf, np.where(grads < rounded, -np.inf, 0.0))
    return near, jnp.where(beyond == 0, near, jnp.nextafter(near, jnp.asarray(beyond, dtype)))


@pytest.mark.parametrize("name,weight_dtype,state_dtype,rounding", CASES, ids=str)
def test_every_form_steps_the_kept_rows_as_the_float64_optimizer_and_leave_the_rest(name, weight_dtype, state_dtype,
                                                                                   rounding, rng):
    margin = MARGINS["arcface"]
    weight, index, where, e_n = draw_tile(rng, weight_dtype)
    e_n = e_n.astype(jnp.float32)  # float32 products: the step's own rounding is what is held to float64 here
    optimizer = STEPS[name][0](state_dtype=state_dtype, weight_rounding=rounding)
    moments = [rng.normal(size=weight.shape) ** (i + 1) for i in range(optimizer.num_slots)]  # AdamW's nu >= 0
    arrays = (weight, *(a for m in moments for a in encode(jnp.asarray(m, jnp.float32), jnp.dtype(state_dtype))))
    lse = tile_lse(e_n, weight[index], margin, where, rng)
    g = rng.uniform(0.5, 2.0, len(e_n))
    keep = random_keep(rng, where)
    lr, count = float(rng.uniform(0.01, 0.5)), int(rng.integers(1, 20))
    per_slot = (len(arrays) - 1) // optimizer.num_slots
    before = as_float64(arrays, per_slot)
    rows, kept = np.asarray(index), np.asarray(keep)
    with jax.enable_x64(True):
        grads = jax.grad(float64_loss(margin, where, lse, g), argnums=1)(np.asarray(e_n, np.float64), before[0][rows])
    # the optimizer takes the gradient as stored: float32 sums rounded to the weight's dtype, which go to the float64
    # gradient's other neighbour where it lies within float32's error of a tie (seed 232027807: -4.171875482 rounds
    # to -4.1875 in bfloat16, the sums' -4.171874 to -4.15625); each result may then differ by that neighbour's step
    refs = [STEPS[name][1](before[0][rows], [s[rows] for s in before[1:]], np.asarray(stored, np.float64), lr, count)
            for stored in stored_neighbours(np.asarray(grads), weight_dtype)]
    ref, other = ([r[0], *r[1]] for r in refs)
    shard_first = int(rng.integers(0, 10**6))
    results = {form: backward(form, arrays, index, where, e_n, jnp.asarray(lse, jnp.float32),
                              jnp.asarray(g, jnp.float32), margin, keep, optimizer_rule(optimizer), jnp.float32(lr),
                              jnp.int32(count), jnp.int32(shard_first))[1] for form in FORMS}
    for form, new in results.items():
        for got, want, other_want, dtype in zip(as_float64(new, per_slot), ref, other,
                                                [weight_dtype] + [state_dtype] * len(ref[1:])):
            # float32 arithmetic, then one rounding to the storage dtype (an int8 code step: 1/127 of the row's
            # largest magnitude); the gradient itself is float32, rounded to the weight's dtype as the reference's
            got, want, straddle = got[rows[kept]], want[kept], np.abs(other_want - want)[kept]
            one_step = (np.abs(want).max(axis=1, keepdims=True) / 127 if dtype == jnp.int8 else
                        np.abs(want) * float(jnp.finfo(dtype).eps))
            assert np.all(np.abs(got - want) <= 1.01 * one_step + 1e-3 * np.abs(want).max() + straddle), (form, dtype)
        untouched = np.setdiff1d(np.arange(len(weight)), rows[kept])  # unlisted rows and listed rows not kept
        for a, b in zip(new, arrays):
            assert a.dtype == b.dtype and np.array_equal(np.asarray(a)[untouched], np.asarray(b)[untouched]), form
    # a 16-bit weight rounds alike in both (stochastic rounding: the same bits), apart only where their float32 sums
    # straddle a cut (float32 weights differ in their last bits, held to float64 above)
    xla, *kernels = (np.asarray(results[form][0])[rows[kept]] for form in FORMS)
    assert weight_dtype == jnp.float32 or all(np.mean(xla == k) > 0.99 for k in kernels)


def test_the_kernels_are_used_only_where_they_can_be(rng):
    def trace(form, d, rows=(), dtype=jnp.float32):
        weight, e_n = jnp.zeros((50, d), dtype), jnp.zeros((8, d))
        index, lse, g = jnp.arange(10), jnp.zeros(8), jnp.zeros(8)
        where = tiles.tile_columns(jnp.zeros(8, jnp.int32), jnp.ones(10, bool), 0, 0)
        slots = tuple(jnp.zeros((50, w)) for w in rows)
        keep_rows = lambda rows, row_grad, index: rows
        return str(jax.make_jaxpr(lambda arrays: backward(form, arrays, index, where, e_n, lse, g, MARGINS["cosface"],
                                                          jnp.ones(10, bool), keep_rows))((weight, *slots)))
    assert trace("pallas_interpret", 32).count("pallas_call") == 2  # the embeddings' gradient, then the update
    assert trace("update_kernel_interpret", 32).count("pallas_call") == 1  # the update alone, after XLA's GEMMs
    assert "pallas_call" not in trace("xla", 32)
    assert "pallas_call" not in trace("pallas_interpret", 24)  # not a power of two
    assert "pallas_call" not in trace("pallas_interpret", 32, rows=(12,))  # a slot's rows of 12: no Triton block
    assert "pallas_call" not in trace("pallas_interpret", 32, dtype=jnp.int8)  # not stored as floats
    with pytest.raises(ValueError, match="unknown rows-backward form 'triton': expected one of xla, "):
        with rows_backward.forced("triton"):
            pass


def test_the_kernels_padding_copies_the_last_row_where_it_stores_and_counts_nothing_where_it_sums(rng):
    """The update kernel pads a tile with copies of its last row, column, keep and gradient parts (``pad_rows``), so
    that each copy stores what the row stores (two stores to one address in one program: only equal values make that
    safe on a GPU, and Pallas' interpreter cannot show a race); the kernels that sum over rows pad with columns that
    are neither kept nor a target."""
    t = int(rng.integers(17, 31))
    targets = jnp.asarray(rng.integers(-1, t, 40), jnp.int32).at[0].set(t - 1)
    where = tiles.tile_columns(targets, jnp.asarray(rng.random(t) < 0.7).at[-1].set(True), 0, 0)
    index = kernel_forms.block_index(jnp.asarray(np.sort(rng.choice(500, t, replace=False)), jnp.int32), 16)
    columns, kept = (kernel_forms.pad_rows(x, 16) for x in (where.columns, where.kept))
    product = kernel_forms.pad_rows(jnp.asarray(rng.normal(size=(t, 8)), jnp.float32), 16)
    assert index.shape == columns.shape == kept.shape == (32,) and product.shape == (32, 8)
    for padded in (index, columns, kept, product):
        assert np.all(np.asarray(padded)[t:] == np.asarray(padded)[t - 1])
    inert = kernel_forms.block_columns(where, 16)
    assert not np.any(np.asarray(inert.kept)[t:])
    assert not np.any(np.asarray(inert.columns)[t:, None] == np.asarray(where.rel)[None, :])


def test_rows_replicated_over_axes_that_hold_other_embeddings_take_xlas_form():
    """With class_axes=('class',) on a (data=2, class=4) mesh each data replica of the rows sees other embeddings:
    the rows' gradient is their sum over data, which autodiff forms in XLA's form and no kernel sees."""
    mesh = jax.make_mesh((2, 4), ("data", "class"))
    where = tiles.tile_columns(jnp.zeros(2, jnp.int32), jnp.ones(8, bool), 0, 0)
    placed = lambda shape, spec: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))

    def traced(weight_spec, update=True):
        def step(weight, e_n):
            keep_rows = (jnp.ones(8, bool), lambda rows, row_grad, index: rows) if update else ()
            return backward("pallas_interpret", (weight,), jnp.arange(8), where, e_n, jnp.zeros(2), jnp.zeros(2),
                            MARGINS["cosface"], *keep_rows)[0]
        shard = jax.shard_map(step, mesh=mesh, in_specs=(weight_spec, P(("data", "class"))),
                              out_specs=P(("data", "class")))
        return str(jax.jit(shard).trace(placed((64, 32), weight_spec), placed((16, 32), P(("data", "class")))).jaxpr)
    assert traced(P(("data", "class"))).count("pallas_call") == 2
    assert "pallas_call" not in traced(P("class"))
    # the embeddings' gradient alone (no update) is no sum over devices: it takes the kernel form either way
    assert traced(P("class"), update=False).count("pallas_call") == 1
