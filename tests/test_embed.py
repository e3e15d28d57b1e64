"""The embedding CLI: folders, .rec files and lists; unreadable images reported and left out (or fatal with
--strict); a run's workdir and its ONNX export give the same rows."""

import importlib.util
import io
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from jaxcls.config import small_r18, base_config
from jaxcls.data.pipeline import normalize
from jaxcls.errors import DataError
from jaxcls.data.recordio import pack, write_records
from jaxcls.data.sources import ProceduralGlyphs
from jaxcls.embed import run
from jaxcls.interop.inference import restore_backbone
from tiny import saved_run

pytestmark = pytest.mark.slow  # compiles an r18 (and exports it)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    c = base_config()
    c.model, c.model_kwargs, c.num_features, c.num_classes, c.batch_size = "r18", small_r18(), 32, 1000, 8
    c.data.input_size = 32
    path = tmp_path_factory.mktemp("run")
    saved_run(path, c, np.random.default_rng(0))
    return path


def glyphs(n, size=32):
    g = ProceduralGlyphs(num_classes=n, size=size)
    return [g.image(k, 0) for k in range(n)]


def encoded(image, fmt="PNG"):
    out = io.BytesIO()
    Image.fromarray(image).save(out, fmt)
    return out.getvalue()


def expected(workdir, images, flip=False):
    model, _, _ = restore_backbone(workdir)
    x = np.stack(images)
    emb = np.asarray(model(normalize(x)))
    return emb + np.asarray(model(normalize(np.ascontiguousarray(x[:, :, ::-1])))) if flip else emb


def test_a_folder_with_a_broken_image_embeds_the_rest_and_lists_it(workdir, tmp_path):
    images = glyphs(5) + [glyphs(1, size=48)[0]]  # the last at another size: resized
    (tmp_path / "faces" / "b").mkdir(parents=True)
    names = ["a0.png", "b/b1.png", "b/b2.jpg", "c3.png", "d4.png", "e5.png"]
    for name, image in zip(names, images):
        (tmp_path / "faces" / name).write_bytes(encoded(image, "JPEG" if name.endswith("jpg") else "PNG"))
    (tmp_path / "faces" / "notes.txt").write_text("not an image")
    (tmp_path / "faces" / "b" / "broken.png").write_bytes(encoded(images[0])[:100])
    emb, kept, failures = run(tmp_path / "faces", tmp_path / "emb.npy", workdir=workdir, batch_size=4, flip=True,
                              progress=False)
    # in torchvision's walk: a folder's own images, then each subfolder's
    assert kept == ["a0.png", "c3.png", "d4.png", "e5.png", "b/b1.png", "b/b2.jpg"]
    assert [n for n, _ in failures] == ["b/broken.png"]
    assert "broken.png: cannot decode image" in failures[0][1]
    assert (tmp_path / "emb.names.txt").read_text().split() == kept
    assert "b/broken.png\t" in (tmp_path / "emb.failed.txt").read_text()
    decoded = [np.asarray(Image.open(tmp_path / "faces" / n).convert("RGB").resize((32, 32), Image.BILINEAR))
               for n in kept]
    np.testing.assert_allclose(np.load(tmp_path / "emb.npy"), expected(workdir, decoded, flip=True), rtol=1e-4,
                               atol=1e-3)
    with pytest.raises(DataError, match="broken.png"):
        run(tmp_path / "faces", tmp_path / "strict.npy", workdir=workdir, strict=True, progress=False)


def test_a_rec_file_and_a_list_give_their_images_in_order(workdir, tmp_path):
    images = glyphs(9)
    write_records(tmp_path / "rec", {k + 1: pack([k % 3], encoded(im)) for k, im in enumerate(images)})
    emb, names, failures = run(tmp_path / "rec" / "train.rec", tmp_path / "new" / "rec", workdir=workdir,
                               batch_size=8, progress=False)  # a folder made, .npy added
    assert names == [str(k) for k in range(1, 10)] and not failures
    np.testing.assert_array_equal(np.load(tmp_path / "new" / "rec.npy"), emb)
    assert (tmp_path / "new" / "rec.names.txt").read_text().split() == names
    want = expected(workdir, images)
    np.testing.assert_allclose(emb, want, rtol=1e-4, atol=1e-3)
    (tmp_path / "list").mkdir()
    for k in (4, 2):
        (tmp_path / "list" / f"{k}.png").write_bytes(encoded(images[k]))
    (tmp_path / "list" / "faces.txt").write_text("4.png\n\n2.png\nmissing.png\n")
    emb, names, failures = run(tmp_path / "list" / "faces.txt", tmp_path / "list.npy", workdir=workdir,
                               progress=False)
    assert names == ["4.png", "2.png"] and failures[0][0] == "missing.png" and "No such file" in failures[0][1]
    np.testing.assert_allclose(emb, want[[4, 2]], rtol=1e-4, atol=1e-3)
    with pytest.raises(FileNotFoundError, match="no such folder, .rec file or image list"):
        run(tmp_path / "nowhere", tmp_path / "x.npy", workdir=workdir)


@pytest.mark.skipif(importlib.util.find_spec("jax2onnx") is None,
                    reason="jax2onnx is not installed: pip install --no-deps jax2onnx==0.17.1")
def test_cli_with_onnx_equals_the_workdir_and_strict_stops(workdir, tmp_path):
    from jaxcls.interop.export import export_run
    export_run(workdir, onnx=tmp_path / "m.onnx")
    (tmp_path / "faces").mkdir()
    for k, image in enumerate(glyphs(3)):
        (tmp_path / "faces" / f"{k}.png").write_bytes(encoded(image))
    cli = lambda *args: subprocess.run([sys.executable, "-m", "jaxcls.embed", "--images", str(tmp_path / "faces"),
                                        *args], capture_output=True, text=True, timeout=600)
    done = cli("--onnx", str(tmp_path / "m.onnx"), "--out", str(tmp_path / "onnx.npy"), "--flip")
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"wrote {tmp_path / 'onnx.npy'} (3 × 32 float32)" in done.stdout
    from_workdir, _, _ = run(tmp_path / "faces", tmp_path / "jax.npy", workdir=workdir, flip=True, progress=False)
    np.testing.assert_allclose(np.load(tmp_path / "onnx.npy"), from_workdir, rtol=1e-4, atol=1e-3)
    (tmp_path / "faces" / "3.png").write_bytes(b"\x89PNG garbage")
    failed = cli("--onnx", str(tmp_path / "m.onnx"), "--out", str(tmp_path / "x.npy"), "--strict")
    assert failed.returncode == 1 and "3.png: cannot decode image" in failed.stderr, failed.stderr[-2000:]
