"""Embeddings of a folder, a ``.rec`` file or a list of images with a trained run or an exported ONNX model.

``python -m jaxcls.embed (--workdir runs/x [--step N] | --onnx model.onnx) --images DIR|FILE.rec|LIST --out emb.npy``

Writes ``emb.npy`` (float32 ``[N, D]``, not normalised; with ``--flip`` each row is the sum of the image's and its
mirror's embeddings, as insightface evaluates) and ``emb.names.txt`` (row ``i``'s image: its path relative to the
folder or list, or its record key in the ``.rec``). Images are expected aligned; other sizes are resized (bilinear).
An image that cannot be read or decoded is reported (which file, why), left out and listed in ``emb.failed.txt``;
``--strict`` stops at the first instead.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from absl import flags

from jaxcls.interop.inference import embed_images, image_source, open_embedder
from jaxcls.reporting import configure_logging, run_cli


def run(images: str, out: str, *, workdir=None, onnx=None, step=None, batch_size=256, flip=False, strict=False,
        progress=True) -> tuple[np.ndarray, list[str], list]:
    """The CLI as a function: writes ``out`` (``.npy`` added if missing), ``<out>.names.txt`` and (when any)
    ``<out>.failed.txt``."""
    out = Path(out) if str(out).endswith(".npy") else Path(f"{out}.npy")
    out.parent.mkdir(parents=True, exist_ok=True)  # before hours of work, not after
    embedder = open_embedder(workdir, onnx, step)
    names, loaders = image_source(images, embedder.input_size)
    embeddings, kept, failures = embed_images(embedder, loaders, names, batch_size=batch_size, flip=flip,
                                              strict=strict, progress=progress)
    stem = out.with_suffix("")
    np.save(out, embeddings)
    Path(f"{stem}.names.txt").write_text("".join(f"{names[i]}\n" for i in kept))
    failed = Path(f"{stem}.failed.txt")
    if failures:
        failed.write_text("".join(f"{name}\t{message}\n" for name, message in failures))
    elif failed.exists():
        failed.unlink()  # from an earlier run of the same command
    return embeddings, [names[i] for i in kept], failures


def main(argv):
    del argv
    f = flags.FLAGS
    configure_logging(verbose=f["verbosity"].present)
    embeddings, names, failures = run(f.images, f.out, workdir=f.workdir, onnx=f.onnx, step=f.step,
                                      batch_size=f.batch_size, flip=f.flip, strict=f.strict)
    stem = Path(f.out.removesuffix(".npy"))
    print(f"wrote {stem}.npy ({embeddings.shape[0]:,} × {embeddings.shape[1]} float32) and {stem}.names.txt"
          + (f"; {len(failures):,} image{'s' if len(failures) > 1 else ''} could not be read, listed in "
               f"{stem}.failed.txt" if failures else ""))


if __name__ == "__main__":
    flags.DEFINE_string("workdir", None, "a training run's workdir (its latest or --step checkpoint)")
    flags.DEFINE_integer("step", None, "checkpoint step (default: latest)")
    flags.DEFINE_string("onnx", None, "an exported .onnx model instead of a workdir")
    flags.DEFINE_string("images", None, "a folder, a .rec file or a text file listing image paths", required=True)
    flags.DEFINE_string("out", None, "the .npy file to write", required=True)
    flags.DEFINE_integer("batch_size", 256, "images per batch (split over every local device)")
    flags.DEFINE_bool("flip", False, "add each image's mirror embedding (insightface's flip test)")
    flags.DEFINE_bool("strict", False, "stop at the first unreadable image instead of skipping it")
    run_cli(main)
