"""The class-parallel margin loss against a dense float64 reference, on several meshes."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import MESH_SHAPES
from hlo import collectives
from jaxcls import batch_sharding, make_mesh
from jaxcls.losses import (
    arcface,
    class_parallel_cross_entropy,
    class_shards,
    cosface,
    init_weight,
    masked_fill_value,
    sharded_margin_loss,
    weight_sharding,
)
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


@pytest.mark.parametrize("divisible", [True, False], ids=["C_divisible", "C_padded"])
@pytest.mark.parametrize("margin_name", sorted(MARGINS))
@pytest.mark.parametrize("mesh_shape", MESH_SHAPES, ids=str)
def test_matches_dense_reference(mesh_shape, margin_name, divisible, rng):
    mesh = make_mesh(*mesh_shape)
    emb, weight, labels, c = make_problem(rng, mesh, divisible=divisible)
    margin = MARGINS[margin_name]
    result = loss_and_grads(emb, weight, labels, margin, mesh, c)
    check_against_reference(emb, weight, labels, c, margin, result, tol=1e-5)


@pytest.mark.parametrize("class_axes", [("data", "class"), ("class",)], ids=["all_devices", "class_only"])
@pytest.mark.parametrize("mesh_shape", MESH_SHAPES, ids=str)
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


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("mesh_shape", [(1, 8), (2, 4)], ids=str)
def test_low_precision_compute_within_tolerance(mesh_shape, dtype, rng):
    mesh = make_mesh(*mesh_shape)
    emb, weight, labels, c = make_problem(rng, mesh, divisible=False, dtype=dtype)
    margin = MARGINS["cosface"]
    loss, (g_emb, g_w) = loss_and_grads(emb, weight, labels, margin, mesh, c, chunk_size=5)
    assert g_emb.dtype == dtype and loss.dtype == jnp.float32
    ref_loss, (ref_g_emb, ref_g_w) = value_and_grads(emb.astype(jnp.float32), np.asarray(weight)[:c], labels, margin)
    tol = 0.05 if dtype == jnp.bfloat16 else 0.01  # logits are s·cos with s = 64: operand rounding is amplified
    assert rel_err(loss, ref_loss) < tol
    assert rel_err(g_emb.astype(jnp.float32), ref_g_emb) < 2 * tol
    assert rel_err(np.asarray(g_w)[:c], ref_g_w) < 2 * tol


@pytest.mark.parametrize("axis", ["class", ("data", "class")])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_inner_op_matches_log_softmax(axis, dtype, rng):
    mesh = make_mesh(2, 4)
    axes = (axis,) if isinstance(axis, str) else axis
    shards = class_shards(mesh, axes)
    n, c_local = 8 * int(rng.integers(1, 3)), int(rng.integers(2, 9))
    logits = (10 * rng.normal(size=(n, shards * c_local))).astype(np.float32)
    labels = rng.integers(0, shards * c_local, size=n).astype(np.int32)
    spec = P(None, axes)

    def per_shard(x, y):
        first = jax.lax.axis_index(axis) * x.shape[1]
        local = jnp.where((y >= first) & (y < first + x.shape[1]), y - first, -1)
        return class_parallel_cross_entropy(x, local, axis)

    f = jax.shard_map(per_shard, mesh=mesh, in_specs=(spec, P()), out_specs=P())
    g_out = rng.normal(size=n).astype(np.float32)
    x = jax.device_put(jnp.asarray(logits, dtype), NamedSharding(mesh, spec))
    losses, pullback = jax.vjp(lambda x: f(x, labels), x)
    (grad,) = pullback(jnp.asarray(g_out))
    assert losses.dtype == jnp.float32 and grad.dtype == dtype
    with jax.enable_x64(True):
        exact = np.asarray(x.astype(jnp.float32), np.float64)
        ref_fn = lambda x: -jnp.take_along_axis(jax.nn.log_softmax(x), labels[:, None], 1)[:, 0]
        ref_losses, ref_pullback = jax.vjp(jax.jit(ref_fn), exact)
        (ref_grad,) = ref_pullback(g_out.astype(np.float64))
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    assert rel_err(losses, ref_losses) < tol
    assert rel_err(grad.astype(jnp.float32), ref_grad) < tol


def test_inner_op_backward_adds_no_communication():
    mesh = make_mesh(1, 8)
    spec = P(None, "class")
    labels = jnp.zeros(16, jnp.int32)
    f = jax.shard_map(lambda x: class_parallel_cross_entropy(x, labels, "class").sum(), mesh=mesh,
                      in_specs=spec, out_specs=P())
    x = jax.ShapeDtypeStruct((16, 64), jnp.float32, sharding=NamedSharding(mesh, spec))
    forward = collectives(jax.jit(f).lower(x).compile().as_text())
    both = collectives(jax.jit(jax.value_and_grad(f)).lower(x).compile().as_text())
    assert forward and sorted(both) == sorted(forward)


def test_padding_logits_fill_value_is_finite():
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
        assert np.isfinite(float(masked_fill_value(dtype)))


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
    assert any(op == "all-gather" for op, _ in found), found  # embeddings and labels are gathered
    assert max(size for _, size in found) <= n * d < n * c_local, found


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

    def test_label_out_of_range_under_jit_gives_nan(self):
        f = jax.jit(lambda y: self.loss(labels=y))
        assert np.isfinite(float(f(self.labels)))
        assert np.isnan(float(f(self.labels.at[3].set(21))))

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


@pytest.mark.parametrize("data,classes,n", [(3, 3, 8), (2, 3, 8), (16, None, 8)])
def test_make_mesh_rejects_wrong_device_count(data, classes, n):
    with pytest.raises(ValueError, match="devices"):
        make_mesh(data, classes, devices=jax.devices()[:n])


def test_make_mesh_defaults_all_devices_on_class_axis():
    mesh = make_mesh()
    assert dict(mesh.shape) == {"data": 1, "class": 8}
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
