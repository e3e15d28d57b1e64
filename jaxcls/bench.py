"""What the benchmark scripts (``benchmarks/``) share: timing, compiled and peak memory, the train step's throughput,
the plain Flax step it is measured against, tables, JSON results with their environment, and rows computed each in
a fresh process."""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcls.config import small_r18
from jaxcls.data.pipeline import HostBatches, device_batch
from jaxcls.data.recordio import MXFaceDataset
from jaxcls.losses import rows_backward, rows_stats
from jaxcls.mesh import batch_sharding
from jaxcls.run import build


def time_ms(fn, *args, warmup: int = 3, iters: int = 20) -> float:
    """Median wall time in ms of ``fn(*args)``, synchronized on its outputs, after warm-up."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


# the least a sampled FC row must move (D = 512), KB per FC storage dtype: the weight row read twice and written once,
# its momentum read and written once
FC_ROW_FLOOR_KB = {"bfloat16": 5.0, "float32": 10.0}
# a script's --set help, by which tests/test_lease_jobs.py knows its values for config keys
CONFIG_KEY = "KEY=VALUE: a jaxcls config key (repeatable)"
FC_KERNELS = ("xla", *rows_backward.VARIANTS)
FC_KERNELS_HELP = ("the FC path's row kernels (jaxcls.losses.rows_stats, rows_backward): xla, XLA's forms of both; "
                   "pallas, both Triton kernels (CUDA GPUs); pallas_update, the statistics kernel and XLA's GEMMs "
                   "with the rows updated by a Triton kernel (rows_backward.GEMMS_IN_KERNELS off); default, each "
                   "platform's own (on CUDA GPUs that of pallas_update)")


@contextmanager
def fc_kernels(form: str | None):
    """Within the block, trace the FC path's statistics pass and backward in ``form`` (None: by platform; see
    ``FC_KERNELS_HELP``)."""
    variant = form if form in rows_backward.VARIANTS else None
    kernel = "pallas" if variant else form
    with rows_backward.variant(variant), rows_stats.forced(kernel), rows_backward.forced(kernel):
        yield


def compiled_memory(compiled) -> dict:
    """Per-device bytes from ``compiled.memory_analysis()`` (None where the backend gives none)."""
    stats = compiled.memory_analysis()
    if stats is None:
        return {"temp_bytes": None, "argument_bytes": None, "output_bytes": None}
    return {"temp_bytes": int(stats.temp_size_in_bytes), "argument_bytes": int(stats.argument_size_in_bytes),
            "output_bytes": int(stats.output_size_in_bytes)}


def peak_device_bytes(before: int | None = None) -> int | None:
    """Peak bytes in use on device 0 so far (GPU/TPU), else None. With ``before``, what this returned when a row
    began: that row's own peak where the row raised the process's, else None (the allocator keeps one peak per
    process, never reset, so an earlier, bigger row's would stand for this one's)."""
    peak = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
    return peak if before is None or peak is None or peak > before else None


def environment() -> dict:
    """Where a result was measured: JAX, the backend and its devices, Python, the command line."""
    dev = jax.devices()[0]
    return {"jax": jax.__version__, "backend": dev.platform, "device_kind": dev.device_kind,
            "device_count": jax.device_count(), "python": platform.python_version(), "argv": sys.argv}


def select(grid: list[tuple], keys: list[str], conditions: list[str]) -> list[tuple]:
    """The specs of ``grid`` (tuples named by ``keys``) matching every ``KEY=VALUE`` of ``conditions``; none matching
    stops the script with the grid's values (a job that would write an empty table)."""
    chosen = grid
    for condition in conditions:
        key, equals, value = condition.partition("=")
        if not equals or key not in keys:
            sys.exit(f"--only {condition}: expected KEY=VALUE, KEY one of {', '.join(keys)}")
        chosen = [spec for spec in chosen if str(spec[keys.index(key)]) == value]
    if not chosen:
        values = {key: sorted({str(spec[i]) for spec in grid}) for i, key in enumerate(keys)}
        sys.exit(f"--only {' '.join(conditions)}: no row of the grid matches; its values: "
                 + "; ".join(f"{key} {', '.join(v)}" for key, v in values.items()))
    return chosen


