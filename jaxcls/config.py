"""The trainer's configuration: every key with its default, and the checks run before training.

Config files (``configs/*.py``) define ``get_config()`` returning ``base_config()`` with changes; keys
not in ``base_config()`` are an error, as are inconsistent values (see ``validate``).
"""

from __future__ import annotations

import functools

import ml_collections

from jaxcls.data.sources import SOURCES
from jaxcls.fc import DEFAULT_CHUNK
from jaxcls.losses.margins import MARGINS
from jaxcls.mesh import CLASS_AXES
from jaxcls.models import MODELS
from jaxcls.models.layers import REMAT_POLICIES
from jaxcls.optimizers import OPTIMIZERS
from jaxcls.partial_fc import check_sample_rate
from jaxcls.precision import DTYPES
from jaxcls.registry import lookup


def base_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0
    # Data: kind is recordio | folder | procedural | synthetic.
    c.data = ml_collections.ConfigDict(dict(
        kind="procedural", root="", input_size=32, workers=0, threads=4, flip=True,
        procedural=dict(num_classes=1000, images_per_class=16, size=32, strokes=5),
    ))
    c.num_classes = 1000
    # Model.
    c.model = "r18"
    c.model_kwargs = ml_collections.ConfigDict(dict(width=16))  # extra backbone arguments (IResNet: width)
    c.num_features = 128
    c.precision = "float32"  # compute dtype: float32 | bfloat16 | float16 (dynamic loss scaling)
    c.remat = "none"  # none | full | save_dots | save_block_outputs
    # FC head and loss.
    c.margin = ml_collections.ConfigDict(dict(name="cosface", s=64.0, m=0.4, straight_through=False))
    c.sample_rate = 1.0  # PartialFC
    c.class_axes = "data,class"  # "data,class" (every device) or "class"
    c.mesh_data = 1  # size of the data axis; the class axis takes the remaining devices
    c.chunk_size = DEFAULT_CHUNK  # FC rows per tile of the fused FC step (0: one tile per shard)
    c.fc_dtype = "float32"  # storage of FC weight and its optimizer state
    # Optimization (arcface_torch defaults).
    c.optimizer = "sgd"  # sgd | adamw
    c.lr = 0.1
    c.momentum = 0.9
    c.weight_decay = 5e-4
    c.batch_size = 128  # global
    c.accum_steps = 1
    c.total_steps = 600
    c.warmup_steps = 50
    c.lr_power = 2.0  # polynomial decay after warmup (arcface_torch's PolyScheduler)
    c.clip_grad_norm = 5.0  # backbone only
    c.loss_scale = ml_collections.ConfigDict(dict(initial=2.0**16, growth_interval=100))
    # Evaluation, logging, checkpoints.
    c.eval_bins = []  # paths of verification .bin files; the procedural source adds its own pairs
    c.eval_every = 200
    c.eval_batch_size = 256
    c.log_every = 50
    c.ckpt_every = 200
    c.keep_checkpoints = 3
    c.collapse_warning = 0.5  # warn when the eval embeddings' mean cosine exceeds this
    return c


FREE_FORM = {"model_kwargs", "data.procedural"}  # passed through to constructors as they are


def check_keys(config, reference=None, prefix="") -> None:
    """Every key of ``config`` must exist in ``base_config()`` (nested dicts checked recursively)."""
    reference = base_config() if reference is None else reference
    for key, value in config.items():
        name = prefix + key
        if key not in reference:
            raise ValueError(f"unknown config key {name!r}")
        if name not in FREE_FORM and isinstance(reference[key], ml_collections.ConfigDict):
            check_keys(value, reference[key], name + ".")


# (key, its registry, what the error calls it): every named choice of a config
NAMED_CHOICES = [
    ("model", MODELS, "model"), ("remat", REMAT_POLICIES, "remat policy"), ("precision", DTYPES, "precision"),
    ("fc_dtype", DTYPES, "fc_dtype"), ("margin.name", MARGINS, "margin"), ("optimizer", OPTIMIZERS, "optimizer"),
    ("class_axes", CLASS_AXES, "class_axes"), ("data.kind", SOURCES, "data source"),
]


def validate(config, num_devices: int) -> None:
    """Raise ``ValueError`` naming the first unknown key, unknown name or inconsistent value; builds nothing."""
    check_keys(config)
    for key, table, what in NAMED_CHOICES:
        lookup(table, functools.reduce(lambda node, part: node[part], key.split("."), config), what)
    if config.batch_size % (num_devices * config.accum_steps):
        raise ValueError(f"batch_size {config.batch_size} is not divisible by {num_devices} devices × "
                         f"accum_steps {config.accum_steps}")
    check_sample_rate(config.sample_rate)
    if num_devices % config.mesh_data:
        raise ValueError(f"mesh_data {config.mesh_data} does not divide the {num_devices} devices")
    if config.warmup_steps >= config.total_steps:
        raise ValueError(f"warmup_steps {config.warmup_steps} must be below total_steps {config.total_steps}")


def check_data_classes(config, data_classes: int) -> None:
    """The FC must have a row for every class of the training data."""
    if config.num_classes < data_classes:
        raise ValueError(f"num_classes {config.num_classes} is smaller than the {data_classes} classes in the data")


def face_config(*, root, num_classes, num_images, epochs, model="r50", margin=("arcface", 0.5), batch=1024,
                lr=0.1, weight_decay=5e-4, sample_rate=1.0, optimizer="sgd", warmup_epochs=0):
    """A face-recognition recipe on an insightface RecordIO folder (after arcface_torch's configs)."""
    c = base_config()
    c.data.kind = "recordio"
    c.data.root = root
    c.data.input_size = 112
    c.data.workers = 8
    c.num_classes = num_classes
    c.model = model
    c.model_kwargs = {}
    c.num_features = 512
    c.precision = "bfloat16"
    c.margin = dict(name=margin[0], s=64.0, m=margin[1], straight_through=False)
    c.sample_rate = sample_rate
    c.optimizer, c.lr, c.weight_decay = optimizer, lr, weight_decay
    c.batch_size = batch  # global: arcface_torch's per-GPU batch × 8 GPUs
    steps_per_epoch = num_images // batch
    c.total_steps = steps_per_epoch * epochs
    c.warmup_steps = steps_per_epoch * warmup_epochs
    c.eval_bins = [f"{root}/{name}.bin" for name in ("lfw", "cfp_fp", "agedb_30")]
    c.eval_every = 2000
    c.log_every = 50
    c.ckpt_every = 2000
    return c


def get_config() -> ml_collections.ConfigDict:
    """The built-in default run (``python -m jaxcls.train`` with no ``--config``): ``base_config()``."""
    return base_config()
