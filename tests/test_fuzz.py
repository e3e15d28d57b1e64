"""Fuzzing the readers: damaged or crafted ``.rec``/``.idx`` pairs, ``.bin`` pickles, image headers and IJB meta
files give the right data or a ``DataError`` naming the file; never another exception, a hang or a payload run.

Neither format has checksums, so a changed byte inside a record's payload (its labels or image) or inside a ``.bin``
image or pair flag may go unnoticed: there any well-formed result is allowed. A change anywhere else (chunk
headers, padding, the pickle's structure) and any truncation must give exactly the original data or a ``DataError``
naming the file and where in it; no other exception type, and no hang (every test here runs in a few seconds).
"""

import io
import os
import pickle
import re
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from jaxcls.data.recordio import _MAGIC_BYTES, MXFaceDataset, encode_record, pack
from jaxcls.errors import DataError
from jaxcls.data.images import decode_image, max_image_pixels
from jaxcls.eval.verification import load_bin
from test_image_limit import claiming, encoded

# a deadline of 2 s per example: a reader that loops or reads a huge chunk length fails
FUZZ = settings(max_examples=120, deadline=2000, database=None, suppress_health_check=[HealthCheck.too_slow])


def jpeg(seed, comment=b""):
    """A 16×16 JPEG; ``comment`` goes into a COM segment right after SOI."""
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(buf, "JPEG", quality=80)
    data = buf.getvalue()
    if comment:
        data = data[:2] + b"\xff\xfe" + struct.pack(">H", len(comment) + 2) + comment + data[2:]
    return data


# insightface's layout: header record 0 announces images 1..4 of 4 classes. Key 2 is split by MXNet's writer into
# three chunks: the magic sits twice, 4-aligned, in its JPEG's comment.
PAYLOADS = {0: pack([5.0, 9.0], b""), 1: pack(0.0, jpeg(1)),
            2: pack(1.0, jpeg(2, b"ab" + _MAGIC_BYTES + b"cdef" + _MAGIC_BYTES)),
            3: pack([2.0, 5.0, 6.0], jpeg(3)), 4: pack(3.0, jpeg(4))}


def layout():
    """The ``.rec`` bytes, ``.idx`` text and, per key, the file ranges holding its payload."""
    rec, idx, payload_ranges = bytearray(), [], {}
    for key, payload in PAYLOADS.items():
        idx.append(f"{key}\t{len(rec)}\n")
        start, ranges, record = len(rec), [], encode_record(payload)
        pos = 0
        while pos < len(record):  # walk the chunks: payload bytes follow each 8-byte chunk header
            length = struct.unpack_from("<I", record, pos + 4)[0] & ((1 << 29) - 1)
            ranges.append(range(start + pos + 8, start + pos + 8 + length))
            pos += 8 + length + (-length % 4)
        payload_ranges[key] = ranges
        rec += record
    return bytes(rec), "".join(idx), payload_ranges


REC, IDX, PAYLOAD_RANGES = layout()
OFFSETS = {key: ranges[0].start - 8 for key, ranges in PAYLOAD_RANGES.items()}
HOT = sorted({i for ranges in PAYLOAD_RANGES.values() for r in ranges for i in range(r.start - 8, r.start)}
             | {i for ranges in PAYLOAD_RANGES.values() for i in range(ranges[0].start, ranges[0].start + 32)})
assert len(PAYLOAD_RANGES[2]) == 3  # key 2 is split


def write(root, rec, idx):
    (root / "train.rec").write_bytes(rec)
    (root / "train.idx").write_bytes(idx)
    return root


with tempfile.TemporaryDirectory() as d:
    ds = MXFaceDataset(write(Path(d), REC, IDX.encode()))
    EXPECTED = {int(ds.keys[i]): ds[i] for i in range(len(ds))}
    del ds


def test_the_undamaged_files_read_back():
    images = {1: jpeg(1), 2: jpeg(2, b"ab" + _MAGIC_BYTES + b"cdef" + _MAGIC_BYTES), 3: jpeg(3), 4: jpeg(4)}
    assert sorted(EXPECTED) == [1, 2, 3, 4] and [EXPECTED[k][1] for k in images] == [0, 1, 2, 3]
    for key, data in images.items():
        np.testing.assert_array_equal(EXPECTED[key][0], np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))


@st.composite
def damage(draw, data: bytes, hot=(0,)):
    """``data`` with 1–3 runs of 1–8 bytes overwritten (often at a ``hot`` offset), maybe truncated; the changed
    offsets."""
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 3))):
        pos = draw(st.integers(0, len(data) - 1) | st.sampled_from(hot))
        out[pos:pos + 8] = draw(st.binary(min_size=1, max_size=8))[:len(data) - pos]
    if draw(st.booleans()):
        del out[draw(st.integers(0, len(data) - 1)):]
    changed = {i for i in range(len(data)) if i >= len(out) or out[i] != data[i]}
    return bytes(out), changed


def assert_names_where(error: DataError, *files):
    message = str(error)
    assert any(str(f) in message for f in files), message
    assert re.search(r"byte offset \d+|\.idx:\d+|key \d+|image \d+|empty index", message), message


