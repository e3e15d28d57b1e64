"""A tiny run that 8 CPU devices train in seconds; also a config file: ``--config tests/tiny.py``."""

from jaxcls.config import base_config


def get_config(**overrides):
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
    c.eval_batch_size = 64
    c.data.threads = 2
    c.update(overrides)
    return c
