"""The planner against a device: XLA:CPU's compiled bytes (what ``python -m jaxcls.plan`` reports) next to the
device backend's compiled bytes and the peak it really uses running the step, by part.

    python benchmarks/planner.py            # on a GPU: r50 / mbf, batch 128, 1M classes, PartialFC 0.1, bf16
    python benchmarks/planner.py --small    # CPU only (no device columns): a narrow r18; what the tests run

One device each (the planner's per-device numbers for more devices differ only by the FC rows per device); each
row runs in a fresh process, so that the device's peak is that row's alone.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import jax
from common import print_table, write_json
from train import measure

from jaxcls.config import face_config
from jaxcls.memory import step_memory
from jaxcls.run import build

GRID = [("r50", 128, 1_000_000, 0.1, "float32"), ("r50", 128, 1_000_000, 0.1, "bfloat16"),
        ("r50", 128, 8_000_000, 0.1, "bfloat16"), ("mbf", 512, 1_000_000, 0.1, "float32")]


def step_config(model, batch, classes, sample_rate, fc_dtype, small):
    c = face_config(root="/not/read", num_classes=classes, num_images=10**7, epochs=1, model=model,
                    batch=batch, sample_rate=sample_rate)
    c.data.kind, c.fc_dtype, c.warmup_steps = "synthetic", fc_dtype, 1
    if small:  # a narrow model that a CPU compiles and steps in seconds
        c.data.input_size, c.model_kwargs, c.num_features, c.precision = 32, dict(width=8), 32, "float32"
    return c


def row(config, on_device: bool) -> dict:
    cpu = step_memory(build(config, jax.devices("cpu")[:1], with_data=False))
    r = {"model": config.model, "batch": config.batch_size, "classes": config.num_classes,
         "sample_rate": config.sample_rate, "fc_dtype": config.fc_dtype, "planner_GiB": cpu.total / 2**30,
         "planner_parts": cpu.parts, "device_GiB": None, "device_parts": None, "peak_GiB": None}
    if on_device:
        device = step_memory(build(config, jax.devices()[:1], with_data=False))
        peak = measure(config, steps=2, warmup=1, devices=jax.devices()[:1])["peak_bytes"]
        r.update(device_GiB=device.total / 2**30, device_parts=device.parts,
                 peak_GiB=None if peak is None else peak / 2**30,
                 activations_ratio=cpu.parts["activations and temporaries"]
                 / device.parts["activations and temporaries"])
    return r


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--out", default="benchmarks/results/planner.json")
    parser.add_argument("--row", type=int, default=None, help=argparse.SUPPRESS)  # run one row, print it as JSON
    args = parser.parse_args()
    grid = [("r18", 32, 1000, 0.1, "float32")] if args.small else GRID
    if args.row is not None:
        return print(json.dumps(row(step_config(*grid[args.row], small=args.small),
                                    on_device=jax.default_backend() != "cpu")))
    rows = []
    for i in range(len(grid)):
        cmd = [sys.executable, __file__, "--row", str(i)] + ["--small"] * args.small
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    print_table(rows, ["model", "batch", "classes", "sample_rate", "fc_dtype", "planner_GiB", "device_GiB",
                       "peak_GiB", "activations_ratio"])
    write_json(args.out, rows)


if __name__ == "__main__":
    main()
