"""The inner op ``class_parallel_cross_entropy`` over a sharded class axis, against float64 log-softmax."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxcls import class_shards, make_mesh
from jaxcls.plan.hlo import collectives
from jaxcls.losses import class_parallel_cross_entropy, masked_fill_value
from reference import rel_err


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
    # the reference takes the same rounded logits: the statistics are float32 whatever their dtype, and only the
    # gradient's own rounding to the logits' dtype is left (bfloat16: 2⁻⁹ relative)
    assert rel_err(losses, ref_losses) < 1e-6
    assert rel_err(grad.astype(jnp.float32), ref_grad) < (1e-6 if dtype == jnp.float32 else 2**-8)


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
