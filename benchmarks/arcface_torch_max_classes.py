"""arcface_torch's largest class count on this GPU, by the arcface_torch bench's own test of a count (``fits``: two
warm-up and two timed steps of its training step, out of memory or not), searched from a bracket instead of from 1M.

    python benchmarks/arcface_torch_max_classes.py --bench .gpudata/bench --network r50 --batch 128 \
        --runs 8000000 --fails 10000000 [--resolution 250000] [--out max.json]

The bench's ``--max-classes`` doubles from 1M until a count fails, then bisects to 500,000: about 8 model builds,
past 200 s on an H100. Where a lease already ran one count and saw another run out of memory (r50 at batch 128:
8M ran on three leases, 10M ran out of memory on the first), the search starts from those two: ``--fails`` is tried
first (the bracket moved up while it runs), then the bracket bisected to ``--resolution``: 4 builds for 8M and
10M at the default 250,000, and a fifth, of ``--runs``, if none of them ran. Each count is printed as it is known;
the JSON says which counts ran and which did not.
"""

import argparse
import importlib
import json
import sys
from collections.abc import Callable


def largest_that_fits(fits: Callable[[int], bool], runs: int, fails: int, resolution: int, raises: int = 8) -> dict:
    """``{"max_classes", "first_failing", "tried"}``: the largest count ``fits`` holds within ``resolution``, given a
    bracket: ``runs``, taken to fit, and ``fails``, tried first; while it fits the bracket moves up, twice as wide each
    time (at most ``raises`` times); ``runs`` is tried too if nothing else fit. ``tried``: ``[count, fits]`` in
    order, each printed as it is known (a search cut short by a time limit still shows how far it got)."""
    if not 0 < runs < fails or resolution < 1:
        raise ValueError(f"expected 0 < runs < fails and a positive resolution, got {runs}, {fails}, {resolution}")
    tried = []

    def test(count):
        tried.append([count, bool(fits(count))])
        print(json.dumps({"classes": count, "fits": tried[-1][1]}), flush=True)
        return tried[-1][1]

    for _ in range(raises + 1):
        if not test(fails):
            break
        runs, fails = fails, fails + 2 * (fails - runs)
    else:
        raise RuntimeError(f"{runs} classes still fit after {raises} raises of the bracket: start it higher")
    while fails - runs > resolution:
        middle = (runs + fails) // 2
        runs, fails = (middle, fails) if test(middle) else (runs, middle)
    if not any(fit for _, fit in tried) and not test(runs):
        raise RuntimeError(f"{runs} classes, the bracket's lower end, do not fit either: start it lower")
    return {"max_classes": runs, "first_failing": fails, "tried": tried}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bench", required=True, help="the folder of arcface_torch_bench.py")
    parser.add_argument("--network", default="r50")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--sample-rate", type=float, default=0.1)
    parser.add_argument("--runs", type=int, required=True, help="a class count known to run")
    parser.add_argument("--fails", type=int, required=True, help="a class count seen to run out of memory")
    parser.add_argument("--resolution", type=int, default=250_000)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args()
    sys.path.insert(0, args.bench)
    bench = importlib.import_module("arcface_torch_bench")
    if not bench.torch.cuda.is_available():
        sys.exit("arcface_torch_max_classes.py searches for a GPU's out-of-memory point: it needs a GPU")
    bench.init_process_group()
    settings = argparse.Namespace(network=args.network, batch=args.batch, sample_rate=args.sample_rate, fp16=True,
                                  compile=args.compile)  # fp16 as train_v2.py runs it
    result = {"network": args.network, "batch": args.batch, "sample_rate": args.sample_rate, "fp16": True,
              "compile": args.compile, "device": bench.torch.cuda.get_device_name(), "resolution": args.resolution,
              **largest_that_fits(lambda count: bench.fits(settings, count), args.runs, args.fails, args.resolution)}
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
