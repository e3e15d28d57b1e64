"""Training sources by kind, each built from ``config.data`` (RecordIO's reader: test_recordio.py)."""

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from jaxcls.errors import DataError
from jaxcls.data.recordio import MXFaceDataset, pack, write_records
from jaxcls.data.sources import ImageFolder, ProceduralGlyphs, SyntheticNoise, make_source
from conftest import jaxcls_records
from tiny import get_config as tiny_config


def png(value, size=8):
    buf = io.BytesIO()
    Image.fromarray(np.full((size, size, 3), value, np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def test_image_folder_numbers_classes_in_name_order(tmp_path):
    for name, values in {"zebra": [1, 2], "apple": [3], "mango": [4, 5, 6]}.items():
        (tmp_path / name).mkdir()
        for v in values:
            (tmp_path / name / f"{v}.png").write_bytes(png(v))
    (tmp_path / "apple" / "notes.txt").write_text("not an image")
    ds = ImageFolder(tmp_path)
    assert ds.classes == ["apple", "mango", "zebra"] and ds.num_classes() == 3 and len(ds) == 6
    got = sorted((int(np.asarray(Image.open(io.BytesIO(ds.raw(i)[0])))[0, 0, 0]), ds.raw(i)[1]) for i in range(6))
    assert got == [(1, 2), (2, 2), (3, 0), (4, 1), (5, 1), (6, 1)]


def test_image_folder_takes_torchvisions_images_at_any_depth_and_warns_of_other_files(tmp_path, caplog):
    """torchvision's ``ImageFolder`` (arcface_torch's reader of folders) walks each class folder down, sorted
    folder by folder, and takes its nine suffixes in any case; nothing of it is dropped, other files are counted."""
    files = {"a/x.jpg": 1, "a/sub/y.JPG": 2, "a/sub/deeper/z.png": 3, "a/w.ppm": 4, "b/v.tif": 5, "b/u.pgm": 6,
             "b/t.webp": 7, "b/s.tiff": 8, "b/r.bmp": 9, "b/q.jpeg": 10}
    for name, value in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        fmt = {".jpg": "JPEG", ".jpeg": "JPEG", ".ppm": "PPM", ".pgm": "PPM", ".tif": "TIFF", ".tiff": "TIFF",
               ".webp": "WEBP", ".bmp": "BMP", ".png": "PNG"}[Path(name).suffix.lower()]
        image = Image.fromarray(np.full((8, 8, 3), value * 20, np.uint8))
        image.convert("L").save(tmp_path / name, fmt) if name.endswith(".pgm") else image.save(tmp_path / name, fmt)
    (tmp_path / "a" / "sub" / "notes.txt").write_text("not an image")
    (tmp_path / "b" / "anim.gif").write_bytes(b"GIF89a")
    with jaxcls_records(caplog):
        ds = ImageFolder(tmp_path)
    order = ["a/w.ppm", "a/x.jpg", "a/sub/y.JPG", "a/sub/deeper/z.png",
             "b/q.jpeg", "b/r.bmp", "b/s.tiff", "b/t.webp", "b/u.pgm", "b/v.tif"]  # sorted os.walk, as torchvision
    assert [f.relative_to(tmp_path).as_posix() for f in ds.files] == order
    assert ds.labels().tolist() == [0] * 4 + [1] * 6 and [ds.raw(i)[1] for i in range(10)] == ds.labels().tolist()
    assert f"{tmp_path}: 2 files in the class folders are not images by their suffix and are not used" in caplog.text


def test_image_folder_errors(tmp_path):
    with pytest.raises(ValueError, match="no class folders"):
        ImageFolder(tmp_path)
    (tmp_path / "a").mkdir()
    with pytest.raises(ValueError, match="no images in 1 of its 1 class folders: a "):
        ImageFolder(tmp_path)
    for name in ("b/1.png", "d/1.png"):  # a class without images between two with: no class it would never train
        (tmp_path / name).parent.mkdir()
        Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(tmp_path / name)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "notes.txt").write_text("not an image")
    with pytest.raises(ValueError, match=r"no images in 2 of its 4 class folders: a, c \(looked for"):
        ImageFolder(tmp_path)


def test_procedural_glyphs_are_deterministic_and_identity_specific():
    ds = ProceduralGlyphs(num_classes=10, images_per_class=4, size=24)
    assert len(ds) == 40 and ds.num_classes() == 10 and ds.raw(9)[1] == 2
    np.testing.assert_array_equal(ds.image(3, 1), ProceduralGlyphs(num_classes=10, size=24).image(3, 1))
    same = np.abs(ds.image(3, 1).astype(int) - ds.image(3, 2)).mean()
    other = np.abs(ds.image(3, 1).astype(int) - ds.image(4, 1)).mean()
    assert ds.image(3, 1).shape == (24, 24, 3) and same < other


def test_heldout_pairs_alternate_and_use_unseen_identities():
    ds = ProceduralGlyphs(num_classes=10, images_per_class=4, size=16)
    images, issame = ds.heldout_pairs(num_pairs=20)
    assert images.shape == (40, 16, 16, 3) and images.dtype == np.uint8
    assert issame.tolist() == [True, False] * 10
    trained = {ds.raw(i)[0].tobytes() for i in range(len(ds))}
    assert not trained & {im.tobytes() for im in images}
    np.testing.assert_array_equal(images, ds.heldout_pairs(num_pairs=20)[0])


def test_synthetic_noise():
    ds = SyntheticNoise(num_classes=7, size=12, length=100)
    image, label = ds.raw(5)
    assert image.shape == (12, 12, 3) and 0 <= label < 7 and len(ds) == 100
    np.testing.assert_array_equal(image, ds.raw(5)[0])


def test_every_kind_builds_itself_from_the_data_config(tmp_path):
    c = tiny_config()
    assert isinstance(make_source(c.data, 64), ProceduralGlyphs) and make_source(c.data, 64).num_classes() == 64
    c.data.kind = "synthetic"
    synthetic = make_source(c.data, 64)
    assert isinstance(synthetic, SyntheticNoise) and synthetic.raw(0)[0].shape == (16, 16, 3)
    c.data.kind, c.data.root = "recordio", str(write_records(tmp_path / "rec", {k: pack(k, png(k)) for k in range(3)}))
    assert isinstance(make_source(c.data, 64), MXFaceDataset) and len(make_source(c.data, 64)) == 3
    (tmp_path / "folder" / "only").mkdir(parents=True)
    (tmp_path / "folder" / "only" / "x.png").write_bytes(png(0))
    c.data.kind, c.data.root = "folder", str(tmp_path / "folder")
    assert isinstance(make_source(c.data, 64), ImageFolder)
    assert [k.generated for k in (ProceduralGlyphs, SyntheticNoise, ImageFolder, MXFaceDataset)] == [True, True, False,
                                                                                                       False]
    c.data.kind = "webdataset"
    with pytest.raises(ValueError, match=r"unknown data source 'webdataset'; choose one of \['folder'"):
        make_source(c.data, 64)


def test_every_source_names_its_records(tmp_path):
    (tmp_path / "folder" / "a").mkdir(parents=True)
    for k in range(2):
        (tmp_path / "folder" / "a" / f"{k}.png").write_bytes(png(k))
    folder = ImageFolder(tmp_path / "folder")
    assert folder.where(1) == str(tmp_path / "folder" / "a" / "1.png")
    root = write_records(tmp_path / "rec", {0: pack([3.0, 4.0], b""), 1: pack(0, png(0)), 2: pack(1, png(1))})
    offset = int((root / "train.idx").read_text().splitlines()[2].split("\t")[1])
    assert MXFaceDataset(root).where(1) == f"{root / 'train.rec'} (key 2, .idx line 3, byte offset {offset})"
    assert ProceduralGlyphs(num_classes=3).where(7) == "procedural image 7"
    assert SyntheticNoise(num_classes=3).where(7) == "synthetic image 7"
    (tmp_path / "folder" / "a" / "1.png").unlink()
    with pytest.raises(DataError, match=rf"^{tmp_path / 'folder' / 'a' / '1.png'}: cannot read"):
        folder.raw(1)
