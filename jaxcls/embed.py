"""Embeddings of a folder, a ``.rec`` file or a list of images with a trained run or an exported ONNX model.

``python -m jaxcls.embed (--workdir runs/x [--step N] | --onnx model.onnx) --images DIR|FILE.rec|LIST --out emb.npy``

Writes ``emb.npy`` (float32 ``[N, D]``, not normalised; with ``--flip`` each row is the sum of the image's and its
mirror's embeddings, as insightface evaluates) and ``emb.names.txt`` (row ``i``'s image: its path relative to the
folder or list, or its record key in the ``.rec``). Images are expected aligned; other sizes are resized (bilinear).
An image that cannot be read or decoded is reported (which file, why), left out and listed in ``emb.failed.txt``;
``--strict`` stops at the first instead.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import tqdm
from absl import flags

from jaxcls.data.pipeline import to_image
from jaxcls.data.recordio import DataError, MXFaceDataset
from jaxcls.eval.verification import embed_in_batches
from jaxcls.inference import open_embedder
from jaxcls.reporting import configure_logging, run_cli

log = logging.getLogger("jaxcls")
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")


def image_source(spec: str | os.PathLike, size: int) -> tuple[list[str], list[Callable[[], np.ndarray]]]:
    """``(names, loaders)`` of the images of a folder (recursively, by suffix), a ``.rec`` file (with its ``.idx``)
    or a text file listing one image path per line (relative to the list's folder); ``loaders[i]()`` returns
    uint8 ``[size, size, 3]`` RGB or raises ``DataError``/``OSError`` naming the image."""
    path = Path(spec)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
        names = [p.relative_to(path).as_posix() for p in files]
    elif path.suffix == ".rec":
        data = MXFaceDataset(path.parent, path.stem)
        names = [str(k) for k in data.keys]
        loaders = [lambda i=i: to_image(data.raw(i)[0], size, data.where(i)) for i in range(len(data))]
        return names, loaders
    elif path.is_file():
        names = [line.strip() for line in path.read_text().splitlines() if line.strip()]
        files = [path.parent / name for name in names]
    else:
        raise FileNotFoundError(f"{path}: no such folder, .rec file or image list")
    if not names:
        raise DataError(f"{path}: no images in it (looked for {', '.join(IMAGE_SUFFIXES)})")
    return names, [lambda p=p: to_image(p.read_bytes(), size, str(p)) for p in files]


def embed_images(embed: Callable[[np.ndarray], np.ndarray], loaders: Sequence[Callable[[], np.ndarray]],
                 names: Sequence[str], *, batch_size: int = 256, flip: bool = False, strict: bool = False,
                 threads: int = 8, progress: bool = True):
    """``(embeddings float32 [M, D], kept indices [M], failures [(name, message)])``: every image that loads,
    embedded in batches of ``batch_size`` (the last one padded, so one program serves all); images load in
    ``threads`` threads, one batch ahead of the model. ``flip`` adds the mirror image's embedding. ``strict``:
    the first failure raises."""
    failures, kept, out = [], [], []

    def load(i):
        try:
            return loaders[i]()
        except (DataError, OSError) as e:
            if strict:
                raise
            return e

    starts = range(0, len(loaders), batch_size)
    with concurrent.futures.ThreadPoolExecutor(threads) as pool, \
            tqdm.tqdm(total=len(loaders), unit="img", disable=not progress, dynamic_ncols=True) as bar:
        submit = lambda start: [pool.submit(load, i) for i in range(start, min(start + batch_size, len(loaders)))]
        pending = submit(0) if loaders else []
        for start in starts:
            images = [f.result() for f in pending]
            pending = submit(start + batch_size) if start + batch_size < len(loaders) else []
            for i, image in enumerate(images):
                if isinstance(image, Exception):
                    message = str(image) if isinstance(image, DataError) else f"{names[start + i]}: {image}"
                    log.warning("skipped %s", message)
                    failures.append((names[start + i], message))
            good = [i for i, image in enumerate(images) if isinstance(image, np.ndarray)]
            if good:
                batch = np.stack([images[i] for i in good])
                out.append(embed_in_batches(embed, batch, batch_size, flip).astype(np.float32))
                kept.extend(start + i for i in good)
            bar.update(len(images))
    embeddings = np.concatenate(out) if out else np.zeros((0, 0), np.float32)
    return embeddings, np.asarray(kept, np.int64), failures


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
