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
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


_PROBED: dict[int, dict | None] = {}


def probe(classes, args) -> dict | None:
    """Run the step at ``classes`` in a subprocess (once per C); its measurement row, or None if it failed."""
    if classes in _PROBED:
        return _PROBED[classes]
    cmd = [sys.executable, str(HERE / "max_classes.py"), "--probe", str(classes), "--model", args.model,
           "--batch", str(args.batch), "--steps", str(args.steps), "--budget-bytes", str(args.budget_bytes)]
    if args.small:
        cmd.append("--small")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    ok = proc.returncode == 0 and lines
    print(f"  C={classes:>12,}: {'ok' if ok else 'fails'}", flush=True)
    _PROBED[classes] = json.loads(lines[-1]) if ok else None
    return _PROBED[classes]


def run_probe(args):
    if args.small:
        sys.path.insert(0, str(HERE))
        from common import force_cpu_devices

        force_cpu_devices(8)
    sys.path.insert(0, str(HERE))
    from train import measure, step_config

    size = 32 if args.small else 112
    config = step_config(args.model, args.batch, args.probe, 0.1, "float32" if args.small else "bfloat16", size)
    if args.small:
        config.model_kwargs, config.num_features = dict(width=8), 32
    row = measure(config, args.steps, warmup=1 if args.small else 3)
    used = row["argument_bytes"] + row["temp_bytes"]
    if args.budget_bytes and used > args.budget_bytes:
        sys.exit(f"compiled step needs {used} bytes > budget {args.budget_bytes}")
    print(json.dumps(row))


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
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--probe", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default="benchmarks/results/max_classes.json")
    args = parser.parse_args()
    if args.probe is not None:
        return run_probe(args)
    if args.small:
        args.model, args.batch, args.steps = "r18", 32, 1
        args.low, args.high, args.resolution = 1_000, 2_000, 1_000  # one probe: the CPU path, not a bisection
        args.budget_bytes = args.budget_bytes or 16 * 2**20

    from common import print_table, write_json

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
