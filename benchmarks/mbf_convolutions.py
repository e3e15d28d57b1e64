"""MobileFaceNet's grouped and depthwise convolutions in each lowering (``jaxcls.models.grouped_conv``), before/after.

    python benchmarks/mbf_convolutions.py                # every part below
    python benchmarks/mbf_convolutions.py --only layers  # or gpu_layers, train_step, embed
    python benchmarks/mbf_convolutions.py --small        # layers at a quarter of their size; a batch of 16
                                                         # embedded in jaxcls's form only (what the tests run)

Parts (``lowering`` ``xla`` is XLA's grouped convolution, the form before; ``platform`` is what jaxcls chooses):

- ``layers``: each grouped layer of mbf at 112 px, forward + both gradients (``jax.vjp``), float32, batch 4, on one
  CPU device: median ms per lowering.
- ``gpu_layers``: the same layers at batch 512 in bfloat16, compiled for one H100 without a GPU
  (``jaxcls.plan.gpu_target``): the program's kernels by kind, the FLOPs of its convolutions (counted: 6 per
  multiply-add of the forward, times the groups for a block-diagonal kernel) and the bytes its kernels read and
  write (``jaxcls.plan.kernels``). Compile-only: nothing is timed. Needs JAX's CUDA plugin.
- ``train_step``: mbf's train step (float32, batch 4, 1,000 classes, one CPU device; ``jaxcls.bench.time_train_step``).
- ``embed``: what ``jaxcls.embed`` runs (``Embedder``: a run's mbf, each batch split over 8 simulated CPU devices)
  at batch 256, in a fresh process: seconds a batch and the process's peak RSS; a process past ``--rss-cap`` GB is
  stopped and its row says so.
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import threading
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jaxcls.startup import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxcls.bench import RowFailed, in_fresh_process, print_table, time_ms, time_train_step, write_json  # noqa: E402
from jaxcls.config import benchmark_config  # noqa: E402
from jaxcls.models import grouped_conv  # noqa: E402

# mbf's grouped layers at 112 px: (name, size, channels, groups, kernel, stride, padding, count in the network)
LAYERS = [("stem 64×2", 56, 128, 64, 3, 1, 1, 1), ("dw128/2", 56, 128, 128, 3, 2, 1, 1),
          ("dw128", 28, 128, 128, 3, 1, 1, 4), ("dw256/2", 28, 256, 256, 3, 2, 1, 1),
          ("dw256", 14, 256, 256, 3, 1, 1, 6), ("dw512/2", 14, 512, 512, 3, 2, 1, 1),
          ("dw256@7", 7, 256, 256, 3, 1, 1, 2), ("gdc", 7, 512, 512, 7, 1, 0, 1)]
PARTS = ("layers", "gpu_layers", "train_step", "embed")


def lowerings(channels: int, groups: int) -> list[str]:
    """``"platform"`` (jaxcls's choice) and every lowering that computes this layer."""
    return ["platform", *grouped_conv.usable(channels // groups)]


def in_form(lowering: str):
    """``grouped_conv.forced`` for a row's ``lowering``: ``"platform"`` forces nothing."""
    return grouped_conv.forced(None if lowering == "platform" else lowering)


def layer_vjp(groups: int, stride: int, padding: int):
    """``(x, kernel, cotangent) -> (y, dx, dkernel)`` of one grouped convolution."""
    def conv(x, kernel):
        return grouped_conv.conv_general_dilated(x, kernel, (stride, stride), ((padding, padding),) * 2,
                                                 dimension_numbers=grouped_conv.NHWC, feature_group_count=groups)

    def forward_and_back(x, kernel, cotangent):
        y, pullback = jax.vjp(conv, x, kernel)
        return y, *pullback(cotangent)
    return forward_and_back


def layer_args(batch: int, size: int, channels: int, groups: int, k: int, stride: int, padding: int, dtype):
    out = (size + 2 * padding - k) // stride + 1
    return [jax.ShapeDtypeStruct(shape, dtype) for shape in
            ((batch, size, size, channels), (k, k, channels // groups, channels), (batch, out, out, channels))]


def cpu_layers(small: bool) -> list[dict]:
    rows, rng = [], np.random.default_rng(0)
    for name, size, channels, groups, k, stride, padding, count in LAYERS:
        if small:
            size, channels, groups, k = max(size // 4, 3), channels // 4, groups // 4, min(k, 3)
        args = [jnp.asarray(rng.standard_normal(a.shape), jnp.float32)
                for a in layer_args(4, size, channels, groups, k, stride, padding, jnp.float32)]
        for lowering in lowerings(channels, groups):
            with in_form(lowering):
                step = jax.jit(layer_vjp(groups, stride, padding)).lower(*args).compile()
            slow = lowering == "xla" and channels != groups  # ~7 s a call
            ms = time_ms(step, *args, warmup=1, iters=2 if slow else 10)
            rows.append({"layer": name, "count": count, "lowering": lowering, "batch": 4, "ms_fwd_bwd": ms})
            print(rows[-1], flush=True)
    return rows


def gpu_layers(target: str) -> list[dict]:
    from jaxcls.plan import gpu_target
    from jaxcls.plan.kernels import kernels

    device = gpu_target.gpu_devices(target, 1)[0]
    placed = jax.sharding.SingleDeviceSharding(device)
    rows = []
    for name, size, channels, groups, k, stride, padding, count in LAYERS:
        args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=placed)
                for a in layer_args(512, size, channels, groups, k, stride, padding, jnp.bfloat16)]
        for lowering in lowerings(channels, groups):
            with in_form(lowering):
                compiled = jax.jit(layer_vjp(groups, stride, padding)).lower(*args).compile(
                    gpu_target.COMPILE_OPTIONS)
            found = kernels(compiled.as_text())
            out = args[2].shape[1]  # forward and both gradients: 3 × 2 FLOPs per multiply-add of the forward
            form = grouped_conv.choose("cuda", groups, channels // groups) if lowering == "platform" else lowering
            gflop = (6 * 512 * out * out * k * k * (channels // groups) * channels
                     * (groups if form == "block_diagonal" else 1) / 1e9)
            convs = sorted({k.detail.replace("__cudnn$", "") for k in found if k.kind == "cuDNN convolution"})
            rows.append({"layer": name, "count": count, "lowering": lowering, "batch": 512, "dtype": "bfloat16",
                         "kernels": len(found), "cudnn_convolutions": sum(k.kind == "cuDNN convolution" for k in found),
                         "fusions": sum(k.kind == "fusion" for k in found), "gflop": gflop,
                         "moved_GiB": sum(k.moved_bytes * k.count for k in found) / 2**30,
                         "convolution_kinds": ", ".join(convs)})
            print(rows[-1], flush=True)
    return rows


def train_step_row(lowering: str) -> dict:
    config = benchmark_config(model="mbf", batch_size=4, num_classes=1000, precision="float32",
                              fc_dtype="float32", sample_rate=1.0)
    with in_form(lowering):
        row = time_train_step(config, steps=3, warmup=1, devices=jax.devices()[:1])
    return {"lowering": lowering, **row}


def embed_row(lowering: str, batch: int, batches: int, rss_cap_gb: float) -> dict:
    """``Embedder`` of a fresh mbf run (arcface_torch's layout, imported) on every device: ``batches`` batches."""
    from jaxcls.interop.arcface_torch import jaxcls_to_torch, write_run
    from jaxcls.interop.inference import Embedder
    from jaxcls.models import create, get_model

    def watch():  # this process's resident memory, read 20 times a second
        while True:
            rss = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
            if rss > rss_cap_gb:
                print(f'{{"lowering": "{lowering}", "batch": {batch}, "devices": {jax.device_count()}, '
                      f'"stopped_at_rss_GB": {rss:.2f}, "after_s": {time.perf_counter() - start:.1f}}}', flush=True)
                os._exit(0)
            time.sleep(0.05)

    with tempfile.TemporaryDirectory() as tmp:
        write_run(jaxcls_to_torch(create(lambda: get_model("mbf")), "mbf"), "mbf", tmp)
        embedder = Embedder(tmp)
        images = np.random.default_rng(0).integers(0, 256, (batch, 112, 112, 3), np.uint8)
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        start = time.perf_counter()
        threading.Thread(target=watch, daemon=True).start()
        times = []
        with in_form(lowering):
            for _ in range(batches):
                began = time.perf_counter()
                embedder(images)
                times.append(time.perf_counter() - began)
    return {"lowering": lowering, "batch": batch, "devices": embedder.devices, "first_batch_s": times[0],
            "s_per_batch": float(np.median(times[1:])), "peak_rss_GB": resource.getrusage(
                resource.RUSAGE_SELF).ru_maxrss / 2**20, "rss_before_first_batch_GB": rss_before}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", choices=PARTS)
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--target", default="h100")
    parser.add_argument("--rss-cap", type=float, default=16.0, help="GB: an embed process past it is stopped")
    parser.add_argument("--out", default="benchmarks/results/mbf_convolutions.json")
    args = parser.parse_args()
    parts, rows = args.only or (("layers", "embed") if args.small else PARTS), []
    if "layers" in parts:
        rows += [dict(r, part="layers") for r in cpu_layers(args.small)]
        print_table([r for r in rows if r["part"] == "layers"], ["layer", "count", "lowering", "ms_fwd_bwd"])
    if "gpu_layers" in parts:
        gpu = [dict(r, part="gpu_layers") for r in gpu_layers(args.target)]
        print_table(gpu, ["layer", "lowering", "cudnn_convolutions", "fusions", "gflop", "moved_GiB",
                          "convolution_kinds"])
        rows += gpu
    if "train_step" in parts:
        steps = [dict(in_fresh_process(train_step_row, lowering), part="train_step")
                 for lowering in ("xla", "platform")]
        print_table(steps, ["lowering", "batch", "ms_per_step", "compile_s"])
        rows += steps
    if "embed" in parts:
        embeds = []
        for lowering in ("platform",) if args.small else ("xla", "platform"):  # small: not XLA's GBs
            try:
                embeds.append(dict(in_fresh_process(embed_row, lowering, 16 if args.small else 256, 3, args.rss_cap),
                                   part="embed"))
            except RowFailed as e:
                embeds.append({"part": "embed", "lowering": lowering, "failed": str(e)[-500:]})
        print_table(embeds, ["lowering", "batch", "devices", "s_per_batch", "peak_rss_GB", "stopped_at_rss_GB"])
        rows += embeds
    write_json(args.out, rows)


if __name__ == "__main__":
    main()
