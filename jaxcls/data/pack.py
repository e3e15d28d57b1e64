"""Pack an image folder or an image list into insightface's RecordIO layout: ``train.rec``, ``train.idx``, ``property``.

    python -m jaxcls.data.pack --images DIR --out OUT            # DIR/<class>/<image>
    python -m jaxcls.data.pack --images train.tsv --out OUT      # path<TAB>label lines
    python -m jaxcls.data.pack --images REC --classes 0:750 --out OUT   # some identities of a RecordIO folder

A folder is read as ``jaxcls.data.sources.ImageFolder`` (torchvision's) reads it; a list holds
``path<TAB>label`` lines (PaddlePaddle PLSC's label files; relative paths start at the list's folder, blank lines
are skipped) whose labels must be ``0 … K−1`` with every one used. A RecordIO folder (``train.rec``,
``train.idx``), or a ``.rec`` file with its ``.idx``, is read as ``jaxcls.data.recordio.MXFaceDataset`` reads it;
``--classes A:B`` keeps identities ``A … B−1`` of any input, numbered ``0 … B−A−1`` (a model pretrained on some
identities, fine-tuned on others).

The files are what insightface's tools write and ``MXFaceDataset`` reads: record 0 is a header (``flag = 2``, labels
``(N+1, N+K+1)``); records ``1 … N`` are the images sorted by label (a class's images in their listed order), each
``IRHeader(0, label, key, 0)`` + the image; records ``N+1 … N+K`` give each identity's keys ``(first, last + 1)``.
A header's labels are float32, whole numbers exact up to 2^24: past ``N+K+1 = 2^24`` (WebFace42M's size) the file has
no header and no identity records, records ``0 … N−1`` are the images, and both insightface's reader and
``MXFaceDataset`` take every key of the ``.idx`` as an image.
``property`` is ``K,H,W`` (the first image's size). Every image is decoded once to check it. JPEG files are stored
byte for byte; any other format is encoded as JPEG at ``--quality`` (default 95), since the JPEG path is what the
training pipeline decodes fastest (libjpeg-turbo, and straight at a reduced scale).
"""

from __future__ import annotations

import argparse
import io
import os
import re
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np
import tqdm
from PIL import Image

from jaxcls.data.images import decode_image
from jaxcls.data.recordio import MXFaceDataset, pack, write_records
from jaxcls.data.sources import ImageFolder
from jaxcls.errors import DataError


FLOAT32_EXACT = 2**24  # the largest of the whole numbers a float32 label holds exactly, from 0 on


def folder_images(root: str | os.PathLike) -> tuple[list[Path], list[int]]:
    """``root/<class>/…/<image>`` → (image paths, labels) as ``ImageFolder`` reads them."""
    folder = ImageFolder(root)
    return folder.files, folder.labels().tolist()


def listed_images(path: str | os.PathLike) -> tuple[list[Path], list[int]]:
    """A ``path<TAB>label`` list → (image paths, labels); a malformed line is a ``DataError`` naming ``file:line``."""
    path = Path(path)
    files, labels = [], []
    for line_no, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        name, _, label = line.rpartition("\t")
        if not name.strip() or not label.strip().isdigit():
            raise DataError(f"{path}:{line_no}: expected 'path<TAB>label' with a label 0, 1, 2, …, got {line!r}")
        files.append(path.parent / name.strip())
        labels.append(int(label))
    if not files:
        raise DataError(f"{path}: no 'path<TAB>label' lines")
    return files, labels


class RecordImage(NamedTuple):
    """Image ``index`` of a RecordIO folder, read as the packer reads an image file."""
    dataset: MXFaceDataset
    index: int

    def read_bytes(self) -> bytes:
        return self.dataset.raw(self.index)[0]

    def __str__(self) -> str:
        return self.dataset.where(self.index)


def record_images(root: str | os.PathLike, name: str = "train") -> tuple[list[RecordImage], list[int]]:
    """``root/<name>.rec`` (with its ``.idx``) → (its images, their labels)."""
    dataset = MXFaceDataset(root, name)
    return [RecordImage(dataset, i) for i in range(len(dataset))], dataset.labels().tolist()


def keep_classes(files: list, labels: list[int], classes: str) -> tuple[list, list[int]]:
    """The images of identities ``A … B−1`` (``classes`` is ``"A:B"``), labelled ``0 … B−A−1``."""
    parsed = re.fullmatch(r"(\d+):(\d+)", classes, re.ASCII)
    if not (parsed and int(parsed[1]) < int(parsed[2])):
        raise ValueError(f"--classes {classes!r}: expected A:B with 0 <= A < B")
    first, end = int(parsed[1]), int(parsed[2])
    if not labels or end > max(labels) + 1:
        held = f"identities 0..{max(labels)}" if labels else "no images"
        raise ValueError(f"--classes {classes}: the input has {held} only")
    kept = [i for i, label in enumerate(labels) if first <= label < end]
    if not kept:
        raise ValueError(f"--classes {classes}: the input has no images of identities {first}..{end - 1}")
    return [files[i] for i in kept], [labels[i] - first for i in kept]


