"""jaxcls's two FC kernels alone, in each form: the statistics pass (``jaxcls.fc.rows_stats``) and the rows update
(``jaxcls.fc.rows_update``), on one tile of sampled rows.

    python benchmarks/fc_kernels.py           # on a GPU: XLA's form and the Triton kernel
    python benchmarks/fc_kernels.py --small   # on a CPU: XLA's form and the kernel in Pallas' interpreter

Rows (``kernel``, ``case``, ``form``): the median ms of one call, synchronized, after warm-up (the update steps the
same ``[C, D]`` weight and slots in place, call after call); the bytes the call must move at the least over that
time (``least_GB_per_s``: for the update each row of the weight and slots read and written once and the gradient's
parts read, for the statistics each row and the embeddings read once); ``diff_vs_xla``, against XLA's form on the
same inputs: for the update the largest difference in units of the storage dtype's resolution at the row's largest
entry (0: equal; about 1: one rounding apart), for the statistics the largest absolute difference of the log-sum-exp
and of the target logit (ArcFace, s = 64). Defaults: C = 1,048,576, D = 512, T = 65,536 rows, N = 128 embeddings.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxcls.bench import print_table, write_json
from jaxcls.fc import rows_stats, rows_update
from jaxcls.fc.head import optimizer_rule
from jaxcls.fc.optimizers import adamw, encode, sgd
from jaxcls.losses import arcface

UPDATES = [("sgd", "bfloat16", "bfloat16"), ("sgd", "float32", "float32"), ("sgd", "bfloat16", "int8"),
           ("adamw", "float32", "float32")]  # (optimizer, weight, state)
STATISTICS = ["bfloat16", "float32"]  # the weight's dtype; the embeddings are bfloat16


def timed(run, iters, warmup) -> float:
    """Median ms of ``run()``, each call synchronized on what it returns, after ``warmup`` calls."""
    times = []
    for i in range(warmup + iters):
        start = time.perf_counter()
        jax.block_until_ready(run())
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def update_row(case, form, c, d, t, n, iters, warmup, rng):
    name, weight_dtype, state_dtype = case
    optimizer = {"sgd": sgd, "adamw": adamw}[name](state_dtype=state_dtype)
    weight = jnp.asarray(rng.normal(size=(c, d)), weight_dtype)
    slots = tuple(a for i in range(optimizer.num_slots)
                  for a in encode(jnp.asarray(rng.normal(size=(c, d)) ** (i + 1), jnp.float32), jnp.dtype(state_dtype)))
    arrays = (weight, *slots)
    index = jnp.asarray(np.sort(rng.choice(c, t, replace=False)), jnp.int32)
    row_grad = (jnp.asarray(rng.normal(size=(t, d)), weight_dtype), jnp.asarray(rng.normal(size=t), jnp.float32))
    keep = jnp.ones(t, bool)

    def stepper(form):
        def step(arrays):
            with rows_update.forced(form):
                return rows_update.update_rows(arrays, index, row_grad, keep, optimizer_rule(optimizer),
                                               jnp.float32(0.1), jnp.int32(3))
        return jax.jit(step, donate_argnums=0)

    step = stepper(form)
    result = step(tuple(jnp.copy(a) for a in arrays))
    reference = stepper("xla")(tuple(jnp.copy(a) for a in arrays))
    diff = max(_units(a, b) for a, b in zip(result, reference))
    state = [result]

    def run():  # the arrays are donated: each call steps the previous call's result
        state[0] = step(state[0])
        return state[0]

    ms = timed(run, iters, warmup)
    least = sum(2 * t * a.nbytes // a.shape[0] for a in arrays) + sum(x.nbytes for x in row_grad) + index.nbytes
    return {"kernel": "update", "case": "/".join(case), "form": form, "ms": ms, "least_GB_per_s": least / ms / 1e6,
            "diff_vs_xla": diff}


def stats_row(weight_dtype, form, c, d, t, n, iters, warmup, rng):
    weight = jnp.asarray(rng.normal(size=(c, d)), weight_dtype)
    index = jnp.asarray(np.sort(rng.choice(c, t, replace=False)), jnp.int32)
    valid = jnp.ones(t, bool)
    e = rng.normal(size=(n, d))
    e_n = jnp.asarray(e / np.linalg.norm(e, axis=1, keepdims=True), jnp.bfloat16)
    targets = jnp.asarray(np.where(rng.random(n) < 0.5, rng.integers(0, t, n), -1), jnp.int32)
    bounds = jnp.int32(0), jnp.int32(0)

    def statistics_in(form):
        def stats(weight):
            with rows_stats.forced(form):
                return rows_stats.tile_statistics_by_index(weight, index, valid, *bounds, e_n, targets, arcface(),
                                                          lambda: weight[index])
        return jax.jit(stats)

    call = statistics_in(form)
    (high, total, target), (ref_high, ref_total, ref_target) = call(weight), statistics_in("xla")(weight)
    lse, ref_lse = high + jnp.log(total), ref_high + jnp.log(ref_total)
    diff = float(max(jnp.max(jnp.abs(lse - ref_lse)), jnp.max(jnp.abs(target - ref_target))))
    ms = timed(lambda: call(weight), iters, warmup)
    least = t * weight.nbytes // c + e_n.nbytes + index.nbytes
    return {"kernel": "stats", "case": f"{weight_dtype}/N={n}", "form": form, "ms": ms,
            "least_GB_per_s": least / ms / 1e6, "diff_vs_xla": diff}


def _units(a, b) -> float:
    """Largest |a − b| in units of ``b``'s storage resolution at its row's largest magnitude (an integer code: 1)."""
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if jnp.issubdtype(b.dtype, jnp.integer):
        return float(np.max(np.abs(a64 - b64)))
    scale = np.maximum(np.abs(b64).max(axis=-1, keepdims=True), float(jnp.finfo(b.dtype).tiny))
    return float(np.max(np.abs(a64 - b64) / (scale * float(jnp.finfo(b.dtype).eps))))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="C = 4,096, D = 64, T = 1,000, N = 100, 3 timed calls")
    parser.add_argument("--out", default="fc_kernels.json")
    args = parser.parse_args()
    sizes = (4096, 64, 1000, 100, 3, 1) if args.small else (1_048_576, 512, 65_536, 128, 40, 15)
    forms = ["xla", "pallas" if jax.devices()[0].platform == "gpu" else "pallas_interpret"]
    rng = np.random.default_rng(0)
    rows = [stats_row(dtype, form, *sizes, rng) for dtype in STATISTICS for form in forms]
    rows += [update_row(case, form, *sizes, rng) for case in UPDATES for form in forms]
    print_table(rows, ["kernel", "case", "form", "ms", "least_GB_per_s", "diff_vs_xla"])
    write_json(args.out, rows)


if __name__ == "__main__":
    main()
