"""The RecordIO reader against the real glyphs files and against files written here in every layout."""

import copy
import gc
import io
import pickle
import struct
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from jaxcls.data import images
from jaxcls.data.recordio import MAGIC, MXFaceDataset, RecordFile, pack, write_records
from jaxcls.errors import DataError
from jaxcls.data.images import decode_image

original_read = RecordFile.read
GLYPHS = Path(__file__).resolve().parents[2] / "shared" / "data" / "glyphs"
needs_glyphs = pytest.mark.skipif(not (GLYPHS / "train.rec").exists(),
                                  reason=f"glyphs data set not found at {GLYPHS} (../shared/data/glyphs)")


@pytest.fixture(params=["simplejpeg", "Pillow"])
def decoder(request, monkeypatch):
    """Each JPEG test with libjpeg-turbo through simplejpeg, and with Pillow alone (as where it is not installed)."""
    if request.param == "Pillow":
        monkeypatch.setattr(images, "simplejpeg", None)
    elif images.simplejpeg is None:
        pytest.skip("simplejpeg is not installed")
    return request.param


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


def test_a_copy_in_the_same_process_reads_its_own_file_after_the_original_is_gone(tmp_path):
    """A pickled (or deep-copied) dataset shares the process id, not the descriptor's lifetime: once the original
    is collected its descriptor closes and the number can name another file; the copy opens its own."""
    ds = MXFaceDataset(write_records(tmp_path, {k: pack(float(k), jpeg(k)) for k in range(3)}))
    copies = [pickle.loads(pickle.dumps(ds)), copy.deepcopy(ds)]
    del ds
    gc.collect()
    with open(tmp_path / "other.txt", "w+b") as other:  # likely takes the freed descriptor's number
        other.write(b"not a record file at all" * 4)
        other.flush()
        for clone in copies:
            assert [clone.raw(i)[1] for i in range(3)] == [0, 1, 2]


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
    with pytest.raises(DataError, match=rf"train.rec \(key 2, .idx line 3, byte offset {offset}\): "
                                         rf"bad magic 0x[0-9a-f]{{8}} at byte offset {offset}"):
        ds[2]


def test_truncated_record(tmp_path):
    root = write_records(tmp_path, {k: pack(float(k), jpeg(k)) for k in range(2)})
    data = (root / "train.rec").read_bytes()
    (root / "train.rec").write_bytes(data[:-20])
    with pytest.raises(DataError, match=r"train.rec \(key 1, .idx line 2, byte offset \d+\): truncated record"):
        MXFaceDataset(root)[1]


def test_bad_index_line(tmp_path):
    root = write_records(tmp_path, {0: pack(0.0, jpeg(0))})
    (root / "train.idx").write_text("0\t0\nnonsense\n")
    with pytest.raises(DataError, match="train.idx:2"):
        MXFaceDataset(root)


