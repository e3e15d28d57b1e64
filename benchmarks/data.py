"""Input pipeline throughput: RecordIO read + JPEG decode + flip + batch, per core.

    python benchmarks/data.py                      # glyphs (../shared/data/glyphs), 112×112 JPEGs
    python benchmarks/data.py --root DIR           # any insightface RecordIO folder
    python benchmarks/data.py --small              # a small generated file; what the test suite runs

Rows: decode only (PIL, one core), and the Grain pipeline with 1 thread (≈ one core) and with N threads.
"""

from __future__ import annotations

import argparse
import io
import os
import tempfile
import time
from pathlib import Path

import numpy as np
from common import print_table, write_json
from PIL import Image

from jaxcls.data.pipeline import HostBatches
from jaxcls.data.recordio import MXFaceDataset, decode_image, pack, write_records

GLYPHS = Path(__file__).resolve().parents[2] / "shared" / "data" / "glyphs"


def small_recordio(root: Path, n: int = 512, size: int = 112) -> Path:
    rng = np.random.default_rng(0)
    records = {}
    for k in range(n):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(buf, "JPEG", quality=85)
        records[k] = pack(float(k % 10), buf.getvalue())
    return write_records(root, records)


def decode_rate(ds, n):
    raw = [ds.raw(i % len(ds))[0] for i in range(n)]
    start = time.perf_counter()
    for data in raw:
        decode_image(data)
    return n / (time.perf_counter() - start)


def pipeline_rate(ds, batches, batch_size, threads, size):
    it = HostBatches(ds, global_batch=batch_size, rows=(0, batch_size), size=size, seed=0, threads=threads)
    next(it)  # start-up
    start = time.perf_counter()
    for _ in range(batches):
        next(it)
    return batches * batch_size / (time.perf_counter() - start)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default=str(GLYPHS))
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--out", default="benchmarks/results/data.json")
    args = parser.parse_args()
    tmp = tempfile.TemporaryDirectory()
    root = small_recordio(Path(tmp.name)) if args.small or not Path(args.root, "train.rec").exists() else args.root
    ds = MXFaceDataset(root)
    n, batches, batch = (256, 4, 64) if args.small else (4000, 40, 128)
    size = ds[0][0].shape[0]
    rows = [{"stage": "decode only (PIL)", "threads": 1, "img_per_s": decode_rate(ds, n)}]
    for threads in sorted({1, args.threads}):
        rows.append({"stage": "read+decode+flip+batch (Grain)", "threads": threads,
                     "img_per_s": pipeline_rate(ds, batches, batch, threads, size)})
    for r in rows:
        r.update(data=str(root), image_size=size, img_per_s_per_thread=r["img_per_s"] / r["threads"])
    print_table(rows, ["stage", "threads", "img_per_s", "img_per_s_per_thread", "image_size"])
    write_json(args.out, rows)


if __name__ == "__main__":
    main()
