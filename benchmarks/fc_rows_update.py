"""The FC update alone (``jaxcls.fc.rows_update``): one tile of sampled rows stepped in place, in each form.

    python benchmarks/fc_rows_update.py           # on a GPU: XLA's gather/scatter and the Triton kernel
    python benchmarks/fc_rows_update.py --small   # on a CPU: XLA's form and the kernel in Pallas' interpreter

Per case (optimizer, weight dtype, state dtype) and form: the median ms of one step of ``T`` rows of a
``[C, D]`` weight and its slots (updated in place, synchronized every step, after warm-up), the bytes that step
must move at the least (each row of the weight and slots read and written once, the gradient's parts read) over
that time, and the largest difference from XLA's form on the same inputs in units of the storage dtype's
resolution at that value (0: equal; about 1: one rounding apart). Defaults: C = 1,048,576, D = 512, T = 65,536.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxcls.bench import print_table, write_json
from jaxcls.fc import rows_update
from jaxcls.fc.head import optimizer_rule
from jaxcls.fc.optimizers import adamw, encode, sgd

CASES = [("sgd", "bfloat16", "bfloat16"), ("sgd", "float32", "float32"), ("sgd", "bfloat16", "int8"),
         ("adamw", "float32", "float32")]


def inputs(case, c, d, t, seed=0):
    name, weight_dtype, state_dtype = case
    rng = np.random.default_rng(seed)
    optimizer = {"sgd": sgd, "adamw": adamw}[name](state_dtype=state_dtype)
    weight = jnp.asarray(rng.normal(size=(c, d)), weight_dtype)
    slots = tuple(a for i in range(optimizer.num_slots)
                  for a in encode(jnp.asarray(rng.normal(size=(c, d)) ** (i + 1), jnp.float32), jnp.dtype(state_dtype)))
    index = jnp.asarray(np.sort(rng.choice(c, t, replace=False)), jnp.int32)
    row_grad = (jnp.asarray(rng.normal(size=(t, d)), weight_dtype), jnp.asarray(rng.normal(size=t), jnp.float32))
    return optimizer, (weight, *slots), index, row_grad, jnp.ones(t, bool)


def stepper(form, optimizer):
    def step(arrays, index, row_grad, keep):
        with rows_update.forced(form):
            return rows_update.update_rows(arrays, index, row_grad, keep, optimizer_rule(optimizer), jnp.float32(0.1),
                                           jnp.int32(3))
    return jax.jit(step, donate_argnums=0)


def least_bytes(arrays, index, row_grad) -> int:
    t = index.shape[0]
    return sum(2 * t * a.nbytes // a.shape[0] for a in arrays) + sum(x.nbytes for x in row_grad) + index.nbytes


def measure(case, form, c, d, t, iters, warmup):
    optimizer, arrays, index, row_grad, keep = inputs(case, c, d, t)
    step = stepper(form, optimizer)
    reference = stepper("xla", optimizer)(tuple(jnp.copy(a) for a in arrays), index, row_grad, keep)
    result = step(tuple(jnp.copy(a) for a in arrays), index, row_grad, keep)
    units = max(_units(a, b) for a, b in zip(result, reference))
    state, times = result, []
    for i in range(warmup + iters):
        start = time.perf_counter()
        state = jax.block_until_ready(step(state, index, row_grad, keep))
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    ms = statistics.median(times)
    return {"optimizer": case[0], "weight": case[1], "state": case[2], "form": form, "rows": t, "classes": c,
            "dim": d, "ms": ms, "least_GB_per_s": least_bytes(arrays, index, row_grad) / ms / 1e6,
            "diff_vs_xla_units": units}


def _units(a, b) -> float:
    """Largest |a − b| in units of ``b``'s storage resolution at each value (an integer code: 1)."""
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if jnp.issubdtype(b.dtype, jnp.integer):
        return float(np.max(np.abs(a64 - b64)))
    resolution = np.maximum(np.abs(b64), float(jnp.finfo(b.dtype).tiny)) * float(jnp.finfo(b.dtype).eps)
    return float(np.max(np.abs(a64 - b64) / resolution))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="C = 4,096, D = 64, T = 1,000, 3 timed steps")
    parser.add_argument("--out", default="fc_rows_update.json")
    args = parser.parse_args()
    c, d, t, iters, warmup = (4096, 64, 1000, 3, 1) if args.small else (1_048_576, 512, 65_536, 40, 15)
    on_gpu = jax.devices()[0].platform == "gpu"
    forms = ["xla", "pallas" if on_gpu else "pallas_interpret"]
    rows = [measure(case, form, c, d, t, iters, warmup) for case in CASES for form in forms]
    print_table(rows, ["optimizer", "weight", "state", "form", "ms", "least_GB_per_s", "diff_vs_xla_units"])
    write_json(args.out, rows)


if __name__ == "__main__":
    main()
