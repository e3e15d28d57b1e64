"""Decompression bombs: an image whose header claims more pixels than the limit is refused before decoding, naming
where it came from, in every path that decodes images (training records, image folders, ``.bin`` pairs, the
embedding CLI's sources, IJB loose crops, the packer); the limit is ``$JAXCLS_MAX_IMAGE_PIXELS``."""

import io
import pickle
import struct
import tracemalloc
import zlib

import numpy as np
import pytest
from PIL import Image

from jaxcls.data.pack import folder_images, pack_images
from jaxcls.data.pipeline import HostBatches
from jaxcls.data.images import DEFAULT_MAX_IMAGE_PIXELS, decode_image, max_image_pixels
from jaxcls.errors import DataError
from jaxcls.data.recordio import MXFaceDataset, pack, write_records
from jaxcls.data.sources import ImageFolder
from jaxcls.interop.inference import embed_images, image_source
from jaxcls.eval.ijb import aligned_loader
from jaxcls.eval.verification import load_bin

pytestmark = pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")  # Pillow warns before we refuse


def encoded(fmt, seed=0, mode="RGB", size=16):
    buf = io.BytesIO()
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, len(mode)), np.uint8)
    Image.fromarray(pixels, mode).save(buf, fmt)
    return buf.getvalue()


def claiming(data: bytes, width: int, height: int) -> bytes:
    """``data`` (a JPEG or PNG) with its header changed to claim ``width × height`` pixels (PNG: CRC made right)."""
    out = bytearray(data)
    if data[:2] == b"\xff\xd8":
        sof = data.index(b"\xff\xc0")
        out[sof + 5:sof + 9] = struct.pack(">HH", height, width)
    else:
        out[16:24] = struct.pack(">II", width, height)
        out[29:33] = struct.pack(">I", zlib.crc32(bytes(out[12:29])))
    return bytes(out)


CLAIM = r"its header claims \d+ × \d+ = [\d,]+ pixels, more than the limit of 89,478,485 .*; not decoded"
PILLOWS = r"exceeds limit of 178956970 pixels, could be decompression bomb DOS attack. \(Pillow's limit, twice .*"
BOMBS = {"JPEG": (claiming(encoded("JPEG"), 20_000, 10_000), CLAIM),  # simplejpeg's path
         "CMYK JPEG": (claiming(encoded("JPEG", mode="CMYK"), 65_535, 65_535), CLAIM),  # Pillow's
         "PNG": (claiming(encoded("PNG"), 12_000, 10_000), CLAIM),
         # above twice PIL.Image.MAX_IMAGE_PIXELS Pillow's own check refuses the file first
         "PNG beyond Pillow's limit": (claiming(encoded("PNG"), 65_535, 65_535), PILLOWS)}


@pytest.mark.parametrize("at_least", [0, 112])
@pytest.mark.parametrize("kind", BOMBS)
def test_decode_image_refuses_a_bomb_before_decoding(kind, at_least):
    data, refusal = BOMBS[kind]
    tracemalloc.start()
    try:
        with pytest.raises(DataError, match=rf"^bomb: cannot decode image: .*{refusal}"):
            decode_image(data, "bomb", at_least)
        assert tracemalloc.get_traced_memory()[1] < 16 << 20  # 20,000 × 10,000 RGB would be 600 MB
    finally:
        tracemalloc.stop()


def test_the_limit_is_the_environment_variable(monkeypatch):
    image = encoded("PNG", size=16)
    assert max_image_pixels() == DEFAULT_MAX_IMAGE_PIXELS == Image.MAX_IMAGE_PIXELS
    monkeypatch.setenv("JAXCLS_MAX_IMAGE_PIXELS", "255")
    for data in (image, encoded("JPEG")):
        with pytest.raises(DataError, match=r"claims 16 × 16 = 256 pixels, more than the limit of 255 \(a "
                                            r"decompression bomb, or raise JAXCLS_MAX_IMAGE_PIXELS\)"):
            decode_image(data)
    monkeypatch.setenv("JAXCLS_MAX_IMAGE_PIXELS", "256")
    np.testing.assert_array_equal(decode_image(image), np.asarray(Image.open(io.BytesIO(image))))
    monkeypatch.setenv("JAXCLS_MAX_IMAGE_PIXELS", "lots")
    with pytest.raises(ValueError, match="JAXCLS_MAX_IMAGE_PIXELS='lots': expected a positive number of pixels"):
        decode_image(image)


