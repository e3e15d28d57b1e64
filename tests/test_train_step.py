"""The one jitted train step: gradient accumulation, skipped non-finite steps in every precision, float16 loss scaling,
BatchNorm statistics per device or over the global batch."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxcls.data.pipeline import normalize
from jaxcls.plan.hlo import collectives
from jaxcls.run import build
from reference import rel_err
from tiny import get_config as tiny_config

pytestmark = pytest.mark.slow  # each test compiles whole train steps


def as_numpy(x):
    return np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x)


def batch(rng, n):
    return (rng.integers(0, 256, (n, 16, 16, 3), dtype=np.uint8), rng.integers(0, 64, n).astype(np.int32))


def test_gradient_accumulation_divides_the_loss():
    """Two identical micro-batches accumulated == one step on that micro-batch (arcface_torch #2258)."""
    run1 = build(tiny_config(batch_size=16))
    state = past_warmup(run1.init_state())  # at step 0 the lr is 0 and nothing moves
    run2 = build(tiny_config(batch_size=32, accum_steps=2))
    images, labels = batch(np.random.default_rng(0), 16)
    one, m1 = jax.jit(run1.train_step)(state, images, labels)
    # example i of the doubled batch sits at 2i and 2i+1, so both micro-batches (x[0::2], x[1::2]) equal x
    two, m2 = jax.jit(run2.train_step)(state, np.repeat(images, 2, 0), np.repeat(labels, 2, 0))
    np.testing.assert_allclose(m1["loss"], m2["loss"], rtol=1e-6)
    assert all(np.any(a != b) for a, b in zip(jax.tree.leaves(one["params"]), jax.tree.leaves(state["params"])))
    for k in ("params", "weight", "fc_opt"):  # the backbone's step, the FC rows and their momentum
        for a, b in zip(jax.tree.leaves(one[k]), jax.tree.leaves(two[k])):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=k)


def test_float16_overflow_skips_backbone_and_fc_updates_and_halves_the_scale():
    run = build(tiny_config(precision="float16", sample_rate=0.5))
    state = run.init_state()
    images, labels = batch(np.random.default_rng(0), 32)
    step = jax.jit(run.train_step)
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
    step = jax.jit(run.train_step)
    new, m = step(state, *batch(rng, 32))
    assert not bool(m["finite"]) and not np.isfinite(float(m["loss"]))
    for k in ("params", "opt", "stats", "weight", "fc_opt"):
        for a, b in zip(jax.tree.leaves(new[k]), jax.tree.leaves(state[k])):
            np.testing.assert_array_equal(as_numpy(a), as_numpy(b), err_msg=f"{k} (NaN in params leaf {poisoned})")
    assert int(new["step"]) == 3


def past_warmup(state):
    """``state`` at step 1, where the lr is no longer 0."""
    return {**state, "step": jax.device_put(jnp.int32(1), state["step"].sharding)}


def running_stats(run, state):
    """The BatchNorm running statistics of a train state."""
    return nnx.state(nnx.merge(run.train_step.graphdef, state["params"], state["stats"]), nnx.BatchStat)


def assert_close(a, b, rtol=1e-4, atol=1e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)


def flat(tree) -> np.ndarray:
    """Every leaf of ``tree`` raveled into one float64 vector."""
    return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])


def assert_same_update(new, expected, old, rtol=1e-2, leaf_rtol=1e-1, atol=1e-6):
    """``new`` moved from ``old`` as ``expected`` did: the whole move to ``rtol`` of its norm, each leaf's to
    ``leaf_rtol`` of its own. Relative to the move, not the value, and looser per leaf: rounding can put one
    activation on the other side of a PReLU's kink, which changes one term of every sum its gradient enters, and a
    BatchNorm bias followed by another BatchNorm has a gradient that nearly cancels (a sum of near-opposite terms), so
    one flip moves it by a share of its small move (at one seed 1.0% of a bias's move and 0.13% of the whole update,
    against 2e-6 at others: a discrete change, as a flip makes). A wrong step (per-device statistics for synced ones)
    is off by more than its whole move."""
    moved, expected_move = flat(new) - flat(old), flat(expected) - flat(old)
    error, scale = np.linalg.norm(moved - expected_move), np.linalg.norm(expected_move)
    assert error <= rtol * scale, f"the whole update moved {error:.3g} off, of {scale:.3g}"
    for (path, x), y, x0 in zip(jax.tree_util.tree_leaves_with_path(new), jax.tree.leaves(expected),
                                jax.tree.leaves(old), strict=True):
        moved, expected_move = (np.asarray(v, np.float64) - np.asarray(x0, np.float64) for v in (x, y))
        error, scale = np.linalg.norm(moved - expected_move), np.linalg.norm(expected_move)
        assert error <= leaf_rtol * scale + atol, f"{jax.tree_util.keystr(path)}: moved {error:.3g} off, of {scale:.3g}"


def train_steps(run, state, batches):
    """``(the state after each step, each step's loss)`` of ``run`` from ``state`` over ``batches``."""
    step = jax.jit(run.train_step)
    states, losses = [], []
    for images, labels in batches:
        state, metrics = step(jax.device_put(state, run.state_shardings), images, labels)
        states.append(state)
        losses.append(float(metrics["loss"]))
    return states, losses


