"""The one jitted train step: gradient accumulation, skipped non-finite steps in every precision, float16 loss scaling."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcls.run import build
from tiny import get_config as tiny_config

pytestmark = pytest.mark.slow  # each test compiles whole train steps


def as_numpy(x):
    return np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x)


def batch(rng, n):
    return (rng.integers(0, 256, (n, 16, 16, 3), dtype=np.uint8), rng.integers(0, 64, n).astype(np.int32))


def test_gradient_accumulation_divides_the_loss():
    """Two identical micro-batches accumulated == one step on that micro-batch (arcface_torch #2258)."""
    run1 = build(tiny_config(batch_size=16))
    state = run1.init_state()
    run2 = build(tiny_config(batch_size=32, accum_steps=2))
    images, labels = batch(np.random.default_rng(0), 16)
    one, m1 = jax.jit(run1.trainer.train_step)(state, images, labels)
    # example i of the doubled batch sits at 2i and 2i+1, so both micro-batches (x[0::2], x[1::2]) equal x
    two, m2 = jax.jit(run2.trainer.train_step)(state, np.repeat(images, 2, 0), np.repeat(labels, 2, 0))
    np.testing.assert_allclose(m1["loss"], m2["loss"], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(one["params"]), jax.tree.leaves(two["params"])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_float16_overflow_skips_backbone_and_fc_updates_and_halves_the_scale():
    run = build(tiny_config(precision="float16", sample_rate=0.5))
    state = run.init_state()
    images, labels = batch(np.random.default_rng(0), 32)
    step = jax.jit(run.trainer.train_step)
    like = lambda old, value: jax.device_put(jnp.asarray(value, old.dtype), old.sharding)  # no recompilation
    huge = state["scale"]._replace(scale=like(state["scale"].scale, 2.0**120))  # d_emb · scale overflows float16
    skipped, m = step({**state, "scale": huge}, images, labels)
    assert not bool(m["finite"]) and float(skipped["scale"].scale) == 2.0**119
    for k in ("params", "opt", "stats", "weight", "fc_opt"):
        for a, b in zip(jax.tree.leaves(skipped[k]), jax.tree.leaves(state[k])):
            np.testing.assert_array_equal(as_numpy(a), as_numpy(b), err_msg=k)
    state["step"] = like(state["step"], 1)  # past the warmup's lr = 0; optax's count stays 0, as after a skip
    taken, m = step({**state, "scale": huge._replace(scale=like(huge.scale, 8.0))}, images, labels)
    assert bool(m["finite"]) and int(taken["fc_opt"].count) == 1
    assert not np.array_equal(taken["weight"], state["weight"])
    # every backbone parameter moves: its learning rate follows the global step, not optax's step count
    assert all(np.any(a != b) for a, b in zip(jax.tree.leaves(taken["params"]), jax.tree.leaves(state["params"])))


def test_float32_non_finite_step_changes_no_weight(rng):
    """NaN in any backbone array (as a diverged lr leaves it) is a skipped step, in float32 too: nothing of
    the backbone or the FC (rows, slots, optimizer step count) moves. With ``class_axes="class"`` the FC rows are
    replicated over the data axis, each replica seeing other samples, and every replica must skip alike."""
    run = build(tiny_config(sample_rate=0.5, class_axes="class", mesh_data=2, optimizer="adamw"))
    state = run.init_state()
    state["step"] = jax.device_put(jnp.int32(2), state["step"].sharding)  # past the warmup's lr = 0
    leaves, tree = jax.tree.flatten(state["params"])
    poisoned = int(rng.integers(len(leaves)))
    # the whole array: one NaN in a kernel tap that only ever meets padding would not reach the embeddings (then
    # only the backbone skips its update, as its new parameters are non-finite, and the FC rightly learns)
    leaves[poisoned] = jnp.full_like(leaves[poisoned], jnp.nan)
    state["params"] = jax.tree.unflatten(tree, leaves)
    step = jax.jit(run.trainer.train_step)
    new, m = step(state, *batch(rng, 32))
    assert not bool(m["finite"]) and not np.isfinite(float(m["loss"]))
    for k in ("params", "opt", "stats", "weight", "fc_opt"):
        for a, b in zip(jax.tree.leaves(new[k]), jax.tree.leaves(state[k])):
            np.testing.assert_array_equal(as_numpy(a), as_numpy(b), err_msg=f"{k} (NaN in params leaf {poisoned})")
    assert int(new["step"]) == 3
