"""Full train-step throughput: img/s and peak memory of the jitted step (backbone + sharded FC + updates).

    python benchmarks/train.py                 # GPU grid: r50/r100 at batch 128/256/512, mbf at 512; 1M classes,
                                               # PartialFC 0.1, bf16; data already on the device
    python benchmarks/train.py --pipeline DIR  # the same step fed by the RecordIO pipeline from DIR
    python benchmarks/train.py --small         # r18 (width 8) at 32×32 on 8 CPU devices; what the tests run
    python benchmarks/train.py --cpu --bn_sync both --steps 5   # r50 at 112×112, batch 16, float32 on 8 CPU
                                               # devices, BatchNorm statistics per device and over the global batch

Extra ``--set key=value`` pairs override config keys (e.g. ``--set chunk_size=65536``).

Timing is arcface_torch_bench.py's: each step synchronized (its outputs ready before the next is dispatched), the
median of ``--steps`` (default 40) after ``--warmup`` (default 15) steps; img/s is the batch over that median.
Synchronizing each step forgoes the overlap of dispatch with the previous step's work that a JAX training loop has,
so it can only understate jaxcls's throughput. Each row's ``timing`` says how it was timed.
"""

from __future__ import annotations

import argparse
import ast
import itertools
import statistics
import sys
import time

if "--small" in sys.argv or "--cpu" in sys.argv:
    from common import force_cpu_devices

    force_cpu_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from common import compiled_memory, peak_device_bytes, print_table, select, write_json  # noqa: E402

from jaxcls.config import base_config  # noqa: E402
from jaxcls.data.pipeline import HostBatches, device_batch  # noqa: E402
from jaxcls.data.recordio import MXFaceDataset  # noqa: E402
from jaxcls.mesh import batch_sharding  # noqa: E402
from jaxcls.run import build  # noqa: E402


def step_config(model, batch, num_classes, sample_rate, precision, size, overrides=()):
    c = base_config()
    c.data.kind, c.data.input_size = "synthetic", size
    c.model, c.model_kwargs, c.num_features = model, {}, 512
    c.num_classes, c.sample_rate, c.precision, c.batch_size = num_classes, sample_rate, precision, batch
    c.margin = dict(name="arcface", s=64.0, m=0.5, straight_through=False)
    c.total_steps, c.warmup_steps = 10**6, 10
    for item in overrides:
        key, value = item.split("=", 1)
        try:  # True, 65536, 0.1, "r50" as Python reads them (bool("False") would be True)
            c[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            c[key] = value
    return c


def measure(config, steps, pipeline_root=None, warmup=15, devices=None):
    """One row: img/s from the median of ``steps`` synchronized steps after ``warmup``, compile time, memory."""
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
            "compile_s": compile_s, "peak_bytes": peak_device_bytes(), **compiled_memory(step),
            "loss": float(metrics["loss"])}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--cpu", action="store_true", help="r50 at 112×112, batch 16, float32 on 8 CPU devices")
    parser.add_argument("--bn_sync", choices=["off", "on", "both"], default="off",
                        help="BatchNorm statistics per device (off), over the global batch (on), or a row of each")
    parser.add_argument("--pipeline", default=None, help="RecordIO folder to feed the step from")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 40; --small 2, --cpu 5)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 15; --small 1, --cpu 2)")
    parser.add_argument("--only", action="append", default=[], help="KEY=VALUE: grid rows whose KEY (model, batch, "
                        "classes, sample_rate, precision) is VALUE")
    parser.add_argument("--set", action="append", default=[], help="config override key=value")
    parser.add_argument("--out", default="benchmarks/results/train.json")
    args = parser.parse_args()
    if args.small:
        grid, steps, warmup = [("r18", 32, 1000, 0.1, "float32", 32)], 2, 1
    elif args.cpu:
        grid, steps, warmup = [("r50", 16, 1000, 1.0, "float32", 112)], 5, 2
    else:
        grid = [(m, b, 1_000_000, 0.1, "bfloat16", 112) for m in ("r50", "r100") for b in (128, 256, 512)]
        grid += [("mbf", 512, 1_000_000, 0.1, "bfloat16", 112)]
        steps, warmup = 40, 15
    grid = select(grid, ["model", "batch", "classes", "sample_rate", "precision"], args.only)
    steps, warmup = args.steps or steps, warmup if args.warmup is None else args.warmup
    syncs = {"off": [False], "on": [True], "both": [False, True]}[args.bn_sync]
    rows = []
    for (model, batch, classes, rate, precision, size), bn_sync in itertools.product(grid, syncs):
        config = step_config(model, batch, classes, rate, precision, size, args.set)
        config.bn_sync = bn_sync
        if args.small:  # a narrow model that a CPU steps through in a second
            config.model_kwargs = dict(width=8)
            config.num_features = 32
        rows.append(measure(config, steps, args.pipeline, warmup))
    print_table(rows, ["model", "batch", "classes", "sample_rate", "precision", "bn_sync", "input", "img_per_s",
                       "ms_per_step", "compile_s", "peak_bytes", "temp_bytes"])
    write_json(args.out, rows)


if __name__ == "__main__":
    main()
