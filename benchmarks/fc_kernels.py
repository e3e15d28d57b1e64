"""jaxcls's FC kernels alone, in each form: the statistics pass (``jaxcls.losses.rows_stats``) and the backward with the
rows update (``jaxcls.losses.rows_backward``), on one tile of sampled rows.

    python benchmarks/fc_kernels.py           # on a GPU: XLA's form and the Triton kernel
    python benchmarks/fc_kernels.py --small   # on a CPU: XLA's form and the kernel in Pallas' interpreter
    python benchmarks/fc_kernels.py --set rows_backward.UPDATE_BLOCK_ROWS=32 --set rows_backward.UPDATE_WARPS=8
                                              # other block sizes and warps than the modules' (each row says which)
    python benchmarks/fc_kernels.py --kernel backward --update sgd/bfloat16/bfloat16 \
        --set rows_backward.UPDATE_BLOCK_ROWS=16,32,64 --set rows_backward.UPDATE_STAGES=1,3
                                              # a sweep: every combination, XLA's form timed once
    python benchmarks/fc_kernels.py --registers --set rows_backward.UPDATE_WARPS=4,8
                                              # compile-only, no GPU: registers, spills, programs per SM
    python benchmarks/fc_kernels.py --kernel backward --fc-kernels pallas_update,pallas
                                              # the kernel form's variants (rows_backward.VARIANTS), XLA's form once

Rows (``kernel``: ``stats``, ``embedding_grad`` (the backward without the update: in the kernel form its first kernel
alone), ``backward``; ``case``; ``form``; ``variant``, the kernel form's ``rows_backward.VARIANTS`` name, timed in
turn with ``--fc-kernels``; the statistics kernel, the same in every variant, is timed in the first alone, unnamed): the
median ms of one call, synchronized, after warm-up (the update steps the
same ``[C, D]`` weight and slots in place, call after call); the bytes the call must move at the least over that
time (``least_GB_per_s``: for the backward each row of the weight and slots read and written once, for the
statistics each row read once, and the embeddings); ``diff_vs_xla``, against XLA's form on the same inputs: for the
backward the largest difference of the weight and slots over the largest change XLA's form made to them (the rows'
gradient is formed in the embeddings' bfloat16: the forms differ by its rounding, ~0.4%), and ``d_e_diff_vs_xla`` the
embeddings' gradient's largest difference over its largest entry (``embedding_grad`` rows: that as
``diff_vs_xla``); for the statistics the largest absolute difference
of the log-sum-exp and of the target logit (ArcFace, s = 64). Defaults: C = 1,048,576, D = 512, T = 65,536 rows,
N = 128 embeddings.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax.sharding import SingleDeviceSharding

from jaxcls.bench import print_table, write_json
from jaxcls.fc.head import optimizer_rule
from jaxcls.fc.optimizers import adamw, encode, sgd
from jaxcls.losses import MARGINS, arcface, rows_backward, rows_stats, tiles
from jaxcls.plan import gpu_target, ptx

UPDATES = [("sgd", "bfloat16", "bfloat16"), ("sgd", "float32", "float32"), ("sgd", "bfloat16", "int8"),
           ("adamw", "float32", "float32"), ("sgd", "bfloat16", "bfloat16", "stochastic")]
# (optimizer, weight, state[, the weight's rounding if not to nearest])
STATISTICS = ["bfloat16", "float32"]  # the weight's dtype; the embeddings are bfloat16
TUNABLE = {"rows_stats": rows_stats, "rows_backward": rows_backward}  # the modules whose constants --set sets


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
    name, weight_dtype, state_dtype, *rounding = case
    optimizer = {"sgd": sgd, "adamw": adamw}[name](state_dtype=state_dtype, weight_rounding=(*rounding, "nearest")[0])
    keys = jax.random.split(jax.random.key(int(rng.integers(2**31))), 1 + optimizer.num_slots)
    weight = jax.random.normal(keys[0], (c, d), weight_dtype)
    slots = tuple(a for i in range(optimizer.num_slots)
                  for a in encode(jax.random.normal(keys[1 + i], (c, d)) ** (i + 1), jnp.dtype(state_dtype)))
    arrays = (weight, *slots)
    index, where, e_n, lse, g = _tile_with_gradient(weight, t, n, rng)

    def stepper(form):
        def step(arrays):
            with rows_backward.forced(form):
                return rows_backward.tile_backward(arrays, index, where, e_n, lse, g, arcface(),
                                                   lambda: arrays[0][index], where.kept, optimizer_rule(optimizer),
                                                   jnp.float32(0.1), jnp.int32(3), jnp.int32(0))
        return jax.jit(step, donate_argnums=0)

    step = stepper(form)
    d_e, result = step(tuple(jnp.copy(a) for a in arrays))
    ref_d_e, reference = stepper("xla")(tuple(jnp.copy(a) for a in arrays))
    diff = max(float(_relative(a, b, before)) for a, b, before in zip(result, reference, arrays))
    d_e_diff = float(_relative(d_e, ref_d_e, jnp.zeros_like(ref_d_e)))
    state = [result]

    def run():  # the arrays are donated: each call steps the previous call's result
        state[0] = step(state[0])[1]
        return state[0]

    ms = timed(run, iters, warmup)
    least = sum(2 * t * a.nbytes // a.shape[0] for a in arrays) + e_n.nbytes + index.nbytes
    return {"kernel": "backward", "case": "/".join(case), "form": form, "ms": ms, "least_GB_per_s": least / ms / 1e6,
            "diff_vs_xla": diff, "d_e_diff_vs_xla": d_e_diff}


def embedding_grad_row(weight_dtype, form, c, d, t, n, iters, warmup, rng):
    """The backward without the update: the embeddings' gradient alone (in the kernel form, its kernel alone)."""
    weight = jax.random.normal(jax.random.key(int(rng.integers(2**31))), (c, d), weight_dtype)
    index, where, e_n, lse, g = _tile_with_gradient(weight, t, n, rng)

    def gradient(form):
        def d_e(weight):
            with rows_backward.forced(form):
                return rows_backward.tile_backward((weight,), index, where, e_n, lse, g, arcface(),
                                                   lambda: weight[index])[0]
        return jax.jit(d_e)

    run = gradient(form)
    d_e_diff = float(_relative(run(weight), gradient("xla")(weight), jnp.zeros((n, d), jnp.float32)))
    ms = timed(lambda: run(weight), iters, warmup)
    least = t * weight.nbytes // c + e_n.nbytes + index.nbytes
    return {"kernel": "embedding_grad", "case": f"{weight_dtype}/N={n}", "form": form, "ms": ms,
            "least_GB_per_s": least / ms / 1e6, "diff_vs_xla": d_e_diff}


