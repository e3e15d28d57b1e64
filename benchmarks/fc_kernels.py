"""jaxcls's FC kernels alone, in each form: the statistics pass (``jaxcls.losses.rows_stats``) and the backward with the
rows update (``jaxcls.losses.rows_backward``), on one tile of sampled rows.

    python benchmarks/fc_kernels.py           # on a GPU: XLA's form and the Triton kernel
    python benchmarks/fc_kernels.py --small   # on a CPU: XLA's form and the kernel in Pallas' interpreter
    python benchmarks/fc_kernels.py --set rows_backward.UPDATE_BLOCK_ROWS=32 --set rows_backward.UPDATE_WARPS=8
                                              # other block sizes and warps than the modules' (each row says which)

Rows (``kernel``, ``case``, ``form``): the median ms of one call, synchronized, after warm-up (the update steps the
same ``[C, D]`` weight and slots in place, call after call); the bytes the call must move at the least over that
time (``least_GB_per_s``: for the backward each row of the weight and slots read and written once, for the
statistics each row read once, and the embeddings); ``diff_vs_xla``, against XLA's form on the same inputs: for the
backward the largest difference of the weight and slots over the largest change XLA's form made to them (the rows'
gradient is formed in the embeddings' bfloat16: the forms differ by its rounding, ~0.4%), and ``d_e_diff_vs_xla`` the
embeddings' gradient's largest difference over its largest entry; for the statistics the largest absolute difference
of the log-sum-exp and of the target logit (ArcFace, s = 64). Defaults: C = 1,048,576, D = 512, T = 65,536 rows,
N = 128 embeddings.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxcls.bench import print_table, write_json
from jaxcls.losses import rows_backward, rows_stats
from jaxcls.fc.head import optimizer_rule
from jaxcls.fc.optimizers import adamw, encode, sgd
from jaxcls.losses import arcface, tiles

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


def backward_row(case, form, c, d, t, n, iters, warmup, rng):
    name, weight_dtype, state_dtype = case
    optimizer = {"sgd": sgd, "adamw": adamw}[name](state_dtype=state_dtype)
    weight = jnp.asarray(rng.normal(size=(c, d)), weight_dtype)
    slots = tuple(a for i in range(optimizer.num_slots)
                  for a in encode(jnp.asarray(rng.normal(size=(c, d)) ** (i + 1), jnp.float32), jnp.dtype(state_dtype)))
    arrays = (weight, *slots)
    index, where, e_n = _tile(c, d, t, n, rng)
    high, total, _ = _statistics("xla", weight, index, where, e_n)
    lse, g = high + jnp.log(total), jnp.full((n,), 1.0 / n, jnp.float32)

    def stepper(form):
        def step(arrays):
            with rows_backward.forced(form):
                return rows_backward.tile_backward(arrays, index, where, e_n, lse, g, arcface(),
                                                   lambda: arrays[0][index], where.kept, optimizer_rule(optimizer),
                                                   jnp.float32(0.1), jnp.int32(3))
        return jax.jit(step, donate_argnums=0)

    step = stepper(form)
    d_e, result = step(tuple(jnp.copy(a) for a in arrays))
    ref_d_e, reference = stepper("xla")(tuple(jnp.copy(a) for a in arrays))
    diff = max(_relative(a, b, before) for a, b, before in zip(result, reference, arrays))
    d_e_diff = _relative(d_e, ref_d_e, jnp.zeros_like(ref_d_e))
    state = [result]

    def run():  # the arrays are donated: each call steps the previous call's result
        state[0] = step(state[0])[1]
        return state[0]

    ms = timed(run, iters, warmup)
    least = sum(2 * t * a.nbytes // a.shape[0] for a in arrays) + e_n.nbytes + index.nbytes
    return {"kernel": "backward", "case": "/".join(case), "form": form, "ms": ms, "least_GB_per_s": least / ms / 1e6,
            "diff_vs_xla": diff, "d_e_diff_vs_xla": d_e_diff}


def _tile(c, d, t, n, rng):
    """A tile of ``t`` sorted distinct rows of ``c``, its columns, and ``n`` normalized bfloat16 embeddings of width
    ``d``, half of them with a target in the tile."""
    index = jnp.asarray(np.sort(rng.choice(c, t, replace=False)), jnp.int32)
    targets = jnp.asarray(np.where(rng.random(n) < 0.5, rng.integers(0, t, n), -1), jnp.int32)
    e = rng.normal(size=(n, d))
    e_n = jnp.asarray(e / np.linalg.norm(e, axis=1, keepdims=True), jnp.bfloat16)
    return index, tiles.tile_columns(targets, jnp.ones(t, bool), 0, 0), e_n


def _statistics(form, weight, index, where, e_n):
    with rows_stats.forced(form):
        return jax.jit(lambda w: rows_stats.tile_statistics_by_index(w, index, where, e_n, arcface(),
                                                                     lambda: w[index]))(weight)


def stats_row(weight_dtype, form, c, d, t, n, iters, warmup, rng):
    weight = jnp.asarray(rng.normal(size=(c, d)), weight_dtype)
    index, where, e_n = _tile(c, d, t, n, rng)
    (high, total, target), (ref_high, ref_total, ref_target) = (_statistics(f, weight, index, where, e_n)
                                                                for f in (form, "xla"))
    lse, ref_lse = high + jnp.log(total), ref_high + jnp.log(ref_total)
    diff = float(max(jnp.max(jnp.abs(lse - ref_lse)), jnp.max(jnp.abs(target - ref_target))))
    ms = timed(lambda: _statistics(form, weight, index, where, e_n), iters, warmup)
    least = t * weight.nbytes // c + e_n.nbytes + index.nbytes
    return {"kernel": "stats", "case": f"{weight_dtype}/N={n}", "form": form, "ms": ms,
            "least_GB_per_s": least / ms / 1e6, "diff_vs_xla": diff}


def _relative(a, b, before) -> float:
    """Largest ``|a − b|`` over the largest change ``|b − before|`` (float64)."""
    a64, b64, before64 = (np.asarray(x, np.float64) for x in (a, b, before))
    return float(np.max(np.abs(a64 - b64)) / max(np.max(np.abs(b64 - before64)), np.finfo(np.float64).tiny))


def _override(setting: str) -> tuple[str, int]:
    """Set ``MODULE.NAME=INT`` (an upper-case constant of ``jaxcls.losses.MODULE``); returns the pair."""
    name, _, value = setting.partition("=")
    module, _, constant = name.partition(".")
    target = {"rows_stats": rows_stats, "rows_backward": rows_backward}.get(module)
    if target is None or not constant.isupper() or not isinstance(getattr(target, constant, None), int):
        raise SystemExit(f"--set {setting}: expected rows_stats.NAME=INT or rows_backward.NAME=INT, NAME one of their "
                         f"upper-case integer constants")
    setattr(target, constant, int(value))
    return name, int(value)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="C = 4,096, D = 64, T = 1,000, N = 100, 3 timed calls")
    parser.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=INT",
                        help="a block size or warp count of jaxcls.losses.rows_stats or rows_backward")
    parser.add_argument("--out", default="fc_kernels.json")
    args = parser.parse_args()
    settings = dict(_override(setting) for setting in args.set)
    sizes = (4096, 64, 1000, 100, 3, 1) if args.small else (1_048_576, 512, 65_536, 128, 40, 15)
    forms = ["xla", "pallas" if jax.devices()[0].platform == "gpu" else "pallas_interpret"]
    rng = np.random.default_rng(0)
    rows = [stats_row(dtype, form, *sizes, rng) for dtype in STATISTICS for form in forms]
    rows += [backward_row(case, form, *sizes, rng) for case in UPDATES for form in forms]
    rows = [dict(row, settings=settings) for row in rows]
    print_table(rows, ["kernel", "case", "form", "ms", "least_GB_per_s", "diff_vs_xla", "d_e_diff_vs_xla"])
    write_json(args.out, rows)


if __name__ == "__main__":
    main()
