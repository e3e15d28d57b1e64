"""The device's two ceilings, measured where its rows are: memory bandwidth (a large elementwise pass, bytes read plus
bytes written) and the bfloat16 matrix rate (a square product on random data). A lease's floors are these, not the
datasheet's: with them the FC path's floor per sampled row (5 KB with a bfloat16 weight and momentum, 10 KB with
float32: each row read twice and written once, its momentum read and written once) is a time on this card, so rows of
cards with other memory (an H100's 3.35 TB/s, an H200's 4.8 by their datasheets) are read as fractions of their own.

    python benchmarks/device_ceilings.py                 # on the default device: 4 GiB pass, 8192³ product
    python benchmarks/device_ceilings.py --small         # 16 MiB and 256³: what the tests run

Each is the median of 20 synchronized calls after 3 (``jaxcls.bench.time_ms``), on fresh normal draws, never zeros
(a product of zeros runs faster than one of data)."""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from jaxcls.bench import FC_ROW_FLOOR_KB, print_table, time_ms, write_json


def bandwidth_row(gib: float) -> dict:
    """``x + 1`` over a float32 array of ``gib`` GiB: one read and one write of every element."""
    elements = int(gib * 2**30) // 4
    x = jax.random.normal(jax.random.key(0), (elements,), jnp.float32)
    ms = time_ms(jax.jit(lambda v: v + 1), x)
    moved = 2 * 4 * elements
    tb_per_s = moved / ms / 1e9
    return {"measure": "elementwise pass, float32", "size": f"{moved / 2**30:.3g} GiB moved", "ms": ms,
            "TB_per_s": tb_per_s, **{f"floor_ns_per_sampled_row_{dtype}": kb * 1024 / tb_per_s / 1e3
                                     for dtype, kb in FC_ROW_FLOOR_KB.items()}}


def matmul_row(n: int) -> dict:
    """A bfloat16 ``[n, n] @ [n, n]`` with a bfloat16 result (float32 accumulation inside the GEMM)."""
    a, b = (jax.random.normal(key, (n, n), jnp.bfloat16) for key in jax.random.split(jax.random.key(1)))
    ms = time_ms(jax.jit(jnp.matmul), a, b)
    return {"measure": "matrix product, bfloat16", "size": f"{n}³", "ms": ms, "TFLOP_per_s": 2 * n**3 / ms / 1e9}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=4.0, help="size of the elementwise pass's input")
    parser.add_argument("--n", type=int, default=8192, help="side of the square product")
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--out", default="benchmarks/results/device_ceilings.json")
    args = parser.parse_args()
    gib, n = (1 / 64, 256) if args.small else (args.gib, args.n)
    print(f"device: {jax.devices()[0].device_kind}")
    table = [bandwidth_row(gib), matmul_row(n)]
    print_table(table, ["measure", "size", "ms", "TB_per_s", "TFLOP_per_s", "floor_ns_per_sampled_row_bfloat16",
                        "floor_ns_per_sampled_row_float32"])
    write_json(args.out, table)


if __name__ == "__main__":
    main()