def test_bn_sync_one_device_equals_eight_and_per_device_statistics_differ(rng):
    """Two steps from one state: 8 devices with bn_sync compute what one device computes (where statistics are
    always over the whole batch); 8 devices without it normalize each device's 4 rows alone, another step."""
    synced_run = build(tiny_config(bn_sync=True))
    state = past_warmup(synced_run.init_state())
    batches = [batch(rng, 32) for _ in range(2)]
    one, one_losses = train_steps(build(tiny_config(bn_sync=True), devices=jax.devices()[:1]), state, batches)
    synced, synced_losses = train_steps(synced_run, state, batches)
    # the first step, from one state: its loss and running statistics (the forward's) equal to rounding, its update
    # as assert_same_update says. The second starts from those slightly different states, which its loss shows
    # (2.8e-5 off at one seed), where per-device statistics put it 1e-1 off
    np.testing.assert_allclose(synced_losses[0], one_losses[0], rtol=1e-5)
    assert_close(running_stats(synced_run, synced[0]), running_stats(synced_run, one[0]))
    assert_same_update(synced[0]["params"], one[0]["params"], state["params"])
    np.testing.assert_allclose(synced_losses[1], one_losses[1], rtol=1e-4)
    # without bn_sync, each device's 4 rows have their own statistics: the step is another one
    per_device_run = build(tiny_config())
    per_device, per_device_losses = train_steps(per_device_run, state, batches)
    assert abs(per_device_losses[1] - one_losses[1]) > 1e-2  # measured 1.2
    assert rel_err(flat(running_stats(per_device_run, per_device[-1])), flat(running_stats(synced_run, one[-1]))) > 1e-3


def test_per_device_statistics_step_equals_accumulating_the_devices_rows(rng):
    """bn_sync=False on 8 devices == one device accumulating 8 micro-batches, micro-batch j being device j's 4 rows
    (each normalized alone, the loss over all 32, the gradients summed); the running statistics move towards the
    mean over the devices of what each device's rows give."""
    run = build(tiny_config())
    state = past_warmup(run.init_state())
    images, labels = batch(rng, 32)
    new, metrics = jax.jit(run.train_step)(state, images, labels)

    accumulating = build(tiny_config(accum_steps=8), devices=jax.devices()[:1])
    to_micro = lambda x: x.reshape(8, 4, *x.shape[1:]).swapaxes(0, 1).reshape(x.shape)  # row 8i + j = row 4j + i
    ref, ref_metrics = jax.jit(accumulating.train_step)(
        jax.device_put(state, accumulating.state_shardings), to_micro(images), to_micro(labels))
    np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-5)
    assert_same_update(new["params"], ref["params"], state["params"])

    @jax.jit
    def statistics(params, stats, rows):  # a training-mode forward of one device's rows alone
        model = nnx.merge(accumulating.train_step.graphdef, params, stats)
        model(normalize(rows))
        return nnx.state(model, nnx.BatchStat)

    per_device = [statistics(state["params"], state["stats"], images[4 * d: 4 * d + 4]) for d in range(8)]
    assert_close(running_stats(run, new), jax.tree.map(lambda *s: np.mean(s, axis=0), *per_device), rtol=1e-5)


def backbone_all_reduces(hlo_text: str) -> dict:
    """``{"forward" | "backward": [instructions, bytes]}`` of the all-reduces that the backbone's forward (op_name
    ``…/jvp()/…``) and backward (``…/transpose(jvp())/…``) put in a compiled train step (with remat "none" the
    backbone runs in no loop: each executes once)."""
    found = {"forward": [0, 0], "backward": [0, 0]}
    for line in hlo_text.splitlines():
        for c in collectives(line):
            name = re.search(r'op_name="([^"]*)"', line).group(1)
            part = None if c.op != "all-reduce" or "shard_map" in name else (
                "backward" if "transpose(jvp" in name else "forward" if "jvp(" in name else None)
            if part:
                found[part][0] += 1
                found[part][1] += c.result_bytes
    return found


def test_an_iresnet_step_all_reduces_batchnorm_statistics_only_with_bn_sync():
    """Each reduction kept as its own all-reduce (XLA:CPU's combiner off), 8 devices. Without bn_sync the forward
    all-reduces one [2C] vector per BatchNorm layer (its running mean and variance, needed by no later layer)
    and the backward exactly the parameter gradients; with bn_sync the forward needs the mean, then the
    variance, of every layer, and the backward the sums that x's gradient needs (BatchNorm's own backward): they are
    its scale's and bias's (and PReLU's) gradients, so only the features layer's (no scale) adds to them."""
    parts = {}
    for sync in (False, True):
        run = build(tiny_config(bn_sync=sync), with_data=False)  # any IResNet: the small r18
        compiled = run.compile_step(run.abstract_state, {"xla_disable_hlo_passes": "cpu-all-reduce-combiner"})
        parts[sync] = backbone_all_reduces(compiled.as_text())
    stats = jax.tree.leaves(nnx.filter_state(run.abstract_state["stats"], nnx.BatchStat))
    layers = sum(s.size // s.shape[-1] for s in stats) // 2  # stacked blocks' statistics are [depth, C]
    stat_bytes = 4 * sum(s.size for s in stats)  # running mean and variance, float32
    param_bytes = 4 * sum(p.size for p in jax.tree.leaves(run.abstract_state["params"]))
    assert parts[False]["forward"] == [layers, stat_bytes] and parts[False]["backward"][1] == param_bytes
    # XLA may reduce several parameters' gradients in one variadic all-reduce: at most one each
    assert 1 <= parts[False]["backward"][0] <= len(jax.tree.leaves(run.abstract_state["params"]))
    assert parts[True]["forward"] == [2 * layers, stat_bytes]
    features = run.abstract_state["params"]["features"]["bias"].size  # its Σ dy·x̂, [num_features] float32
    assert parts[True]["backward"][1] == param_bytes + 4 * features
