"""Input pipeline throughput: RecordIO read + JPEG decode + flip + batch, per decoder, thread count and output size.

    python benchmarks/input_pipeline.py              # glyphs (../shared/data/glyphs), 112×112 JPEGs
    python benchmarks/input_pipeline.py --root DIR   # any insightface RecordIO folder
    python benchmarks/input_pipeline.py --threads 4  # the multi-threaded rows with 4 threads (default: the cores)
    python benchmarks/input_pipeline.py --small      # a small generated file; what the test suite runs

Rows: each decoder alone (Pillow, simplejpeg, OpenCV where installed) on one thread and on ``--threads`` threads
(does it release the GIL?); ``decode_image`` (marker checks + simplejpeg, or Pillow without it); a reduced-scale
decode to 48 pixels (``to_image``: DCT scaling + bilinear) against a full decode + resize; the Grain pipeline
(``HostBatches``) with 1 thread, ``--threads`` threads, twice that, and ``--threads`` worker processes, at the
stored size, and at 48; each augmentation alone (probability 1) per image at both sizes.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from absl import flags
from PIL import Image

from jaxcls.bench import print_table, write_json
from jaxcls.data import augment as augmentations, images as image_decoding
from jaxcls.data.augment import Augment
from jaxcls.data.images import decode_image
from jaxcls.data.pipeline import HostBatches, to_image
from jaxcls.data.recordio import MXFaceDataset, pack, write_records

GLYPHS = Path(__file__).resolve().parents[2] / "shared" / "data" / "glyphs"
REDUCED = 48  # configs/glyphs_r18.py's input size
PIPELINE = "pipeline (read+decode+flip+batch)"


def small_recordio(root: Path, n: int = 512, size: int = 112) -> Path:
    rng = np.random.default_rng(0)
    records = {}
    for k in range(n):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(buf, "JPEG", quality=85)
        records[k] = pack(float(k % 10), buf.getvalue())
    return write_records(root, records)


def pillow(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as img:
        return np.asarray(img.convert("RGB"))


def decoders() -> dict:
    """The raw decoders to compare, ``{name: bytes -> uint8 [H, W, 3]}``: those installed."""
    found = {"Pillow": pillow}
    if image_decoding.simplejpeg is not None:
        found["simplejpeg"] = lambda data: image_decoding.simplejpeg.decode_jpeg(data, "RGB")
    with contextlib.suppress(ImportError):
        import cv2

        cv2.setNumThreads(1)
        found["OpenCV"] = lambda data: cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR_RGB)
    return found


@contextlib.contextmanager
def decoding_with(name: str):
    """jaxcls's decoder: ``simplejpeg`` (when installed) or ``Pillow`` (as without it)."""
    saved = image_decoding.simplejpeg
    if name == "Pillow":
        image_decoding.simplejpeg = None
    try:
        yield
    finally:
        image_decoding.simplejpeg = saved


def best_of(repeats: int, run) -> float:
    """The best of ``repeats`` rates: on a shared machine, the run least slowed by others' work."""
    return max(run() for _ in range(repeats))


def rate(fn, raw: list[bytes], threads: int, repeats: int) -> float:
    """Images per second of ``fn`` over ``raw``, split into ``threads`` threads."""
    fn(raw[0])
    parts = [raw[k::threads] for k in range(threads)]

    def run():
        start = time.perf_counter()
        list(pool.map(lambda part: [fn(data) for data in part], parts))
        return len(raw) / (time.perf_counter() - start)

    with ThreadPoolExecutor(threads) as pool:
        return best_of(repeats, run)


def augment_rate(augment: Augment, images: np.ndarray, repeats: int) -> float:
    """Images per second of ``augment.apply`` on uint8 ``images`` ``[n, S, S, 3]`` (one thread)."""

    def run():
        batch = images.copy()
        start = time.perf_counter()
        augment.apply(batch, 0, np.arange(len(batch)))
        return len(batch) / (time.perf_counter() - start)

    return best_of(repeats, run)


