"""The trainer: ``python -m jaxcls.train [--config configs/<name>.py] [--workdir runs/x] [--config.key=value]``.

With no arguments it trains a small IResNet on a procedural many-identity image set (no download) and
verifies on held-out identities. Writes to the workdir: ``config.json`` (the resolved config),
``metrics.jsonl``, TensorBoard events, ``checkpoints/`` (orbax; resumed automatically).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import app, flags
from flax import nnx
from ml_collections import config_flags
from tqdm import tqdm

from jaxcls import checkpoint as ckpt
from jaxcls.config import validate
from jaxcls.data.pipeline import device_batch, normalize, train_batches
from jaxcls.data.sources import ProceduralGlyphs, make_source
from jaxcls.eval.verification import evaluate, flip_sum_embeddings, load_bin
from jaxcls.fc import FCHead
from jaxcls.losses import MARGINS, CombinedMargin, validate_labels
from jaxcls.mesh import batch_sharding, make_mesh, replicated
from jaxcls.losses.sharded import weight_sharding
from jaxcls.models import get_model
from jaxcls.precision import DynamicLossScale, compute_dtype
from jaxcls.sparse_fc import OPTIMIZERS, SparseState
from jaxcls.train_step import Trainer, backbone_optimizer, lr_schedule

log = logging.getLogger("jaxcls")


def make_margin(cfg) -> CombinedMargin:
    kwargs = {"s": cfg.s, "m": cfg.m}
    if cfg.name == "arcface":
        kwargs["straight_through"] = cfg.straight_through
    return MARGINS[cfg.name](**kwargs)


@dataclasses.dataclass
class Run:
    """Everything built from a config: mesh, data source, trainer, eval-mode graph and state shardings."""

    config: object
    mesh: object
    source: object
    trainer: Trainer
    eval_graphdef: object
    state_shardings: dict


def build(config, devices=None, with_data: bool = True) -> tuple[Run, dict]:
    """Validate ``config``, build the run and a freshly initialised state (placed on the mesh).

    ``with_data=False`` skips opening the training data (evaluation on a machine without it).
    """
    devices = jax.devices() if devices is None else devices
    source = None
    if with_data or config.data.kind == "procedural":
        source = make_source(config.data.kind, config.data.root, **(
            dict(config.data.procedural) if config.data.kind == "procedural" else
            {"num_classes": config.num_classes, "size": config.data.input_size} if config.data.kind == "synthetic"
            else {}))
    validate(config, len(devices), None if source is None else source.num_classes())
    mesh = make_mesh(config.mesh_data, len(devices) // config.mesh_data, devices=devices)
    dtype = compute_dtype(config.precision)
    model = get_model(config.model, config.num_features, dtype=dtype, remat=config.remat,
                      input_size=config.data.input_size, rngs=nnx.Rngs(params=config.seed, dropout=config.seed + 1), **config.model_kwargs)
    graphdef, params, stats = split_model(model)
    model.eval()
    eval_graphdef = split_model(model)[0]
    schedule = lr_schedule(config.lr, config.warmup_steps, config.total_steps, config.lr_power)
    fc_dtype = compute_dtype(config.fc_dtype)
    head = FCHead(mesh, config.num_classes, config.num_features, make_margin(config.margin),
                  OPTIMIZERS[config.optimizer](**({"momentum": config.momentum} if config.optimizer == "sgd" else {}),
                                               weight_decay=config.weight_decay, state_dtype=fc_dtype),
                  sample_rate=config.sample_rate, class_axes=tuple(config.class_axes.split(",")),
                  chunk_size=config.chunk_size or None, dtype=fc_dtype)
    tx = backbone_optimizer(config.optimizer, momentum=config.momentum,
                            weight_decay=config.weight_decay, clip=config.clip_grad_norm)
    scaler = DynamicLossScale(config.loss_scale.initial, config.loss_scale.growth_interval,
                              enabled=config.precision == "float16")
    trainer = Trainer(graphdef, head, tx, schedule, scaler, dtype, config.accum_steps)
    state = trainer.init_state(params, stats, jax.random.key(config.seed))
    shardings = state_shardings(state, mesh, head.class_axes)
    run = Run(config, mesh, source, trainer, eval_graphdef, shardings)
    return run, jax.device_put(state, shardings)


def split_model(model):
    """``(graphdef, params, everything else)``: BatchNorm statistics, RNG state."""
    return nnx.split(model, nnx.Param, ...)


def state_shardings(state: dict, mesh, class_axes) -> dict:
    """FC weight and its per-row optimizer slots: ``P(class_axes, None)``; everything else replicated."""
    shardings = jax.tree.map(lambda _: replicated(mesh), state)
    fc = weight_sharding(mesh, class_axes)
    shardings["weight"] = fc
    shardings["fc_opt"] = SparseState(tuple(fc for _ in state["fc_opt"].slots), replicated(mesh))
    return shardings


def compile_step(run: Run):
    """The jitted train step with the state donated."""
    return jax.jit(run.trainer.train_step, donate_argnums=0,
                   out_shardings=(run.state_shardings, replicated(run.mesh)))


def eval_sets(config, source) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """``(name, uint8 images [2N, S, S, 3], issame [N])`` for every configured verification set."""
    sets = [(Path(p).stem, *load_bin(p, config.data.input_size)) for p in config.eval_bins]
    if isinstance(source, ProceduralGlyphs):
        sets.append(("heldout", *source.verification_pairs()))
    return sets


def make_embed(run: Run):
    """``embed(state, uint8 images [B, S, S, 3]) -> float32 [B, D]`` in eval mode, batch over all devices."""

    @jax.jit
    def embed(params, stats, images):
        return nnx.merge(run.eval_graphdef, params, stats)(normalize(images))

    sharding = batch_sharding(run.mesh)
    return lambda state, images: embed(state["params"], state["stats"], jax.device_put(images, sharding))


def verify(run: Run, state, sets, embed) -> dict:
    """Verification metrics ``val/<name>/<metric>`` on every set; warns on embedding collapse."""
    batch = -(-run.config.eval_batch_size // run.mesh.size) * run.mesh.size
    out = {}
    for name, images, issame in sets:
        emb = flip_sum_embeddings(lambda x: embed(state, x), images, batch)
        result = evaluate(emb, issame)
        out.update({f"val/{name}/{k}": v for k, v in result.items()})
        if result["mean_cosine"] > run.config.collapse_warning:
            log.warning("embedding collapse on %s: eval embeddings have mean cosine %.2f (accuracy %.3f); "
                        "try CosFace or a smaller margin, a lower lr or a longer warmup",
                        name, result["mean_cosine"], result["accuracy"])
    return out


def checkpoint_manager(workdir: Path, config):
    options = ocp.CheckpointManagerOptions(max_to_keep=config.keep_checkpoints, enable_async_checkpointing=True)
    return ocp.CheckpointManager(workdir / "checkpoints", options=options, item_names=("state", "data"))


def restore(manager, abstract_state, step=None):
    """The state (onto the abstract state's mesh, any device count) and data position of a checkpoint."""
    step = manager.latest_step() if step is None else step
    restored = manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore(item=abstract_state, restore_args=ckpt.restore_args(abstract_state)),
        data=ocp.args.JsonRestore()))
    return restored.state, restored.data