def print_table(rows: list[dict], columns: list[str]) -> None:
    """``columns`` of ``rows`` as an aligned text table (numbers to 3 significant digits or with thousands commas)."""
    def fmt(v):
        if v is None or isinstance(v, bool):
            return "-" if v is None else str(v)
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
        return f"{v:,}" if isinstance(v, int) else str(v)

    cells = [[fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print(" | ".join(c.ljust(w) for c, w in zip(columns, widths)))
    print("-|-".join("-" * w for w in widths))
    for row in cells:
        print(" | ".join(v.ljust(w) for v, w in zip(row, widths)))


def write_json(path: str, rows: list[dict]) -> None:
    """``rows`` with their ``environment()`` as JSON at ``path``."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"environment": environment(), "rows": rows}, f, indent=1)
    print(f"wrote {path}")


def time_train_step(config, steps: int, pipeline_root=None, warmup: int = 15, devices=None) -> dict:
    """One row: img/s from the median of ``steps`` synchronized steps after ``warmup``, compile time, memory."""
    peak_before = peak_device_bytes()
    run = build(config, devices)
    state = run.init_state()
    start = time.perf_counter()
    step = run.compile_step(state)  # one compile: timed and read for its memory
    compile_s = time.perf_counter() - start
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (config.batch_size, config.data.input_size, config.data.input_size, 3), np.uint8)
    labels = rng.integers(0, config.num_classes, config.batch_size).astype(np.int32)
    sharding = batch_sharding(run.mesh)
    fixed = device_batch((images, labels), sharding)
    batches = None
    if pipeline_root:
        source = MXFaceDataset(pipeline_root)
        batches = HostBatches(source, global_batch=config.batch_size, rows=(0, config.batch_size),
                              size=config.data.input_size, seed=0, threads=16)
    next_batch = (lambda: device_batch(next(batches), sharding)) if batches else (lambda: fixed)
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        state, metrics = step(state, *next_batch())
        jax.block_until_ready(metrics)  # one program: its outputs are ready when the whole step is done
        if i >= warmup:
            times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    return {"model": config.model, "batch": config.batch_size, "classes": config.num_classes,
            "sample_rate": config.sample_rate, "precision": config.precision, "bn_sync": config.bn_sync,
            "input": "pipeline" if pipeline_root else "on device", "img_per_s": config.batch_size / seconds,
            "ms_per_step": 1e3 * seconds, "timing": f"median of {steps} synchronized steps after {warmup} warm-up",
            "compile_s": compile_s, "peak_bytes": peak_device_bytes(peak_before), **compiled_memory(step),
            "loss": float(metrics["loss"])}


class Block(nn.Module):
    """insightface's IBasicBlock: BN, conv3×3, BN, PReLU, conv3×3 (stride), BN, plus the (projected) input."""

    width: int
    stride: int

    @nn.compact
    def __call__(self, x):
        bn = lambda y: nn.BatchNorm(use_running_average=False, epsilon=1e-5, dtype=jnp.bfloat16)(y)
        conv = lambda y, s: nn.Conv(self.width, (3, 3), s, padding=1, use_bias=False, dtype=jnp.bfloat16)(y)
        y = bn(conv(nn.PReLU(param_dtype=jnp.float32)(bn(conv(bn(x), 1))), self.stride))
        if self.stride != 1 or x.shape[-1] != self.width:
            x = bn(nn.Conv(self.width, (1, 1), self.stride, use_bias=False, dtype=jnp.bfloat16)(x))
        return x + y


class PlainIResNet(nn.Module):
    """The plain Flax step's backbone: a linen IResNet in bfloat16 with float32 parameters."""

    stages: tuple = (3, 4, 14, 3)
    base: int = 64
    features: int = 512

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(self.base, (3, 3), padding=1, use_bias=False, dtype=jnp.bfloat16)(x.astype(jnp.bfloat16))
        x = nn.PReLU(param_dtype=jnp.float32)(nn.BatchNorm(use_running_average=False, dtype=jnp.bfloat16)(x))
        for stage, blocks in enumerate(self.stages):
            for i in range(blocks):
                x = Block(self.base * 2**stage, 2 if i == 0 else 1)(x)
        x = nn.BatchNorm(use_running_average=False, dtype=jnp.bfloat16)(x).reshape(x.shape[0], -1)
        x = nn.Dense(self.features, dtype=jnp.bfloat16)(x)
        return nn.BatchNorm(use_running_average=False, use_scale=False)(x.astype(jnp.float32))


def plain_model(small: bool) -> PlainIResNet:
    """IResNet-50, or for the benchmarks' ``--small`` modes ``config.small_r18()`` with 32-d embeddings."""
    if not small:
        return PlainIResNet()
    kwargs = small_r18()
    return PlainIResNet(tuple(kwargs["stages"]), kwargs["width"], 32)


def plain_step(model: PlainIResNet, rows: int):
    """The plain Flax step that jaxcls's step is measured against (docs/benchmarks.md, "plain Flax"): ``model``, a
    dense normalised FC of ``rows`` rows (all in every step) with a CosFace margin and softmax cross-entropy, SGD
    with momentum. Returns the step ``(trainable, stats, momenta), images, labels → same, loss`` and its
    ``init(key, images) → state``."""
    optimizer = optax.sgd(0.1, momentum=0.9)

    def init(key, images):
        variables = model.init(key, images)
        trainable = {"params": variables["params"],
                     "fc": 0.01 * jax.random.normal(jax.random.fold_in(key, 1), (rows, model.features))}
        return trainable, variables["batch_stats"], optimizer.init(trainable)

    def step(state, images, labels):
        trainable, stats, opt = state

        def loss_fn(trainable):
            embeddings, new = model.apply({"params": trainable["params"], "batch_stats": stats}, images,
                                          mutable=["batch_stats"])
            e = embeddings / jnp.linalg.norm(embeddings, axis=1, keepdims=True)
            w = trainable["fc"] / jnp.linalg.norm(trainable["fc"], axis=1, keepdims=True)
            logits = (e.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16).T).astype(jnp.float32)
            logits = 64.0 * (logits - 0.4 * jax.nn.one_hot(labels, rows))
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), new["batch_stats"]

        (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable)
        updates, opt = optimizer.update(grads, opt, trainable)
        return (optax.apply_updates(trainable, updates), stats, opt), loss

    return step, init


