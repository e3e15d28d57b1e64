"""An arcface_torch backbone (``.pth``) into a jaxcls run, or a run's backbone back (``jaxcls.interop.arcface_torch``
says how each tensor maps).

``python -m jaxcls.convert --torch backbone.pth --model r50 [--num_features 512] [--key K] --workdir runs/x``
``python -m jaxcls.convert --to-torch model.pth --workdir runs/x [--step N]``
"""

from __future__ import annotations

import os

from absl import flags

from jaxcls.interop.arcface_torch import ARCFACE_MODELS, export_torch, import_torch
from jaxcls.reporting import configure_logging, run_cli


def main(argv):
    del argv  # run_cli refuses positional arguments
    configure_logging(verbose=flags.FLAGS["verbosity"].present)
    f = flags.FLAGS
    if bool(f.torch) == bool(f.to_torch):
        raise ValueError("give either --torch FILE.pth (into a jaxcls run) or --to-torch FILE.pth (out of one)")
    given = [name for name in ("model", "num_features", "key", "step") if f[name].present]
    wrong = [name for name in given if name not in (("model", "num_features", "key") if f.torch else ("step",))]
    if wrong:
        raise ValueError(f"--{', --'.join(wrong)} {'goes' if len(wrong) == 1 else 'go'} with "
                         f"{'--to-torch' if f.torch else '--torch'}, not {'--torch' if f.torch else '--to-torch'}")
    if f.torch:
        if not f.model:
            raise ValueError(f"--torch needs --model, the arcface_torch backbone's name: {', '.join(ARCFACE_MODELS)}")
        config = import_torch(f.torch, f.model, f.workdir, f.num_features, f.key)
        kwargs = f" {dict(config.model_kwargs)}" if config.model_kwargs else ""
        print(f"wrote {f.workdir}: arcface_torch {f.model} as jaxcls {config.model}{kwargs}, {config.num_features}-d "
              "embeddings, checkpoint 0")
    else:
        step, name = export_torch(f.workdir, f.to_torch, f.step)
        print(f"wrote {f.to_torch}: arcface_torch {name} state dict of {f.workdir} step {step} "
              f"({os.path.getsize(f.to_torch) / 2**20:.1f} MiB)")


if __name__ == "__main__":
    flags.DEFINE_string("torch", None, "an arcface_torch backbone's state dict (.pth) to write as a jaxcls run")
    flags.DEFINE_string("model", None, f"with --torch: the backbone's arcface_torch name ({', '.join(ARCFACE_MODELS)})")
    flags.DEFINE_integer("num_features", None, "with --torch: its embedding size (default: the file's)")
    flags.DEFINE_string("key", None, "with --torch: the state dict's entry in a file holding several (e.g. "
                        "arcface_torch's checkpoint_gpu_0.pt: state_dict_backbone)")
    flags.DEFINE_string("to_torch", None, "write the run's backbone here as an arcface_torch state dict (.pth)")
    flags.DEFINE_alias("to-torch", "to_torch")
    flags.DEFINE_string("workdir", None, "the jaxcls run: written by --torch, read by --to-torch", required=True)
    flags.DEFINE_integer("step", None, "with --to-torch: the checkpoint step (default: the latest)")
    run_cli(main)
