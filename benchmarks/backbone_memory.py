"""Backbone memory and CPU step time per precision × remat policy, and fused vs unfused ops.

    python benchmarks/backbone_memory.py            # r50 at 112×112, batch 8 (timing: batch 2, 2 steps)
    python benchmarks/backbone_memory.py --small    # the small r18 at 32 px, a two-block ViT-t; what the tests run

Columns: ``saved_bytes`` = activations kept for the backward (the vjp residuals, exact on any backend);
``temp_bytes`` = compiled temp memory of a full gradient step from ``memory_analysis()``. IResNet scans its
identical blocks, so their recomputation runs inside the backward loop and ``temp_bytes`` drops on CPU too;
blocks applied one by one (IResNet's first block per stage, MobileFaceNet, ViT) are recomputed early by
XLA:CPU's scheduler, so there remat shows in ``saved_bytes`` only.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
from flax import nnx

from jaxcls.bench import print_table, write_json
from jaxcls.config import small_r18
from jaxcls.models import create, get_model
from jaxcls.models.layers import REMAT_POLICIES
from jaxcls.precision import DTYPES


def loss_of(model, x):
    return jnp.mean(model(x).astype(jnp.float32) ** 2)


def measure(name, dtype, remat, batch, size, time_batch, steps, **model_kwargs):
    make = lambda: get_model(name, dtype=DTYPES[dtype], remat=remat, input_size=size, **model_kwargs)
    abstract = nnx.eval_shape(make)
    graphdef, state = nnx.split(abstract)
    x = jax.ShapeDtypeStruct((batch, size, size, 3), jnp.float32)
    grad_step = jax.jit(lambda s, x: nnx.grad(loss_of)(nnx.merge(graphdef, s), x))
    compiled = grad_step.lower(state, x).compile()

    abstract.eval()  # frozen statistics: a pure function of the parameters, for jax.vjp
    g, params, rest = nnx.split(abstract, nnx.Param, ...)
    pullback = jax.eval_shape(lambda p, r, x: jax.vjp(lambda p: loss_of(nnx.merge(g, p, r), x), p)[1], params, rest, x)
    saved = sum(r.size * r.dtype.itemsize for r in jax.tree.leaves(pullback))

    row = {"model": name, "dtype": dtype, "remat": remat, "batch": batch, "size": size, "saved_bytes": saved,
           "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
           **{k: str(v) for k, v in model_kwargs.items()}}
    if steps:
        state = nnx.split(create(make))[1]
        step = compiled if time_batch == batch else grad_step
        xs = jax.random.normal(jax.random.key(0), (time_batch, size, size, 3))
        jax.block_until_ready(step(state, xs))
        start = time.perf_counter()
        for _ in range(steps):
            jax.block_until_ready(step(state, xs))
        row["cpu_s_per_image"] = (time.perf_counter() - start) / steps / time_batch
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--model", default="r50")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per config (0: memory only)")
    parser.add_argument("--out", default="benchmarks/results/backbone_memory.json")
    args = parser.parse_args()
    name, size, batch, time_batch = (("r18", 32, 8, 8) if args.small else (args.model, 112, 8, 2))
    dtypes = ("float32",) if args.small else tuple(DTYPES)
    policies = ("none", "full") if args.small else tuple(REMAT_POLICIES)
    kwargs = small_r18() if args.small else {}
    rows = [measure(name, d, r, batch, size, time_batch, 1 if args.small else args.steps, **kwargs)
            for d in dtypes for r in policies]
    activations = ("fused_silu",) if args.small else ("silu", "fused_silu")  # --small: the code path, once
    vit = dict(depth=2) if args.small else {}  # --small: two blocks, the second with its drop path
    rows += [measure("vit_t", "float32", "none", batch, 18 if args.small else 112, time_batch, 0, act=act, **vit)
             for act in activations]
    print_table(rows, ["model", "dtype", "remat", "act", "batch", "size", "saved_bytes", "temp_bytes",
                       "cpu_s_per_image"])
    write_json(args.out, rows)


if __name__ == "__main__":
    main()
