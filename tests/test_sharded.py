"""``sharded_margin_loss``: the class-parallel margin loss against a dense float64 reference, on several meshes."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import MESH_SHAPES
from jaxcls import batch_sharding, class_shards, make_mesh, weight_sharding
from jaxcls.plan.hlo import collectives
from jaxcls.losses import arcface, cosface, init_weight, sharded_margin_loss
from jaxcls.precision import cpu_scatter_converts
from reference import MARGINS, rel_err, value_and_grads


def make_problem(rng, mesh, class_axes=("data", "class"), divisible=True, dtype=jnp.float32):
    """Fresh random sizes and values; returns (embeddings, weight, labels, C) placed on ``mesh``."""
    shards = class_shards(mesh, class_axes)
    n = mesh.size * int(rng.integers(1, 4))
    d = int(rng.integers(4, 33))
    c = shards * int(rng.integers(2, 7))
    if not divisible:
        c -= int(rng.integers(1, shards)) if shards > 1 else 0
    key = jax.random.key(int(rng.integers(2**31)))
    weight = init_weight(key, c, d, mesh, class_axes, stddev=1.0)
    emb = jax.device_put(rng.normal(size=(n, d)).astype(np.float32), batch_sharding(mesh)).astype(dtype)
    labels = jax.device_put(rng.integers(0, c, size=n).astype(np.int32), batch_sharding(mesh))
    return emb, weight, labels, c


def loss_and_grads(emb, weight, labels, margin, mesh, num_classes, **kwargs):
    f = partial(sharded_margin_loss, margin=margin, mesh=mesh, num_classes=num_classes, **kwargs)
    return jax.jit(jax.value_and_grad(lambda e, w: f(e, w, labels), argnums=(0, 1)))(emb, weight)


def check_against_reference(emb, weight, labels, c, margin, result, tol):
    loss, (g_emb, g_w) = result
    ref_loss, (ref_g_emb, ref_g_w) = value_and_grads(emb, np.asarray(weight)[:c], labels, margin)
    assert rel_err(loss, ref_loss) < tol
    assert rel_err(g_emb, ref_g_emb) < tol
    assert rel_err(np.asarray(g_w)[:c], ref_g_w) < tol
    assert np.all(np.asarray(g_w)[c:] == 0), "padding rows must get zero gradient"


# every margin on every mesh (the last two in the slow lane); C a multiple of the class shards on two meshes,
# padded on the other two
LAYOUTS = [pytest.param(shape, divisible, marks=[pytest.mark.slow] if i >= 2 else [])
           for i, (shape, divisible) in enumerate(zip(MESH_SHAPES, [False, True, False, True]))]


@pytest.mark.parametrize("margin_name", sorted(MARGINS))
@pytest.mark.parametrize("mesh_shape,divisible", LAYOUTS, ids=lambda v: str(v) if isinstance(v, tuple) else
                         ("C_divisible" if v else "C_padded"))
def test_matches_dense_reference(mesh_shape, divisible, margin_name, rng):
    mesh = make_mesh(*mesh_shape)
    emb, weight, labels, c = make_problem(rng, mesh, divisible=divisible)
    margin = MARGINS[margin_name]
    result = loss_and_grads(emb, weight, labels, margin, mesh, c)
    check_against_reference(emb, weight, labels, c, margin, result, tol=1e-5)


@pytest.mark.parametrize("mesh_shape,class_axes", [(shape, axes) for shape, axes in zip(
    MESH_SHAPES, [("data", "class"), ("class",)] * 2)], ids=str)  # both layouts on two meshes each
def test_chunked_equals_unchunked(mesh_shape, class_axes, rng):
    mesh = make_mesh(*mesh_shape)
    emb, weight, labels, c = make_problem(rng, mesh, class_axes, divisible=False)
    c_local = weight.shape[0] // class_shards(mesh, class_axes)
    chunk = int(rng.integers(1, c_local))  # usually not a divisor: the last tile overlaps its predecessor
    margin = MARGINS["arcface"]
    plain = loss_and_grads(emb, weight, labels, margin, mesh, c, class_axes=class_axes)
    chunked = loss_and_grads(emb, weight, labels, margin, mesh, c, class_axes=class_axes, chunk_size=chunk)
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(chunked)):
        assert rel_err(b, a) < 1e-5
    check_against_reference(emb, weight, labels, c, margin, chunked, tol=1e-5)


@pytest.mark.parametrize("class_axes", [("data", "class"), ("class",)], ids=str)
def test_chunked_tiles_that_overlap_give_every_row_its_gradient_once(class_axes, rng):
    """7 rows a shard in tiles of 3: [0, 3), [3, 6) and [4, 7), which owns only row 6; labels on the overlapping rows
    4 and 5 of every shard. Each row's gradient is written by the tile that owns it, whatever the others hold."""
    mesh = make_mesh(2, 4)
    shards = class_shards(mesh, class_axes)
    emb, weight, _, c = make_problem(rng, mesh, class_axes)
    weight = init_weight(jax.random.key(int(rng.integers(2**31))), 7 * shards, emb.shape[1], mesh, class_axes,
                         stddev=1.0)
    c = 7 * shards
    labels = 7 * rng.integers(0, shards, emb.shape[0]) + rng.choice([4, 5, 6, 0], emb.shape[0])
    labels = jax.device_put(labels.astype(np.int32), batch_sharding(mesh))
    margin = MARGINS["arcface"]
    result = loss_and_grads(emb, weight, labels, margin, mesh, c, class_axes=class_axes, chunk_size=3)
    check_against_reference(emb, weight, labels, c, margin, result, tol=1e-5)


