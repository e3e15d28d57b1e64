"""The Grain input pipeline: host batches, epochs, exact resume from a saved position, device placement."""

import functools
import io
import re
import subprocess
import sys
from pathlib import Path

import grain
import jax
import numpy as np
import pytest
from absl import flags
from PIL import Image

from jaxcls.data.augment import Augment, flip_coins
from jaxcls.data.pipeline import HostBatches, device_batch, normalize, resize_batch, to_image
from jaxcls.errors import DataError
from jaxcls.data.recordio import MXFaceDataset, pack, write_records
from jaxcls.data.sources import ImageFolder, ProceduralGlyphs
from jaxcls.mesh import batch_sharding, make_mesh


def batches(source, rows=(0, 8), global_batch=8, **kwargs):
    return HostBatches(source, global_batch=global_batch, rows=rows, size=16, seed=3, **{"threads": 2, **kwargs})


def test_an_epoch_is_a_permutation_of_the_source_without_flips():
    source = ProceduralGlyphs(num_classes=6, images_per_class=4, size=16)
    it = batches(source, flip=False)
    images, labels = zip(*(next(it) for _ in range(3)))  # 24 images: one epoch
    images, labels = np.concatenate(images), np.concatenate(labels)
    assert images.dtype == np.uint8 and images.shape == (24, 16, 16, 3) and labels.dtype == np.int32
    expected = {source.raw(i)[0].tobytes(): source.raw(i)[1] for i in range(len(source))}
    assert {im.tobytes(): int(y) for im, y in zip(images, labels)} == expected


def test_flips_are_mirror_images_and_deterministic():
    source = ProceduralGlyphs(num_classes=6, images_per_class=4, size=16)
    plain = next(batches(source, flip=False))[0]
    flipped = next(batches(source, flip=True))[0]
    assert all(np.array_equal(f, p) or np.array_equal(f, p[:, ::-1]) for f, p in zip(flipped, plain))
    assert any(not np.array_equal(f, p) for f, p in zip(flipped, plain))
    np.testing.assert_array_equal(flipped, next(batches(source, flip=True))[0])


AUGMENTS = [Augment(), Augment(crop=0.5, rotate=0.5, lowres=0.3, blur=0.3, color=0.5, grayscale=0.2, erase=0.3)]


@pytest.mark.parametrize("augment", AUGMENTS, ids=["flip", "augmented"])
def test_resume_from_a_saved_position_gives_the_same_next_batches(augment):
    source = ProceduralGlyphs(num_classes=6, images_per_class=4, size=16)
    make = functools.partial(batches, augment=augment)
    it = make(source)
    for _ in range(4):  # into the second epoch
        next(it)
    position = it.get_state()
    expected = [next(it) for _ in range(3)]
    resumed = make(source)
    resumed.set_state(position)
    for (a, y), (b, z) in zip(expected, (next(resumed) for _ in range(3))):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(y, z)


def test_normalize_and_resize():
    np.testing.assert_allclose(normalize(np.array([0, 255], np.uint8)), [-1.0, 1.0])
    image = to_image(np.zeros((32, 24, 3), np.uint8), 16)
    assert image.shape == (16, 16, 3) and image.dtype == np.uint8


GLYPHS = Path(__file__).resolve().parents[2] / "shared" / "data" / "glyphs"


@pytest.mark.skipif(not (GLYPHS / "train.rec").exists(), reason=f"glyphs data set not found at {GLYPHS}")
def test_a_reduced_scale_decode_is_close_to_a_full_decode_and_resize():
    """112 → 48: decoded at 1/2 scale (56) then resized, against decoded at 112 then resized. On glyphs (hard black
    strokes on light ground) the mean difference is 1.4 grey levels, at most 3.2 for one image (a few edge pixels
    differ by up to ~40)."""
    ds = MXFaceDataset(GLYPHS)
    errors = []
    for i in range(0, len(ds), 45):
        full = np.asarray(Image.fromarray(ds[i][0]).resize((48, 48), Image.BILINEAR), np.float64)
        errors.append(np.abs(to_image(ds.raw(i)[0], 48) - full).mean())
    assert np.mean(errors) < 2 and max(errors) < 4


def test_resize_batch_is_pillows_resize_of_each_square_image():
    rng = np.random.default_rng(0)
    for side, size in ((56, 48), (112, 48), (20, 48), (48, 16), (16, 16)):
        images = rng.integers(0, 256, (5, side, side, 3), dtype=np.uint8)
        expected = [np.asarray(Image.fromarray(image).resize((size, size), Image.BILINEAR)) for image in images]
        np.testing.assert_array_equal(resize_batch(images, size), np.stack(expected))


