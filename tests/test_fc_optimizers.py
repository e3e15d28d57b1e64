"""Sparse FC optimizers: only the sampled rows (and their state) change, as optax would change them."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jax.sharding import NamedSharding

from jaxcls import make_mesh, weight_sharding
from jaxcls.fc import optimizers as fc_optimizers
from jaxcls.mesh import DEFAULT_CLASS_AXES, row_spec
from jaxcls.losses import init_weight
from jaxcls.fc.sampling import gather_rows
from jaxcls.fc.optimizers import (SparseState, adamw, decode, encode, round_half_even, rounding_bits, sgd,
                                  stochastic_round)
from problems import draw, global_rows


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
    random_like = lambda x, power=1: jax.device_put(rng.normal(size=x.shape).astype(np.float32) ** power, x.sharding)
    # signed draws; AdamW's second moment (its slot 1) is a square
    state = SparseState(tuple(random_like(s, 1 + (i == 1)) for i, s in enumerate(state.slots)),
                        jnp.int32(int(rng.integers(0, 50))))
    grads = random_like(gather_rows(weight, sample, mesh=mesh))
    lr = float(rng.uniform(0.01, 0.5))
    step = jax.jit(partial(opt.update, mesh=mesh), donate_argnums=())
    new_w, new_state = step(weight, state, sample.rows, grads, lr)

    sampled = global_rows(sample.rows, rows, mesh.size)
    w_rows = np.asarray(weight)[sampled]
    slots = tuple(np.asarray(s)[sampled] for s in state.slots)
    ref_w, ref_slots = optax_reference(name, w_rows, slots, np.asarray(grads), lr, int(state.count))
    np.testing.assert_allclose(np.asarray(new_w)[sampled], ref_w, rtol=2e-6, atol=1e-6)  # f32 cancellation in w − lr·buf
    for new, ref in zip(new_state.slots, ref_slots):
        np.testing.assert_allclose(np.asarray(new)[sampled], ref, rtol=2e-6, atol=1e-6)  # f32 cancellation in w − lr·buf
    untouched = np.setdiff1d(np.arange(rows), sampled)
    assert np.array_equal(np.asarray(new_w)[untouched], np.asarray(weight)[untouched])
    for new, old in zip(new_state.slots, state.slots):
        assert np.array_equal(np.asarray(new)[untouched], np.asarray(old)[untouched])
    assert int(new_state.count) == int(state.count) + 1


@pytest.mark.parametrize("opt", [sgd(), sgd(state_dtype=jnp.int8), adamw()], ids=["sgd", "sgd int8", "adamw"])
def test_a_fresh_state_is_its_own_arrays_so_a_step_can_donate_them(opt):
    """Each slot (and each one-byte slot's scales) its own buffer: one array twice cannot be donated twice."""
    state = opt.init(jnp.ones((16, 4), jnp.float32))
    assert len({id(s) for s in state.slots}) == len(state.slots) == opt.num_slots * (2 if opt.state_dtype else 1)
    step = jax.jit(partial(opt.update, mesh=make_mesh(1, 8)), donate_argnums=(0, 1))
    new_w, _ = step(jnp.ones((16, 4), jnp.float32), state, None, jnp.ones((16, 4), jnp.float32), 0.1)
    assert np.isfinite(np.asarray(new_w)).all()


def test_adamw_keeps_its_state_in_float32_only():
    """In float16 ``(1 − b2)·g²`` underflows once ``|g| < 8e-3``: stored as 0, the next step is 65× too large. In
    bfloat16 ``0.999·ν`` rounds back to ν (ν never decays) and ``0.001·g²`` stops adding after ~500 updates."""
    for dtype in (jnp.float16, jnp.bfloat16, jnp.int8):
        with pytest.raises(ValueError, match=f"adamw cannot keep its FC state in {jnp.dtype(dtype).name}"):
            adamw(state_dtype=dtype)
        with pytest.raises(ValueError, match=f"adamw cannot keep its FC state in {jnp.dtype(dtype).name}"):
            adamw().init(jnp.zeros((4, 2), dtype))  # the weight's, by default
    adamw(state_dtype=jnp.float32).init(jnp.zeros((4, 2), jnp.bfloat16))


def test_sgd_keeps_its_momentum_in_a_floating_dtype_or_int8():
    """Another integer dtype would store the momentum truncated ([0.3, −0.5] as [0, 0]), uint8 without its sign."""
    for dtype in (jnp.int16, jnp.int32, jnp.uint8):
        with pytest.raises(ValueError, match=f"sgd cannot keep its momentum in {jnp.dtype(dtype).name}"):
            sgd(state_dtype=dtype)
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16, jnp.int8, jnp.float8_e4m3fn):
        sgd(state_dtype=dtype).init(jnp.zeros((4, 2), jnp.float32))