@pytest.mark.parametrize("chunk_size", [None, 3])
@pytest.mark.parametrize("mesh_shape", [(2, 4), (4, 2)], ids=str)
def test_class_only_layout_matches_reference(mesh_shape, chunk_size, rng):
    """Weight replicated over `data`: gathers span only `class`; the weight gradient is summed over `data`."""
    mesh = make_mesh(*mesh_shape)
    emb, weight, labels, c = make_problem(rng, mesh, ("class",), divisible=False)
    assert weight.sharding.is_equivalent_to(NamedSharding(mesh, P("class", None)), 2)
    margin = MARGINS["combined"]
    result = loss_and_grads(emb, weight, labels, margin, mesh, c, class_axes=("class",), chunk_size=chunk_size)
    check_against_reference(emb, weight, labels, c, margin, result, tol=1e-5)


@pytest.mark.parametrize("chunk_size", [None, 3])
@pytest.mark.parametrize("weight_dtype", [jnp.bfloat16, jnp.float16], ids=str)
def test_a_16_bit_weight_gets_its_float64_gradient_rounded_once(weight_dtype, chunk_size, rng):
    """float32 compute on a bfloat16 or float16 weight (its values exact in float32): the loss and the embeddings'
    gradient as with a float32 weight of those values, the weight's gradient in the weight's dtype within its
    rounding (a relative error under the dtype's half ulp, 2^-9 or 2^-12)."""
    mesh = make_mesh(2, 4)
    emb, weight, labels, c = make_problem(rng, mesh, divisible=False)
    weight = weight.astype(weight_dtype)
    margin = MARGINS["arcface"]
    loss, (g_emb, g_w) = loss_and_grads(emb, weight, labels, margin, mesh, c, chunk_size=chunk_size)
    assert g_w.dtype == weight_dtype and g_emb.dtype == jnp.float32
    ref_loss, (ref_g_emb, ref_g_w) = value_and_grads(emb, np.asarray(weight.astype(jnp.float32))[:c], labels, margin)
    assert rel_err(loss, ref_loss) < 1e-5 and rel_err(g_emb, ref_g_emb) < 1e-5
    half_ulp = 2.0 ** -(jnp.finfo(weight_dtype).nmant + 1)
    assert rel_err(np.asarray(g_w.astype(jnp.float32))[:c], ref_g_w) < half_ulp
    assert np.all(np.asarray(g_w.astype(jnp.float32))[c:] == 0)


@pytest.mark.slow
@pytest.mark.parametrize("chunk_size", [None, 5])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("mesh_shape", [(1, 8), (2, 4)], ids=str)
def test_low_precision_compute_within_tolerance(mesh_shape, dtype, chunk_size, rng):
    mesh = make_mesh(*mesh_shape)
    emb, weight, labels, c = make_problem(rng, mesh, divisible=False, dtype=dtype)
    margin = MARGINS["cosface"]
    loss, (g_emb, g_w) = loss_and_grads(emb, weight, labels, margin, mesh, c, chunk_size=chunk_size)
    assert g_emb.dtype == dtype and loss.dtype == jnp.float32
    ref_loss, (ref_g_emb, ref_g_w) = value_and_grads(emb.astype(jnp.float32), np.asarray(weight)[:c], labels, margin)
    tol = 0.05 if dtype == jnp.bfloat16 else 0.01  # logits are s·cos with s = 64: operand rounding is amplified
    assert rel_err(loss, ref_loss) < tol
    assert rel_err(g_emb.astype(jnp.float32), ref_g_emb) < 2 * tol
    assert rel_err(np.asarray(g_w)[:c], ref_g_w) < 2 * tol


