"""Sharded margin loss (chunked and not) vs the naive full-logits loss: time, FLOP/s, memory.

    python benchmarks/loss.py                 # GPU sizes: C in {1M, 4M}, N in {128, 512}, D=512, bf16
    python benchmarks/loss.py --cpu           # N=256, D=128, C=65,536 on 8 simulated CPU devices, float32
    python benchmarks/loss.py --small         # seconds; what the test suite runs
    python benchmarks/loss.py --fc-kernels xla   # the chunked loss in one form (jaxcls.bench.FC_KERNELS)

Forward+backward (grads w.r.t. embeddings and weight) under one jit. FLOPs counted as 6·N·D·C (the logits
matmul and its two gradient matmuls).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxcls import batch_sharding, make_mesh, padded_num_classes, weight_sharding
from jaxcls.bench import (FC_KERNELS, FC_KERNELS_HELP, compiled_memory, fc_kernels, peak_device_bytes, print_table,
                          time_ms, write_json)
from jaxcls.losses import arcface, l2_normalize, sharded_margin_loss
from jaxcls.startup import simulate_cpu_devices

MARGIN = arcface()


def naive_loss(emb, weight, labels):
    """Full [N, C] logits on one device, the margin by scatter, optax's integer-label cross-entropy."""
    cos = jnp.dot(l2_normalize(emb).astype(emb.dtype), l2_normalize(weight).astype(emb.dtype).T,
                  preferred_element_type=jnp.float32)
    rows = jnp.arange(emb.shape[0])
    logits = MARGIN.logits(cos).at[rows, labels].set(MARGIN.target_logit(cos[rows, labels]))
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def measure(name, loss_fn, n, d, c, rows, dtype, emb_sharding, w_sharding, iters):
    """Compile and time ``value_and_grad(loss_fn)`` on fresh inputs; ``rows`` is the weight's padded C."""
    peak_before = peak_device_bytes()
    emb = jax.random.normal(jax.random.key(0), (n, d), jnp.float32).astype(dtype)
    weight = 0.01 * jax.random.normal(jax.random.key(1), (rows, d), jnp.float32)
    labels = jax.random.randint(jax.random.key(2), (n,), 0, c)
    emb, labels = jax.device_put((emb, labels), emb_sharding)
    weight = jax.device_put(weight, w_sharding)
    step = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1)))
    compiled = step.lower(emb, weight, labels).compile()
    ms = time_ms(compiled, emb, weight, labels, iters=iters)
    tflops = 6 * n * d * c / (ms * 1e-3) / 1e12
    return {"loss": name, "N": n, "D": d, "C": c, "dtype": jnp.dtype(dtype).name, "ms": ms, "TFLOP/s": tflops,
            **compiled_memory(compiled), "peak_bytes": peak_device_bytes(peak_before)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="the CPU comparison (8 simulated devices)")
    parser.add_argument("--small", action="store_true", help="tiny sizes, for the test suite")
    parser.add_argument("--chunk", type=int, default=None, help="chunk size (default: 1/8 of C_local, ≥ 1024)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--peak-tflops", type=float, default=None, help="matmul ceiling for %% of floor")
    parser.add_argument("--fc-kernels", choices=FC_KERNELS, default=None, help=FC_KERNELS_HELP)
    parser.add_argument("--out", default="benchmarks/results/loss.json")
    args = parser.parse_args()
    if args.cpu or args.small:
        simulate_cpu_devices(8)

    if args.small:
        grid, dtype, args.iters, args.chunk = [(64, 16, 4096)], jnp.float32, 3, 100
    elif args.cpu:
        grid, dtype = [(256, 128, 65_536)], jnp.float32
    else:
        grid, dtype = [(n, 512, c) for c in (1 << 20, 4 << 20) for n in (128, 512)], jnp.bfloat16
    mesh = make_mesh()
    results = []
    for n, d, c in grid:
        rows = padded_num_classes(c, mesh.size)
        c_local = rows // mesh.size
        chunk = args.chunk or max(min(1024, c_local), c_local // 8)
        for name, chunk_size in (("sharded", None), (f"sharded chunk={chunk}", chunk)):
            fn = lambda e, w, y, cs=chunk_size: sharded_margin_loss(e, w, y, MARGIN, mesh=mesh, num_classes=c,
                                                                    chunk_size=cs)
            with fc_kernels(args.fc_kernels):
                results.append(measure(name, fn, n, d, c, rows, dtype, batch_sharding(mesh), weight_sharding(mesh),
                                       args.iters))
        one = NamedSharding(make_mesh(devices=jax.devices()[:1]), P())
        results.append(measure("naive, 1 device", naive_loss, n, d, c, c, dtype, one, one, args.iters))
    for r in results:
        r["devices"] = 1 if r["loss"].startswith("naive") else mesh.size
        r["fc_kernels"] = args.fc_kernels or "platform"
        if args.peak_tflops:
            r["% of floor"] = 100 * r["TFLOP/s"] * (1 if r["devices"] == 1 else 1 / r["devices"]) / args.peak_tflops
    print_table(results, ["loss", "devices", "N", "D", "C", "dtype", "ms", "TFLOP/s", "% of floor", "temp_bytes",
                          "peak_bytes"])
    write_json(args.out, results)


if __name__ == "__main__":
    main()