def check_every_key(root, allowed):
    """Each key's image and label: ``allowed(dataset, key, result)``, or a ``DataError`` naming the files."""
    files = root / "train.rec", root / "train.idx"
    try:
        ds = MXFaceDataset(root)
    except DataError as e:
        assert_names_where(e, *files)
        return
    for i in range(len(ds)):
        try:
            image, label = ds[i]
        except DataError as e:
            assert_names_where(e, *files)
            continue
        assert image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3 and isinstance(label, int)
        assert allowed(ds, int(ds.keys[i]), (image, label))


def same(a, b):
    return a[1] == b[1] and np.array_equal(a[0], b[0])


@FUZZ
@given(damage(REC, HOT))
def test_a_damaged_rec_gives_the_right_records_or_errors(damaged):
    rec, changed = damaged

    def allowed(ds, key, result):  # without checksums, changes to a record's payload may go unseen
        return any(i in r for r in PAYLOAD_RANGES[key] for i in changed) or same(result, EXPECTED[key])

    with tempfile.TemporaryDirectory() as d:
        check_every_key(write(Path(d), rec, IDX.encode()), allowed)


@FUZZ
@given(damage(IDX.encode()))
def test_a_damaged_idx_gives_records_or_errors(damaged):
    idx, _ = damaged

    def allowed(ds, key, result):  # a key given another record's offset reads that record: the .idx has no checks
        if ds.index[key][0] == OFFSETS.get(key):
            return same(result, EXPECTED[key])
        return any(same(result, e) for e in EXPECTED.values())

    with tempfile.TemporaryDirectory() as d:
        check_every_key(write(Path(d), REC, idx), allowed)


BINS = [jpeg(k) for k in range(4)]
BIN = pickle.dumps((BINS, [True, False]))
FLAGS_AT = BIN.rindex(BINS[-1]) + len(BINS[-1])  # the pair flags (NEWTRUE, NEWFALSE) come after the last image
BIN_DATA = ({i for b in BINS for i in range(BIN.index(b), BIN.index(b) + len(b))}
            | {i for i in range(FLAGS_AT, len(BIN)) if BIN[i] in (0x88, 0x89)})


@FUZZ
@given(damage(BIN))
def test_a_damaged_bin_gives_the_pairs_or_an_error(damaged):
    data, changed = damaged
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "pairs.bin"
        path.write_bytes(data)
        try:
            images, issame = load_bin(path, size=16)
        except DataError as e:
            assert str(path) in str(e)
            return
    assert images.dtype == np.uint8 and images.shape[1:] == (16, 16, 3) and len(images) == 2 * len(issame)
    assert issame.dtype == bool
    if not changed & BIN_DATA:
        np.testing.assert_array_equal(images, np.stack([decode_image(b) for b in BINS]))
        assert issame.tolist() == [True, False]


@pytest.mark.parametrize("cut", range(0, len(REC), 7))
def test_every_truncation_of_the_rec(cut):
    whole = {key for key, ranges in PAYLOAD_RANGES.items() if ranges[-1].stop <= cut}
    with tempfile.TemporaryDirectory() as d:
        check_every_key(write(Path(d), REC[:cut], IDX.encode()),
                        lambda ds, key, result: key in whole and same(result, EXPECTED[key]))


# Pieces of pickles: well-formed calls of dangerous and of allowed globals in every spelling (GLOBAL, INST,
# STACK_GLOBAL, through the memo), containers and values; a drawn sequence of them is mostly a well-formed pickle.
MARKER = Path(tempfile.gettempdir()) / f"jaxcls-fuzz-marker-{os.getpid()}"
_S = lambda text: b"\x8c" + bytes([len(text)]) + text + b"\x94"  # SHORT_BINUNICODE + MEMOIZE
PICKLE_PIECES = [
    b"cos\nsystem\n", b"cposix\nsystem\n", b"cbuiltins\nexec\n", b"c__builtin__\neval\n", b"csubprocess\ncall\n",
    b"c__builtin__\nbytes\n", b"c_codecs\nencode\n", b"cbuiltins\nbytearray\n", _S(b"os") + _S(b"system") + b"\x93",
    _S(b"builtins") + _S(b"bytes") + b"\x93", b"h\x00", b"h\x01", b"h\x02", b"\x93", b"(S'touch " +
    str(MARKER).encode() + b"'\nios\nsystem\n", b"X\x0b\x00\x00\x00touch /tmp/" + b"\x85R", b"R", b"o", b"\x81",
    b"(", b"t", b"\x85", b"\x86", b"]", b"e", b"a", b")", b"N", b"\x88", b"\x89", b"I01\n", b"U\x02\xff\xd8",
    b"C\x03abc", b"X\x06\x00\x00\x00latin1", b"Q", b"\x82\x01", b"0", b"2", b"b", b"s", b"}", b"\x94",
]


@FUZZ
@given(st.lists(st.sampled_from(PICKLE_PIECES) | st.binary(max_size=6), max_size=24),
       st.sampled_from([b"", b"\x80\x02", b"\x80\x04", b"\x80\x05"]))
