"""Will a config fit? ``python -m jaxcls.plan --config configs/<x>.py [--config.key=value] --devices 8
[--device-memory 80GiB] [--max-classes]``

Compiles the config's real train step for a mesh of ``--devices`` simulated CPU devices (the state and the batch
as ``jax.ShapeDtypeStruct``: nothing is allocated, no data is read) and prints the bytes per device by part, the
total against the memory JAX may use on the device, and a verdict. ``--max-classes`` reports the largest
``num_classes`` that fits (bytes are affine in the class count: two compiles and a solve, a third to confirm).

The FC, parameter, optimizer and input parts are array shapes: the same on every backend. Activations and
temporaries are what XLA:CPU's buffer assignment needs; ``cpu_caveats`` names where a GPU differs.
"""

from __future__ import annotations

import math
import os

import jax
from absl import flags

from jaxcls.config import define_config_flag
from jaxcls.memory import format_bytes, max_classes_that_fit, parse_bytes, step_memory
from jaxcls.mesh import class_shards
from jaxcls.reporting import configure_logging, run_cli
from jaxcls.run import build

DEFAULT_MEM_FRACTION = 0.75  # JAX's default share of a GPU (XLA_PYTHON_CLIENT_MEM_FRACTION)


def simulate_cpu_devices(count: int) -> None:
    """Run on ``count`` CPU devices; must happen before JAX initializes its backends."""
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""),
                                        f"--xla_force_host_platform_device_count={count}",
                                        "--xla_backend_optimization_level=0"])  # buffers only: skip LLVM work
    jax.config.update("jax_platforms", "cpu")
    if jax.device_count() < count:
        raise RuntimeError(f"JAX started with {jax.device_count()} CPU devices before the planner could ask for "
                           f"{count}: run the planner in a fresh process")


def usable_bytes(device_memory: int, fraction: float | None = None) -> int:
    """The share of ``device_memory`` JAX allocates from: ``$XLA_PYTHON_CLIENT_MEM_FRACTION`` (default 0.75)."""
    fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", DEFAULT_MEM_FRACTION)) \
        if fraction is None else fraction
    return int(device_memory * fraction)


def cpu_caveats(config, run) -> list[str]:
    """Where a GPU's compiled step is known to differ from XLA:CPU's numbers for this config."""
    notes = []
    if config.fc_dtype != "float32":
        rows = run.trainer.head.rows // class_shards(run.mesh, run.trainer.head.class_axes)
        notes.append(f"{config.fc_dtype} FC state: XLA:CPU copies the 16-bit FC arrays to update them (one or two "
                     f"arrays per step, measured: up to {format_bytes(2 * rows * config.num_features * 2)} of the "
                     "temporaries here); a GPU updates the rows in place (derived, not measured on a GPU)")
    if config.precision != "float32":
        notes.append(f"{config.precision} compute: XLA:CPU runs 16-bit convolutions in float32, so its activations "
                     "are about float32-sized (r50: 13 GiB per 128 images); a GPU keeps 16-bit activations and "
                     "fuses more, so the GPU's activations are smaller (benchmarks/planner.py measures the "
                     "ratio on a GPU; docs/benchmarks.md)")
    return notes


def verdict(total: int, usable: int, device_memory: int) -> str:
    if total <= usable:
        return f"fits: {format_bytes(total)} of {format_bytes(usable)} usable ({format_bytes(usable - total)} spare)"
    if total <= device_memory * 0.95:
        return (f"does not fit in JAX's default share ({format_bytes(usable)}); it would with "
                f"XLA_PYTHON_CLIENT_MEM_FRACTION={min(0.95, total / device_memory + 0.02):.2f}")
    return f"does not fit: {format_bytes(total)} > {format_bytes(usable)} usable"


def plan(config, devices: int, device_memory: int, max_classes: bool = False) -> list[str]:
    """The planner's report as lines (``jax`` must already have ``devices`` CPU devices)."""

    def build_run(num_classes=None):
        c = config.copy_and_resolve_references()
        c.num_classes = config.num_classes if num_classes is None else num_classes
        return build(c, jax.devices()[:devices], with_data=False)

    run, usable = build_run(), usable_bytes(device_memory)
    memory = step_memory(run)
    lines = [*run.summary()[:3], f"compiled by XLA:CPU for {devices} simulated devices; bytes per device:",
             *memory.table(), f"device memory {format_bytes(device_memory)}; JAX allocates "
             f"{usable / device_memory:.0%} of it ({format_bytes(usable)}, XLA_PYTHON_CLIENT_MEM_FRACTION)",
             "verdict: " + verdict(memory.total, usable, device_memory)]
    if max_classes:
        shards = class_shards(run.mesh, run.trainer.head.class_axes)
        rows = max(2**20, math.ceil(2 * config.chunk_size / config.sample_rate))  # PartialFC samples full tiles
        classes, best = max_classes_that_fit(lambda c: step_memory(build_run(c)), usable, shards, rows)
        lines.append(f"largest num_classes that fits: {classes:,} ({format_bytes(best.total)} per device, "
                     f"{classes // shards:,} FC rows per device)")
    return lines + [f"note: {n}" for n in cpu_caveats(config, run)]


def main(argv):
    if len(argv) > 1:
        raise ValueError(f"unexpected arguments {argv[1:]}")
    f = flags.FLAGS
    if f["devices"].value < 1:
        raise ValueError(f"--devices must be >= 1, got {f['devices'].value}")
    device_memory = parse_bytes(f["device-memory"].value)
    configure_logging(verbose=f["verbosity"].present)
    simulate_cpu_devices(f["devices"].value)
    lines = plan(f.config, f["devices"].value, device_memory, f["max-classes"].value)
    print("\n".join(lines))


def define_flags():
    define_config_flag()
    flags.DEFINE_integer("devices", 8, "devices the run will have (simulated here as CPU devices)")
    flags.DEFINE_string("device-memory", "80GiB", "memory of one device, e.g. 80GiB, 24GB, 40GiB")
    flags.DEFINE_bool("max-classes", False, "also find the largest num_classes that fits")


if __name__ == "__main__":
    define_flags()
    run_cli(main)
