"""Throughput benchmark: r50, 1M classes, PartialFC 0.1, bf16, synthetic images (arcface_torch's synthetic mode)."""

from jaxcls.config import base_config


def get_config():
    c = base_config()
    c.data.kind = "synthetic"
    c.data.input_size = 112
    c.num_classes = 1_000_000
    c.model = "r50"
    c.model_kwargs = {}
    c.num_features = 512
    c.precision = "bfloat16"
    c.sample_rate = 0.1
    c.margin.update(name="arcface", s=64.0, m=0.5, straight_through=False)
    c.batch_size = 128
    c.total_steps = 200
    c.warmup_steps = 10
    c.eval_every = 10**9
    c.log_every = 20
    c.ckpt_every = 10**9
    return c
