"""The trainer end to end: config checks, a glyphs smoke run, exact resume, gradient accumulation."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcls.config import base_config, check_keys
from jaxcls.train import build, train
from test_recordio import GLYPHS, needs_glyphs


def tiny_config(**overrides):
    c = base_config()
    c.data.procedural = dict(num_classes=64, images_per_class=8, size=16, strokes=4)
    c.data.input_size = 16
    c.num_classes = 64
    c.model_kwargs = dict(width=8)
    c.num_features = 32
    c.margin = dict(name="cosface", s=16.0, m=0.2, straight_through=False)
    c.batch_size = 32
    c.total_steps, c.warmup_steps = 6, 1
    c.log_every, c.eval_every, c.ckpt_every = 1, 10**6, 3
    c.data.threads = 2
    c.update(overrides)
    return c


def as_numpy(x):
    return np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x)


def losses(workdir):
    return [json.loads(line)["loss"] for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]


class TestConfigErrors:
    def test_unknown_key(self):
        c = tiny_config()
        c.unlock()
        c.learning_rate = 0.1
        with pytest.raises(ValueError, match="unknown config key 'learning_rate'"):
            check_keys(c)
        c = tiny_config()
        c.data.unlock()
        c.data.rooot = "x"
        with pytest.raises(ValueError, match="unknown config key 'data.rooot'"):
            check_keys(c)

    def test_batch_not_divisible(self):
        with pytest.raises(ValueError, match="batch_size 36 is not divisible by 8 devices"):
            build(tiny_config(batch_size=36))

    @pytest.mark.parametrize("rate", [0.0, 1.5])
    def test_sample_rate(self, rate):
        with pytest.raises(ValueError, match="sample_rate must be in"):
            build(tiny_config(sample_rate=rate))

    def test_num_classes_smaller_than_data(self):
        with pytest.raises(ValueError, match="num_classes 10 is smaller than the 64 classes in the data"):
            build(tiny_config(num_classes=10))


@needs_glyphs
def test_glyphs_smoke_on_2x4_mesh(tmp_path):
    c = tiny_config(num_classes=1500, mesh_data=2, batch_size=64, total_steps=40, warmup_steps=5, ckpt_every=100,
                    sample_rate=0.5)
    c.data.kind, c.data.root, c.data.input_size = "recordio", str(GLYPHS), 32
    c.margin = dict(name="cosface", s=32.0, m=0.2, straight_through=False)
    state, last = train(c, tmp_path, progress=False)
    assert dict(state["weight"].sharding.mesh.shape) == {"data": 2, "class": 4}
    history = np.array(losses(tmp_path))
    assert len(history) == 40 and np.isfinite(history).all()
    # The loss first rises while the warm-up raises the lr (seen: 24 → 28 by step 15), then falls.
    assert np.polyfit(np.arange(20), history[20:], 1)[0] < 0, history
    assert history[-5:].mean() < history[10:20].mean() - 1.0, history
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["data"]["root"] == str(GLYPHS) and saved["mesh_data"] == 2


def test_resume_is_exact_and_works_on_another_mesh(tmp_path):
    c = tiny_config(sample_rate=0.5)
    straight, _ = train(c, tmp_path / "straight", progress=False)
    train(c, tmp_path / "resumed", progress=False, stop_after=3)
    resumed, _ = train(c, tmp_path / "resumed", progress=False)
    assert int(resumed["step"]) == int(straight["step"]) == 6
    for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed)):
        np.testing.assert_array_equal(as_numpy(a), as_numpy(b))
    assert losses(tmp_path / "straight") == losses(tmp_path / "resumed")

    # The same checkpoint continues on 4 devices with a (2, 2) mesh.
    moved, _ = train(tiny_config(sample_rate=0.5, mesh_data=2, total_steps=6), tmp_path / "moved", progress=False,
                     stop_after=3, devices=jax.devices())
    moved, _ = train(tiny_config(sample_rate=0.5, mesh_data=2), tmp_path / "moved", progress=False,
                     devices=jax.devices()[:4])
    assert dict(moved["weight"].sharding.mesh.shape) == {"data": 2, "class": 2}
    assert int(moved["step"]) == 6 and np.isfinite(losses(tmp_path / "moved")).all()


def test_relative_workdir_and_resume_with_other_class_count(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    train(tiny_config(total_steps=2, ckpt_every=1), "runs/relative", progress=False)
    assert sorted(p.name for p in (tmp_path / "runs/relative/checkpoints").iterdir()) == ["1", "2"]
    with pytest.raises(ValueError, match="checkpoint holds an FC of 64 classes, the config asks for 70"):
        train(tiny_config(total_steps=4, num_classes=70), "runs/relative", progress=False)


def test_gradient_accumulation_divides_the_loss():
    """Two identical micro-batches accumulated == one step on that micro-batch (arcface_torch #2258)."""
    run1, state = build(tiny_config(batch_size=16))
    run2, _ = build(tiny_config(batch_size=32, accum_steps=2))
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (16, 16, 16, 3), dtype=np.uint8)
    labels = rng.integers(0, 64, 16).astype(np.int32)
    one, m1 = jax.jit(run1.trainer.train_step)(state, images, labels)
    # example i of the doubled batch sits at 2i and 2i+1, so both micro-batches (x[0::2], x[1::2]) equal x
    two, m2 = jax.jit(run2.trainer.train_step)(state, np.repeat(images, 2, 0), np.repeat(labels, 2, 0))
    np.testing.assert_allclose(m1["loss"], m2["loss"], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(one["params"]), jax.tree.leaves(two["params"])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_float16_overflow_skips_backbone_and_fc_updates_and_halves_the_scale():
    run, state = build(tiny_config(precision="float16", sample_rate=0.5))
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (32, 16, 16, 3), dtype=np.uint8)
    labels = rng.integers(0, 64, 32).astype(np.int32)
    step = jax.jit(run.trainer.train_step)
    huge = state["scale"]._replace(scale=jnp.float32(2.0**120))  # d_emb · scale overflows float16
    skipped, m = step({**state, "scale": huge}, images, labels)
    assert not bool(m["finite"]) and float(skipped["scale"].scale) == 2.0**119
    for k in ("params", "opt", "stats", "weight", "fc_opt"):
        for a, b in zip(jax.tree.leaves(skipped[k]), jax.tree.leaves(state[k])):
            np.testing.assert_array_equal(as_numpy(a), as_numpy(b), err_msg=k)
    state["step"] = jnp.int32(1)  # past the warmup's lr = 0; optax's own count stays 0, as after a skipped step
    taken, m = step({**state, "scale": huge._replace(scale=jnp.float32(8.0))}, images, labels)
    assert bool(m["finite"]) and int(taken["fc_opt"].count) == 1
    assert not np.array_equal(taken["weight"], state["weight"])
    # every backbone parameter moves: its learning rate follows the global step, not optax's step count
    assert all(np.any(a != b) for a, b in zip(jax.tree.leaves(taken["params"]), jax.tree.leaves(state["params"])))
