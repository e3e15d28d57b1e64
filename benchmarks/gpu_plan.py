"""XLA:GPU's bytes per device for the face recipes on H100s, compiled here without a GPU (``jaxcls.gpu_target``).

Each row compiles the real train step (112×112, 512-d ArcFace, bfloat16 compute, SGD with momentum) at 1M and 2M FC
rows per GPU (at PartialFC 0.1, 1.3M and 2.6M: enough that it samples whole tiles); bytes per device are affine in
the class count, so the two give the fixed bytes, the bytes per class
and the largest class count at JAX's default 75% of the GPU and at 95% (``--config.mem_fraction=0.95``).
``python -m jaxcls.plan --target h100 --max-classes`` confirms one such count with a third compile.

    python benchmarks/gpu_plan.py                      # the whole grid: 64 rows, 1–5 min each on 2 CPU cores
    python benchmarks/gpu_plan.py --only model=r50     # the rows of one model (or batch=, fc_dtype=, rate=, gpus=)
    python benchmarks/gpu_plan.py --small              # a narrow r18 on one GPU: what the tests run
    python benchmarks/gpu_plan.py --fc_state_dtype int8  # the FC momentum in one byte and a scale per row

Batch sizes are per GPU (arcface_torch's convention): the global batch is ``batch × gpus``. Each row runs in a
fresh process. Needs JAX's CUDA plugin (``pip install -e '.[plan-gpu]'``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only GPUs: no CUDA driver is needed, none is started

from common import print_table, select, write_json  # noqa: E402

GRID = list(itertools.product(("r50", "r100", "mbf", "vit_t"), (128, 512), ("float32", "bfloat16"), (1.0, 0.1),
                              (1, 8)))
COLUMNS = ["model", "batch", "fc_dtype", "fc_state_dtype", "rate", "gpus", "fixed_GiB", "bytes_per_class",
           "max_classes_75", "max_classes_95", "compile_s"]


def step_config(model, batch, fc_dtype, rate, gpus, small, fc_state_dtype):
    from jaxcls.config import face_config

    c = face_config(root="/not/read", num_classes=10**6, num_images=10**7, epochs=1, model=model, batch=batch * gpus,
                    sample_rate=rate)
    c.data.kind, c.fc_dtype, c.fc_state_dtype = "synthetic", fc_dtype, fc_state_dtype
    if small:
        c.data.input_size, c.model_kwargs, c.num_features = 32, dict(width=8), 32
    return c


def row(spec, target, small, fc_state_dtype) -> dict:
    from jaxcls import gpu_target
    from jaxcls.memory import fit_classes, probe_rows
    from jaxcls.mesh import class_shards
    from jaxcls.plan import compiled_memory, target_devices
    from jaxcls.run import build

    model, batch, fc_dtype, rate, gpus = spec
    devices, config = target_devices(target, gpus), step_config(*spec, small, fc_state_dtype)
    start = time.perf_counter()

    compiled, cublas = {}, {}

    def memory_at(classes):
        _, compiled[classes], cublas[classes] = compiled_memory(config, devices, target, classes)
        return compiled[classes]

    head = build(config, devices, with_data=False).trainer.head
    shards = class_shards(head.mesh, head.class_axes)
    rows = probe_rows(config.chunk_size, rate)
    fixed, per_class = fit_classes(memory_at, (shards * rows, shards * 2 * rows))
    memory = gpu_target.device_memory(target)
    fits = {share: int((memory * share / 100 - fixed) / per_class) // shards * shards for share in (75, 95)}
    return {"model": model, "batch": batch, "fc_dtype": fc_dtype, "fc_state_dtype": fc_state_dtype, "rate": rate,
            "gpus": gpus,
            "fixed_GiB": fixed / 2**30, "bytes_per_class": per_class, "max_classes_75": fits[75],
            "max_classes_95": fits[95], "compile_s": (time.perf_counter() - start) / 2, "target": target,
            "parts_at_2_rows": compiled[shards * 2 * rows].parts, "cublas_gemms": any(cublas.values())}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="h100")
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--only", action="append", default=[], help="KEY=VALUE: rows whose KEY is VALUE")
    parser.add_argument("--fc_state_dtype", default="same", help="the FC optimizer state's storage (config key)")
    parser.add_argument("--out", default="benchmarks/results/gpu_plan.json")
    parser.add_argument("--row", default=None, help=argparse.SUPPRESS)  # one row's spec as JSON, printed as JSON
    args = parser.parse_args()
    if args.row is not None:
        return print(json.dumps(row(tuple(json.loads(args.row)), args.target, args.small, args.fc_state_dtype)))
    grid = [("r18", 32, "bfloat16", 0.5, 1)] if args.small else GRID
    grid = select(grid, ["model", "batch", "fc_dtype", "rate", "gpus"], args.only)
    rows = []
    for spec in grid:
        cmd = [sys.executable, __file__, "--row", json.dumps(spec), "--target", args.target,
               "--fc_state_dtype", args.fc_state_dtype] + ["--small"] * args.small
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"row {spec} failed:\n{proc.stderr[-3000:]}")
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print_table(rows[-1:], COLUMNS)
    print_table(rows, COLUMNS)
    write_json(args.out, rows)


if __name__ == "__main__":
    main()
