"""``python -m jaxcls.data.pack``: folders and lists packed into insightface's layout read back by MXFaceDataset."""

import io
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from jaxcls.data.pack import check_labels, folder_images, keep_classes, main, pack_images
from jaxcls.errors import DataError
from jaxcls.data.recordio import MXFaceDataset

GLYPHS = Path(__file__).resolve().parents[2] / "shared" / "data" / "glyphs"


def encoded(seed, fmt="JPEG", size=(20, 24)):
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)).save(buf, fmt)
    return buf.getvalue()


def payload_header(ds, key):
    """``(flag, label, id, id2, extra float32 labels)`` of record ``key``."""
    payload = ds._read(key)
    flag, label, id_, id2 = struct.unpack_from("<IfQQ", payload)
    return flag, label, id_, id2, struct.unpack_from(f"<{flag}f", payload, 24) if flag else ()


def folder(tmp_path):
    """Classes ``b`` (2 JPEGs), ``a`` (1 JPEG, 1 PNG), ``c`` (1 JPEG): ``{(class, name): bytes}``."""
    images = {("b", "0.jpg"): encoded(0), ("b", "1.jpg"): encoded(1), ("a", "x.jpg"): encoded(2),
              ("a", "y.png"): encoded(3, "PNG"), ("c", "z.jpeg"): encoded(4)}
    for (cls, name), data in images.items():
        (tmp_path / "images" / cls).mkdir(parents=True, exist_ok=True)
        (tmp_path / "images" / cls / name).write_bytes(data)
    return tmp_path / "images", images


def test_a_folder_round_trips(tmp_path):
    root, images = folder(tmp_path)
    pack_images(*folder_images(root), tmp_path / "out")
    ds = MXFaceDataset(tmp_path / "out")
    assert len(ds) == 5 and ds.num_classes() == 3 and (tmp_path / "out" / "property").read_text() == "3,20,24\n"
    expected = [("a", "x.jpg"), ("a", "y.png"), ("b", "0.jpg"), ("b", "1.jpg"), ("c", "z.jpeg")]  # sorted classes
    assert [ds.raw(i)[1] for i in range(5)] == [0, 0, 1, 1, 2]
    for i, name in enumerate(expected):
        if name[1].endswith("png"):  # stored as a JPEG of the same pixels, quality 95
            jpeg = io.BytesIO()
            Image.open(io.BytesIO(images[name])).save(jpeg, "JPEG", quality=95)
            assert ds.raw(i)[0] == jpeg.getvalue()
        else:
            assert ds.raw(i)[0] == images[name]  # byte for byte
    # insightface's header and identity records: each class's keys [first, last + 1)
    assert payload_header(ds, 0) == (2, 0.0, 0, 1, (6.0, 9.0))
    assert [payload_header(ds, k)[4] for k in (6, 7, 8)] == [(1.0, 3.0), (3.0, 5.0), (5.0, 6.0)]
    assert [payload_header(ds, k)[:4] for k in range(1, 6)] == [(0, float(y), k, 0) for k, y in
                                                                zip(range(1, 6), [0, 0, 1, 1, 2])]


def test_a_list_round_trips_sorted_by_label_in_listed_order(tmp_path):
    root, images = folder(tmp_path)
    (tmp_path / "lists").mkdir()
    lines = ["../images/c/z.jpeg\t1", "", f"{root / 'b' / '1.jpg'}\t0", "../images/a/x.jpg\t1", "../images/b/0.jpg\t0"]
    (tmp_path / "lists" / "train.tsv").write_text("\n".join(lines) + "\n")
    main(["--images", str(tmp_path / "lists" / "train.tsv"), "--out", str(tmp_path / "out")])
    ds = MXFaceDataset(tmp_path / "out")
    assert ds.num_classes() == 2
    got = [ds.raw(i) for i in range(len(ds))]
    assert got == [(images["b", "1.jpg"], 0), (images["b", "0.jpg"], 0), (images["c", "z.jpeg"], 1),
                   (images["a", "x.jpg"], 1)]


