"""The fused FC step (``FCHead.step``): loss, embedding gradient and sparse update against float64 references."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcls import batch_sharding, class_shards, make_mesh
from jaxcls.plan.hlo import collectives
from jaxcls.fc import FCHead
from jaxcls.fc import head as fc_head
from jaxcls.losses import rows_backward, rows_stats, sharded_margin_loss
from jaxcls.fc.sampling import gather_rows
from jaxcls.fc.optimizers import SparseState, adamw, decode, encode, sgd
from jaxcls.precision import cpu_scatter_converts
from problems import global_rows
from reference import MARGINS, adamw_step, rel_err, sgd_step, value_and_grads

LAYOUTS = [((1, 8), ("data", "class")), ((2, 4), ("data", "class")), ((2, 4), ("class",)), ((4, 2), ("class",))]
OPTIMIZERS = {"sgd": (sgd, sgd_step), "adamw": (adamw, adamw_step)}


def setup(rng, mesh_shape, class_axes, rate, chunk, optimizer="sgd", margin="arcface", dtype=jnp.float32, d=None,
          per_shard=(12, 40)):
    """A head with random weight and optimizer state, a batch, and its sample (``d``: the width, default random;
    ``per_shard``: the range of classes a shard holds)."""
    mesh = make_mesh(*mesh_shape)
    shards = class_shards(mesh, class_axes)
    c, d, n = shards * int(rng.integers(*per_shard)) - int(rng.integers(0, shards)), d or int(rng.integers(4, 17)), 16
    head = FCHead(mesh, c, d, MARGINS[margin], OPTIMIZERS[optimizer][0](state_dtype=dtype), sample_rate=rate,
                  class_axes=class_axes, chunk_size=chunk, dtype=dtype)
    weight, state = head.init(jax.random.key(int(rng.integers(2**31))))
    real = np.arange(head.rows)[:, None] < c
    noise = lambda x, f: jax.device_put(np.where(real, f(rng.normal(size=x.shape)), 0).astype(dtype), x.sharding)
    weight = noise(weight, lambda x: x)
    state = SparseState(tuple(noise(s, np.square) for s in state.slots), jnp.int32(int(rng.integers(0, 50))))
    emb = jax.device_put(rng.normal(size=(n, d)).astype(np.float32), batch_sharding(mesh))
    labels = jax.device_put(rng.integers(0, c, size=n).astype(np.int32), batch_sharding(mesh))
    sample = jax.jit(head.sample)(jax.random.key(int(rng.integers(2**31))), labels)
    return head, weight, state, emb, labels, sample


def sampled_global_rows(head, sample_rows):
    """Global row index of every sampled row, in sample order (every row without sampling)."""
    if sample_rows is None:
        return np.arange(head.rows)
    return global_rows(sample_rows, head.rows, class_shards(head.mesh, head.class_axes))


def run(head, weight, state, emb, labels, sample, lr, **kwargs):
    step = jax.jit(lambda w, s, e, l, smp: head.step(w, s, e, l, smp, lr, **kwargs))
    return step(weight, state, emb, labels, sample)


def check_step_against_reference(head, optimizer, inputs, result):
    """``inputs`` (weight, state, emb, labels, sample rows or None, lr) and ``result`` (loss, d_emb, new weight,
    new state) of ``head.step`` against the float64 reference of the restricted problem; arrays may be numpy."""
    weight, state, emb, labels, sample_rows, lr = inputs
    loss, d_emb, new_w, new_state = result
    rows = sampled_global_rows(head, sample_rows)
    rows = rows[rows < head.num_classes]  # the restricted problem: the sampled real classes
    w_rows = np.asarray(weight, np.float64)[rows]
    ref_loss, (ref_d_emb, ref_g) = value_and_grads(emb, w_rows, np.searchsorted(rows, np.asarray(labels)),
                                                   head.margin)
    count = int(state.count) + 1
    ref_w, ref_slots = OPTIMIZERS[optimizer][1](w_rows, [np.asarray(s, np.float64)[rows] for s in state.slots],
                                                ref_g, lr, count)
    assert rel_err(loss, ref_loss) < 1e-5
    assert rel_err(d_emb, ref_d_emb) < 1e-5
    assert rel_err(np.asarray(new_w)[rows] - w_rows, ref_w - w_rows) < 1e-4  # the step itself, not w + step
    for new, ref in zip(new_state.slots, ref_slots):
        assert rel_err(np.asarray(new)[rows], ref) < 1e-4
    assert int(new_state.count) == count
    untouched = np.setdiff1d(np.arange(head.rows), rows)  # unsampled and padding rows: bit for bit
    assert np.array_equal(np.asarray(new_w)[untouched], np.asarray(weight)[untouched])
    for new, old in zip(new_state.slots, state.slots):
        assert np.array_equal(np.asarray(new)[untouched], np.asarray(old)[untouched])


CASES = [(1.0, None, "sgd"), (1.0, 7, "sgd"), (0.3, None, "sgd"), (0.3, 5, "adamw")]  # (rate, chunk, optimizer)
# every layout with a full and a sampled case, every case on two layouts (tiles on (2,4) and (4,2) class-only)
GRID = [(layout, CASES[(i + k) % 4]) for i, layout in enumerate(LAYOUTS) for k in (0, 2)]


@pytest.mark.parametrize("layout,case", GRID, ids=str)
def test_fused_step_equals_dense_float64_reference(layout, case, rng):
    (mesh_shape, class_axes), (rate, chunk, optimizer) = layout, case
    head, weight, state, emb, labels, sample = setup(rng, mesh_shape, class_axes, rate, chunk, optimizer)
    lr = float(rng.uniform(0.01, 0.5))
    result = run(head, weight, state, emb, labels, sample, lr)
    check_step_against_reference(head, optimizer, (weight, state, emb, labels, sample and sample.rows, lr), result)


@pytest.mark.slow
@pytest.mark.parametrize("margin", sorted(MARGINS))
def test_fused_step_equals_autodiff_route(margin, rng):
    """Same numbers as ``sharded_margin_loss`` differentiated by JAX plus ``SparseOptimizer.update``."""
    head, weight, state, emb, labels, sample = setup(rng, (2, 4), ("data", "class"), 0.5, 4, "sgd", margin)
    loss, d_emb, new_w, new_state = run(head, weight, state, emb, labels, sample, 0.1)
    f = lambda e, r: sharded_margin_loss(e, r, labels, head.margin, mesh=head.mesh, num_classes=head.num_classes,
                                         row_classes=sample.classes)
    ref_loss, (ref_d_emb, g_rows) = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(
        emb, gather_rows(weight, sample, mesh=head.mesh))
    ref_w, ref_state = jax.jit(lambda w, s, g: head.optimizer.update(w, s, sample.rows, g, 0.1, mesh=head.mesh))(
        weight, state, g_rows)
    assert rel_err(loss, ref_loss) < 1e-6  # float32 both ways, summed in another order
    assert rel_err(d_emb, ref_d_emb) < 1e-5
    assert rel_err(np.asarray(new_w) - weight, np.asarray(ref_w) - weight) < 1e-5
    assert rel_err(new_state.slots[0], ref_state.slots[0]) < 1e-5


def test_skipped_or_gradient_only_steps_leave_the_fc_untouched(rng):
    head, weight, state, emb, labels, sample = setup(rng, (2, 4), ("data", "class"), 0.3, 5, "adamw")
    loss, d_emb, _, _ = run(head, weight, state, emb, labels, sample, 0.1)
    for kwargs in ({"keep_update": jnp.bool_(False)}, {"with_update": False}):
        loss2, d_emb2, new_w, new_state = run(head, weight, state, emb, labels, sample, 0.1, **kwargs)
        assert float(loss2) == float(loss) and np.array_equal(d_emb2, d_emb)
        assert np.array_equal(new_w, weight) and int(new_state.count) == int(state.count)
        for new, old in zip(new_state.slots, state.slots):
            assert np.array_equal(new, old)


def test_bad_label_under_jit_gives_nan_and_leaves_the_fc_untouched(rng):
    head, weight, state, emb, labels, sample = setup(rng, (1, 8), ("data", "class"), 1.0, None)
    bad = jax.device_put(np.asarray(labels).copy(), labels.sharding).at[3].set(head.num_classes)
    loss, _, new_w, new_state = run(head, weight, state, emb, bad, sample, 0.1)
    assert np.isnan(float(loss)) and np.array_equal(new_w, weight) and int(new_state.count) == int(state.count)
    with pytest.raises(ValueError, match=f"label {head.num_classes} at batch index 3"):
        head.step(weight, state, emb, jax.device_put(bad, labels.sharding), sample, 0.1)


@pytest.mark.parametrize("mesh_shape, class_axes", [((1, 8), ("data", "class")), ((2, 4), ("class",))], ids=str)
def test_a_sample_that_lacks_a_batch_label_gives_nan_and_leaves_the_fc_untouched(mesh_shape, class_axes, rng):
    """A sample drawn for other labels (reused across batches, drawn per micro-batch): the labels it lacks would
    train with no target at all, a finite and wrong loss."""
    head, weight, state, emb, labels, sample = setup(rng, mesh_shape, class_axes, 0.3, None, per_shard=(60, 90))
    other = np.setdiff1d(np.arange(head.num_classes), np.asarray(sample.classes))  # classes the sample lacks
    loss, _, new_w, new_state = run(head, weight, state, emb, labels, sample, 0.1)
    assert np.isfinite(float(loss)) and int(new_state.count) == int(state.count) + 1
    missing = jax.device_put(np.asarray(labels).copy(), labels.sharding).at[5].set(int(rng.choice(other)))
    loss, _, new_w, new_state = run(head, weight, state, emb, missing, sample, 0.1)
    assert np.isnan(float(loss)) and np.array_equal(new_w, weight) and int(new_state.count) == int(state.count)
    for new, old in zip(new_state.slots, state.slots):
        assert np.array_equal(new, old)


def storages(*cases):
    """``cases`` (each a tuple led by a dtype), each with ``as_bits``: bfloat16 and 8-bit float rows move as
    themselves on GPUs and as raw bits on CPUs (``fc_head.stored_as_bits``), so they take both; other dtypes move as
    themselves everywhere, so they take one."""
    def case_id(case, bits):
        storage = "as bits (CPU)" if bits else "as floats (GPU)" if cpu_scatter_converts(case[0]) else "as stored"
        return "-".join([jnp.dtype(case[0]).name, *map(str, case[1:]), storage])

    return [pytest.param(*case, bits, id=case_id(case, bits))
            for case in cases for bits in ((False, True) if cpu_scatter_converts(case[0]) else (False,))]


@pytest.mark.parametrize("dtype, state_dtype, as_bits", [
    (jnp.float32, None, ()), (jnp.float16, jnp.int8, ()), (jnp.bfloat16, None, (0, 1)), (jnp.float16, None, ()),
    (jnp.float32, jnp.bfloat16, (1,)), (jnp.bfloat16, jnp.int8, (0,)), (jnp.float32, jnp.float8_e4m3fn, (1,))], ids=str)
def test_rows_move_as_bits_on_cpu_where_xla_cannot_scatter_them_and_the_head_asks_for_the_elemental_emitter(
        dtype, state_dtype, as_bits, monkeypatch):
    head = FCHead(make_mesh(2, 4), 64, 8, MARGINS["arcface"], sgd(state_dtype=state_dtype), dtype=dtype)
    arrays = jax.eval_shape(head.init, jax.random.key(0))
    arrays = [arrays[0], arrays[1].slots[0]]  # the weight and its momentum (an int8 one's scales are float32)
    assert [i for i, a in enumerate(arrays) if fc_head.stored_as_bits(head.mesh, a.dtype)] == list(as_bits)
    assert head.compiler_options == ({"xla_cpu_use_fusion_emitters": False} if as_bits else {})
    monkeypatch.setattr(fc_head, "stores_bits", lambda mesh: False)  # a GPU's mesh
    assert head.compiler_options == {} and not any(fc_head.stored_as_bits(head.mesh, a.dtype) for a in arrays)


@pytest.mark.slow
@pytest.mark.parametrize("dtype, rounding, as_bits", storages((jnp.bfloat16, "nearest"), (jnp.float16, "nearest"),
                                                               (jnp.bfloat16, "stochastic")))
def test_compact_storage_matches_the_autodiff_route(dtype, rounding, as_bits, rng, monkeypatch):
    """One rounding each way; stochastic rounding draws the same bits in both (each row's class, the step)."""
    monkeypatch.setattr(fc_head, "stores_bits", lambda mesh: as_bits)
    head, weight, state, emb, labels, sample = setup(rng, (2, 4), ("data", "class"), 0.3, 6, "sgd", dtype=dtype)
    head = dataclasses.replace(head, optimizer=sgd(state_dtype=dtype, weight_rounding=rounding))
    loss, _, new_w, new_state = run(head, weight, state, emb, labels, sample, 0.1)
    assert new_w.dtype == dtype and new_state.slots[0].dtype == dtype
    f = lambda r: sharded_margin_loss(emb, r, labels, head.margin, mesh=head.mesh, num_classes=head.num_classes,
                                      row_classes=sample.classes)
    g_rows = jax.jit(jax.grad(f))(gather_rows(weight, sample, mesh=head.mesh))
    ref_w, _ = jax.jit(lambda w, s, g: head.optimizer.update(w, s, sample.rows, g, 0.1, mesh=head.mesh))(
        weight, state, g_rows)
    ulp = float(jnp.finfo(dtype).eps)  # float32 arithmetic, then one rounding each: at most one ulp apart
    np.testing.assert_allclose(np.asarray(new_w, np.float32), np.asarray(ref_w, np.float32), rtol=ulp, atol=1e-6)
    rows = sampled_global_rows(head, sample.rows)  # and mostly equal: apart only where float32 sums straddle a cut
    assert np.mean(np.asarray(new_w)[rows] == np.asarray(ref_w)[rows]) > 0.99


@pytest.mark.parametrize("state_dtype, as_bits", storages((jnp.int8,), (jnp.float8_e4m3fn,)))
def test_one_byte_state_matches_the_autodiff_route(state_dtype, as_bits, rng, monkeypatch):
    monkeypatch.setattr(fc_head, "stores_bits", lambda mesh: as_bits)
    head, weight, _, emb, labels, sample = setup(rng, (2, 4), ("data", "class"), 0.4, 5)
    head = dataclasses.replace(head, optimizer=sgd(state_dtype=state_dtype))
    real = np.arange(head.rows)[:, None] < head.num_classes
    momentum = jax.device_put(np.where(real, rng.normal(size=weight.shape), 0).astype(np.float32), weight.sharding)
    state = SparseState(jax.jit(encode, static_argnums=1)(momentum, state_dtype), jnp.int32(9))
    _, _, new_w, new_state = run(head, weight, state, emb, labels, sample, 0.1)
    f = lambda r: sharded_margin_loss(emb, r, labels, head.margin, mesh=head.mesh, num_classes=head.num_classes,
                                      row_classes=sample.classes)
    g_rows = jax.jit(jax.grad(f))(gather_rows(weight, sample, mesh=head.mesh))
    ref_w, ref_state = jax.jit(lambda w, s, g: head.optimizer.update(w, s, sample.rows, g, 0.1, mesh=head.mesh))(
        weight, state, g_rows)
    assert [(a.dtype, a.shape) for a in new_state.slots] == [(a.dtype, a.shape) for a in state.slots]
    assert rel_err(np.asarray(new_w) - weight, np.asarray(ref_w) - weight) < 1e-5
    # float32 both ways, summed in another order: a value may round to the neighbouring code value
    new, ref = np.asarray(decode(new_state.slots)), np.asarray(decode(ref_state.slots))
    values, scales = np.asarray(ref_state.slots[0], np.float32), np.asarray(ref_state.slots[1])
    code_step = scales if state_dtype == jnp.int8 else np.abs(values) * scales * float(jnp.finfo(state_dtype).eps)
    assert np.all(np.abs(new - ref) <= 1.01 * code_step + 1e-6 * scales)
    rows = sampled_global_rows(head, sample.rows)
    untouched = np.setdiff1d(np.arange(head.rows), rows[rows < head.num_classes])
    for a, b in zip((new_w, *new_state.slots), (weight, *state.slots)):  # bit for bit
        assert np.array_equal(np.asarray(a)[untouched], np.asarray(b)[untouched])


@pytest.mark.parametrize("variant", list(rows_backward.VARIANTS))
@pytest.mark.parametrize("layout,case", [(LAYOUTS[0], CASES[1]), (LAYOUTS[1], CASES[3])], ids=str)
def test_fused_step_through_the_row_kernels_equals_dense_float64_reference(layout, case, variant, rng, monkeypatch):
    """The step as a CUDA GPU runs it, its statistics and backward in jaxcls.losses' Pallas kernels (in Pallas'
    interpreter here), against float64: tiles that overlap, a sample, both optimizers; the backward's two kernels, or
    XLA's GEMMs and the update kernel alone (rows_backward.GEMMS_IN_KERNELS off). The interpreter runs inside
    shard_map only without its check of how values vary over the mesh, which the layouts here do not need (the rows
    vary over every axis the embeddings do)."""
    monkeypatch.setattr(jax, "shard_map", functools.partial(jax.shard_map, check_vma=False))
    (mesh_shape, class_axes), (rate, chunk, optimizer) = layout, case
    head, weight, state, emb, labels, sample = setup(rng, mesh_shape, class_axes, rate, chunk or 24, optimizer, d=32)
    lr = float(rng.uniform(0.01, 0.5))
    with rows_backward.forced("pallas_interpret"), rows_stats.forced("pallas_interpret"), \
            rows_backward.variant(variant):
        traced = str(jax.make_jaxpr(lambda *a: head.step(*a, lr))(weight, state, emb, labels, sample))
        result = run(head, weight, state, emb, labels, sample, lr)
    # statistics, [embeddings' gradient,] update
    assert traced.count("pallas_call") == (3 if variant == "pallas" else 2)
    check_step_against_reference(head, optimizer, (weight, state, emb, labels, sample and sample.rows, lr), result)


def compiled_fc_step(mesh, c, rate, chunk, d=64, n=64, state_dtype=None, dtype=jnp.float32):
    head = FCHead(mesh, c, d, MARGINS["arcface"], sgd(state_dtype=state_dtype), sample_rate=rate, chunk_size=chunk,
                  dtype=dtype)
    weight, state = jax.eval_shape(head.init, jax.random.key(0))
    emb = jax.ShapeDtypeStruct((n, d), jnp.float32, sharding=batch_sharding(mesh))
    labels = jax.ShapeDtypeStruct((n,), jnp.int32, sharding=batch_sharding(mesh))

    def step(weight, state, emb, labels, key):
        return head.step(weight, state, emb, labels, head.sample(key, labels), 0.1)

    # XLA:CPU's fusion emitters, a user's default (conftest compiles with its elemental emitter), and the head's options
    options = {"xla_cpu_use_fusion_emitters": True, **head.compiler_options}
    return jax.jit(step, donate_argnums=(0, 1)).lower(weight, state, emb, labels, jax.random.key(0)).compile(options)


@pytest.mark.parametrize("rate, state_dtype, dtype", [(1.0, None, jnp.float32), (0.25, None, jnp.float32),
                                                      (0.25, jnp.int8, jnp.float32), (0.25, None, jnp.bfloat16),
                                                      (0.25, jnp.int8, jnp.bfloat16), (0.25, None, jnp.float16)])
def test_compiled_step_updates_in_place_with_no_class_sized_temporaries_or_collectives(rate, state_dtype, dtype):
    """As a user compiles it, with ``head.compiler_options``: a bfloat16 weight moves as raw bits on CPU
    (``stored_as_bits``), in place only with XLA:CPU's elemental emitter, which those options ask for; float16 XLA:CPU
    scatters in place (docs/benchmarks.md, "XLA:CPU and a 16-bit FC weight")."""
    mesh, d, n = make_mesh(2, 4), 64, 64
    small, large = (compiled_fc_step(mesh, 8 * rows, rate, 512, state_dtype=state_dtype, dtype=dtype)
                    for rows in (4096, 16384))
    sizes = [c.largest for c in collectives(large.as_text())]
    assert sizes and max(sizes) <= n * d, f"a collective scales with the classes: {sizes}"
    m_small, m_large = small.memory_analysis(), large.memory_analysis()
    weight_row = d * jnp.dtype(dtype).itemsize  # momentum in the weight's dtype, or int8 and a float32 scale
    row_bytes = weight_row + (weight_row if state_dtype is None else d + 4)
    assert m_large.alias_size_in_bytes >= 16384 * row_bytes, "weight and momentum must be updated in place"
    per_row = (m_large.temp_size_in_bytes - m_small.temp_size_in_bytes) / (16384 - 4096)
    assert per_row < 8, f"temporaries grow by {per_row:.1f} B per class row (a row holds {row_bytes} B)"