def photo_jpeg(seed=0, size=64, **options):
    """A JPEG as Pillow writes it (baseline 4:2:0 unless ``options`` say otherwise): a noisy gradient."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[:size, :size] * (256 // size)
    pixels = np.stack([x, y, (x + y) // 2], -1) + rng.integers(0, 40, (size, size, 3))
    buf = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(buf, "JPEG", **{"quality": 85, **options})
    return buf.getvalue()


def pillow(data):
    with Image.open(io.BytesIO(data)) as img:
        return np.asarray(img.convert("RGB"))


def damaged(data):
    """``{pattern: (damaged bytes, message)}``: every pattern must fail to decode, with that message."""
    pos = 2
    while data[pos + 1] != 0xDA:  # to the scan header
        pos += 2 + int.from_bytes(data[pos + 2:pos + 4], "big")
    start, end = pos + 2 + int.from_bytes(data[pos + 2:pos + 4], "big"), len(data) - 2  # the scan's bytes

    def cut(p):  # a cut point not splitting an FF 00 pair
        while data[p - 1] == 0xFF:
            p += 1
        return p

    a, b = cut(start + (end - start) // 3), cut(start + 2 * (end - start) // 3)
    return {
        "zeroed header": (bytes(16) + data[16:], "cannot identify image file"),
        "truncated in the headers": (data[:start - 20], "runs past the end of the data"),
        "truncated in the scan": (data[:a], r"runs to the end without a marker \(truncated\)"),
        "EOI missing": (data[:-2], r"runs to the end without a marker \(truncated\)"),
        "stray marker in the scan": (data[:a] + b"\xff\xc4" + data[a + 2:], "unexpected marker 0xc4"),
        "restart marker without DRI": (data[:a] + b"\xff\xd3" + data[a + 2:], "restart marker RST3 out of turn"),
        "a third of the scan lost": (data[:a] + data[b:], "JPEG scan data is damaged or truncated"),
        "a third of the scan repeated": (data[:b] + data[a:], "the image ends before the scan's last byte"),
    }


@pytest.mark.parametrize("pattern", list(damaged(photo_jpeg())))
def test_damaged_jpegs_are_errors_naming_the_record(tmp_path, pattern, decoder):
    image, message = damaged(photo_jpeg())[pattern]
    root = write_records(tmp_path, {0: pack(0.0, photo_jpeg()), 1: pack(1.0, image)})
    offset = int((root / "train.idx").read_text().splitlines()[1].split("\t")[1])
    ds = MXFaceDataset(root)
    np.testing.assert_array_equal(ds[0][0], pillow(photo_jpeg()))
    with pytest.raises(DataError, match=rf"train.rec \(key 1, .idx line 2, byte offset {offset}\): "
                                         rf"cannot decode image: .*{message}"):
        ds[1]


@needs_glyphs
@pytest.mark.parametrize("at_least", [0, 48])
def test_damaged_glyph_jpegs_are_errors(decoder, at_least):
    ds = MXFaceDataset(GLYPHS)
    for i in (0, 777, 17999):
        for image, message in damaged(ds.raw(i)[0]).values():
            with pytest.raises(DataError, match=f"^glyph {i}: cannot decode image: .*{message}"):
                decode_image(image, lambda: f"glyph {i}", at_least)


@needs_glyphs
def test_glyph_jpegs_decode_exactly_as_pillow_does(decoder):
    ds = MXFaceDataset(GLYPHS)
    for i in range(0, len(ds), 60):
        np.testing.assert_array_equal(ds[i][0], pillow(ds.raw(i)[0]))


def pillow_draft(data, at_least):
    """Pillow's own reduced-scale JPEG decode (``Image.draft``)."""
    with Image.open(io.BytesIO(data)) as img:
        img.draft("RGB", (at_least, at_least))
        return np.asarray(img.convert("RGB"))


@needs_glyphs
def test_glyphs_decode_at_a_reduced_scale_exactly_as_pillows_draft(decoder):
    ds = MXFaceDataset(GLYPHS)
    for i in range(0, len(ds), 60):
        data = ds.raw(i)[0]
        for at_least in (48, 56):  # 1/2 scale: 56 pixels a side
            image = decode_image(data, at_least=at_least)
            assert image.shape == (56, 56, 3)
            np.testing.assert_array_equal(image, pillow_draft(data, at_least))


@pytest.mark.parametrize("height, width, at_least, expected", [
    (112, 112, 57, (112, 112)), (112, 112, 56, (56, 56)), (112, 112, 28, (28, 28)), (112, 112, 27, (28, 28)),
    (112, 112, 14, (14, 14)), (112, 112, 1, (14, 14)), (113, 90, 45, (57, 45)), (113, 90, 46, (113, 90)),
    (37, 64, 9, (10, 16)),
])
def test_the_reduced_scale_is_the_smallest_of_one_half_quarter_eighth_keeping_both_sides(
        decoder, height, width, at_least, expected):
    data = io.BytesIO()
    Image.fromarray(np.zeros((height, width, 3), np.uint8)).save(data, "JPEG")
    assert decode_image(data.getvalue(), at_least=at_least).shape == (*expected, 3)
    np.testing.assert_array_equal(decode_image(data.getvalue(), at_least=at_least),
                                  pillow_draft(data.getvalue(), at_least))


def test_where_is_only_formatted_for_an_error():
    calls = []

    def where():
        calls.append(1)
        return "the record"

    decode_image(photo_jpeg(), where, 16)
    assert not calls
    with pytest.raises(DataError, match="^the record: cannot decode image"):
        decode_image(photo_jpeg()[:-30], where)
    assert calls == [1]


@pytest.mark.parametrize("options", [{}, {"subsampling": 0}, {"quality": 10, "optimize": True}, {"progressive": True},
                                     {"restart_marker_blocks": 3}, {"restart_marker_rows": 1}])