def compile_row_kernels(device, optimizer="sgd", weight="bfloat16", state="bfloat16", embeddings="bfloat16",
                        margin="arcface", rounding="nearest", n=128, options=None):
    """The row kernels (statistics, embeddings' gradient, update; with ``rows_backward.GEMMS_IN_KERNELS`` off the
    statistics and the update alone) of one 65,536-row tile of a 1M × 512 weight,
    compiled by XLA for ``device`` (e.g. ``gpu_target.gpu_devices("h100", 1)[0]``: no GPU needed) with ``options``
    added to ``gpu_target.COMPILE_OPTIONS``."""
    at = lambda shape, dtype: jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=SingleDeviceSharding(device))
    c, d, t = 1 << 20, 512, 65_536
    rule_of = {"sgd": sgd, "adamw": adamw}[optimizer](state_dtype=state, weight_rounding=rounding)
    slots = jax.eval_shape(lambda w: rule_of.init(w).slots, jax.ShapeDtypeStruct((c, d), jnp.dtype(weight)))
    arrays = (at((c, d), weight), *(at(s.shape, s.dtype) for s in slots))
    margin = MARGINS[margin]()

    def step(arrays, index, targets, valid, e_n, lse, g, lr, count):
        where = tiles.tile_columns(targets, valid, 0, 0)
        stats = rows_stats.tile_statistics_by_index(arrays[0], index, where, e_n, margin, lambda: arrays[0][index])
        return stats, rows_backward.tile_backward(arrays, index, where, e_n, lse, g, margin, lambda: arrays[0][index],
                                                  where.kept, optimizer_rule(rule_of), lr, count, jnp.int32(0))

    with rows_stats.forced("pallas"), rows_backward.forced("pallas"):
        traced = jax.jit(step, donate_argnums=0).trace(
            arrays, at((t,), "int32"), at((n,), "int32"), at((t,), "bool"), at((n, d), embeddings),
            at((n,), "float32"), at((n,), "float32"), at((), "float32"), at((), "int32"))
        return traced.lower().compile({**gpu_target.COMPILE_OPTIONS, **(options or {})})


