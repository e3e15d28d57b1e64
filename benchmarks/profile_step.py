"""Where a train step's device time goes: jaxcls's step and the plain Flax step (``jaxcls.bench.plain_step``, the
same batch and as many FC rows as PartialFC samples) run under JAX's profiler, their kernels summed by kind and by
the HLO op that launched them.

    python benchmarks/profile_step.py                      # on a GPU: r50, batch 128, 1M classes, PartialFC 0.1, bf16
    python benchmarks/profile_step.py --batch 512 --set fc_dtype=bfloat16
    python benchmarks/profile_step.py --model mbf --batch 512   # jaxcls alone: the plain step is an IResNet-50
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python benchmarks/profile_step.py --classes 36925351 --set fc_dtype=bfloat16 \
        --jaxcls-only                                      # the FC path at its largest, jaxcls alone
    python benchmarks/profile_step.py --small              # r18 (width 8) at 32 px on the CPU; what the tests run

XLA's command buffers are turned off (each kernel then names its HLO op; the step ran 1% faster with them on an H100).
Per program: wall ms per step (median), device ms per step (kernel time summed over every stream, per step), and
per kind (convolution, GEMM, fusion, collective, copy/transpose, sort, other) its ms per step; then the ``--top`` HLO
ops by device time, each with the JAX operation and source line it came from (the HLO's metadata). On a CPU the
"kernels" are XLA:CPU's thunks, timed on host threads.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.profiler import ProfileData

from jaxcls.bench import CONFIG_KEY, plain_model, plain_step, print_table, write_json
from jaxcls.config import benchmark_config
from jaxcls.plan.kernels import origins
from jaxcls.run import build
from jaxcls.startup import simulate_cpu_devices

KINDS = ("convolution", "GEMM", "fusion", "collective", "copy/transpose", "sort", "other")
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def kind_of(op: str, kernel: str) -> str:
    """The kind of a kernel launched by HLO op ``op`` (XLA's instruction name) under the name ``kernel``."""
    op, kernel = op.lower(), kernel.lower()
    if "convolution" in op or "cudnn" in op:
        return "convolution"
    if any(w in op for w in ("gemm", "dot", "cublas")) or "gemm" in kernel:
        return "GEMM"
    if any(op.startswith(c) for c in COLLECTIVES) or "nccl" in kernel:
        return "collective"
    if op.startswith(("copy", "transpose")) or "transpose" in op:
        return "copy/transpose"
    if "sort" in op or "sort" in kernel:
        return "sort"
    return "fusion" if "fusion" in op else "other"


def kernel_times(trace_dir: str) -> collections.Counter:
    """``(hlo_op, kernel) → ns`` over the trace: device streams where there are any, else host threads."""
    (path,) = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    planes = list(ProfileData.from_file(path).planes)
    devices = [p for p in planes if p.name.startswith("/device:")]
    lines = [l for p in devices for l in p.lines if l.name.startswith("Stream")]
    if not lines:
        lines = [l for p in planes if p.name.startswith("/host:") for l in p.lines]
    times = collections.Counter()
    for line in lines:
        for event in line.events:
            stats = dict(event.stats)
            if "hlo_op" in stats:
                times[(stats["hlo_op"], event.name)] += event.duration_ns
    return times


def source_file(origin: str) -> str:
    """The file of an HLO op's JAX origin (``…/reduce_and (precision.py:100)`` → ``precision.py``); ``?`` without."""
    match = re.search(r"\(([^():]+\.py):\d+\)$", origin)
    return match.group(1) if match else "?"


def profile(step, state, batch, steps: int) -> tuple[dict, list]:
    """Run the compiled ``step(state, *batch) → (state, out)``: wall ms per step, then ``steps`` steps under the
    profiler; the HLO ops by device time with their JAX origin."""
    origin = origins(step.as_text())
    for _ in range(3):
        state, out = step(state, *batch)
    jax.block_until_ready(out)
    walls = []
    for _ in range(steps):
        start = time.perf_counter()
        state, out = step(state, *batch)
        jax.block_until_ready(out)
        walls.append(1e3 * (time.perf_counter() - start))
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(steps):
                state, out = step(state, *batch)
            jax.block_until_ready(out)
        times = kernel_times(trace_dir)
    per_kind, ops = collections.Counter(), collections.Counter()
    for (op, kernel), ns in times.items():
        per_kind[kind_of(op, kernel)] += ns / steps / 1e6
        ops[op] += ns / steps / 1e6
    by_source, ops_by_source = collections.Counter(), collections.Counter()  # e.g. precision.py: the skip's checks
    for op, ms in ops.items():
        source = source_file(origin.get(op, ""))
        by_source[source] += ms
        ops_by_source[source] += 1
    row = {"wall_ms": statistics.median(walls), "device_ms": sum(per_kind.values()),
           **{f"{k}_ms": per_kind[k] for k in KINDS}, "ms_by_source": dict(by_source.most_common()),
           "ops_by_source": {f: ops_by_source[f] for f, _ in by_source.most_common()}}
    return row, [(op, ms, origin.get(op, "")) for op, ms in ops.most_common()]


def main():
    # XLA:GPU batches kernels into command buffers (CUDA graphs), which the profiler shows as one op each: off, so
    # that every kernel names its HLO op (XLA reads its flags when JAX starts its backends)
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer="
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--model", default="r50")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--classes", type=int, default=1_000_000)
    parser.add_argument("--sample_rate", type=float, default=0.1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--set", action="append", default=[], help=CONFIG_KEY)
    parser.add_argument("--jaxcls-only", action="store_true", help="without the plain Flax step (at tens of millions "
                        "of classes its dense rows do not fit beside jaxcls's FC)")
    parser.add_argument("--out", default="benchmarks/results/profile_step.json")
    args = parser.parse_args()
    if args.small:
        simulate_cpu_devices(1)
        args.model, args.batch, args.classes, args.steps, args.top = "r18", 16, 1000, 2, 10
    config = benchmark_config(small=args.small, overrides=args.set, model=args.model, batch_size=args.batch,
                              num_classes=args.classes, sample_rate=args.sample_rate)
    size = config.data.input_size
    rng = np.random.default_rng(0)
    labels = rng.integers(0, config.num_classes, args.batch).astype(np.int32)
    run = build(config, jax.devices()[:1])
    state = run.init_state()
    images = rng.integers(0, 256, (args.batch, size, size, 3), np.uint8)
    ours, our_ops = profile(run.compile_step(state), state, (jnp.asarray(images), jnp.asarray(labels)), args.steps)

    table, tops = [dict(ours, program="jaxcls")], {"jaxcls": our_ops}
    if (args.model == "r50" or args.small) and not args.jaxcls_only:  # the plain step is an IResNet-50 (or narrow)
        rows = max(1, round(config.num_classes * config.sample_rate))
        step, init = plain_step(plain_model(args.small), rows)
        plain_images = jnp.asarray(images / 127.5 - 1.0, jnp.bfloat16)
        plain_state = jax.jit(init)(jax.random.key(0), plain_images)
        plain_batch = (plain_images, jnp.asarray(labels % rows))
        compiled = jax.jit(step, donate_argnums=0).lower(plain_state, *plain_batch).compile()
        plain, tops["plain Flax"] = profile(compiled, plain_state, plain_batch, args.steps)
        table.append(dict(plain, program=f"plain Flax, {rows:,} dense rows"))
    for name, ops in tops.items():
        print(f"\n{name}: the {args.top} HLO ops with the most device time (ms per step)")
        print_table([{"op": op, "ms": ms, "origin": origin[-90:]} for op, ms, origin in ops[:args.top]],
                    ["op", "ms", "origin"])
    for row in table:
        print(f"\n{row['program']}: device time by source file (ms per step, HLO ops timed)")
        print_table([{"source": f, "ms": ms, "ops": row["ops_by_source"][f]}
                     for f, ms in list(row["ms_by_source"].items())[:args.top]], ["source", "ms", "ops"])
    print(f"\n{args.model}, batch {args.batch}, {config.num_classes:,} classes, PartialFC {config.sample_rate}, "
          f"{jax.devices()[0].device_kind}")
    print_table(table, ["program", "wall_ms", "device_ms", *(f"{k}_ms" for k in KINDS)])
    write_json(args.out, [dict(r, top_ops=ops[:args.top]) for r, ops in zip(table, tops.values())])


if __name__ == "__main__":
    main()
