"""XLA:GPU's bytes per device for the face recipes on H100s, compiled here without a GPU (``jaxcls.plan.gpu_target``).

Each row compiles the real train step (112×112, 512-d ArcFace, bfloat16 compute, SGD with momentum) at 1M and 2M FC
rows per GPU (at PartialFC 0.1, 1.3M and 2.6M: enough that it samples whole tiles); bytes per device are affine in
the class count, so the two give the fixed bytes, the bytes per class
and the largest class count at JAX's default 75% of the GPU and at 95% (``--config.mem_fraction=0.95``).
``python -m jaxcls.plan --target h100 --max-classes`` confirms one such count with a third compile.

    python benchmarks/gpu_plan.py                      # the whole grid: 64 rows, 1–5 min each on 2 CPU cores
    python benchmarks/gpu_plan.py --only model=r50     # the rows of one model (or batch=, fc_dtype=, rate=, gpus=)
    python benchmarks/gpu_plan.py --small              # a narrow r18 on one GPU: what the tests run
    python benchmarks/gpu_plan.py --fc_state_dtype int8  # the FC momentum in one byte and a scale per row
    python benchmarks/gpu_plan.py --fc-kernels pallas_update  # the FC path in another form (jaxcls.bench.FC_KERNELS)

Batch sizes are per GPU (arcface_torch's convention): the global batch is ``batch × gpus``. Each row runs in a
fresh process. Needs JAX's CUDA plugin (``pip install -e '.[plan-gpu]'``).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only GPUs: no CUDA driver is needed, none is started

from jaxcls.bench import (FC_KERNELS, FC_KERNELS_HELP, RowFailed, fc_kernels, in_fresh_process, print_table,  # noqa: E402
                          select, write_json)
from jaxcls.config import benchmark_config  # noqa: E402
from jaxcls.mesh import class_shards  # noqa: E402
from jaxcls.plan import gpu_target  # noqa: E402
from jaxcls.plan.memory import fit_classes, probe_rows  # noqa: E402
from jaxcls.plan.planner import compile_step_memory, target_devices  # noqa: E402
from jaxcls.run import build  # noqa: E402

GRID = list(itertools.product(("r50", "r100", "mbf", "vit_t"), (128, 512), ("float32", "bfloat16"), (1.0, 0.1),
                              (1, 8)))
COLUMNS = ["model", "batch", "fc_dtype", "fc_state_dtype", "rate", "gpus", "fixed_GiB", "bytes_per_class",
           "max_classes_75", "max_classes_95", "compile_s"]


def row(spec, target, small, fc_state_dtype, form=None) -> dict:
    """One spec of the grid, in its own process: the fixed bytes and bytes per class from two compiles, the FC path's
    kernels as ``--fc-kernels form`` picks them (None: the platform's)."""
    model, batch, fc_dtype, rate, gpus = spec
    devices = target_devices(target, gpus)
    config = benchmark_config(small=small, model=model, batch_size=batch * gpus, sample_rate=rate, fc_dtype=fc_dtype,
                              fc_state_dtype=fc_state_dtype, precision="bfloat16")  # bfloat16 when --small too
    start = time.perf_counter()

    compiled, cublas = {}, {}

    def memory_at(classes):
        with fc_kernels(form):
            _, compiled[classes], cublas[classes] = compile_step_memory(config, devices, target, classes)
        return compiled[classes]

    head = build(config, devices, with_data=False).train_step.head
    shards = class_shards(head.mesh, head.class_axes)
    rows = probe_rows(config.chunk_size, rate)
    fixed, per_class = fit_classes(memory_at, (shards * rows, shards * 2 * rows))
    memory = gpu_target.device_memory(target)
    fits = {share: int((memory * share / 100 - fixed) / per_class) // shards * shards for share in (75, 95)}
    return {"model": model, "batch": batch, "fc_dtype": fc_dtype, "fc_state_dtype": fc_state_dtype, "rate": rate,
            "gpus": gpus, "fc_kernels": form or "platform",
            "fixed_GiB": fixed / 2**30, "bytes_per_class": per_class, "max_classes_75": fits[75],
            "max_classes_95": fits[95], "compile_s": (time.perf_counter() - start) / 2, "target": target,
            "parts_at_2_rows": compiled[shards * 2 * rows].parts, "cublas_gemms": any(cublas.values())}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="h100")
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--only", action="append", default=[], help="KEY=VALUE: rows whose KEY is VALUE")
    parser.add_argument("--fc_state_dtype", default="same", help="the FC optimizer state's storage (config key)")
    parser.add_argument("--fc-kernels", choices=FC_KERNELS, default=None, help=FC_KERNELS_HELP)
    parser.add_argument("--out", default="benchmarks/results/gpu_plan.json")
    args = parser.parse_args()
    grid = [("r18", 32, "bfloat16", 0.5, 1)] if args.small else GRID
    grid = select(grid, ["model", "batch", "fc_dtype", "rate", "gpus"], args.only)
    rows = []
    for spec in grid:
        try:
            rows.append(in_fresh_process(row, spec, args.target, args.small, args.fc_state_dtype, args.fc_kernels))
        except RowFailed as failed:
            sys.exit(str(failed))
        print_table(rows[-1:], COLUMNS)
    print_table(rows, COLUMNS)
    write_json(args.out, rows)


if __name__ == "__main__":
    main()
