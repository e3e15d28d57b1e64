"""The largest class count whose full train step runs on the device (r50, batch 128, PartialFC 0.1, D=512).

Each probe runs a few real train steps in a fresh process (so an out-of-memory leaves nothing behind);
a bisection over C between --low and --high finds the largest that succeeds, then img/s is measured at
1M, 8M and that maximum.

    python benchmarks/max_classes.py                       # on a GPU
    python benchmarks/max_classes.py --small               # CPU: tiny model, a memory budget stands in for the card

``--budget-bytes`` makes a probe fail when the compiled step's memory (arguments + temporaries) exceeds it,
for machines where running out of memory is not the limit (a CPU).
"""

from __future__ import annotations

import argparse
import sys

from jaxcls.bench import RowFailed, in_fresh_process, print_table, time_train_step, write_json
from jaxcls.config import benchmark_config
from jaxcls.startup import simulate_cpu_devices

_PROBED: dict[int, dict | None] = {}


def probe(classes, args) -> dict | None:
    """Run the step at ``classes`` in a fresh process (once per C); its measurement row, or None if it failed."""
    if classes not in _PROBED:
        try:
            _PROBED[classes] = in_fresh_process(probe_row, classes, args.model, args.batch, args.steps,
                                                args.budget_bytes, args.small, timeout=args.timeout)
        except RowFailed:
            _PROBED[classes] = None
        print(f"  C={classes:>12,}: {'fails' if _PROBED[classes] is None else 'ok'}", flush=True)
    return _PROBED[classes]


def probe_row(classes, model, batch, steps, budget_bytes, small) -> dict:
    """One probe, in its own process: the step's measurement row at ``classes``; exits with an error where the
    compiled step's arguments and temporaries exceed ``budget_bytes`` (when set)."""
    if small:
        simulate_cpu_devices(8)
    config = benchmark_config(small=small, model=model, batch_size=batch, num_classes=classes)
    row = time_train_step(config, steps, warmup=1 if small else 3)
    used = row["argument_bytes"] + row["temp_bytes"]
    if budget_bytes and used > budget_bytes:
        sys.exit(f"compiled step needs {used} bytes > budget {budget_bytes}")
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--model", default="r50")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--low", type=int, default=1_000_000)
    parser.add_argument("--high", type=int, default=64_000_000)
    parser.add_argument("--resolution", type=int, default=1_000_000, help="stop when high − low is below this")
    parser.add_argument("--budget-bytes", type=int, default=0)
    parser.add_argument("--timeout", type=int, default=900, help="seconds a probe may take; one past it fails")
    parser.add_argument("--out", default="benchmarks/results/max_classes.json")
    args = parser.parse_args()
    if args.small:
        args.model, args.batch, args.steps = "r18", 32, 1
        args.low, args.high, args.resolution = 1_000, 2_000, 1_000  # one probe: the CPU path, not a bisection
        args.budget_bytes = args.budget_bytes or 16 * 2**20

    low, high = args.low, args.high
    if probe(low, args) is None:
        sys.exit(f"even C={low} fails")
    while high - low > args.resolution:
        mid = (low + high) // 2
        low, high = (mid, high) if probe(mid, args) is not None else (low, mid)
    marks = [low] if args.small else [1_000_000, 8_000_000, low]
    rows = [dict(r, is_max=(c == low)) for c in marks if (r := probe(c, args)) is not None]
    print_table(rows, ["model", "batch", "classes", "img_per_s", "peak_bytes", "temp_bytes", "is_max"])
    write_json(args.out, rows)


if __name__ == "__main__":
    main()