def test_a_batch_of_images_of_several_sizes(tmp_path):
    (tmp_path / "a").mkdir()
    for k in range(8):
        (tmp_path / "a" / f"{k}.png").write_bytes(png(k, size=16 + 8 * (k % 3)))
    source = ImageFolder(tmp_path)
    images = next(batches(source, flip=False))[0]
    expected = {to_image(source.raw(i)[0], 16).tobytes() for i in range(8)}
    assert {image.tobytes() for image in images} == expected and len(expected) == 8


def test_flip_coins_are_fair_deterministic_and_differ_by_seed():
    positions = np.arange(10_000, 30_000)
    coins = flip_coins(3, positions)
    assert coins.dtype == bool and abs(coins.mean() - 0.5) < 0.01
    np.testing.assert_array_equal(coins[5:9], flip_coins(3, positions[5:9]))
    assert abs((coins == flip_coins(4, positions)).mean() - 0.5) < 0.01  # another seed: independent coins
    assert abs((coins[1:] == coins[:-1]).mean() - 0.5) < 0.01  # neighbours too


def test_a_batch_is_its_records_decoded_resized_and_mirrored_by_their_coins(tmp_path):
    records = {}
    for k in range(12):
        buf = io.BytesIO()
        Image.fromarray(np.random.default_rng(k).integers(0, 256, (40, 36, 3), dtype=np.uint8)).save(buf, "JPEG")
        records[k] = pack(float(k % 3), buf.getvalue())
    source = MXFaceDataset(write_records(tmp_path, records))
    images, labels = next(HostBatches(source, global_batch=6, rows=(0, 6), size=16, seed=5, threads=2))
    order = grain.MapDataset.range(12).shuffle(seed=5)  # the first epoch's order
    coins = flip_coins(5, np.arange(6))
    assert 0 < coins.sum() < 6
    for row in range(6):
        expected = to_image(source.raw(order[row])[0], 16)
        np.testing.assert_array_equal(images[row], expected[:, ::-1] if coins[row] else expected)
        assert labels[row] == order[row] % 3


def test_device_batch_splits_the_batch_over_every_device():
    mesh = make_mesh(2, 4)
    images, labels = device_batch((np.zeros((16, 4, 4, 3), np.uint8), np.arange(16, dtype=np.int32)),
                                  batch_sharding(mesh))
    assert images.shape == (16, 4, 4, 3) and labels.sharding == batch_sharding(mesh)
    assert {s.data.shape[0] for s in labels.addressable_shards} == {2}
    np.testing.assert_array_equal(jax.device_get(labels), np.arange(16))


@pytest.mark.parametrize("augment", AUGMENTS, ids=["flip", "augmented"])
def test_hosts_take_their_rows_of_every_global_batch_and_share_one_position(augment):
    make = functools.partial(batches, augment=augment)
    source = ProceduralGlyphs(num_classes=6, images_per_class=4, size=16)
    whole = make(source)
    hosts = [make(source, rows=rows) for rows in ((0, 3), (3, 8))]
    for _ in range(4):  # into the second epoch
        images, labels = next(whole)
        parts = [next(h) for h in hosts]
        np.testing.assert_array_equal(images, np.concatenate([p[0] for p in parts]))
        np.testing.assert_array_equal(labels, np.concatenate([p[1] for p in parts]))
    assert hosts[0].get_state() == hosts[1].get_state() == whole.get_state() == {"global_batches": 4}
    expected = next(whole)
    one_host = make(source)
    one_host.set_state(hosts[0].get_state())  # saved by two hosts, continued by one
    np.testing.assert_array_equal(next(one_host)[0], expected[0])


def test_a_position_of_the_old_per_host_format_is_refused():
    source = ProceduralGlyphs(num_classes=6, images_per_class=4, size=16)
    with pytest.raises(ValueError, match="older jaxcls"):
        batches(source).set_state({"next_index": 16})


def png(seed, size=16):
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def recordio(tmp_path, bad_image=(), bad_label=(), n=20):
    """``n`` PNG records with labels ``k % 4``: zeroed headers at keys ``bad_image``, label 7 at keys ``bad_label``."""
    records = {k: pack(7.0 if k in bad_label else float(k % 4), bytes(16) + png(k)[16:] if k in bad_image else png(k))
               for k in range(n)}
    return MXFaceDataset(write_records(tmp_path, records))


def epoch(it, n=5):
    return [next(it) for _ in range(n)]


def test_a_record_that_cannot_be_decoded_is_named(tmp_path):
    it = batches(recordio(tmp_path, bad_image=[5]), rows=(0, 4), global_batch=4)
    with pytest.raises(DataError, match=r"train.rec \(key 5, .idx line 6, byte offset \d+\): cannot decode image: "
                                        "cannot identify image file"):
        epoch(it)