def test_valid_images_decode_exactly_as_pillow_does(options, decoder):
    for seed, size in ((0, 64), (1, 1), (2, 37)):
        data = photo_jpeg(seed, size, **options)
        np.testing.assert_array_equal(decode_image(data), pillow(data))
        np.testing.assert_array_equal(decode_image(data + b"trailing bytes"), pillow(data))
    gray, cmyk = io.BytesIO(), io.BytesIO()
    Image.fromarray(np.arange(64 * 48, dtype=np.uint8).reshape(64, 48)).save(gray, "JPEG")
    Image.open(io.BytesIO(photo_jpeg())).convert("CMYK").save(cmyk, "JPEG")  # four components: Pillow converts
    for data in (gray.getvalue(), cmyk.getvalue()):
        np.testing.assert_array_equal(decode_image(data), pillow(data))
    np.testing.assert_array_equal(decode_image(jpeg(3)), pillow(jpeg(3)))  # a PNG


def test_restart_markers_out_of_turn():
    data = photo_jpeg(restart_marker_blocks=2)
    first = data.index(b"\xff\xd0")
    second = data.index(b"\xff\xd1")
    swapped = data[:first] + b"\xff\xd1" + data[first + 2:second] + b"\xff\xd0" + data[second + 2:]
    with pytest.raises(DataError, match="restart marker RST1 out of turn"):
        decode_image(swapped)


def test_png_with_a_damaged_chunk():
    data = bytearray(jpeg(4))
    data[data.index(b"IDAT") + 10] ^= 0x01
    with pytest.raises(DataError, match="^x.png: cannot decode image: .*checksum"):
        decode_image(bytes(data), "x.png")


def records(tmp_path, n=3):
    root = write_records(tmp_path, {k: pack(float(k), photo_jpeg(k, 16)) for k in range(n)})
    lines = (root / "train.idx").read_text().splitlines()
    return root, [int(line.split("\t")[1]) for line in lines]


def test_a_bad_idx_offset_names_key_line_and_offset(tmp_path):
    root, offsets = records(tmp_path)
    size = (root / "train.rec").stat().st_size
    for bad, message in ((size + 100, "truncated record: 8 bytes wanted"), (offsets[1] + 4, "bad magic")):
        (root / "train.idx").write_text(f"0\t{offsets[0]}\n\n2\t{bad}\n1\t{offsets[1]}\n")
        ds = MXFaceDataset(root)
        assert ds[0][1] == 0 and ds[1][1] == 1
        with pytest.raises(DataError, match=rf"train.rec \(key 2, .idx line 3, byte offset {bad}\): {message}"):
            ds[2]


def test_a_chunk_longer_than_the_file_fails_at_once(tmp_path):
    root, offsets = records(tmp_path)
    data = bytearray((root / "train.rec").read_bytes())
    data[offsets[1] + 4:offsets[1] + 8] = struct.pack("<I", (1 << 29) - 1)  # cflag 0, 512 MiB
    (root / "train.rec").write_bytes(bytes(data))
    with pytest.raises(DataError, match=rf"truncated record: {(1 << 29) - 1} bytes wanted at byte offset "
                                         rf"{offsets[1] + 8}, the file has {len(data)}"):
        MXFaceDataset(root)[1]


def test_continuation_chunk_where_a_record_starts(tmp_path):
    root, offsets = records(tmp_path)
    data = bytearray((root / "train.rec").read_bytes())
    data[offsets[1] + 7] |= 2 << 5  # cflag 0 → 2
    (root / "train.rec").write_bytes(bytes(data))
    with pytest.raises(DataError, match=rf"continuation flag 2 at byte offset {offsets[1]} starting a record"):
        MXFaceDataset(root)[1]


@pytest.mark.parametrize("label", [float("nan"), -1.0, 2.5, 2.0**31])
def test_a_label_that_is_not_a_class_number(tmp_path, label):
    ds = MXFaceDataset(write_records(tmp_path, {0: pack(0.0, jpeg(0)), 1: pack(label, jpeg(1))}))
    for read in (lambda: ds.raw(1), ds.num_classes):  # a record read, and the count of classes from the headers
        with pytest.raises(DataError, match=r"key 1, .idx line 2, byte offset \d+\): label .* is not a class number"):
            read()


def test_a_key_twice_in_the_index(tmp_path):
    root, offsets = records(tmp_path)
    (root / "train.idx").write_text(f"0\t{offsets[0]}\n1\t{offsets[1]}\n0\t{offsets[2]}\n")
    with pytest.raises(DataError, match="train.idx:3: key 0 is also on line 1"):
        MXFaceDataset(root)