@pytest.mark.parametrize("name,rounding", [("sgd", "nearest"), ("adamw", "nearest"), ("sgd", "stochastic")])
def test_dense_update_equals_update_of_every_row(name, rounding, rng):
    """The same rows and, with stochastic rounding, the same bits: each row's class is found alike."""
    mesh = make_mesh(2, 4)
    opt = {"sgd": sgd, "adamw": adamw}[name](weight_rounding=rounding)
    dtype = jnp.bfloat16 if rounding == "stochastic" else jnp.float32
    weight = init_weight(jax.random.key(int(rng.integers(2**31))), 8 * 6, 8, mesh, stddev=1.0, dtype=dtype)
    state = opt.init(weight)
    grads = jax.device_put(rng.normal(size=weight.shape).astype(np.float32), weight.sharding)
    every_row = jax.device_put(np.tile(np.arange(6, dtype=np.int32), 8), jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec(("data", "class"))))
    step = jax.jit(partial(opt.update, mesh=mesh))
    dense, sparse = step(weight, state, None, grads, 0.1), step(weight, state, every_row, grads, 0.1)
    for a, b in zip(jax.tree.leaves(dense), jax.tree.leaves(sparse)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("dtype, on_cpu", [(jnp.bfloat16, True), (jnp.bfloat16, False), (jnp.float16, True)],
                         ids=["bfloat16 as bits (CPU)", "bfloat16 as floats (GPU)", "float16"])
def test_compact_state_updates_in_float32_and_stores_rounded(dtype, on_cpu, rng, monkeypatch):
    monkeypatch.setattr(fc_optimizers, "on_cpu", lambda mesh: on_cpu)
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
    sampled = global_rows(sample.rows, rows, 8)
    w32 = np.asarray(weight.astype(jnp.float32))[sampled]
    g = np.asarray(grads) + 5e-4 * w32
    assert_rounded_float32_result(np.asarray(new_w)[sampled], w32 - 0.1 * g, dtype, np.abs(w32) + np.abs(0.1 * g))
    assert_rounded_float32_result(np.asarray(new_state.slots[0])[sampled], g, dtype,
                                  np.abs(np.asarray(grads)) + np.abs(5e-4 * w32))


@pytest.mark.parametrize("dtype, state_dtype", [(jnp.float32, None), (jnp.bfloat16, None), (jnp.float16, None),
                                                (jnp.bfloat16, jnp.int8)], ids=str)
def test_update_of_sampled_rows_is_in_place_on_cpu(dtype, state_dtype):
    """Donated, the weight and its slots are updated in place: temporaries independent of the class count. XLA:CPU
    scatters into bfloat16 arrays only by converting them whole, so there their rows move as bits (513 B a class row
    at D = 64 before)."""
    mesh, d, sampled = make_mesh(2, 4), 64, 8 * 256
    opt = sgd(state_dtype=state_dtype)
    temporaries = []
    for c in (8 * 4096, 8 * 16384):
        weight = jax.ShapeDtypeStruct((c, d), dtype, sharding=weight_sharding(mesh))
        state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                             jax.eval_shape(opt.init, weight))
        rows = jax.ShapeDtypeStruct((sampled,), jnp.int32, sharding=NamedSharding(mesh, row_spec(DEFAULT_CLASS_AXES)))
        grads = jax.ShapeDtypeStruct((sampled, d), jnp.float32, sharding=weight_sharding(mesh))
        compiled = jax.jit(partial(opt.update, mesh=mesh), donate_argnums=(0, 1)).lower(
            weight, state, rows, grads, 0.1).compile()
        temporaries.append(compiled.memory_analysis().temp_size_in_bytes)
    per_row = (temporaries[1] - temporaries[0]) / (16384 - 4096)
    assert per_row < 8, f"temporaries grow by {per_row:.0f} B a class row"