def check_labels(labels: list[int], where: str) -> int:
    """The number of classes ``K``: labels must be ``0 … K−1`` with every one used, else a ``DataError`` naming the
    missing ones."""
    num_classes = max(labels) + 1
    missing = np.flatnonzero(np.bincount(labels, minlength=num_classes) == 0)
    if missing.size:
        shown = ", ".join(map(str, missing[:10])) + (f", … ({missing.size} in all)" if missing.size > 10 else "")
        raise DataError(f"{where}: labels must be 0..{num_classes - 1} with every one used; missing: {shown}")
    return num_classes


def stored_image(path: Path | RecordImage, quality: int) -> tuple[bytes, tuple[int, int]]:
    """The bytes to store for one image file or record (JPEG as it is, else encoded as JPEG) and its
    ``(height, width)``."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DataError(f"{path}: cannot read: {e.strerror or e}") from e
    image = decode_image(data, str(path))
    if data[:2] != b"\xff\xd8":
        buf = io.BytesIO()
        Image.fromarray(image).save(buf, "JPEG", quality=quality)
        data = buf.getvalue()
    return data, image.shape[:2]


def pack_images(files: list[Path], labels: list[int], out: str | os.PathLike, quality: int = 95,
                where: str = "images") -> tuple[int, int, tuple[int, int]]:
    """Write ``out/train.rec``, ``train.idx`` and ``property`` (see the module) for images ``files`` of class
    ``labels``; ``(N images, K classes, (height, width) of the first)``. Nothing is left in ``out`` on an error."""
    out = Path(out)
    if (out / "train.rec").exists():
        raise FileExistsError(f"{out / 'train.rec'} exists: remove it or choose another --out")
    n, num_classes = len(files), check_labels(labels, where)
    if num_classes > FLOAT32_EXACT:
        raise ValueError(f"{where}: {num_classes:,} classes; a record's label is a float32, exact for at most "
                         f"{FLOAT32_EXACT:,}")
    headed = n + num_classes + 1 <= FLOAT32_EXACT  # else no header: every record an image (see the module)
    order = np.argsort(labels, kind="stable")
    ends = np.cumsum(np.bincount(labels, minlength=num_classes)) + 1  # one past each class's last key
    sizes = []

    def records():
        if headed:
            yield 0, pack([n + 1, n + num_classes + 1], b"", ids=(0, 1))
        for key, i in enumerate(tqdm.tqdm(order, desc="packing", unit="img", disable=None), int(headed)):
            data, size = stored_image(files[i], quality)
            sizes.append(size)
            yield key, pack(labels[i], data, ids=(key, 0))
        for k, end in enumerate(ends if headed else []):
            start = ends[k - 1] if k else 1
            yield n + 1 + k, pack([start, end], b"", ids=(n + 1 + k, 0))

    try:
        write_records(out, records(), name="train.partial")
    except BaseException:
        for suffix in (".rec", ".idx"):
            (out / f"train.partial{suffix}").unlink(missing_ok=True)
        raise
    for suffix in (".rec", ".idx"):
        (out / f"train.partial{suffix}").replace(out / f"train{suffix}")
    (out / "property").write_text(f"{num_classes},{sizes[0][0]},{sizes[0][1]}\n")
    return n, num_classes, sizes[0]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m jaxcls.data.pack", description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", required=True,
                        help="a folder DIR/<class>/<image>, a path<TAB>label list, a RecordIO folder or a .rec file")
    parser.add_argument("--classes", help="A:B keeps identities A..B-1 only, numbered 0..B-A-1")
    parser.add_argument("--out", required=True, help="the folder to write train.rec, train.idx and property into")
    parser.add_argument("--quality", type=int, default=95, help="JPEG quality for images that are not JPEG (1-100)")
    args = parser.parse_args(argv)
    if not 1 <= args.quality <= 100:
        parser.error(f"--quality {args.quality} is not in 1..100")
    try:
        if not Path(args.images).exists():
            raise FileNotFoundError(f"{args.images}: no such folder or list")
        source = Path(args.images)
        if source.suffix == ".rec":  # the file itself, with the .idx beside it
            files, labels = record_images(source.parent, source.stem)
        elif not source.is_dir():
            files, labels = listed_images(source)
        elif (source / "train.rec").exists():
            files, labels = record_images(source)
        else:
            files, labels = folder_images(source)
        if args.classes:
            files, labels = keep_classes(files, labels, args.classes)
        n, num_classes, (h, w) = pack_images(files, labels, args.out, args.quality, where=args.images)
    except (DataError, OSError, ValueError) as e:
        sys.exit(f"error: {e}")
    print(f"wrote {Path(args.out) / 'train.rec'}, train.idx and property: {n:,} images of {num_classes:,} "
          f"identities, {h}×{w}")


if __name__ == "__main__":
    main()