@pytest.mark.parametrize("chunk_size", [None, 1024])
def test_no_collective_scales_with_classes(chunk_size):
    """Default layout: every collective of jit(grad(loss)) is O(N·D) or O(N), never O(N·C_local)."""
    mesh = make_mesh(2, 4)
    n, d, c = 64, 16, 8 * 4096
    c_local = c // 8
    spec = dict(margin=arcface(), mesh=mesh, num_classes=c, chunk_size=chunk_size)
    grad_fn = jax.jit(jax.grad(lambda e, w, y: sharded_margin_loss(e, w, y, **spec), argnums=(0, 1)))
    args = (jax.ShapeDtypeStruct((n, d), jnp.float32, sharding=batch_sharding(mesh)),
            jax.ShapeDtypeStruct((c, d), jnp.float32, sharding=weight_sharding(mesh)),
            jax.ShapeDtypeStruct((n,), jnp.int32, sharding=batch_sharding(mesh)))
    found = collectives(grad_fn.lower(*args).compile().as_text())
    assert any(c.op == "all-gather" for c in found), found  # embeddings and labels are gathered
    assert max(c.largest for c in found) <= n * d < n * c_local, found


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16], ids=str)
def test_chunked_gradient_is_filled_in_place_on_cpu(dtype):
    """The weight's gradient is written tile by tile into one array of the weight's dtype, and no converted copy of the
    weight is held: XLA:CPU scatters float16 in place, and a bfloat16 weight and its gradient move as their bits
    (``precision.bits_dtype``; before, a float32 gradient and a float32 copy of the weight, which XLA:CPU hoisted out of
    the tile loops, grew the temporaries by 513 B a row here, and by 257 for float16). With XLA:CPU's elemental
    emitter (the tests') the bits' bitcasts are free; with its fusion emitters (a user's default) they are one copy of
    a bfloat16 weight."""
    mesh, n, d = make_mesh(2, 4), 64, 64
    bitcast_copy = d * jnp.dtype(dtype).itemsize if cpu_scatter_converts(dtype) else 0
    for fusion_emitters, bound in ((False, 8), (True, 8 + bitcast_copy)):
        temporaries = []
        for c in (8 * 4096, 8 * 16384):
            spec = dict(margin=arcface(), mesh=mesh, num_classes=c, chunk_size=1024)
            grad_fn = jax.jit(jax.grad(lambda e, w, y: sharded_margin_loss(e, w, y, **spec), argnums=(0, 1)))
            args = (jax.ShapeDtypeStruct((n, d), dtype, sharding=batch_sharding(mesh)),
                    jax.ShapeDtypeStruct((c, d), dtype, sharding=weight_sharding(mesh)),
                    jax.ShapeDtypeStruct((n,), jnp.int32, sharding=batch_sharding(mesh)))
            compiled = grad_fn.lower(*args).compile({"xla_cpu_use_fusion_emitters": fusion_emitters})
            temporaries.append(compiled.memory_analysis().temp_size_in_bytes)
        per_row = (temporaries[1] - temporaries[0]) / (16384 - 4096)
        assert per_row < bound, f"temporaries grow by {per_row:.0f} B a class row, fusion emitters {fusion_emitters}"


def test_sgd_lowers_loss_on_separable_problem(rng):
    mesh = make_mesh(2, 4)
    c, d, n = 20, 16, 64
    centres = rng.normal(size=(c, d)).astype(np.float32)
    labels = rng.integers(0, c, size=n).astype(np.int32)
    emb = centres[labels] + 0.1 * rng.normal(size=(n, d)).astype(np.float32)
    emb = jax.device_put(emb, batch_sharding(mesh))
    labels = jax.device_put(labels, batch_sharding(mesh))
    weight = init_weight(jax.random.key(0), c, d, mesh, stddev=1.0)
    loss_fn = lambda w: sharded_margin_loss(emb, w, labels, cosface(s=16.0, m=0.2), mesh=mesh, num_classes=c)
    step = jax.jit(lambda w: (loss_fn(w), w - 0.5 * jax.grad(loss_fn)(w)))
    losses = []
    for _ in range(30):
        loss, weight = step(weight)
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0], losses