def pipeline_rate(ds, batches: int, batch_size: int, size: int, threads: int, repeats: int, workers: int = 0) -> float:
    it = HostBatches(ds, global_batch=batch_size, rows=(0, batch_size), size=size, seed=0, threads=threads,
                     workers=workers)
    for _ in range(max(threads, workers) + 1):  # start-up: every thread or worker busy
        next(it)

    def run():
        start = time.perf_counter()
        for _ in range(batches):
            next(it)
        return batches * batch_size / (time.perf_counter() - start)

    return best_of(repeats, run)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", help=f"a RecordIO folder (default: {GLYPHS}, or a generated file where it is absent)")
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--out", default="benchmarks/results/input_pipeline.json")
    args = parser.parse_args()
    flags.FLAGS.mark_as_parsed()  # Grain's worker processes read absl flags
    tmp = tempfile.TemporaryDirectory()
    if args.root and (args.small or not Path(args.root, "train.rec").exists()):  # measured, not replaced
        parser.error("--small generates its own file: --root would be ignored" if args.small else
                     f"no train.rec in --root {args.root}")
    root = args.root or (GLYPHS if (GLYPHS / "train.rec").exists() and not args.small else None)
    if root is None:
        print(f"{'--small' if args.small else f'no glyphs at {GLYPHS}'}: a generated file of 512 images", flush=True)
        root = small_recordio(Path(tmp.name))
    ds = MXFaceDataset(root)
    n, batches, batch, repeats = (256, 4, 64, 1) if args.small else (4000, 30, 128, 3)
    raw = [ds.raw(i % len(ds))[0] for i in range(n)]
    stored = ds[0][0].shape[0]
    counts = sorted({1, args.threads})
    ours = ["Pillow"] + ["simplejpeg"] * (image_decoding.simplejpeg is not None)  # jaxcls's decoder, without and with
    rows = []

    def row(stage, decoder, img_per_s, threads=1, workers=0, size=stored):
        rows.append({"stage": stage, "decoder": decoder, "threads": threads, "workers": workers, "size": size,
                     "img_per_s": img_per_s, "img_per_s_per_core": img_per_s / (threads * max(workers, 1))})

    for name, fn in decoders().items():
        for threads in counts:
            row("decode only", name, rate(fn, raw, threads, repeats), threads)
    for name in ours:
        with decoding_with(name):
            row("decode_image (checked)", name, rate(decode_image, raw, 1, repeats))
            row(f"to_image {stored}->{REDUCED} (reduced scale)", name,
                rate(lambda data: to_image(data, REDUCED), raw, 1, repeats), size=REDUCED)
            row(f"decode + resize {stored}->{REDUCED} (full scale)", name,
                rate(lambda data: to_image(decode_image(data), REDUCED), raw, 1, repeats), size=REDUCED)
            for threads in counts:
                row(PIPELINE, name, pipeline_rate(ds, batches, batch, stored, threads, repeats), threads)
    with decoding_with(ours[-1]):
        for threads, workers in ((2 * args.threads, 0), (1, args.threads)):  # past the crossover; processes
            row(PIPELINE, ours[-1], pipeline_rate(ds, batches, batch, stored, threads, repeats, workers), threads,
                workers)
        for threads in counts:
            row(PIPELINE, ours[-1], pipeline_rate(ds, batches, batch, REDUCED, threads, repeats), threads,
                size=REDUCED)
    for size in (stored, REDUCED):  # each augmentation alone, applied to every image
        images = np.stack([to_image(data, size) for data in raw[:512]])
        for name in ("none",) + augmentations.PROBABILITIES:
            augment = Augment(**({} if name == "none" else {name: 1.0}))
            row(f"augment {name} (p=1)", "-", augment_rate(augment, images, repeats), size=size)
    for r in rows:
        r.update(data=str(root), stored_size=stored)
    print_table(rows, ["stage", "decoder", "threads", "workers", "size", "img_per_s", "img_per_s_per_core"])
    write_json(args.out, rows)


if __name__ == "__main__":
    main()