@pytest.mark.parametrize("labels", [[float("nan"), 9.0], [5.0, float("inf")], [5.0, 2.0], [1e30, 1e31], [-3.0, 9.0]])
def test_a_damaged_header_record_is_no_header(tmp_path, labels):
    ds = MXFaceDataset(write_records(tmp_path, {0: pack(labels, b""), **{k: pack(0.0, jpeg(k)) for k in range(1, 5)}}))
    assert ds.header_classes is None and len(ds) == 5
    with pytest.raises(DataError, match=r"train.rec \(key 0, .idx line 1, byte offset 0\): record holds no image"):
        ds.raw(0)


def test_labels_of_a_file_without_a_header_are_read_from_the_headers_alone(tmp_path, monkeypatch, rng):
    """Without insightface's header record the classes are counted from every record: whole records from their first
    ~40 bytes, many at once (im2rec's and shuffle_rec.py's files of tens of millions of images); a split record or
    one with several labels is read as ``raw`` reads it, and a bad one stops the count with ``raw``'s error, or with
    ``bad_records = "skip"`` is left out."""
    labels = rng.integers(0, 50, size=40)
    payloads = {k: pack(float(label), jpeg(k)) for k, label in enumerate(labels)}
    payloads[7] = pack([float(labels[7]), 3.0], jpeg(7))  # flag 2: the first of its labels
    magic = struct.pack("<I", MAGIC)
    image = jpeg(11)  # split where the magic occurs: read whole
    payloads[11] = pack(float(labels[11]), image + b"\0" * (-(24 + len(image)) % 4) + magic + b"tail")
    root = write_records(tmp_path, payloads)
    reads = []
    monkeypatch.setattr(RecordFile, "read", lambda self, offset, where=None: reads.append(offset) or
                        original_read(self, offset, where))
    ds = MXFaceDataset(root)
    reads.clear()  # record 0, read to look for a header
    np.testing.assert_array_equal(ds.labels(), labels)
    assert ds.num_classes() == labels.max() + 1 and len(reads) == 1  # the split record alone
    assert [ds.raw(i)[1] for i in range(len(ds))] == labels.tolist()

    offsets = [int(line.split("\t")[1]) for line in (root / "train.idx").read_text().splitlines()]
    data = bytearray((root / "train.rec").read_bytes())
    data[offsets[5]:offsets[5] + 4] = b"JUNK"
    (root / "train.rec").write_bytes(bytes(data))
    with pytest.raises(DataError, match=rf"train.rec \(key 5, .idx line 6, byte offset {offsets[5]}\): bad magic"):
        MXFaceDataset(root).num_classes()
    skipping = MXFaceDataset.from_config(SimpleNamespace(root=root, bad_records="skip"), 50)
    assert skipping.labels()[5] == -1 and skipping.num_classes() == np.delete(labels, 5).max() + 1



def test_a_16_bit_greyscale_png_keeps_the_high_byte_of_its_levels(rng):
    """As OpenCV's colour read (mxnet's imdecode): level >> 8 in three channels, where Pillow's convert("RGB")
    clips every level above 255 to white."""
    levels = rng.integers(0, 65536, (12, 10)).astype(np.uint16)
    buf = io.BytesIO()
    Image.fromarray(levels).save(buf, "PNG")
    assert Image.open(io.BytesIO(buf.getvalue())).mode == "I;16"
    np.testing.assert_array_equal(decode_image(buf.getvalue(), "x.png"), np.repeat((levels >> 8)[..., None], 3, -1))


def test_labels_of_a_header_file_whose_idx_lacks_a_key_name_the_key(tmp_path):
    """The header announces images 1..4: with key 3 missing from the .idx the count stops at it, naming it (never
    key 4's label for it), as with an offset no file can reach (past 2**63 once the header's bytes are added)."""
    root = write_records(tmp_path, {0: pack([5.0, 7.0], b""), **{k: pack(float(k % 2), jpeg(k)) for k in range(1, 6)}})
    lines = (root / "train.idx").read_text().splitlines()
    (root / "train.idx").write_text("\n".join(lines[:3] + lines[4:]) + "\n")
    with pytest.raises(DataError, match=r"train.rec \(key 3\): key missing from .*train.idx"):
        MXFaceDataset(root).labels()
    (root / "train.idx").write_text("\n".join(lines[:3] + [f"3\t{2**63 - 20}"] + lines[4:]) + "\n")
    with pytest.raises(DataError, match=rf"key 3, .idx line 4, byte offset {2**63 - 20}\): truncated record"):
        MXFaceDataset(root).labels()
