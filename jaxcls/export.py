"""A run's backbone as ONNX or StableHLO (``jaxcls.interop.export`` says what the files take and give).

``python -m jaxcls.export --workdir runs/x [--step N] --onnx model.onnx [--jax model.jaxexport]``
"""

from __future__ import annotations

import os

from absl import flags

from jaxcls.interop.export import export_run
from jaxcls.reporting import configure_logging, run_cli


def main(argv):
    del argv
    configure_logging(verbose=flags.FLAGS["verbosity"].present)
    f = flags.FLAGS
    step = export_run(f.workdir, f.step, f.onnx, f.jax)
    for path in (f.onnx, f.jax):
        if path:
            print(f"wrote {path} (step {step}, {os.path.getsize(path) / 2**20:.1f} MiB)")


if __name__ == "__main__":
    flags.DEFINE_string("workdir", None, "the training run's workdir", required=True)
    flags.DEFINE_integer("step", None, "checkpoint step (default: latest)")
    flags.DEFINE_string("onnx", None, "write an ONNX model here")
    flags.DEFINE_string("jax", None, "write serialized StableHLO (jax.export) here")
    run_cli(main)