def register_rows(settings: dict, n: int, sms: int = 132) -> list[dict]:
    """Compile-only (for an H100): each row kernel's launch, registers, spills, programs an SM holds and waves."""
    device = gpu_target.gpu_devices("h100", 1)[0]
    found = ptx.triton_resources(lambda options: compile_row_kernels(device, n=n, options=options))
    rows = []
    for kernel, r in found.items():
        programs = r["grid"][0] * r["grid"][1] * r["grid"][2]
        rows.append(dict(kernel=kernel, N=n, programs=programs, warps=r["warps"], stages=r["stages"],
                         registers=r["registers"], spill_bytes=r["spill_bytes"], programs_per_sm=r["programs_per_sm"],
                         waves=programs / (sms * r["programs_per_sm"]), settings=settings))
    return rows


def _tile_with_gradient(weight, t, n, rng):
    """``_tile``'s rows, columns and embeddings for ``weight``, with the tile's log-sum-exp and each embedding's
    weight in the loss (``1/n``), as a backward gets them."""
    index, where, e_n = _tile(*weight.shape, t, n, rng)
    high, total, _ = _statistics("xla", index, where, e_n)(weight)
    return index, where, e_n, high + jnp.log(total), jnp.full((n,), 1.0 / n, jnp.float32)


def _tile(c, d, t, n, rng):
    """A tile of ``t`` sorted distinct rows of ``c``, its columns, and ``n`` normalized bfloat16 embeddings of width
    ``d``, half of them with a target in the tile."""
    index = jnp.asarray(np.sort(rng.choice(c, t, replace=False)), jnp.int32)
    targets = jnp.asarray(np.where(rng.random(n) < 0.5, rng.integers(0, t, n), -1), jnp.int32)
    e = rng.normal(size=(n, d))
    e_n = jnp.asarray(e / np.linalg.norm(e, axis=1, keepdims=True), jnp.bfloat16)
    return index, tiles.tile_columns(targets, jnp.ones(t, bool), 0, 0), e_n


def _statistics(form, index, where, e_n):
    """The statistics pass of a weight's rows ``index`` in ``form``, jitted (traced once, at its first call)."""
    def statistics_of(weight):
        with rows_stats.forced(form):
            return rows_stats.tile_statistics_by_index(weight, index, where, e_n, arcface(), lambda: weight[index])
    return jax.jit(statistics_of)


def stats_row(weight_dtype, form, c, d, t, n, iters, warmup, rng):
    weight = jax.random.normal(jax.random.key(int(rng.integers(2**31))), (c, d), weight_dtype)
    index, where, e_n = _tile(c, d, t, n, rng)
    run = _statistics(form, index, where, e_n)
    (high, total, target), (ref_high, ref_total, ref_target) = (run(weight),
                                                                _statistics("xla", index, where, e_n)(weight))
    lse, ref_lse = high + jnp.log(total), ref_high + jnp.log(ref_total)
    diff = float(max(jnp.max(jnp.abs(lse - ref_lse)), jnp.max(jnp.abs(target - ref_target))))
    ms = timed(lambda: run(weight), iters, warmup)
    least = t * weight.nbytes // c + e_n.nbytes + index.nbytes
    return {"kernel": "stats", "case": f"{weight_dtype}/N={n}", "form": form, "ms": ms,
            "least_GB_per_s": least / ms / 1e6, "diff_vs_xla": diff}


@jax.jit
def _relative(a, b, before) -> jax.Array:
    """Largest ``|a − b|`` over the largest change ``|b − before|``, in float32 on the device (the arrays are GBs:
    their random values are drawn there too)."""
    a, b, before = (x.astype(jnp.float32) for x in (a, b, before))
    return jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b - before)), jnp.finfo(jnp.float32).tiny)


def _settings(settings: list[str]) -> list[dict[str, int]]:
    """Every combination of ``MODULE.NAME=INT[,INT...]`` (upper-case integer constants of ``jaxcls.losses.MODULE``)."""
    names, values = [], []
    for setting in settings:
        name, _, value = setting.partition("=")
        module, _, constant = name.partition(".")
        target = TUNABLE.get(module)
        if target is None or not constant.isupper() or not isinstance(getattr(target, constant, None), int):
            raise SystemExit(f"--set {setting}: expected rows_stats.NAME=INT[,INT...] or rows_backward.NAME=INT[,...], "
                             f"NAME one of their upper-case integer constants")
        names.append(name)
        values.append([int(v) for v in value.split(",")])
    return [dict(zip(names, combination)) for combination in itertools.product(*values)]


def _variants(names: list[str], settings: list[str]) -> list[str | None]:
    """The ``rows_backward.VARIANTS`` named by ``--fc-kernels NAME[,NAME...]`` (none: ``[None]``, the module's own
    flags), refused beside a ``--set`` of the flags a variant sets."""
    variants = [v for arg in names for v in arg.split(",")]
    unknown = [v for v in variants if v not in rows_backward.VARIANTS]
    if unknown:
        raise SystemExit(f"--fc-kernels {','.join(unknown)}: expected one of {', '.join(rows_backward.VARIANTS)}")
    clash = [s for s in settings if variants and s.partition("=")[0].partition(".")[2] in rows_backward.VARIANT_FLAGS]
    if clash:
        raise SystemExit(f"--set {clash[0]}: --fc-kernels sets {', '.join(rows_backward.VARIANT_FLAGS)}")
    return variants or [None]


