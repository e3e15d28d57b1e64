"""Bytes the FC path's kernels read and write per sampled row, on the XLA:GPU program compiled here (no GPU).

    python benchmarks/fc_bytes_per_row.py                 # bfloat16 and float32 FC states, 4M and 16M classes
    python benchmarks/fc_bytes_per_row.py --classes 2000000 8000000 --fc-dtype bfloat16
    python benchmarks/fc_bytes_per_row.py --small         # 64k and 256k classes, a quick look
    python benchmarks/fc_bytes_per_row.py --fc-dtype bfloat16 --fc-kernels pallas   # what the tests run

The train step (ArcFace or ``--margin``, batch 128 or ``--batch``, PartialFC 0.1, D = 512, bfloat16 compute, SGD with
momentum) is compiled for one H100 (``jaxcls.plan.gpu_target``) at two class counts; the bytes its kernels read and
write (``jaxcls.plan.kernels``) differ by what the extra sampled rows cost, so their difference over the difference in
sampled rows is the FC path's traffic per sampled row, whatever the backbone (``jaxcls.config.small_r18()`` at 32 px
here, for a fast compile). The floor: each sampled row read twice (statistics, then gradient) and written once, with its
momentum read and written once: 5 KB a row in bfloat16, 10 KB in float32.
Each row also gives the bytes per sampled row of each JAX source line's kernels (64 B or more;
``jaxcls.plan.kernels.moved_by_origin``, a gradient's lines marked backward). ``--loss-alone``
counts the loss by itself instead: ``sharded_margin_loss`` forward and backward at C = 1M, N = 512 on one H100.
``--fc-kernels pallas`` counts the looped Triton kernels' form of the FC path (by default the GPU program runs the
statistics kernel, XLA's GEMMs and the update kernel: ``jaxcls.losses.rows_backward.KERNEL_ON_CUDA``; the loss alone
keeps XLA's backward), ``--fc-kernels xla`` XLA's forms.
``--fc-weight-rounding stochastic`` counts a bfloat16 weight rounded stochastically (its bits hashed where they are
used, or written to memory if XLA does not fuse the hash).
Compile-only: it counts bytes, it does not time. Needs JAX's CUDA plugin.
"""

from __future__ import annotations

import argparse
import collections
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only GPUs: no CUDA driver is needed, none is started

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxcls.bench import (FC_KERNELS, FC_KERNELS_HELP, FC_ROW_FLOOR_KB, fc_kernels, print_table,  # noqa: E402
                          write_json)
from jaxcls.config import small_r18, benchmark_config  # noqa: E402
from jaxcls.fc.sampling import sample_budget  # noqa: E402
from jaxcls.losses import arcface, sharded_margin_loss  # noqa: E402
from jaxcls.mesh import make_mesh  # noqa: E402
from jaxcls.plan import gpu_target  # noqa: E402
from jaxcls.plan.kernels import kernels, moved_by_origin  # noqa: E402
from jaxcls.run import build  # noqa: E402

MARGIN_M = {"arcface": 0.5, "cosface": 0.4}  # the step's margin: arcface_torch's m for each (s = 64)


def moved_bytes(fc_dtype: str, classes: int, batch: int, model: str, input_size: int, device, rounding="nearest",
                margin="arcface"):
    """``(bytes the step's kernels read and write per JAX source line, sampled rows)`` at ``classes`` classes."""
    c = benchmark_config(model=model, num_classes=classes, fc_dtype=fc_dtype, precision="bfloat16", batch_size=batch,
                         sample_rate=0.1, num_features=512, fc_weight_rounding=rounding)
    c.margin.name, c.margin.m = margin, MARGIN_M[margin]
    c.data.input_size = input_size
    if model == "r18":
        c.model_kwargs = small_r18()
    run = build(c, [device], with_data=False)
    compiled = run.compile_step(run.abstract_state, gpu_target.COMPILE_OPTIONS)
    rows = sample_budget(run.train_step.head.rows, c.batch_size, c.sample_rate)
    return moved_by_origin(kernels(compiled.as_text())), rows


def loss_alone_bytes(n: int, classes: int, chunk: int | None, device) -> tuple[collections.Counter, int]:
    """Bytes per source line the kernels of ``compiled_loss_alone`` read and write, and its temporaries' bytes."""
    compiled = compiled_loss_alone(n, classes, chunk, device)
    return moved_by_origin(kernels(compiled.as_text())), compiled.memory_analysis().temp_size_in_bytes