class MetricsWriter:
    """``metrics.jsonl`` plus TensorBoard scalars (when tensorboardX is installed), process 0 only."""

    def __init__(self, workdir: Path):
        self.active = jax.process_index() == 0
        self.file = open(workdir / "metrics.jsonl", "a") if self.active else None
        try:
            from tensorboardX import SummaryWriter

            self.tb = SummaryWriter(str(workdir / "tensorboard")) if self.active else None
        except ImportError:
            self.tb = None

    def write(self, step: int, metrics: dict) -> None:
        if not self.active:
            return
        row = {"step": step, **metrics}
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in row.items():
                if k != "step":
                    self.tb.add_scalar(k, v, step)

    def close(self):
        if self.file:
            self.file.close()
        if self.tb:
            self.tb.close()


def train(config, workdir: str | os.PathLike, devices=None, progress: bool = True, stop_after: int | None = None):
    """Train (resuming from the workdir's latest checkpoint if any); returns ``(state, last metrics)``.

    ``stop_after`` ends the run early at that step (after checkpointing it), as an interruption would.
    """
    workdir = Path(workdir).absolute()  # orbax writes only to absolute paths
    workdir.mkdir(parents=True, exist_ok=True)
    run, state = build(config, devices)
    manager = checkpoint_manager(workdir, config)
    if manager.latest_step() is not None and (workdir / "config.json").exists():
        # restores pad or truncate FC rows to the new mesh, so a changed class count must be caught here
        ckpt.check_num_classes(json.loads((workdir / "config.json").read_text())["num_classes"], config.num_classes)
    if jax.process_index() == 0:
        (workdir / "config.json").write_text(config.to_json_best_effort(indent=2))
    batches = train_batches(run.source, batch_size=config.batch_size // jax.process_count(),
                            size=config.data.input_size, seed=config.seed, flip=config.data.flip,
                            workers=config.data.workers, threads=config.data.threads)
    if manager.latest_step() is not None:
        state, data_state = restore(manager, ckpt.abstract_like(state))
        batches.set_state(data_state)
        log.info("resumed from step %d", int(state["step"]))
    step_fn, embed = compile_step(run), make_embed(run)
    sets = eval_sets(config, run.source)
    writer = MetricsWriter(workdir)
    sharding = batch_sharding(run.mesh)
    start = int(state["step"])
    bar = tqdm(total=config.total_steps, initial=start, disable=not progress or jax.process_index() != 0,
               unit="step", dynamic_ncols=True)
    last, tick, metrics = {}, time.perf_counter(), None
    end = config.total_steps if stop_after is None else min(stop_after, config.total_steps)
    for step in range(start + 1, end + 1):
        images, labels = next(batches)
        validate_labels(labels, config.num_classes)  # host-side: a bad label stops before any device work
        state, metrics = step_fn(state, *device_batch((images, labels), sharding))
        if step % config.log_every == 0 or step == config.total_steps:
            metrics = jax.device_get(metrics)
            now = time.perf_counter()
            steps_done = config.log_every if step % config.log_every == 0 else step % config.log_every
            last = {k: float(metrics[k]) for k in ("loss", "lr", "grad_norm", "loss_scale")}
            last["img_per_s"] = steps_done * config.batch_size / (now - tick)
            if not metrics["finite"]:
                log.warning("step %d: non-finite gradients; update skipped", step)
            if step % config.eval_every == 0 or step == config.total_steps:
                last.update(verify(run, state, sets, embed))
            writer.write(step, last)
            bar.set_postfix({k: f"{v:.4g}" for k, v in last.items() if "/" not in k or k.endswith("accuracy")})
            tick = time.perf_counter()
        bar.update(1)
        if step % config.ckpt_every == 0 or step == end:
            save(manager, step, state, batches)
    manager.wait_until_finished()
    bar.close()
    writer.close()
    return state, last


def save(manager, step, state, batches):
    manager.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state),
                                               data=ocp.args.JsonSave(batches.get_state())))


def main(argv):
    config = flags.FLAGS.config
    if flags.FLAGS.distributed:
        jax.distributed.initialize()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    log.setLevel(logging.INFO)
    _, final = train(config, flags.FLAGS.workdir)
    print(json.dumps(final, indent=1))


def define_flags():
    default = os.path.join(os.path.dirname(__file__), "config.py")
    config_flags.DEFINE_config_file("config", default, "a configs/*.py file; default: the built-in procedural run")
    flags.DEFINE_string("workdir", "runs/default", "where checkpoints, metrics and the config go")
    flags.DEFINE_bool("distributed", False, "call jax.distributed.initialize() (one process per host)")


if __name__ == "__main__":
    define_flags()
    app.run(main)