def assert_rounded_float32_result(stored, exact, dtype, operands):
    """``stored`` is ``exact`` computed in float32 (error ≤ 4 float32 ulps of the ``operands``' magnitude: XLA may
    fuse or reorder) and rounded once to ``dtype`` (≤ half a ``dtype`` ulp; below the normal range the ulp is the
    smallest subnormal: float16 under 6.1e-5). Arithmetic in ``dtype`` breaks it."""
    half_ulp = np.maximum(np.abs(exact) * float(jnp.finfo(dtype).eps), float(jnp.finfo(dtype).smallest_subnormal)) / 2
    bound = half_ulp + 4 * float(np.finfo(np.float32).eps) * operands
    error = np.abs(np.asarray(stored, np.float32) - exact)
    assert np.all(error <= bound), f"{np.sum(error > bound)} values off by up to {np.max(error - bound):.3g}"


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn])
def test_one_byte_state_is_the_float32_momentum_rounded_to_a_scale_per_row(dtype, rng):
    mesh = make_mesh(2, 4)
    c, d = 8 * 20 - 3, int(rng.integers(4, 40))
    labels, sample, rows = draw(rng, mesh, c, 16, 0.2)
    weight = init_weight(jax.random.key(int(rng.integers(2**31))), c, d, mesh, stddev=1.0)
    opt = sgd(state_dtype=dtype)
    values, scales = opt.init(weight).slots
    assert values.dtype == dtype and values.shape == weight.shape and scales.shape == (weight.shape[0], 1)
    assert values.sharding == scales.sharding == weight.sharding
    # a random stored momentum (rows of very different sizes), written by the code itself
    momentum = rng.normal(size=weight.shape) * np.exp(rng.uniform(-8, 3, size=(weight.shape[0], 1)))
    momentum[rng.integers(0, rows, size=3)] = 0.0  # all-zero rows (as every row at the start) stay exact
    state = SparseState(jax.jit(encode, static_argnums=1)(jax.device_put(momentum.astype(np.float32),
                                                                         weight.sharding), dtype), jnp.int32(3))
    grads = jax.device_put(rng.normal(size=(len(sample.rows), d)).astype(np.float32), weight.sharding)
    lr = float(rng.uniform(0.01, 0.5))
    new_w, new_state = jax.jit(partial(opt.update, mesh=mesh))(weight, state, sample.rows, grads, lr)

    sampled = global_rows(sample.rows, rows, 8)
    w64, old = np.asarray(weight, np.float64)[sampled], np.asarray(decode(state.slots), np.float64)[sampled]
    exact = 0.9 * old + np.asarray(grads, np.float64) + 5e-4 * w64  # the float64 momentum of this step
    operands = 0.9 * np.abs(old) + np.abs(np.asarray(grads)) + 5e-4 * np.abs(w64)
    f32 = 4 * float(np.finfo(np.float32).eps) * operands
    # the weight moves by the momentum before it is rounded for storage
    assert np.all(np.abs(np.asarray(new_w)[sampled] - (w64 - lr * exact)) <= 2e-6 * np.abs(w64) + lr * f32)
    new_values, new_scales = (np.asarray(a, np.float64)[sampled] for a in new_state.slots)
    top = float(jnp.finfo(dtype).max if dtype == jnp.float8_e4m3fn else jnp.iinfo(dtype).max)
    row_max = np.max(np.abs(exact), axis=1, keepdims=True)
    # the largest magnitude maps to the top value
    assert np.all(np.abs(new_scales - row_max / top) <= (np.max(f32, axis=1, keepdims=True) + 1e-6 * row_max) / top)
    assert np.array_equal(np.max(np.abs(new_values), axis=1), np.full(len(sampled), top))
    # each value is the nearest one of the code (half a step off at most), in units of its row's scale
    scaled = exact / new_scales
    step = 1.0 if dtype == jnp.int8 else np.maximum(np.abs(scaled) * float(jnp.finfo(dtype).eps),
                                                    float(jnp.finfo(dtype).smallest_subnormal))
    assert np.all(np.abs(new_values - scaled) <= step / 2 + f32 / new_scales + 1e-5 * np.abs(scaled))
    untouched = np.setdiff1d(np.arange(rows), sampled)
    for new, before in zip((new_w, *new_state.slots), (weight, *state.slots)):
        assert np.array_equal(np.asarray(new)[untouched], np.asarray(before)[untouched])
    zero_rows = np.all(momentum == 0, axis=1)  # stored with scale 0; they decode to zeros, not NaN
    assert np.all(np.asarray(state.slots[1])[zero_rows] == 0)
    assert np.all(np.asarray(decode(state.slots))[zero_rows] == 0)