def compiled_loss_alone(n: int, classes: int, chunk: int | None, device):
    """``value_and_grad(sharded_margin_loss)`` (ArcFace, D = 512, bfloat16 embeddings, float32 weight, as
    ``benchmarks/loss.py`` times it on a GPU) compiled for ``device``."""
    mesh = make_mesh(devices=[device])
    placed = jax.sharding.SingleDeviceSharding(device)
    args = (jax.ShapeDtypeStruct((n, 512), jnp.bfloat16, sharding=placed),
            jax.ShapeDtypeStruct((classes, 512), jnp.float32, sharding=placed),
            jax.ShapeDtypeStruct((n,), jnp.int32, sharding=placed))
    loss = lambda e, w, y: sharded_margin_loss(e, w, y, arcface(), mesh=mesh, num_classes=classes, chunk_size=chunk)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*args).compile(gpu_target.COMPILE_OPTIONS)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--classes", type=int, nargs=2)
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--fc-dtype", action="append", choices=list(FC_ROW_FLOOR_KB))
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--model", default="r18")
    parser.add_argument("--input-size", type=int, default=32)
    parser.add_argument("--loss-alone", action="store_true", help="instead: the bytes of the loss alone at C = 1M, "
                        "N = 512 (whole and in benchmarks/loss.py's chunks), and their time at the "
                        "target's datasheet bandwidth")
    parser.add_argument("--target", default="h100", choices=list(gpu_target.TARGETS))
    parser.add_argument("--fc-kernels", choices=FC_KERNELS, default=None, help=FC_KERNELS_HELP)
    parser.add_argument("--fc-weight-rounding", choices=["nearest", "stochastic"], default="nearest",
                        help="how a bfloat16 weight's updated rows are rounded (stochastic: bfloat16 only)")
    parser.add_argument("--margin", choices=list(MARGIN_M), default="arcface",
                        help="the step's margin (s = 64; the per-row figures before 2026-11-28 were CosFace's); "
                        "--loss-alone always runs ArcFace, as benchmarks/loss.py does")
    parser.add_argument("--out", default="benchmarks/results/fc_bytes_per_row.json")
    args = parser.parse_args()
    if args.loss_alone:  # its N, C and float32 weight are fixed: a per-row option would be ignored
        ignored = [f"--{name.replace('_', '-')}" for name in ("classes", "small", "fc_dtype", "batch", "model",
                                                              "input_size", "fc_weight_rounding")
                   if getattr(args, name) != parser.get_default(name)]
        if ignored:
            parser.error(f"--loss-alone measures N = 512, C = 1M, a float32 weight: {', '.join(ignored)} would be "
                         "ignored")
    args.classes = args.classes or ([65_536, 262_144] if args.small else [4_000_000, 16_000_000])
    device = gpu_target.gpu_devices(args.target, 1)[0]
    with fc_kernels(args.fc_kernels):
        rows = loss_alone_rows(device, args.target) if args.loss_alone else per_row_rows(args, device)
    write_json(args.out, [dict(row, fc_kernels=args.fc_kernels or "platform") for row in rows])


def loss_alone_rows(device, target: str) -> list[dict]:
    rows, tb_per_s = [], gpu_target.DATASHEET_TB_PER_S[target]
    at = f"ms_at_{tb_per_s}_TB_per_s"  # the key names the bandwidth, so rows of two targets never read as one
    for chunk in (None, 131_072):
        lines, temp = loss_alone_bytes(512, 1 << 20, chunk, device)
        moved = sum(lines.values())
        rows.append({"loss": "sharded" if chunk is None else f"sharded chunk={chunk}", "N": 512, "C": 1 << 20,
                     "moved_GiB": moved / 2**30, at: moved / (tb_per_s * 1e12) * 1e3, "temp_GB": temp / 1e9,
                     "GiB_by_line": {k: v / 2**30 for k, v in lines.most_common() if v >= 2**28}})
    print_table(rows, ["loss", "N", "C", "moved_GiB", at, "temp_GB"])
    return rows


def per_row_rows(args, device) -> list[dict]:
    rows = []
    rounding = args.fc_weight_rounding
    for fc_dtype in args.fc_dtype or (["bfloat16"] if rounding == "stochastic" else list(FC_ROW_FLOOR_KB)):
        (low, low_rows), (high, high_rows) = (moved_bytes(fc_dtype, c, args.batch, args.model, args.input_size, device,
                                                          rounding, args.margin) for c in args.classes)
        per_row = {line: (high[line] - low[line]) / (high_rows - low_rows) for line in high | low}
        rows.append({"fc_dtype": fc_dtype, "fc_weight_rounding": rounding, "margin": args.margin, "model": args.model,
                     "batch": args.batch, "classes": args.classes,
                     "sampled_rows": [low_rows, high_rows], "moved_bytes": [sum(low.values()), sum(high.values())],
                     "kb_per_sampled_row": sum(per_row.values()) / 1024, "floor_kb": FC_ROW_FLOOR_KB[fc_dtype],
                     "bytes_per_row_by_line": dict(sorted(((k, v) for k, v in per_row.items() if abs(v) >= 64),
                                                          key=lambda kv: -kv[1]))})
        print(rows[-1], flush=True)
    print_table(rows, ["fc_dtype", "margin", "model", "batch", "sampled_rows", "kb_per_sampled_row", "floor_kb"])
    return rows


if __name__ == "__main__":
    main()