def _variant_name() -> str:
    """The ``rows_backward.VARIANTS`` name of the module's flags as they are now."""
    flags = tuple(getattr(rows_backward, name) for name in rows_backward.VARIANT_FLAGS)
    return next((name for name, set_to in rows_backward.VARIANTS.items() if set_to == flags), str(flags))


def _apply(settings: dict[str, int]) -> None:
    for name, value in settings.items():
        module, _, constant = name.partition(".")
        setattr(TUNABLE[module], constant, value)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="C = 4,096, D = 64, T = 1,000, N = 100, 3 timed calls")
    parser.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=INT[,INT...]",
                        help="a block size, warp or stage count of jaxcls.losses.rows_stats or rows_backward; "
                             "several values: every combination is timed (XLA's form once)")
    parser.add_argument("--kernel", choices=["stats", "embedding_grad", "backward"], action="append",
                        help="default: all three")
    parser.add_argument("--update", action="append", choices=["/".join(case) for case in UPDATES],
                        help="backward cases (default: all)")
    parser.add_argument("--registers", action="store_true", help="compile-only, any machine: each kernel's "
                        "registers, spills and programs per SM for an H100 (needs the plan-gpu extra)")
    parser.add_argument("--fc-kernels", action="append", default=[], metavar="VARIANT[,VARIANT...]",
                        help="the kernel form's variants to time in turn (rows_backward.VARIANTS: "
                             f"{', '.join(rows_backward.VARIANTS)}; default: as the module's flags are)")
    parser.add_argument("--batch", type=int, default=None, help="N embeddings (default 128; --small 100)")
    parser.add_argument("--out", default="fc_kernels.json")
    args = parser.parse_args()
    if args.registers and (ignored := [f"--{name}" for name in ("small", "kernel", "update") if getattr(args, name)]):
        parser.error(f"--registers compiles every row kernel at the full sizes for an H100: {', '.join(ignored)} "
                     "would be ignored")
    variants, combinations = _variants(args.fc_kernels, args.set), _settings(args.set)
    runs = [(variant, settings) for variant in variants for settings in combinations]
    if args.registers:
        rows = []
        for variant, settings in runs:
            _apply(settings)
            with rows_backward.variant(variant):
                rows += [dict(row, variant=_variant_name()) for row in register_rows(settings, args.batch or 128)]
        print_table(rows, ["kernel", "variant", "N", "programs", "warps", "stages", "registers", "spill_bytes",
                           "programs_per_sm", "waves", "settings"])
        return write_json(args.out, rows)
    c, d, t, n, iters, warmup = (4096, 64, 1000, 100, 3, 1) if args.small else (1_048_576, 512, 65_536, 128, 40, 15)
    sizes = (c, d, t, args.batch or n, iters, warmup)
    kernel = "pallas" if jax.devices()[0].platform == "gpu" else "pallas_interpret"
    updates = [case for case in UPDATES if args.update is None or "/".join(case) in args.update]
    kernels = {"stats": (stats_row, STATISTICS), "embedding_grad": (embedding_grad_row, STATISTICS),
               "backward": (backward_row, updates)}  # each kernel's row and its cases
    measured = [(row, case) for name, (row, cases) in kernels.items() if name in (args.kernel or kernels)
                for case in cases]
    rows = []
    for i, (variant, settings) in enumerate(runs):
        _apply(settings)
        with rows_backward.variant(variant):
            for j, (row, case) in enumerate(measured):
                if row is stats_row and variant != variants[0]:
                    continue
                for form in ["xla", kernel] if i == 0 else [kernel]:
                    rng = np.random.default_rng(j)  # each case's inputs the same in every run
                    named = form != "xla" and row is not stats_row  # (the statistics kernel has no variants)
                    rows.append(dict(row(case, form, *sizes, rng), variant=_variant_name() if named else "",
                                     settings=settings if form != "xla" else {}))
                    print(rows[-1], flush=True)
        write_json(args.out, rows)  # after each combination: a sweep stopped by a time limit keeps what it timed
    print_table(rows, ["kernel", "case", "form", "variant", "ms", "least_GB_per_s", "diff_vs_xla", "d_e_diff_vs_xla"])


if __name__ == "__main__":
    main()