def test_round_half_even_is_jnp_round(rng):
    """encode's rounding (without jnp.round, which Triton kernels lack) on ties, near-ties and random values."""
    ties = np.arange(-254, 255) / 2
    near = np.concatenate([np.nextafter(ties.astype(np.float32), np.float32(-np.inf)),
                           np.nextafter(ties.astype(np.float32), np.float32(np.inf))])
    x = np.concatenate([ties, near, rng.uniform(-127, 127, 10_000), [1e-30, -1e-30, 0.0]]).astype(np.float32)
    np.testing.assert_array_equal(jax.jit(round_half_even)(x), np.round(x))


def bfloat16_neighbours(x):
    """The bfloat16 values either side of float32 ``x`` (toward and away from zero) and the share of the step
    between them that ``|x|`` lies above the first."""
    word = np.asarray(x, np.float32).view(np.uint32)
    low = (word & np.uint32(0xFFFF0000)).view(np.float32).astype(np.float64)
    high = ((word & np.uint32(0xFFFF0000)) + np.uint32(0x10000)).view(np.float32).astype(np.float64)
    return low, high, (np.asarray(x, np.float64) - low) / (high - low)


def test_stochastic_rounding_is_unbiased_over_the_steps_bits(rng):
    """Each float32 value rounded with the bits of 4,000 steps: always one of its two bfloat16 neighbours, the
    value itself where bfloat16 holds it, and equal to it on average (to 5 standard errors); rounding to nearest
    is not. Infinities and NaN pass through."""
    x = (rng.choice([-1, 1], (8, 64)) * 10.0 ** rng.uniform(-6, 3, (8, 64))).astype(np.float32)
    x[0, :8] = np.asarray(x[0, :8], jnp.bfloat16).astype(np.float32)  # exactly representable
    x[1, :3] = [np.inf, -np.inf, np.nan]
    classes = jnp.asarray(rng.choice(10**7, 8, replace=False), jnp.int32)
    steps = jnp.arange(1, 4001, dtype=jnp.int32)
    rounded = np.asarray(jax.jit(jax.vmap(lambda t: stochastic_round(jnp.asarray(x), rounding_bits(classes, 64, t))))(
        steps), np.float64)
    assert np.array_equal(rounded[:, 1, :3], np.broadcast_to(x[1, :3], (4000, 3)), equal_nan=True)
    finite = np.isfinite(x)
    x = np.where(finite, x, 0).astype(np.float32)  # the checks below are of the finite values
    low, high, above = bfloat16_neighbours(x)
    assert np.all((rounded == low) | (rounded == high) | ~finite)
    assert np.all(rounded[:, 0, :8] == x[0, :8])
    standard_error = np.abs(high - low) * np.sqrt(above * (1 - above) / len(steps))
    error = np.abs(rounded.mean(axis=0) - x)
    assert np.all((error <= 5 * standard_error + 1e-9 * np.abs(x)) | ~finite)
    nearest = np.abs(np.asarray(x, jnp.bfloat16).astype(np.float64) - x)
    assert np.mean(nearest > 5 * standard_error + 1e-9 * np.abs(x)) > 0.5  # the check above can fail