class TestBadInput:
    mesh_shape = (2, 4)

    def setup_method(self):
        self.mesh = make_mesh(*self.mesh_shape)
        self.c, self.d = 21, 8
        self.weight = init_weight(jax.random.key(0), self.c, self.d, self.mesh)
        self.emb = jax.device_put(jnp.ones((16, self.d)), batch_sharding(self.mesh))
        self.labels = jax.device_put(jnp.arange(16, dtype=jnp.int32), batch_sharding(self.mesh))

    def loss(self, emb=None, weight=None, labels=None, **kwargs):
        kwargs = dict(dict(mesh=self.mesh, num_classes=self.c), **kwargs)
        return sharded_margin_loss(self.emb if emb is None else emb, self.weight if weight is None else weight,
                                   self.labels if labels is None else labels, arcface(), **kwargs)

    @pytest.mark.parametrize("bad", [21, 1000, -1])
    def test_label_out_of_range_eager(self, bad):
        labels = self.labels.at[5].set(bad)
        with pytest.raises(ValueError, match=rf"label {bad} at batch index 5 is outside \[0, 21\)"):
            self.loss(labels=labels)

    @pytest.mark.parametrize("chunk_size", [None, 2])
    def test_label_out_of_range_under_jit_gives_nan_loss_and_gradients(self, chunk_size):
        """The gradients too, so that a step guarded on finite gradients (``optax.apply_if_finite``, a loss scale)
        skips the batch: a select gave a NaN loss with zero, finite gradients."""
        f = jax.jit(jax.value_and_grad(lambda e, w, y: self.loss(e, w, y, chunk_size=chunk_size), argnums=(0, 1)))
        emb = jax.device_put(jnp.asarray(np.random.default_rng(0).normal(size=(16, self.d)), jnp.float32),
                             batch_sharding(self.mesh))
        value, grads = f(emb, self.weight, self.labels)
        assert np.isfinite(float(value)) and all(np.isfinite(np.asarray(g)).all() for g in grads)
        value, grads = f(emb, self.weight, self.labels.at[3].set(21))
        d_emb, d_weight = (np.asarray(g) for g in grads)  # the padding rows' gradient stays 0
        assert np.isnan(float(value)) and np.isnan(d_emb).all() and np.isnan(d_weight[:self.c]).all()

    def test_batch_not_divisible(self):
        with pytest.raises(ValueError, match="batch size 12 is not divisible by the 8 devices"):
            self.loss(emb=jnp.ones((12, self.d)), labels=jnp.zeros(12, jnp.int32))

    def test_weight_shape(self):
        with pytest.raises(ValueError, match=r"must be \[24, 8\]"):
            self.loss(weight=jnp.ones((21, self.d)))

    def test_weight_dim_mismatch(self):
        with pytest.raises(ValueError, match="embeddings have D=4 but the weight has D=8"):
            self.loss(emb=jnp.ones((16, 4)))

    def test_weight_sharding(self):
        replicated = jax.device_put(self.weight, NamedSharding(self.mesh, P()))
        with pytest.raises(ValueError, match="does not match"):
            self.loss(weight=replicated)

    def test_unknown_class_axis(self):
        with pytest.raises(ValueError, match="not a mesh axis"):
            self.loss(class_axes=("model",))

    def test_bad_chunk_size(self):
        with pytest.raises(ValueError, match="chunk_size must be positive"):
            self.loss(chunk_size=0)


@pytest.mark.parametrize("chunk_size", [None, 24])
def test_float16_compute_keeps_a_scaled_losss_row_gradients_in_float32(chunk_size, rng):
    """With a loss scale (the trainer's first is 2¹⁶) the rows' gradient products exceed float16's range; they are
    multiplied and kept in float32 for a float32 weight (rounded to float16 first, they were inf)."""
    mesh = make_mesh(1, 8)
    c, d, n, scale = 200, 64, 64, 2.0**16
    weight = init_weight(jax.random.key(int(rng.integers(2**31))), c, d, mesh)  # its default, small rows
    emb = jax.device_put(rng.normal(size=(n, d)).astype(np.float16), batch_sharding(mesh))
    labels = jax.device_put(rng.integers(0, c, size=n).astype(np.int32), batch_sharding(mesh))
    f = partial(sharded_margin_loss, labels=labels, margin=MARGINS["cosface"], mesh=mesh, num_classes=c,
                chunk_size=chunk_size)
    grad = jax.jit(jax.grad(lambda w, k: k * f(emb, w), argnums=0))
    scaled, plain = (np.asarray(grad(weight, k))[:c] for k in (scale, 1.0))
    assert np.abs(scaled).max() > np.finfo(np.float16).max  # the case: beyond float16
    assert np.isfinite(scaled).all() and rel_err(scaled / scale, plain) < 1e-3