@pytest.mark.skipif(not (GLYPHS / "train.rec").exists(), reason=f"glyphs data set not found at {GLYPHS}")
def test_the_records_are_those_mxnet_wrote_for_glyphs(tmp_path):
    glyphs = MXFaceDataset(GLYPHS)
    lines = []
    for i in range(36):  # the first three identities
        (tmp_path / f"{i}.jpg").write_bytes(glyphs.raw(i)[0])
        lines.append(f"{i}.jpg\t{glyphs.raw(i)[1]}")
    (tmp_path / "list.tsv").write_text("\n".join(lines))
    main(["--images", str(tmp_path / "list.tsv"), "--out", str(tmp_path / "out")])
    ds = MXFaceDataset(tmp_path / "out")
    assert all(ds._read(k) == glyphs._read(k) for k in range(1, 37))  # IRHeader(0, label, key, 0) + the JPEG
    assert payload_header(ds, 0)[:4] == payload_header(glyphs, 0)[:4]
    assert [payload_header(ds, k)[4] for k in (37, 38, 39)] == [payload_header(glyphs, k)[4]
                                                               for k in (18001, 18002, 18003)]
    assert (tmp_path / "out" / "property").read_text() == (GLYPHS / "property").read_text().replace("1500", "3")


def test_some_identities_of_a_recordio_folder_are_repacked_numbered_from_zero(tmp_path):
    root, images = folder(tmp_path)
    main(["--images", str(root), "--out", str(tmp_path / "all")])
    main(["--images", str(tmp_path / "all" / "train.rec"), "--classes", "1:3", "--out", str(tmp_path / "bc")])
    ds = MXFaceDataset(tmp_path / "bc")
    assert ds.num_classes() == 2 and (tmp_path / "bc" / "property").read_text() == "2,20,24\n"
    assert [ds.raw(i) for i in range(len(ds))] == [(images["b", "0.jpg"], 0), (images["b", "1.jpg"], 0),
                                                  (images["c", "z.jpeg"], 1)]
    assert [payload_header(ds, k)[4] for k in (4, 5)] == [(1.0, 3.0), (3.0, 4.0)]  # each identity's keys


def test_a_rec_file_is_read_itself_not_its_folders_train_rec(tmp_path):
    root, images = folder(tmp_path)
    main(["--images", str(root), "--out", str(tmp_path / "in")])
    for suffix in (".rec", ".idx"):  # beside a train.rec of other images
        (tmp_path / "in" / f"train{suffix}").rename(tmp_path / "in" / f"other{suffix}")
    (tmp_path / "one" / "z").mkdir(parents=True)
    (tmp_path / "one" / "z" / "q.jpg").write_bytes(encoded(9))
    main(["--images", str(tmp_path / "one"), "--out", str(tmp_path / "in")])
    main(["--images", str(tmp_path / "in" / "other.rec"), "--out", str(tmp_path / "out")])
    ds = MXFaceDataset(tmp_path / "out")  # other.rec's 5 images, not train.rec's one
    assert [ds.raw(i)[1] for i in range(len(ds))] == [0, 0, 1, 1, 2] and ds.raw(4)[0] == images["c", "z.jpeg"]


def test_past_float32s_whole_numbers_the_file_has_no_header_and_reads_back_whole(tmp_path, monkeypatch):
    """A header holds ``N+K+1`` as a float32: past 2^24 it would round and drop or add images. With the limit
    lowered to 8, 5 images of 3 classes (5 + 3 + 1 = 9) are written as records 0..4, no header, no identities."""
    root, images = folder(tmp_path)
    monkeypatch.setattr("jaxcls.data.pack.FLOAT32_EXACT", 8)
    pack_images(*folder_images(root), tmp_path / "out")
    ds = MXFaceDataset(tmp_path / "out")
    assert ds.keys.tolist() == [0, 1, 2, 3, 4] and ds.header_classes is None and ds.num_classes() == 3
    assert [ds.raw(i)[1] for i in range(5)] == [0, 0, 1, 1, 2] and ds.raw(2)[0] == images["b", "0.jpg"]
    assert [payload_header(ds, k)[:4] for k in range(5)] == [(0, float(y), k, 0) for k, y in
                                                             enumerate([0, 0, 1, 1, 2])]
    monkeypatch.setattr("jaxcls.data.pack.FLOAT32_EXACT", 9)  # exactly representable: the header is written
    pack_images(*folder_images(root), tmp_path / "exact")
    assert MXFaceDataset(tmp_path / "exact").header_classes == 3
    monkeypatch.setattr("jaxcls.data.pack.FLOAT32_EXACT", 2)
    with pytest.raises(ValueError, match="3 classes; a record's label is a float32, exact for at most 2"):
        pack_images(*folder_images(root), tmp_path / "classes")