def test_rounding_bits_are_uniform_and_a_function_of_class_column_and_step(rng):
    classes = rng.choice(5 * 10**7, 256, replace=False).astype(np.int32)
    bits = np.asarray(rounding_bits(jnp.asarray(classes), 128, jnp.int32(7)))
    share_set = np.unpackbits(bits.view(np.uint8).reshape(-1, 4), axis=1).mean(axis=0)  # per bit of the word
    assert np.all(np.abs(share_set - 0.5) < 5 * 0.5 / np.sqrt(bits.size))
    assert len(np.unique(bits)) > 0.999 * bits.size
    order = rng.permutation(256)[:100]  # a row's bits depend on its class, not on where it stands
    np.testing.assert_array_equal(np.asarray(rounding_bits(jnp.asarray(classes[order]), 128, jnp.int32(7))),
                                  bits[order])
    for other in (rounding_bits(jnp.asarray(classes), 128, jnp.int32(8)),
                  rounding_bits(jnp.asarray(classes + 1), 128, jnp.int32(7)),
                  rounding_bits(jnp.asarray(classes), 256, jnp.int32(7))[:, 128:]):
        assert np.mean(np.asarray(other) == bits) < 1e-3


@pytest.mark.parametrize("mesh_shape", [(1, 8), (4, 2)], ids=str)
def test_stochastic_rounding_keeps_the_updates_below_the_bfloat16_step(mesh_shape, rng):
    """Sampled rows of a bfloat16 weight, every update under half its step: rounded to nearest the weight stays
    as it was; rounded stochastically each entry lands on a neighbour of the float64 result, and the moves add up
    to the float64 updates (a signed sum, to 5 standard errors)."""
    mesh = make_mesh(*mesh_shape)
    c, d = 8 * 300 - 3, 16
    labels, sample, rows = draw(rng, mesh, c, 64, 0.5)
    weight = init_weight(jax.random.key(0), c, d, mesh, dtype=jnp.bfloat16)  # entries of magnitude 1 to 2, whose
    magnitudes = rng.choice([-1, 1], weight.shape) * rng.uniform(1, 2, weight.shape)  # bfloat16 step is 2**-7
    weight = jax.device_put(magnitudes.astype(jnp.bfloat16), weight.sharding)
    grads = jax.device_put(rng.normal(size=(len(sample.rows), d)).astype(np.float32), weight.sharding)
    sampled = global_rows(sample.rows, rows, 8)
    w = np.asarray(weight, np.float64)[sampled]
    lr = 0.45 * 2.0**-8 / float(np.max(np.abs(np.asarray(grads) + 5e-4 * w)))  # every update under half a step
    exact = w - lr * (np.asarray(grads, np.float64) + 5e-4 * w)  # sgd's first step (no momentum yet), float64
    new = {}
    for rounding in ("nearest", "stochastic"):
        opt = sgd(weight_rounding=rounding)
        new[rounding] = np.asarray(jax.jit(partial(opt.update, mesh=mesh))(
            weight, opt.init(weight), sample.rows, grads, lr)[0], np.float64)
    assert np.array_equal(new["nearest"], np.asarray(weight, np.float64))
    moved = new["stochastic"][sampled]
    low, high, above = bfloat16_neighbours(exact.astype(np.float32))
    assert np.all((moved == low) | (moved == high))
    update = exact - w
    noise = np.sqrt(np.sum((high - low) ** 2 * above * (1 - above)))
    assert abs(np.sum(np.sign(update) * (moved - exact))) < 5 * noise
    assert np.sum(np.abs(update)) > 20 * noise  # rounding to nearest (moved == w) would fail the sum
    untouched = np.setdiff1d(np.arange(rows), sampled)
    assert np.array_equal(new["stochastic"][untouched], np.asarray(weight, np.float64)[untouched])
