"""The RecordIO reader against the real glyphs files and against files written here in every layout."""

import io
import struct
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from jaxcls.data.recordio import MAGIC, MXFaceDataset, RecordError, pack, write_records

GLYPHS = Path(__file__).resolve().parents[2] / "shared" / "data" / "glyphs"
needs_glyphs = pytest.mark.skipif(not (GLYPHS / "train.rec").exists(),
                                  reason=f"glyphs data set not found at {GLYPHS} (../shared/data/glyphs)")


@needs_glyphs
def test_reads_glyphs():
    ds = MXFaceDataset(GLYPHS)
    assert len(ds) == 18000 and ds.header_classes == 1500 and ds.num_classes() == 1500
    image, label = ds[0]
    assert image.shape == (112, 112, 3) and image.dtype == np.uint8 and label == 0
    assert ds[len(ds) - 1][1] == 1499
    labels = ds.labels()
    assert labels.min() == 0 and labels.max() == 1499 and len(np.unique(labels)) == 1500


def jpeg(seed, size=16):
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (size, size, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def test_insightface_header(tmp_path):
    images = {k: pack(float(k % 3), jpeg(k)) for k in range(1, 7)}
    header = pack([7.0, 10.0], b"")
    ds = MXFaceDataset(write_records(tmp_path, {0: header, **images}))
    assert len(ds) == 6 and ds.header_classes == 3
    assert [ds[i][1] for i in range(6)] == [1, 2, 0, 1, 2, 0]


def test_no_header_plain_im2rec(tmp_path):
    ds = MXFaceDataset(write_records(tmp_path, {k: pack(float(k), jpeg(k)) for k in range(5)}))
    assert len(ds) == 5 and ds.header_classes is None and ds.num_classes() == 5
    np.testing.assert_array_equal(ds[2][0], np.asarray(Image.open(io.BytesIO(jpeg(2))).convert("RGB")))


def test_multi_float_labels_use_the_first(tmp_path):
    ds = MXFaceDataset(write_records(tmp_path, {k: pack([float(k), 9.5, 3.0], jpeg(k)) for k in range(3)}))
    assert [ds[i][1] for i in range(3)] == [0, 1, 2]


def test_split_records_are_joined(tmp_path):
    magic = struct.pack("<I", MAGIC)
    image = jpeg(1)
    # put the magic inside the payload at a 4-aligned offset, twice: start, middle and end parts
    pad = b"\0" * (-(24 + len(image)) % 4)
    tricky = image + pad + magic + b"abcd" + magic + b"tail"
    data = pack(4.0, tricky)
    assert data.count(magic) == 2
    root = write_records(tmp_path, {0: data})
    assert struct.unpack("<II", (root / "train.rec").read_bytes()[:8])[1] >> 29 == 1  # really split
    ds = MXFaceDataset(root)
    raw, label = ds.raw(0)
    assert raw == tricky and label == 4


def test_corrupt_magic_names_file_and_offset(tmp_path):
    root = write_records(tmp_path, {k: pack(float(k), jpeg(k)) for k in range(3)})
    offset = int((root / "train.idx").read_text().splitlines()[2].split("\t")[1])
    data = bytearray((root / "train.rec").read_bytes())
    data[offset:offset + 4] = b"JUNK"
    (root / "train.rec").write_bytes(bytes(data))
    ds = MXFaceDataset(root)
    assert ds[0][1] == 0
    with pytest.raises(RecordError, match=rf"train.rec: bad magic 0x[0-9a-f]{{8}} at byte offset {offset}"):
        ds[2]


def test_truncated_record(tmp_path):
    root = write_records(tmp_path, {k: pack(float(k), jpeg(k)) for k in range(2)})
    data = (root / "train.rec").read_bytes()
    (root / "train.rec").write_bytes(data[:-20])
    with pytest.raises(RecordError, match="truncated record at byte offset"):
        MXFaceDataset(root)[1]


def test_bad_index_line(tmp_path):
    root = write_records(tmp_path, {0: pack(0.0, jpeg(0))})
    (root / "train.idx").write_text("0\t0\nnonsense\n")
    with pytest.raises(RecordError, match="train.idx:2"):
        MXFaceDataset(root)