@pytest.mark.parametrize("classes, message", [("2:1", "expected A:B with 0 <= A < B"), ("1", "expected A:B"),
                                              ("a:b", "expected A:B"), ("\u00b2:3", "expected A:B"),
                                              ("1:4", "the input has identities 0..2 only")])
def test_a_bad_class_range_is_named(tmp_path, classes, message):
    root, _ = folder(tmp_path)
    with pytest.raises(SystemExit, match=f"^error: --classes '?{classes}'?: {message}"):
        main(["--images", str(root), "--classes", classes, "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_a_class_range_without_images_is_named(tmp_path):
    root, _ = folder(tmp_path)
    (root / "aa").mkdir()  # an empty class folder: refused as the trainer's folder reader refuses it
    with pytest.raises(SystemExit, match=rf"^error: {root}: no images in 1 of its 4 class folders: aa "):
        main(["--images", str(root), "--classes", "1:2", "--out", str(tmp_path / "out")])
    # an input whose labels skip one (a list file's, a RecordIO file's)
    with pytest.raises(ValueError, match=r"^--classes 1:2: the input has no images of identities 1..1$"):
        keep_classes(["x.jpg", "y.jpg"], [0, 2], "1:2")


def test_the_command_line(tmp_path):
    root, _ = folder(tmp_path)
    run = [sys.executable, "-m", "jaxcls.data.pack", "--images", str(root), "--out", str(tmp_path / "out")]
    proc = subprocess.run(run, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "5 images of 3 identities, 20×24" in proc.stdout
    again = subprocess.run(run, capture_output=True, text=True)
    assert again.returncode == 1 and again.stderr.strip() == f"error: {tmp_path / 'out' / 'train.rec'} exists: " \
                                                             "remove it or choose another --out"


@pytest.mark.parametrize("lines, message", [
    (["a.jpg 0"], r"list.tsv:1: expected 'path<TAB>label'"),
    (["a.jpg\t0", "", "b.jpg\tseven"], r"list.tsv:3: expected 'path<TAB>label'"),
    (["a.jpg\t-1"], r"list.tsv:1: expected 'path<TAB>label'"),
    (["\t0"], r"list.tsv:1: expected 'path<TAB>label'"),
    ([""], r"list.tsv: no 'path<TAB>label' lines"),
    (["a.jpg\t0", "b.jpg\t2", "a.jpg\t4"], r"list.tsv: labels must be 0..4 with every one used; missing: 1, 3$"),
    (["a.jpg\t0", "missing.jpg\t0"], r"missing.jpg: cannot read: No such file or directory"),
    (["a.jpg\t0", "broken.jpg\t0"], r"broken.jpg: cannot decode image"),
])
def test_errors_name_the_line_image_or_labels(tmp_path, lines, message):
    (tmp_path / "a.jpg").write_bytes(encoded(0))
    (tmp_path / "b.jpg").write_bytes(encoded(1))
    (tmp_path / "broken.jpg").write_bytes(encoded(2)[:-200])
    (tmp_path / "list.tsv").write_text("\n".join(lines))
    with pytest.raises(SystemExit, match=rf"^error: \S*{message}"):
        main(["--images", str(tmp_path / "list.tsv"), "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())  # nothing half-written


def test_many_missing_labels_are_counted():
    with pytest.raises(DataError, match=r"^x: labels must be 0..99 .* missing: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, … "
                                        r"\(98 in all\)$"):
        check_labels([0, 99], "x")
    assert check_labels([2, 0, 1, 1], "x") == 3