def test_a_crafted_pickle_loads_or_is_refused_and_never_runs(pieces, header):
    data = header + b"".join(pieces) + b"."
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "x.bin"
        path.write_bytes(data)
        try:
            images, issame = load_bin(path, size=16)
            assert images.shape == (2 * len(issame), 16, 16, 3)
        except DataError as e:
            assert str(e).startswith(str(path)), e
    assert not MARKER.exists()


@FUZZ
@given(st.binary(max_size=512))
def test_random_bytes_as_a_bin(data):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "x.bin"
        path.write_bytes(data)
        with pytest.raises(DataError, match=f"^{re.escape(str(path))}"):
            load_bin(path, size=16)


@FUZZ
@given(st.sampled_from(["JPEG", "PNG"]), st.integers(0, 65_535), st.integers(0, 65_535), st.integers(0, 400),
       st.sampled_from([0, 16, 112]))
def test_an_image_header_claiming_any_size_decodes_as_claimed_or_is_refused(fmt, width, height, cut, at_least):
    data = claiming(encoded(fmt), width, height)
    data = data[:len(data) - cut] if cut < len(data) else data
    try:
        image = decode_image(data, "x.img", at_least)
    except DataError as e:
        assert str(e).startswith("x.img: cannot decode image"), e
        return
    assert image.dtype == np.uint8 and image.shape[2] == 3 and image.shape[0] * image.shape[1] <= max_image_pixels()


@FUZZ
@given(st.lists(st.tuples(st.integers(-(1 << 70), 1 << 70) | st.integers(0, 8), st.integers(-(1 << 70), 1 << 70)
                          | st.sampled_from(list(OFFSETS.values()))), min_size=1, max_size=6))
def test_an_idx_with_any_numbers(entries):
    idx = "".join(f"{key}\t{offset}\n" for key, offset in entries).encode()
    with tempfile.TemporaryDirectory() as d:
        check_every_key(write(Path(d), REC, idx), lambda ds, key, result: any(same(result, e) for e in
                                                                             EXPECTED.values()))


IJB_FIELD = (st.sampled_from(["1", "-3", "0", "nan", "inf", "-inf", "1e400", str(1 << 64), str(-(1 << 70)), "x.jpg",
                              "0.5", "1.jpg", "", "\x00", "é"]) | st.integers(-(1 << 70), 1 << 70).map(str))


IJB_META = {"name_5pts_score": "1.jpg" + " 1.5" * 10 + " 0.9\n2.jpg" + " 2.5" * 10 + " 0.8\n",
            "face_tid_mid": "1.jpg 1 7\n2.jpg 2 8\n", "template_pair_label": "1 2 0\n"}


def ijb_protocol(root: Path, name: str, data: bytes):
    """``read_protocol`` of a valid two-face release whose meta file ``name`` is replaced by ``data``: a
    ``Protocol`` whose every array is sound, or the ``DataError`` naming the meta file."""
    from jaxcls.eval.ijb import read_protocol
    (root / "meta").mkdir()
    for file, text in IJB_META.items():
        (root / "meta" / f"ijbc_{file}.txt").write_bytes(data if file == name else text.encode())
    try:
        protocol = read_protocol(root, "IJBC")
    except DataError as e:
        assert str(root / "meta") in str(e), e
        return e
    assert len(protocol.names) == len(protocol.scores) == len(protocol.templates) == 2
    assert np.isfinite(protocol.landmarks).all() and np.isfinite(protocol.scores).all()
    assert protocol.pairs.dtype == np.int64 and set(protocol.labels.tolist()) <= {0, 1}
    return protocol


@FUZZ
@given(st.lists(st.lists(IJB_FIELD, min_size=0, max_size=13), max_size=5), st.sampled_from(list(IJB_META)),
       st.binary(max_size=8))
def test_ijb_meta_files_with_any_fields(lines, name, junk):
    with tempfile.TemporaryDirectory() as d:
        ijb_protocol(Path(d), name, "\n".join(" ".join(f) for f in lines).encode() + junk)


@pytest.mark.parametrize("name, line, message", [
    ("name_5pts_score", "1.jpg" + " 1.5" * 9 + " nan 0.9", r"\(line 1\): 'nan' is not a finite number"),
    ("name_5pts_score", "1.jpg" + " 1.5" * 10 + " 1e400", r"\(line 1\): '1e400' is not a finite number"),
    ("face_tid_mid", f"1.jpg {1 << 64} 7", r"\(line 1\): '18446744073709551616' is outside the 64-bit range"),
    ("template_pair_label", f"1 {-(1 << 63) - 1} 0", r"\(line 1\): '-9223372036854775809' is outside the 64-bit"),
    ("template_pair_label", "\xff\xfe", "not a text file"),
])
def test_ijb_meta_values_that_would_poison_the_arrays(tmp_path, name, line, message):
    lines = IJB_META[name].splitlines()  # the first line replaced
    error = ijb_protocol(tmp_path, name, "\n".join([line] + lines[1:]).encode("latin1"))
    assert isinstance(error, DataError) and re.search(message, str(error)), error
