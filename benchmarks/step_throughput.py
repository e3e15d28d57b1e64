"""Full train-step throughput: img/s and peak memory of the jitted step (backbone + sharded FC + updates).

    python benchmarks/step_throughput.py                 # GPU grid: r50/r100 at batch 128/256/512, mbf at 512;
                                                         # 1M classes, PartialFC 0.1, bf16; data already on the device
    python benchmarks/step_throughput.py --pipeline DIR  # the same step fed by the RecordIO pipeline from DIR
    python benchmarks/step_throughput.py --small         # r18 (width 8) at 32×32 on 8 CPU devices, 16-row FC tiles;
                                                         # what the tests run
    python benchmarks/step_throughput.py --cpu --bn_sync both --steps 5   # r50 at 112×112, batch 16, float32 on 8
                                                         # CPU devices, BatchNorm statistics per device and over the
                                                         # global batch

Extra ``--set key=value`` pairs override config keys (e.g. ``--set chunk_size=65536``); ``--grouped-conv xla``
times mbf with XLA's grouped convolutions (the form before ``jaxcls.models.grouped_conv``) for a before/after, and
``--fc-kernels xla|pallas|pallas_update`` the FC path in one form
(``jaxcls.losses.rows_stats``, ``rows_backward``; by default each platform's own), ``--bn-backward written|autodiff``
BatchNorm's backward in one form (``jaxcls.models.layers``; by default written out on CPUs, autodiff's elsewhere).

Timing is arcface_torch_bench.py's: each step synchronized (its outputs ready before the next is dispatched), the
median of ``--steps`` (default 40) after ``--warmup`` (default 15) steps; img/s is the batch over that median.
Synchronizing each step forgoes the overlap of dispatch with the previous step's work that a JAX training loop has,
so it can only understate jaxcls's throughput. Each row's ``timing`` says how it was timed.
"""

from __future__ import annotations

import argparse
import itertools

from jaxcls.bench import (CONFIG_KEY, FC_KERNELS, FC_KERNELS_HELP, fc_kernels, print_table, select, time_train_step,
                          write_json)
from jaxcls.config import benchmark_config
from jaxcls.models import grouped_conv, layers
from jaxcls.startup import simulate_cpu_devices

KEYS = ["model", "batch", "classes", "sample_rate", "precision"]  # of a grid row, as --only names them
CONFIG_KEYS = ["model", "batch_size", "num_classes", "sample_rate", "precision"]  # the same, as the config names them
GRID = [(m, b, 1_000_000, 0.1, "bfloat16") for m in ("r50", "r100") for b in (128, 256, 512)]
GRID += [("mbf", 512, 1_000_000, 0.1, "bfloat16")]


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
    parser.add_argument("--set", action="append", default=[], help=CONFIG_KEY)
    parser.add_argument("--grouped-conv", choices=grouped_conv.LOWERINGS, default=None,
                        help="one lowering for every grouped convolution (default: each platform's own)")
    parser.add_argument("--fc-kernels", choices=FC_KERNELS, default=None, help=FC_KERNELS_HELP)
    parser.add_argument("--bn-backward", choices=layers.BN_BACKWARDS, default=None,
                        help="BatchNorm's backward in training (default: each platform's own)")
    parser.add_argument("--out", default="benchmarks/results/step_throughput.json")
    args = parser.parse_args()
    if args.small or args.cpu:
        simulate_cpu_devices(8)
    if args.small:
        grid, steps, warmup = [("r18", 32, 1000, 0.1, "float32")], 2, 1
    elif args.cpu:
        grid, steps, warmup = [("r50", 16, 1000, 1.0, "float32")], 5, 2
    else:
        grid, steps, warmup = GRID, 40, 15
    grid = select(grid, KEYS, args.only)
    steps, warmup = args.steps or steps, warmup if args.warmup is None else args.warmup
    syncs = {"off": [False], "on": [True], "both": [False, True]}[args.bn_sync]
    tiles = {"chunk_size": 16} if args.small else {}  # --small: several FC tiles a shard, as the full run's
    rows = []
    for spec, bn_sync in itertools.product(grid, syncs):
        config = benchmark_config(small=args.small, overrides=args.set, **dict(zip(CONFIG_KEYS, spec)), bn_sync=bn_sync,
                                  **tiles)
        with (grouped_conv.forced(args.grouped_conv), fc_kernels(args.fc_kernels),
              layers.bn_backward_forced(args.bn_backward)):
            row = time_train_step(config, steps, args.pipeline, warmup)
        rows.append(dict(row, grouped_conv=args.grouped_conv or "platform", fc_kernels=args.fc_kernels or "platform",
                         bn_backward=args.bn_backward or "platform"))
    print_table(rows, ["model", "batch", "classes", "sample_rate", "precision", "bn_sync", "input", "img_per_s",
                       "ms_per_step", "compile_s", "peak_bytes", "temp_bytes"])
    write_json(args.out, rows)


if __name__ == "__main__":
    main()