def test_an_image_folder_file_that_cannot_be_decoded_is_named(tmp_path):
    (tmp_path / "a").mkdir()
    for k in range(8):
        (tmp_path / "a" / f"{k}.png").write_bytes(png(k) if k != 3 else bytes(16) + png(k)[16:])
    with pytest.raises(DataError, match=rf"^{tmp_path / 'a' / '3.png'}: cannot decode image"):
        epoch(batches(ImageFolder(tmp_path)), 1)


def test_a_label_outside_the_classes_is_named(tmp_path):
    source = recordio(tmp_path, bad_label=[12])
    epoch(batches(source, rows=(0, 4), global_batch=4))  # no num_classes: nothing checked
    with pytest.raises(DataError, match=r"^label 7 of \S*train.rec \(key 12, .idx line 13, byte offset \d+\) is "
                                        r"outside \[0, 4\)"):
        epoch(batches(source, rows=(0, 4), global_batch=4, num_classes=4))


@pytest.mark.slow  # a Python process and a Grain worker process
def test_worker_processes_start_from_python_where_no_cli_parsed_absl_flags():
    """``train(config, workdir)`` from a notebook with ``data.workers > 0``: Grain's workers read absl flags."""
    script = ("from jaxcls.data.pipeline import HostBatches\n"
              "from jaxcls.data.sources import ProceduralGlyphs\n"
              "if __name__ == '__main__':\n"
              "    source = ProceduralGlyphs(num_classes=4, images_per_class=2, size=16)\n"
              "    batches = HostBatches(source, global_batch=4, rows=(0, 4), size=16, seed=0, workers=1)\n"
              "    images, labels = next(batches)\n"
              "    print(images.shape, sorted(labels.tolist()) != [])\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "(4, 16, 16, 3) True" in done.stdout, done.stderr[-3000:]


@pytest.fixture
def parsed_flags():
    """Grain's worker processes read absl flags: parsed by the CLIs, not under pytest."""
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def test_skip_replaces_bad_records_by_the_next_good_ones_deterministically(tmp_path, parsed_flags):
    source = recordio(tmp_path, bad_image=[5], bad_label=[12])
    log = tmp_path / "bad_records.txt"

    def run(**kwargs):
        return batches(source, rows=(0, 4), global_batch=4, num_classes=4, bad_records="skip", bad_records_log=log,
                       **kwargs)

    it = run(flip=False)
    images, labels = map(np.concatenate, zip(*epoch(it)))
    assert images.shape == (20, 16, 16, 3) and it.bad_records == 2
    kept = [source[i] for i in range(20) if i not in (5, 12)] + [source[6], source[13]]  # the replacements
    assert sorted((im.tobytes(), y) for im, y in zip(images, labels)) == sorted((im.tobytes(), y) for im, y in kept)
    assert logged_keys(log) == {5, 12}

    reference, expected, counts = run(), [], []
    for _ in range(10):  # two epochs, flipped
        expected.append(next(reference))
        counts.append(reference.bad_records)
    assert counts[-1] == 4

    def same(it, first=0):
        for (a, y), (b, z) in zip(expected[first:], epoch(it, 10 - first)):
            np.testing.assert_array_equal(a, b)
            np.testing.assert_array_equal(y, z)
        return it.bad_records

    assert [same(run(**kwargs)) for kwargs in ({"threads": 1}, {"threads": 3}, {"workers": 1})] == [4, 4, 4]
    resumed = run()
    resumed.set_state({"global_batches": 7})
    assert same(resumed, 7) == counts[9] - counts[6]
    hosts = [batches(source, rows=rows, global_batch=4, num_classes=4, bad_records="skip") for rows in ((0, 1), (1, 4))]
    for images, labels in expected:
        parts = [next(h) for h in hosts]
        np.testing.assert_array_equal(images, np.concatenate([p[0] for p in parts]))
        np.testing.assert_array_equal(labels, np.concatenate([p[1] for p in parts]))
    assert hosts[0].bad_records + hosts[1].bad_records == 4
    assert logged_keys(log) == {5, 12}


def logged_keys(log):
    """The keys of the bad records in the log; every line must name its record (prefetching may log some twice)."""
    return {int(re.search(r"train.rec \(key (\d+), .idx line \d+, byte offset \d+\)", line)[1])
            for line in log.read_text().splitlines()}


def test_skip_gives_up_on_a_broken_data_set(tmp_path):
    it = batches(recordio(tmp_path, bad_image=range(3), n=3), rows=(0, 2), global_batch=2, bad_records="skip")
    with pytest.raises(DataError, match=r"100 bad records in a row from \S*train.rec \(key \d, .*the data set is broken"):
        next(it)


def test_an_unknown_bad_records_policy():
    with pytest.raises(ValueError, match="unknown bad_records policy 'ignore': choose error or skip"):
        batches(ProceduralGlyphs(num_classes=6, images_per_class=4, size=16), bad_records="ignore")
