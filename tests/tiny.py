"""A tiny run that 8 CPU devices train in seconds; also a config file: ``--config tests/tiny.py``."""

from jaxcls.config import small_r18, base_config


def get_config(**overrides):
    c = base_config()
    c.data.procedural = dict(num_classes=64, images_per_class=8, size=16, strokes=4)
    c.data.input_size = 16
    c.num_classes = 64
    c.model_kwargs = small_r18()
    c.num_features = 32
    c.margin.update(name="cosface", s=16.0, m=0.2, straight_through=False)
    c.batch_size = 32
    c.total_steps, c.warmup_steps = 6, 1
    c.log_every, c.eval_every, c.ckpt_every = 1, 10**6, 3
    c.eval_batch_size = 64
    c.data.threads = 2
    c.update(overrides)
    return c


def saved_run(workdir, config, rng=None, step=1):
    """``workdir`` holding ``config`` and checkpoint ``step`` of its freshly initialized state (one device), as the
    trainer leaves it; with ``rng`` the BatchNorm statistics are drawn at random (mean ~ N(0, 0.3), var ~ U(0.5, 2)),
    so that eval mode differs from a batch's statistics."""
    from pathlib import Path

    import jax
    import jax.numpy as jnp

    from jaxcls.checkpoint import RunCheckpoints
    from jaxcls.run import build

    state = build(config, devices=jax.devices()[:1], with_data=False).init_state()
    if rng is not None:
        def draw(path, x):
            keys = [getattr(k, "key", None) for k in path]  # e.g. ['bn1', 'mean', None] (the last: .value)
            if not jnp.issubdtype(x.dtype, jnp.floating):
                return x
            if "mean" in keys:
                return jnp.asarray(rng.normal(0, 0.3, x.shape), x.dtype)
            return jnp.asarray(rng.uniform(0.5, 2, x.shape), x.dtype) if "var" in keys else x
        state["stats"] = jax.tree_util.tree_map_with_path(draw, state["stats"])
    Path(workdir).mkdir(parents=True, exist_ok=True)
    (Path(workdir) / "config.json").write_text(config.to_json_best_effort(indent=2))
    checkpoints = RunCheckpoints(Path(workdir) / "checkpoints", keep=2)
    checkpoints.save(step, state, {})
    checkpoints.close()
    return state


def from_command_line(monkeypatch, *args, config=__file__):
    """The config ``jaxcls.train --config <config> <args>`` reads, its flags checked as the command line checks them."""
    import sys

    from absl import flags

    from jaxcls.config import check_config_flags, define_config_flag

    argv, values = ["train", "--config", str(config), *args], flags.FlagValues()
    monkeypatch.setattr(sys, "argv", argv)  # where ml_collections looks for the overrides it defines
    define_config_flag(values)
    check_config_flags(argv)
    values(argv)
    return values.config
