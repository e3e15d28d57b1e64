"""The trainer's configuration: every key with its default, and the checks run before training.

Config files (``configs/*.py``) define ``get_config()`` returning ``base_config()`` with changes; keys
not in ``base_config()`` are an error, as are inconsistent values (see ``validate``).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import json
import numbers
import os

import ml_collections
import numpy as np
from absl import flags
from ml_collections import config_flags

from jaxcls.data import augment
from jaxcls.data.augment import Augment
from jaxcls.data.sources import SOURCES
from jaxcls.fc import DEFAULT_CHUNK
from jaxcls.fc.optimizers import check_weight_rounding
from jaxcls.fc.sampling import check_sample_rate
from jaxcls.losses.margins import MARGINS, CombinedMargin
from jaxcls.mesh import CLASS_AXES
from jaxcls.models import MODELS
from jaxcls.models.layers import REMAT_POLICIES
from jaxcls.optimizers import OPTIMIZERS, make_optimizers
from jaxcls.precision import DTYPES, FC_STATE_DTYPES
from jaxcls.registry import lookup


def base_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0
    # Data: kind is recordio | folder | procedural | synthetic.
    c.data = ml_collections.ConfigDict(dict(
        kind="procedural", root="", input_size=32, workers=0, threads=2, flip=True,
        # threads: host batches decoded at once, in this process or in each of `workers` processes (docs/training.md)
        bad_records="error",  # error | skip: a record that cannot be read or decoded stops the run, or is
        # replaced by the next good one and listed in <workdir>/bad_records.txt (bad_records.<process>.txt by each
        # process of several)
        procedural=dict(num_classes=1000, images_per_class=16, size=32, strokes=5),
        # per image, before the flip: a probability per op (0: off) and its strength (jaxcls.data.augment.Augment)
        augment={f.name: f.default for f in dataclasses.fields(Augment)},
    ))
    c.num_classes = 1000
    # Model.
    c.model = "r18"
    c.model_kwargs = ml_collections.ConfigDict(dict(width=16))  # extra backbone arguments (IResNet: width)
    c.num_features = 128
    c.precision = "float32"  # compute dtype: float32 | bfloat16 | float16 (dynamic loss scaling)
    c.remat = "none"  # none | full | save_dots | save_block_outputs
    c.bn_sync = False  # BatchNorm statistics in training: per device (arcface_torch) or, True, over the global batch
    # FC head and loss.
    # m: one number, or (m1, m2, m3) for "combined"; typed object so that either parses from the command line
    c.margin = ml_collections.ConfigDict(dict(name="cosface", s=64.0, m=ml_collections.FieldReference(0.4, object),
                                              straight_through=False))
    c.sample_rate = 1.0  # PartialFC
    c.class_axes = "data,class"  # "data,class" (every device) or "class"
    c.mesh_data = 1  # size of the data axis; the class axis takes the remaining devices
    c.chunk_size = DEFAULT_CHUNK  # FC rows per tile of the fused FC step (0: one tile per shard)
    c.fc_dtype = "float32"  # storage of FC weight and its optimizer state
    c.fc_state_dtype = "same"  # storage of the FC optimizer state: as fc_dtype, or float32 | bfloat16 | float16 |
    # int8 (one byte per value and a float32 scale per row: sgd only; docs/partial_fc.md)
    c.fc_weight_rounding = "nearest"  # how updated FC weight rows are stored: nearest | stochastic (bfloat16
    # fc_dtype only: keeps updates below bfloat16's step in expectation; docs/partial_fc.md)
    c.mem_fraction = 0.0  # share of each GPU's memory XLA may allocate (XLA_PYTHON_CLIENT_MEM_FRACTION), set before
    # the backend starts; 0: the environment's XLA_PYTHON_CLIENT_MEM_FRACTION, else JAX's default 0.75
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
    c.clip_grad_norm = 5.0  # backbone only; 0: no clipping
    c.max_bad_steps = 20  # stop after this many consecutive steps with a non-finite loss or gradient (skipped)
    c.loss_scale = ml_collections.ConfigDict(dict(initial=2.0**16, growth_interval=100))
    # Evaluation, logging, checkpoints.
    c.eval_bins = ()  # verification .bin files: paths, or bare names found in data.root (as arcface_torch's
    # val_targets are); the procedural source adds its own pairs
    c.eval_every = 200
    c.eval_batch_size = 256
    c.log_every = 50
    c.ckpt_every = 200
    c.keep_checkpoints = 3
    c.collapse_warning = 0.5  # warn when the eval embeddings' mean cosine exceeds this
    return c


FREE_FORM = {"model_kwargs", "data.procedural"}  # passed through to constructors as they are


def flat_keys(config, prefix="") -> list[str]:
    """Every leaf key of ``config`` as a dotted path (free-form dicts count as one leaf)."""
    keys = []
    for key, value in config.items():
        name = prefix + key
        nested = isinstance(value, (dict, ml_collections.ConfigDict)) and name not in FREE_FORM
        keys += flat_keys(value, name + ".") if nested else [name]
    return keys


def unknown_key_error(name: str) -> ValueError:
    """``unknown config key 'name'`` with the closest valid key, if one is close."""
    close = difflib.get_close_matches(name, flat_keys(base_config()) + sorted(FREE_FORM), n=1, cutoff=0.6)
    return ValueError(f"unknown config key {name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))


def check_keys(config, reference=None, prefix="") -> None:
    """Every key of ``config`` must exist in ``base_config()`` (nested dicts checked recursively)."""
    reference = base_config() if reference is None else reference
    for key in config.keys():  # values read only where nested: a face recipe's steps are computed when read
        name = prefix + key
        if key not in reference:
            raise unknown_key_error(name)
        if name not in FREE_FORM and isinstance(reference[key], ml_collections.ConfigDict):
            check_keys(config[key], reference[key], name + ".")


def check_config_flags(argv, flag: str = "config") -> None:
    """Refuse a missing ``--config`` file or a ``--config.<key>=…`` naming no key (before ml_collections parses
    them, which would fail later with a traceback)."""
    valid = flat_keys(base_config())
    for i, arg in enumerate(argv[1:], 1):
        if arg == f"--{flag}" or arg.startswith(f"--{flag}="):
            path = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            if not os.path.isfile(path.split(":")[0]):
                raise ValueError(f"config file {path.split(':')[0]!r} not found")
        if arg.startswith(f"--{flag}.") or arg.startswith(f"--no{flag}."):
            name = arg.split("=", 1)[0].split(".", 1)[1]
            if name not in valid and not any(name.startswith(f + ".") for f in FREE_FORM):
                raise unknown_key_error(name)


def define_config_flag(values: flags.FlagValues = flags.FLAGS) -> None:
    """The ``--config`` flag of the command-line programs: a configs/*.py file (default: this module's
    procedural run) with ``--config.<key>=<value>`` overrides. ``check_config_flags`` refuses unknown keys before
    parsing, so only the free-form dicts take new keys (``--config.model_kwargs.dropout=0.2``, read as a literal)."""
    config_flags.DEFINE_config_file("config", __file__, "a configs/*.py file; default: the built-in procedural run",
                                    flag_values=values, lock_config=False, accept_new_attributes=True)


FLOAT32_MAX = float(np.finfo(np.float32).max)
MAX_CLASSES = 2**31 - 2**16  # labels and FC row indices are int32, with room for padding over 65,536 shards
# (dotted key, predicate, the rule in words): every numeric key's range
RANGES = [(key, rule, words) for keys, rule, words in [
    (("batch_size",), lambda v: v >= 1, ">= 1"),  # first: a face recipe's step counts are read through it
    (("lr",), lambda v: v > 0, "> 0"),
    (("momentum",), lambda v: 0 <= v < 1, "in [0, 1)"),
    (("weight_decay", "clip_grad_norm", "warmup_steps", "chunk_size", "data.workers"), lambda v: v >= 0, ">= 0"),
    (("margin.m",), lambda v: all(isinstance(m, numbers.Real) and not isinstance(m, bool) and m >= 0
                                  for m in (v if isinstance(v, (tuple, list)) else (v,))),
     ">= 0"),  # one number, or (m1, m2, m3) for 'combined'; typed object, so a string could come from the command line
    (("lr_power",), lambda v: v >= 0, ">= 0"),
    (("margin.s",), lambda v: v > 0, "> 0"),
    (("loss_scale.initial",), lambda v: 0 < v <= FLOAT32_MAX, f"in (0, {FLOAT32_MAX:.4g}] (a float32)"),
    (("seed",), lambda v: 0 <= v < 2**31 - 1, "in [0, 2**31 - 1) (an int32, as is seed + 1)"),
    (("num_classes",), lambda v: 1 <= v <= MAX_CLASSES, f"in [1, {MAX_CLASSES:,}] (int32 labels)"),
    (("num_features", "accum_steps", "total_steps", "mesh_data", "eval_every",
      "eval_batch_size", "log_every", "ckpt_every", "keep_checkpoints", "max_bad_steps", "data.input_size",
      "data.threads", "loss_scale.growth_interval"), lambda v: v >= 1, ">= 1"),
    (("collapse_warning", "mem_fraction"), lambda v: 0 <= v <= 1, "in [0, 1]"),
] for key in keys] + [("data.augment." + name, rule, words) for name, rule, words in augment.RANGES]
# keys that may differ when a run resumes: where and how it runs, what it reports; never the model, the data
# stream or the optimization
RESUMABLE_KEYS = {"mesh_data", "class_axes", "chunk_size", "remat", "data.root", "data.workers", "data.threads",
                  "data.bad_records", "eval_bins", "eval_every", "eval_batch_size", "log_every", "ckpt_every",
                  "keep_checkpoints", "collapse_warning", "max_bad_steps", "mem_fraction"}


def get_key(config, key: str):
    return functools.reduce(lambda node, part: node[part], key.split("."), config)


def from_json(text: str) -> ml_collections.ConfigDict:
    """A config saved as JSON (a run's ``config.json``) laid over ``base_config()``: keys added to jaxcls since
    it was written take their defaults, lists become tuples again."""
    config = base_config()

    def merge(node, values, prefix):
        for key, value in values.items():
            name = prefix + key
            nested = isinstance(node.get(key), ml_collections.ConfigDict) and name not in FREE_FORM
            if isinstance(value, dict) and nested:
                merge(node[key], value, name + ".")
            else:
                node[key] = tuple(value) if isinstance(value, list) else value

    merge(config, json.loads(text), "")
    return config


def resume_differences(saved, config) -> list[str]:
    """``key: saved → new`` for every key outside ``RESUMABLE_KEYS`` whose value differs from the saved config."""
    differences = []
    for key in sorted(set(flat_keys(saved)) | set(flat_keys(config))):
        if key in RESUMABLE_KEYS:
            continue
        try:
            old = get_key(saved, key)
        except (KeyError, AttributeError):
            old = "(absent)"
        try:
            new = get_key(config, key)
        except (KeyError, AttributeError):
            new = "(absent)"
        if plain(old) != plain(new):
            differences.append(f"{key}: {plain(old)!r} → {plain(new)!r}")
    return differences


def plain(value):
    """``value`` as its JSON reads back, at any depth: tuples as lists, config dicts as dicts."""
    if hasattr(value, "to_dict"):
        value = value.to_dict()
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return [plain(v) for v in value] if isinstance(value, (list, tuple)) else value


# (key, its registry, what the error calls it): every named choice of a config
NAMED_CHOICES = [
    ("model", MODELS, "model"), ("remat", REMAT_POLICIES, "remat policy"), ("precision", DTYPES, "precision"),
    ("fc_dtype", DTYPES, "fc_dtype"), ("fc_state_dtype", FC_STATE_DTYPES, "fc_state_dtype"),
    ("margin.name", MARGINS, "margin"), ("optimizer", OPTIMIZERS, "optimizer"),
    ("class_axes", CLASS_AXES, "class_axes"), ("data.kind", SOURCES, "data source"),
]


def validate(config, num_devices: int) -> None:
    """Raise ``ValueError`` naming the first unknown key, unknown name or inconsistent value; builds nothing."""
    check_keys(config)
    for key, table, what in NAMED_CHOICES:
        lookup(table, get_key(config, key), what)
    for key, rule, words in RANGES:
        if not rule(get_key(config, key)):
            raise ValueError(f"{key} must be {words}, got {get_key(config, key)!r}")
    if config.data.bad_records not in ("error", "skip"):
        raise ValueError(f"unknown data.bad_records policy {config.data.bad_records!r}; choose 'error' or 'skip'")
    if config.batch_size % (num_devices * config.accum_steps):
        raise ValueError(f"batch_size {config.batch_size} is not divisible by {num_devices} devices × "
                         f"accum_steps {config.accum_steps}")
    check_sample_rate(config.sample_rate)
    if num_devices % config.mesh_data:
        raise ValueError(f"mesh_data {config.mesh_data} does not divide the {num_devices} devices")
    if config.warmup_steps >= config.total_steps:
        raise ValueError(f"warmup_steps {config.warmup_steps} must be below total_steps {config.total_steps}")
    make_margin(config.margin)  # refuses a combined margin's m that is not (m1, m2, m3), an m1 of 0, an m2 of π
    make_optimizers(config.optimizer, momentum=config.momentum, weight_decay=config.weight_decay,
                    clip=config.clip_grad_norm, fc_state_dtype=fc_state_dtype(config),
                    fc_weight_rounding=config.fc_weight_rounding)  # refuses what cannot work
    check_weight_rounding(config.fc_weight_rounding, DTYPES[config.fc_dtype])


def make_margin(margin_config) -> CombinedMargin:
    """``config.margin`` (name, s, m, straight_through) → a ``CombinedMargin``; for ``name="combined"`` ``m`` is
    ``(m1, m2, m3)``, arcface_torch's ``margin_list``."""
    if margin_config.name != "combined" and isinstance(margin_config.m, (tuple, list)):
        raise ValueError(f"margin {margin_config.name!r} takes one number m, got {margin_config.m!r}; "
                         "(m1, m2, m3) is margin 'combined'")
    return MARGINS[margin_config.name](s=margin_config.s, m=margin_config.m,
                                       straight_through=margin_config.straight_through)


def check_batchnorm_rows(config, num_devices: int) -> None:
    """Training normalizes each BatchNorm over the rows of a micro-batch (of a device's share without ``bn_sync``):
    ``ValueError`` where that is one row. The embedding's BatchNorm then gives every image its bias, and the backbone no
    gradient (torch refuses it too). Evaluation, which normalizes with running statistics, is not held to it."""
    normalized_together = config.batch_size // (config.accum_steps * (1 if config.bn_sync else num_devices))
    if normalized_together < 2:
        raise ValueError(f"batch_size {config.batch_size} leaves BatchNorm one row per "
                         f"{'micro-batch' if config.bn_sync else 'device and micro-batch'}: every embedding would be "
                         "the same and the backbone get no gradient; give it at least 2 rows"
                         + ("" if config.bn_sync else " per device (or bn_sync=True)"))


def fc_state_dtype(config):
    """The FC optimizer state's storage dtype: ``fc_state_dtype``, or for ``"same"`` the ``fc_dtype``."""
    return FC_STATE_DTYPES[config.fc_state_dtype] or DTYPES[config.fc_dtype]


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
    c.margin.update(name=margin[0], s=64.0, m=margin[1], straight_through=False)
    c.sample_rate = sample_rate
    c.optimizer, c.lr, c.weight_decay = optimizer, lr, weight_decay
    c.batch_size = batch  # global: arcface_torch's per-GPU batch × 8 GPUs
    # steps from the global batch where they are read, as train_v2.py counts them when it starts: a batch set on the
    # command line keeps the epochs (a total_steps or warmup_steps set there replaces its count)
    steps_per_epoch = ml_collections.FieldReference(num_images) // c.get_ref("batch_size")
    c.total_steps = steps_per_epoch * epochs
    c.warmup_steps = steps_per_epoch * warmup_epochs
    c.lr_power = 1.0  # train_v2.py's PolynomialLRWarmup (the base config's 2 is its older train.py's PolyScheduler)
    c.eval_bins = ("lfw.bin", "cfp_fp.bin", "agedb_30.bin")  # in data.root, wherever it is moved
    c.eval_every = 2000
    c.log_every = 50
    c.ckpt_every = 2000
    return c


def small_r18() -> dict:
    """``model_kwargs`` of the small IResNet-18 that the tests train and the benchmarks' --small modes compile: 8 wide,
    one block a stage but the last's two (that stage still holds a stack of identical blocks); a step compiles ~1/3
    faster than (2, 2, 2, 2)'s. A new dict each call: a config that changes its copy changes no other."""
    return {"width": 8, "stages": [1, 1, 1, 2]}


def benchmark_config(*, small: bool = False, overrides=(), **keys) -> ml_collections.ConfigDict:
    """The train step the benchmarks measure, on synthetic data: ``face_config``'s recipe (r50 at 112×112, 512-d
    ArcFace, bfloat16) with 1M classes, batch 128 and PartialFC 0.1. ``small``: ``small_r18()`` (32-d) at 32×32 in
    float32, which a CPU compiles and steps in seconds. Then ``keys`` (``batch_size=512``), then
    ``overrides``: a ``--set`` flag's ``KEY=VALUE`` strings, each value as Python reads it (``True``, ``65536``,
    ``0.1``) or else as text (``r50``); a dotted key reaches a nested one (``data.input_size=64``)."""
    c = face_config(root="/not/read", num_classes=1_000_000, num_images=10**7, epochs=1, batch=128, sample_rate=0.1)
    c.data.kind = "synthetic"
    c.total_steps, c.warmup_steps = 10**6, 10  # any number of timed steps, after a short warmup
    if small:
        c.model, c.model_kwargs, c.num_features, c.precision = "r18", small_r18(), 32, "float32"
        c.data.input_size = 32
    c.update_from_flattened_dict(keys)
    for item in overrides:
        key, text = item.split("=", 1)
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text
        c.update_from_flattened_dict({key: value})
    return c


def get_config() -> ml_collections.ConfigDict:
    """The built-in default run (``python -m jaxcls.train`` with no ``--config``): ``base_config()``."""
    return base_config()
