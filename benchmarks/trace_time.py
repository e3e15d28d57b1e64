"""Host seconds to trace and to lower the train step, before XLA compiles anything: what every run, resume, plan and
benchmark row pays first. Traced for 8 simulated CPU devices, or for compile-only GPUs (``--target h100``).

    python benchmarks/trace_time.py                        # r50, mbf and vit_t at batch 128, 1M classes, 8 CPU devices
    python benchmarks/trace_time.py --target h100 --devices 1
    python benchmarks/trace_time.py --small                # a narrow r18: what the tests run

Each time is the median of ``--repeats`` traces, each of a freshly jitted step (JAX caches a function's trace); the
first of them is in ``trace_s_first`` and ``lower_s_first`` too (a process's first trace also fills JAX's caches of
the helpers it calls)."""

from __future__ import annotations

import argparse
import statistics
import time

from jaxcls.startup import simulate_cpu_devices

simulate_cpu_devices(8)

import jax  # noqa: E402

from jaxcls.bench import print_table, write_json  # noqa: E402
from jaxcls.config import benchmark_config  # noqa: E402
from jaxcls.run import build  # noqa: E402

COLUMNS = ["model", "batch", "classes", "target", "devices", "trace_s", "lower_s"]


def trace_row(config, devices, repeats: int) -> dict:
    run = build(config, devices, with_data=False)
    c, batch = run.config, run.abstract_batch()
    traces, lowers = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        traced = run.jit_step().trace(run.abstract_state, *batch)
        traced_at = time.perf_counter()
        traced.lower()
        traces.append(traced_at - start)
        lowers.append(time.perf_counter() - traced_at)
    return {"model": c.model, "batch": c.batch_size, "classes": c.num_classes, "precision": c.precision,
            "target": devices[0].device_kind, "devices": len(devices), "trace_s": statistics.median(traces),
            "lower_s": statistics.median(lowers), "trace_s_first": traces[0], "lower_s_first": lowers[0],
            "repeats": repeats}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="r50,mbf,vit_t")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--classes", type=int, default=1_000_000)
    parser.add_argument("--target", default="cpu", help="cpu (simulated devices) or a GPU target: h100, h200")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--out", default="benchmarks/results/trace_time.json")
    args = parser.parse_args()
    if args.target == "cpu":
        devices = jax.devices("cpu")[:args.devices]
    else:
        from jaxcls.plan import gpu_target
        devices = gpu_target.gpu_devices(args.target, args.devices)
    models = ["r18"] if args.small else args.models.split(",")
    rows = []
    for model in models:
        config = benchmark_config(small=args.small, model=model, batch_size=args.batch, num_classes=args.classes)
        rows.append(trace_row(config, devices, 1 if args.small else args.repeats))
        print_table(rows[-1:], COLUMNS)
    print_table(rows, COLUMNS)
    write_json(args.out, rows)


if __name__ == "__main__":
    main()