def records(tmp_path, bomb_key=3, n=6):
    data = {k: pack(float(k % 2), BOMBS["JPEG"][0] if k == bomb_key else encoded("PNG", k)) for k in range(n)}
    return MXFaceDataset(write_records(tmp_path, data))


def test_training_records_and_folders(tmp_path):
    dataset = records(tmp_path / "rec")
    with pytest.raises(DataError, match=rf"train.rec \(key 3, .idx line 4, byte offset \d+\): cannot decode image: "
                                        rf"{CLAIM}"):
        dataset[3]
    batches = HostBatches(dataset, global_batch=6, rows=(0, 6), size=16, seed=0, threads=2)
    with pytest.raises(DataError, match=rf"train.rec \(key 3, .*{CLAIM}"):
        next(batches)
    (tmp_path / "folder" / "a").mkdir(parents=True)
    for k in range(4):
        (tmp_path / "folder" / "a" / f"{k}.png").write_bytes(BOMBS["PNG"][0] if k == 2 else encoded("PNG", k))
    with pytest.raises(DataError, match=rf"^{tmp_path / 'folder' / 'a' / '2.png'}: cannot decode image: {CLAIM}"):
        next(HostBatches(ImageFolder(tmp_path / "folder"), global_batch=4, rows=(0, 4), size=16, seed=0))


def test_verification_bin(tmp_path):
    path = tmp_path / "lfw.bin"
    path.write_bytes(pickle.dumps(([encoded("JPEG"), BOMBS["JPEG"][0]], [True])))
    with pytest.raises(DataError, match=rf"^{path} \(image 1\): cannot decode image: {CLAIM}"):
        load_bin(path)


def test_embedding_sources(tmp_path):
    (tmp_path / "faces").mkdir()
    for name, data in {"a.jpg": encoded("JPEG"), "b.png": BOMBS["PNG"][0], "c.jpg": encoded("JPEG", 1)}.items():
        (tmp_path / "faces" / name).write_bytes(data)
    names, loaders = image_source(tmp_path / "faces", 16)
    embeddings, kept, failures = embed_images(lambda x: np.ones((len(x), 4)), loaders, names, batch_size=2,
                                              progress=False)
    assert kept.tolist() == [0, 2] and [name for name, _ in failures] == ["b.png"]
    assert failures[0][1].startswith(f"{tmp_path / 'faces' / 'b.png'}: cannot decode image: its header claims")
    names, loaders = image_source(records(tmp_path / "rec").rec.path, 16)
    with pytest.raises(DataError, match=rf"train.rec \(key 3, .*{CLAIM}"):
        loaders[3]()


def test_ijb_loose_crops(tmp_path):
    (tmp_path / "loose_crop").mkdir()
    (tmp_path / "loose_crop" / "1.jpg").write_bytes(BOMBS["JPEG"][0])
    landmarks = np.array([[38.3, 51.7], [73.5, 51.5], [56.0, 71.7], [41.5, 92.4], [70.7, 92.2]])
    with pytest.raises(DataError, match=rf"^{tmp_path / 'loose_crop' / '1.jpg'}: cannot decode image: {CLAIM}"):
        aligned_loader(tmp_path, "1.jpg", landmarks, 112)()


def test_the_packer(tmp_path):
    (tmp_path / "images" / "a").mkdir(parents=True)
    (tmp_path / "images" / "a" / "0.jpg").write_bytes(encoded("JPEG"))
    (tmp_path / "images" / "a" / "1.png").write_bytes(BOMBS["PNG"][0])
    with pytest.raises(DataError, match=rf"{tmp_path / 'images' / 'a' / '1.png'}: cannot decode image: {CLAIM}"):
        pack_images(*folder_images(tmp_path / "images"), tmp_path / "out")
