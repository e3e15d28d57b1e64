"""Compiled per-device memory of one FC step, and bytes per class.

One FC step = PartialFC sampling, the sharded margin loss, its gradient w.r.t. the embeddings and a sparse
SGD-momentum update, under one jit with the weight and optimizer state donated, by two routes:

* ``fused``: ``FCHead.step``, what the trainer runs (tiles of rows: loss, gradient, update in one pass);
* ``autodiff``: gather the sampled rows, ``jax.value_and_grad`` of ``sharded_margin_loss``, then
  ``SparseOptimizer.update`` (the composable pieces).

Only compiled (``memory_analysis()``), never run, so large C can be examined on a CPU.

    python benchmarks/fc_memory.py                 # C up to 40M on one device, D=512, N=128
    python benchmarks/fc_memory.py --devices 8     # the same split over 8 (simulated CPU) devices
    python benchmarks/fc_memory.py --small         # seconds; what the test suite runs
    python benchmarks/fc_memory.py --devices 8 --classes 8388608 16777216 --emitters on off jaxcls
                                                   # XLA:CPU's fusion emitters (its default), its elemental emitter,
                                                   # and what the trainer compiles with (FCHead.compiler_options)

bytes/class = (arguments + outputs − donated aliases + temporaries) × devices / C.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from jaxcls import batch_sharding, make_mesh, padded_num_classes, weight_sharding
from jaxcls.bench import print_table, write_json
from jaxcls.fc import FCHead
from jaxcls.fc.optimizers import sgd
from jaxcls.fc.sampling import gather_rows
from jaxcls.losses import arcface, sharded_margin_loss
from jaxcls.mesh import replicated
from jaxcls.precision import ELEMENTAL_EMITTER
from jaxcls.startup import simulate_cpu_devices


def autodiff_step(head, weight, fc_state, emb, labels, sample, lr):
    rows = weight if sample is None else gather_rows(weight, sample, mesh=head.mesh)
    loss_fn = lambda e, r: sharded_margin_loss(e, r, labels, head.margin, mesh=head.mesh, num_classes=head.num_classes,
                                               chunk_size=head.chunk_size,
                                               row_classes=None if sample is None else sample.classes)
    loss, (g_emb, g_rows) = jax.value_and_grad(loss_fn, argnums=(0, 1))(emb, rows)
    weight, fc_state = head.optimizer.update(weight, fc_state, None if sample is None else sample.rows, g_rows, lr,
                                             mesh=head.mesh)
    return loss, g_emb, weight, fc_state


ROUTES = {"fused": lambda head, *args: head.step(*args), "autodiff": autodiff_step}


# XLA:CPU's emitter: jaxlib's default (its fusion emitters), its elemental emitter, or the FC head's choice, as
# ``Run.compile_step`` makes it (the elemental emitter where rows move as bits: ``FCHead.compiler_options``)
EMITTERS = {"on": lambda head: None, "off": lambda head: ELEMENTAL_EMITTER,
            "jaxcls": lambda head: head.compiler_options or None}


def fc_step_memory(mesh, c, n, d, rate, dtype, chunk_size, route, emitters="jaxcls"):
    head = FCHead(mesh, c, d, arcface(), sgd(), sample_rate=rate, chunk_size=chunk_size, dtype=dtype)

    def step(weight, fc_state, emb, labels, key):
        return ROUTES[route](head, weight, fc_state, emb, labels, head.sample(key, labels), 0.1)

    weight, fc_state = jax.eval_shape(head.init, jax.random.key(0))
    w_abs = jax.ShapeDtypeStruct(weight.shape, weight.dtype, sharding=weight_sharding(mesh))
    state_abs = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=(
        weight_sharding(mesh) if s.ndim else replicated(mesh))), fc_state)
    compute = jnp.float32 if dtype == jnp.float32 else jnp.bfloat16
    emb = jax.ShapeDtypeStruct((n, d), compute, sharding=batch_sharding(mesh))
    labels = jax.ShapeDtypeStruct((n,), jnp.int32, sharding=batch_sharding(mesh))
    options = EMITTERS[emitters](head)
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(w_abs, state_abs, emb, labels,
                                                          jax.random.key(0)).compile(options)
    m = compiled.memory_analysis()
    total = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
    return {"route": route, "C": c, "sample_rate": rate, "dtype": jnp.dtype(dtype).name, "chunk": chunk_size, "N": n,
            "D": d, "devices": mesh.size, "emitters": emitters, "argument_bytes": int(m.argument_size_in_bytes),
            "temp_bytes": int(m.temp_size_in_bytes),
            "alias_bytes": int(m.alias_size_in_bytes), "total_bytes_per_device": int(total),
            "GiB_per_device": total / 2**30, "bytes_per_class": total * mesh.size / c}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=None, help="simulate this many CPU devices")
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--classes", type=int, nargs="+", help="class counts (default: 1M, 8M, 30M, 40M)")
    parser.add_argument("--emitters", nargs="+", choices=list(EMITTERS), default=["jaxcls"],
                        help="XLA:CPU's fusion emitters (on: its default), its elemental emitter (off, as the tests "
                             "compile), or the FC head's choice (jaxcls: off where rows move as bits, else on)")
    parser.add_argument("--out", default="benchmarks/results/fc_memory.json")
    args = parser.parse_args()
    if args.devices or args.small:
        simulate_cpu_devices(args.devices or 8)
    if args.small:
        grid, n, d = [65_536], 64, 128
    else:
        grid, n, d = args.classes or [1 << 20, 8 << 20, 30_000_000, 40_000_000], args.batch, args.dim
    mesh = make_mesh()
    dtypes = (jnp.float32,) if args.small else (jnp.float32, jnp.bfloat16)
    cases = ((1.0, None), (0.1, 65_536)) if args.small else ((1.0, None), (1.0, 65_536), (0.1, None), (0.1, 65_536))
    rows = []
    for c in grid:
        for dtype in dtypes:
            for rate, chunk in cases:
                c_local = padded_num_classes(c, mesh.size) // mesh.size
                if chunk is not None and chunk >= rate * c_local:
                    chunk = max(1, int(rate * c_local) // 4)
                for route in ROUTES:
                    rows += [fc_step_memory(mesh, c, n, d, rate, dtype, chunk, route, emitters)
                             for emitters in args.emitters]
    print_table(rows, ["route", "C", "devices", "sample_rate", "dtype", "chunk", "emitters", "GiB_per_device",
                       "temp_bytes", "bytes_per_class"])
    write_json(args.out, rows)


if __name__ == "__main__":
    main()