def plain_program(batch: int, size: int, rows: int, model: PlainIResNet, device):
    """The plain step compiled for ``device`` (one ``jax.jit`` with the state donated)."""
    step, init = plain_step(model, rows)
    images = jax.ShapeDtypeStruct((batch, size, size, 3), jnp.bfloat16)
    labels = jax.ShapeDtypeStruct((batch,), jnp.int32)
    state = jax.eval_shape(init, jax.random.key(0), images)
    placed = jax.sharding.SingleDeviceSharding(device)
    put = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=placed), tree)
    return jax.jit(step, donate_argnums=0).lower(put(state), put(images), put(labels)).compile()


class RowFailed(RuntimeError):
    """A row's process failed or ran past its time; the message ends with the end of its stderr."""


def in_fresh_process(function, *args, timeout: float | None = None) -> dict:
    """``function(*args)``, a row of JSON values, computed in a fresh Python process: its devices, peak memory and
    compiled programs are that row's alone, and a crash or an out-of-memory costs only that row. ``function``: a
    module-level function of a script or a module, loaded from its file there (the script's ``main`` guarded by
    ``__name__``); ``args``: JSON values. A failure, or ``timeout`` seconds passed, raises ``RowFailed``."""
    command = [sys.executable, "-c", "import sys; from jaxcls.bench import run_row; run_row(*sys.argv[1:])",
               inspect.getfile(function), function.__name__, json.dumps(args)]
    call = f"{function.__name__}{args}"
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RowFailed(f"{call} ran past {timeout} s") from None
    if done.returncode:
        raise RowFailed(f"{call} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_row(path: str, name: str, args: str) -> None:
    """The fresh process of ``in_fresh_process``: the function ``name`` of the file ``path`` called with the JSON
    list ``args``, its row printed as JSON on the last line."""
    spec = importlib.util.spec_from_file_location("jaxcls_bench_row", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    print(json.dumps(getattr(module, name)(*json.loads(args))))
