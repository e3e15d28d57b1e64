"""Inference throughput of an exported backbone: onnxruntime vs JAX (the same float32 eval-mode model).

    python benchmarks/inference_runtimes.py          # r50, 112×112, batch 64: JAX, onnxruntime, jax.export round trip
    python benchmarks/inference_runtimes.py --small  # r18 (width 8) at 112×112, batch 8; what the test suite runs

Rows: ``runtime`` (jax = ``jax.jit`` of the model on the default device, stablehlo = the deserialized
``.jaxexport``, onnxruntime = the ``.onnx`` file on its CPU or CUDA provider), ``img_per_s`` (median over
``iters`` batches after warm-up), ``export_s`` (seconds to write the file), ``max_rel_err`` (largest
difference to JAX relative to the embedding's largest entry). Needs jax2onnx and onnxruntime.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import jax
import numpy as np

from jaxcls.bench import print_table, time_ms, write_json
from jaxcls.config import small_r18
from jaxcls.interop.export import export_jax, export_onnx, load_jax_export
from jaxcls.interop.inference import OnnxEmbedder, agreement, deployed, deployed_input
from jaxcls.models import create, get_model


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--out", default="benchmarks/results/inference_runtimes.json")
    args = parser.parse_args()
    name, kwargs, batch, iters = ("r18", small_r18(), 8, 3) if args.small else ("r50", {}, 64, 3)
    model = create(lambda: get_model(name, 512, input_size=112, **kwargs))
    model.eval()
    images = np.random.default_rng(0).integers(0, 256, (batch, 112, 112, 3), dtype=np.uint8)
    x = deployed_input(images)
    reference = np.asarray(jax.jit(deployed(model))(x))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        export_jax(model, os.path.join(tmp, "m.jaxexport"), 112)
        jax_export_s = time.perf_counter() - start
        start = time.perf_counter()
        export_onnx(model, os.path.join(tmp, "m.onnx"), 112)
        onnx_export_s = time.perf_counter() - start
        runtimes = {"jax": (jax.jit(deployed(model)), x, None),
                    "stablehlo": (load_jax_export(os.path.join(tmp, "m.jaxexport")), x, jax_export_s),
                    "onnxruntime": (OnnxEmbedder(os.path.join(tmp, "m.onnx")), images, onnx_export_s)}
        for runtime, (fn, inputs, export_s) in runtimes.items():
            ms = time_ms(fn, inputs, warmup=1, iters=iters)
            err = agreement(fn(inputs), reference)[1]
            rows.append({"runtime": runtime, "model": name, "batch": batch, "ms_per_batch": ms,
                         "img_per_s": batch / ms * 1e3, "export_s": export_s, "max_rel_err": float(err),
                         "threads": os.cpu_count()})
    print_table(rows, ["runtime", "model", "batch", "ms_per_batch", "img_per_s", "export_s", "max_rel_err"])
    write_json(args.out, rows)


if __name__ == "__main__":
    main()
