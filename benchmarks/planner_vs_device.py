"""The planner against a device: XLA:CPU's compiled bytes (what ``python -m jaxcls.plan`` reports) next to the
device backend's compiled bytes and the peak it really uses running the step, by part.

    python benchmarks/planner_vs_device.py          # on a GPU: r50 / mbf, batch 128, 1M classes, PartialFC 0.1, bf16
    python benchmarks/planner_vs_device.py --small  # CPU only (no device columns): a narrow r18; what the tests run

One device each (the planner's per-device numbers for more devices differ only by the FC rows per device); each
row runs in a fresh process, so that the device's peak is that row's alone.
"""

from __future__ import annotations

import argparse

import jax

from jaxcls.bench import in_fresh_process, print_table, time_train_step, write_json
from jaxcls.config import benchmark_config
from jaxcls.plan.memory import step_memory
from jaxcls.run import build

GRID = [("r50", 128, 1_000_000, 0.1, "float32"), ("r50", 128, 1_000_000, 0.1, "bfloat16"),
        ("r50", 128, 8_000_000, 0.1, "bfloat16"), ("mbf", 512, 1_000_000, 0.1, "float32")]


def row(spec, small: bool) -> dict:
    """One spec of the grid: the planner's bytes and, where JAX's default backend is not the CPU, the device's."""
    model, batch, classes, sample_rate, fc_dtype = spec
    config = benchmark_config(small=small, model=model, batch_size=batch, num_classes=classes,
                              sample_rate=sample_rate, fc_dtype=fc_dtype)
    cpu = step_memory(build(config, jax.devices("cpu")[:1], with_data=False))
    r = {"model": config.model, "batch": config.batch_size, "classes": config.num_classes,
         "sample_rate": config.sample_rate, "fc_dtype": config.fc_dtype, "planner_GiB": cpu.total / 2**30,
         "planner_parts": cpu.parts, "device_GiB": None, "device_parts": None, "peak_GiB": None}
    if jax.default_backend() != "cpu":
        device = step_memory(build(config, jax.devices()[:1], with_data=False))
        peak = time_train_step(config, steps=2, warmup=1, devices=jax.devices()[:1])["peak_bytes"]
        r.update(device_GiB=device.total / 2**30, device_parts=device.parts,
                 peak_GiB=None if peak is None else peak / 2**30,
                 activations_ratio=cpu.parts["activations and temporaries"]
                 / device.parts["activations and temporaries"])
    return r


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--out", default="benchmarks/results/planner_vs_device.json")
    args = parser.parse_args()
    grid = [("r18", 32, 1000, 0.1, "float32")] if args.small else GRID
    rows = [in_fresh_process(row, spec, args.small) for spec in grid]
    print_table(rows, ["model", "batch", "classes", "sample_rate", "fc_dtype", "planner_GiB", "device_GiB",
                       "peak_GiB", "activations_ratio"])
    write_json(args.out, rows)


if __name__ == "__main__":
    main()
