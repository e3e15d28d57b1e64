"""A run built from a config: the one path from ``config`` to mesh, data source, model, FC head, optimizers and state.

``build(config)`` validates the whole config first (``jaxcls.config.validate``: every key, every named
choice, the batch against the devices) and only then builds. The state is never materialized on one
device: ``Run.init_state()`` creates it inside ``jax.jit`` directly in its shardings (FC weight and
its optimizer slots ``P(class_axes, None)``, everything else replicated), and ``Run.abstract_state``
describes it (shapes, dtypes, shardings) for restoring a checkpoint without initializing anything.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxcls.config import check_data_classes, fc_state_dtype, make_margin, validate
from jaxcls.data.augment import Augment
from jaxcls.data.images import decode_image
from jaxcls.data.pipeline import HostBatches
from jaxcls.data.sources import SOURCES, make_source
from jaxcls.errors import DataError
from jaxcls.fc import FCHead
from jaxcls.fc.sampling import sample_budget
from jaxcls.mesh import CLASS_AXES, batch_sharding, class_shards, host_rows, make_mesh, replicated, state_shardings
from jaxcls.models import make_model, one_off_compile_options, split_model
from jaxcls.models.layers import BatchNorm
from jaxcls.optimizers import lr_schedule, make_optimizers
from jaxcls.precision import DynamicLossScale, compute_dtype
from jaxcls.train_step import TrainStep


@dataclasses.dataclass
class Run:
    """Everything built from a config; ``source`` is None when built without data (evaluation elsewhere)."""

    config: Any
    mesh: Mesh
    source: Any
    train_step: TrainStep
    eval_graphdef: Any  # the backbone's graph in eval mode (running BatchNorm statistics, no dropout)
    abstract_state: dict  # jax.ShapeDtypeStruct leaves with their shardings
    init_fn: Any  # seed -> state, jitted with the state's shardings as outputs

    def init_state(self) -> dict:
        """A freshly initialised state, created in place on the mesh (deterministic in ``config.seed``).

        It runs once, so it is compiled with ``one_off_compile_options`` (no LLVM optimization on CPU).
        """
        options = one_off_compile_options(self.mesh.devices.flat[0].platform)
        return self.init_fn.lower(self.config.seed).compile(compiler_options=options)(self.config.seed)

    @property
    def state_shardings(self) -> dict:
        return jax.tree.map(lambda s: s.sharding, self.abstract_state)

    def jit_step(self):
        """``step(state, images, labels) -> (state, metrics)``, jitted with the state donated."""
        def train_step(state, images, labels):  # a named function: the program's ops read jit(train_step)/...
            return self.train_step(state, images, labels)

        return jax.jit(train_step, donate_argnums=0, out_shardings=(self.state_shardings, replicated(self.mesh)))

    def abstract_batch(self) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
        """One global batch as the step takes it: uint8 images ``[B, S, S, 3]`` and int32 labels ``[B]``, in the
        batch sharding."""
        c, sharding = self.config, batch_sharding(self.mesh)
        return (jax.ShapeDtypeStruct((c.batch_size, c.data.input_size, c.data.input_size, 3), jnp.uint8,
                                     sharding=sharding),
                jax.ShapeDtypeStruct((c.batch_size,), jnp.int32, sharding=sharding))

    def compile_step(self, state, compiler_options: dict | None = None):
        """``jit_step`` compiled ahead of time for ``state`` (as initialized, restored or abstract) and one
        ``abstract_batch``, with ``compiler_options`` and over them the options the FC step needs to update in place
        (``FCHead.compiler_options``)."""
        options = {**(compiler_options or {}), **self.train_step.head.compiler_options}
        return self.jit_step().lower(state, *self.abstract_batch()).compile(options or None)

    def batches(self, bad_records_log=None) -> HostBatches:
        """The checkpointable iterator of this host's rows of every global training batch; labels are checked against
        ``num_classes`` and bad records handled by ``config.data.bad_records``, skipped ones listed in
        ``bad_records_log`` (a path)."""
        c = self.config
        return HostBatches(self.source, global_batch=c.batch_size, rows=host_rows(self.mesh, c.batch_size),
                           size=c.data.input_size, seed=c.seed, flip=c.data.flip,
                           augment=Augment.from_config(c.data.augment), workers=c.data.workers,
                           threads=c.data.threads, num_classes=c.num_classes, bad_records=c.data.bad_records,
                           bad_records_log=bad_records_log)

    def summary(self) -> list[str]:
        """The resolved run in a few lines: model, FC, mesh and batch, data."""
        c, head = self.config, self.train_step.head
        params = sum(x.size for x in jax.tree.leaves(self.abstract_state["params"]))
        shards = class_shards(self.mesh, head.class_axes)
        sampling = "no PartialFC"
        if c.sample_rate < 1:  # the sample is never smaller than the global batch: a rate can be more in effect
            rows = head.rows // shards
            budget = sample_budget(rows, c.batch_size, c.sample_rate)
            floor = budget > sample_budget(rows, 0, c.sample_rate)
            sampling = (f"PartialFC {c.sample_rate:g}: {budget:,} of {rows:,} rows a shard"
                        + (f" ({budget / rows:.2g} in effect: never fewer than the global batch's {c.batch_size})"
                           if floor else ""))
        margin_m = tuple(c.margin.m) if isinstance(c.margin.m, (tuple, list)) else f"{c.margin.m:g}"  # combined: 3
        data = "no training data opened" if self.source is None else (
            f"{len(self.source):,} images of {self.source.num_classes():,} classes")
        return [
            f"model {c.model} {dict(c.model_kwargs)}: {params / 1e6:.2f}M parameters, {c.num_features}-d "
            f"embeddings, compute {c.precision}, remat {c.remat}, BatchNorm statistics "
            f"{'of the global batch' if c.bn_sync else 'per device'}",
            f"FC {c.num_classes:,} classes × {c.num_features} ({c.fc_dtype}"
            f"{', rounded stochastically' if c.fc_weight_rounding == 'stochastic' else ''}, optimizer state "
            f"{jnp.dtype(fc_state_dtype(c)).name}) over {shards} class shards, "
            f"{head.rows // shards:,} rows per device; {c.margin.name} s={c.margin.s:g} m={margin_m}; {sampling}",
            f"mesh data={self.mesh.shape['data']} × class={self.mesh.shape['class']} "
            f"({self.mesh.devices.flat[0].platform}, {jax.process_count()} process(es)); global batch "
            f"{c.batch_size} ({c.batch_size // self.mesh.size} per device); optimizer {c.optimizer} lr {c.lr:g}",
            f"data {c.data.kind}{' ' + c.data.root if c.data.root else ''}: {data}; "
            f"input {c.data.input_size}×{c.data.input_size}{stored_size(self.source, c.data.input_size)}; augment: "
            + ", ".join(Augment.from_config(c.data.augment).names() + ["flip"] * c.data.flip or ["none"]),
        ]


def stored_size(source, size: int) -> str:
    """`` (stored H×W, resized)`` where a data set's first image is not ``size``×``size`` (every image is resampled to
    the input size; ``stretched`` where it is not square), else nothing; nothing for generated data or an image that
    does not decode (the pipeline meets it under the run's bad-records policy)."""
    if source is None or source.generated or not len(source):
        return ""
    try:
        height, width = decode_image(source.raw(0)[0], source.where(0)).shape[:2]
    except DataError:
        return ""
    if (height, width) == (size, size):
        return ""
    return f" (stored {height}×{width}, {'resized' if height == width else 'stretched to a square'})"


def bn_groups(config, mesh: Mesh) -> int:
    """1 with ``bn_sync`` (statistics over the global batch), else every device of the mesh (one block of rows each,
    as ``batch_sharding`` places them)."""
    return 1 if config.bn_sync else mesh.size


def build(config, devices=None, with_data: bool = True) -> Run:
    """Validate ``config`` and build its run (nothing is initialised on the devices; see ``Run.init_state``).

    ``with_data=False`` opens no training data unless the source is generated (evaluation on a machine
    without the data set).
    """
    devices = jax.devices() if devices is None else devices
    validate(config, len(devices))
    source = None
    if with_data or SOURCES[config.data.kind].generated:
        source = make_source(config.data, config.num_classes)
        check_data_classes(config, source.num_classes())
    mesh = make_mesh(config.mesh_data, len(devices) // config.mesh_data, devices=devices)
    dtype, fc_dtype = compute_dtype(config.precision), compute_dtype(config.fc_dtype)
    groups = bn_groups(config, mesh)
    abstract_model = nnx.eval_shape(lambda: make_model(config, dtype, bn_groups=groups))
    if mesh.size > groups:  # bn_sync over several devices: two-pass statistics (BatchNorm.one_pass)
        for _, module in nnx.iter_graph(abstract_model):
            if isinstance(module, BatchNorm):
                module.one_pass = False
    graphdef = split_model(abstract_model)[0]
    abstract_model.eval()
    eval_graphdef = split_model(abstract_model)[0]
    tx, fc_optimizer = make_optimizers(config.optimizer, momentum=config.momentum, weight_decay=config.weight_decay,
                                       clip=config.clip_grad_norm, fc_state_dtype=fc_state_dtype(config),
                                       fc_weight_rounding=config.fc_weight_rounding)
    head = FCHead(mesh, config.num_classes, config.num_features, make_margin(config.margin), fc_optimizer,
                  sample_rate=config.sample_rate, class_axes=CLASS_AXES[config.class_axes],
                  chunk_size=config.chunk_size or None, dtype=fc_dtype)
    scaler = DynamicLossScale(config.loss_scale.initial, config.loss_scale.growth_interval,
                              enabled=config.precision == "float16")
    schedule = lr_schedule(config.lr, config.warmup_steps, config.total_steps, config.lr_power)
    train_step = TrainStep(graphdef, head, tx, schedule, scaler, dtype, config.accum_steps)

    def init(seed):  # the seed is an argument, so every seed shares one compiled program
        _, params, stats = split_model(make_model(config, dtype, seed))
        return train_step.init_state(params, stats, jax.random.key(seed))

    abstract = jax.eval_shape(init, config.seed)
    shardings = state_shardings(abstract, mesh, head.class_axes)
    abstract = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), abstract, shardings)
    return Run(config, mesh, source, train_step, eval_graphdef, abstract, jax.jit(init, out_shardings=shardings))
