"""Bytes that cross hosts in one train step, read from the compiled HLO of the real step, for each FC layout.

    python benchmarks/cross_host.py          # r50, 1M classes, batch 128 per GPU, 4 hosts × 8 GPUs
    python benchmarks/cross_host.py --small  # r18 (width 8), 64 classes, 2 hosts × 4 devices; what the tests run

Nothing runs: the step is compiled for ``hosts × per_host`` simulated CPU devices (the collectives are the
partitioner's, the same on every backend; GPUs only combine small ones), and device ``i`` of the mesh is
placed on host ``i // per_host``, as ``jax.make_mesh`` orders the devices of a multi-host job. Bytes per host
follow ``jaxcls.plan.hlo.cross_host_bytes``: what a host-aware algorithm must receive from other hosts, the largest
host's share. Layouts: the FC over every device with the class axis spanning the hosts (``mesh_data=1``), or
with ``mesh_data = hosts`` (the data axis across hosts, the class axis inside each); the FC over the class
axis only (``class_axes=class``), replicated once per host.
"""

from __future__ import annotations

import argparse
import collections

import jax

from jaxcls.bench import print_table, write_json
from jaxcls.config import benchmark_config
from jaxcls.mesh import class_shards
from jaxcls.models import one_off_compile_options
from jaxcls.plan.hlo import collectives, cross_host_bytes
from jaxcls.run import build
from jaxcls.startup import simulate_cpu_devices

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--small", action="store_true")
parser.add_argument("--hosts", type=int, default=None)
parser.add_argument("--per_host", type=int, default=None)
parser.add_argument("--out", default="benchmarks/results/cross_host.json")
ARGS = parser.parse_args()
HOSTS = ARGS.hosts or (2 if ARGS.small else 4)
PER_HOST = ARGS.per_host or (4 if ARGS.small else 8)
# (class_axes, mesh_data); --small skips the second, whose collectives equal the first's
LAYOUTS = [("data,class", 1), ("data,class", HOSTS), ("class", HOSTS)][::2 if ARGS.small else 1]


def measure(class_axes: str, mesh_data: int) -> dict:
    config = benchmark_config(small=ARGS.small, class_axes=class_axes, mesh_data=mesh_data, sample_rate=1.0,
                              num_classes=64 if ARGS.small else 1_000_000,
                              batch_size=(4 if ARGS.small else 128) * HOSTS * PER_HOST)
    if ARGS.small:
        config.data.input_size = 16  # compiled only, never run
    run = build(config, jax.devices()[:HOSTS * PER_HOST])
    compiled = run.compile_step(run.abstract_state, one_off_compile_options("cpu"))
    hosts = [d.id // PER_HOST for d in run.mesh.devices.flat]
    by_op, per_host = collections.Counter(), [0] * HOSTS
    found = collectives(compiled.as_text())
    for c in found:  # an instruction inside the FC's tile loop runs once per tile
        received = [c.count * b for b in cross_host_bytes(c, hosts)]
        per_host = [a + b for a, b in zip(per_host, received)]
        by_op[c.op] += max(received)
    shards = class_shards(run.mesh, run.train_step.head.class_axes)
    mb = lambda b: b / 2**20
    return {"class_axes": class_axes, "mesh": f"data={run.mesh.shape['data']} × class={run.mesh.shape['class']}",
            "hosts": HOSTS, "per_host": PER_HOST, "model": config.model, "classes": config.num_classes,
            "batch_per_device": config.batch_size // run.mesh.size,
            "fc_rows_per_device": run.train_step.head.rows // shards,
            "collectives": sum(c.count for c in found),
            "all_reduce_MB": mb(by_op["all-reduce"]), "all_gather_MB": mb(by_op["all-gather"]),
            "reduce_scatter_MB": mb(by_op["reduce-scatter"]),
            "other_MB": mb(by_op["all-to-all"] + by_op["collective-permute"]),
            "cross_host_MB_per_host": mb(max(per_host)),
            "collective_MB_per_device": mb(sum(c.count * c.result_bytes for c in found))}


def main():
    simulate_cpu_devices(HOSTS * PER_HOST)
    rows = [measure(*layout) for layout in LAYOUTS]
    print_table(rows, ["class_axes", "mesh", "fc_rows_per_device", "collectives", "all_reduce_MB", "all_gather_MB",
                       "reduce_scatter_MB", "other_MB", "cross_host_MB_per_host", "collective_MB_per_device"])
    write_json(ARGS.out, rows)


if __name__ == "__main__":
    main()
