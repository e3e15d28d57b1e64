"""The Grain input pipeline: host batches, epochs, exact resume from a saved position, device placement."""

import jax
import pytest
import numpy as np

from jaxcls.data.pipeline import HostBatches, device_batch, normalize, to_image
from jaxcls.data.sources import ProceduralGlyphs
from jaxcls.mesh import batch_sharding, make_mesh


def batches(source, rows=(0, 8), **kwargs):
    return HostBatches(source, global_batch=8, rows=rows, size=16, seed=3, threads=2, **kwargs)


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


def test_resume_from_a_saved_position_gives_the_same_next_batches():
    source = ProceduralGlyphs(num_classes=6, images_per_class=4, size=16)
    it = batches(source)
    for _ in range(4):  # into the second epoch
        next(it)
    position = it.get_state()
    expected = [next(it) for _ in range(3)]
    resumed = batches(source)
    resumed.set_state(position)
    for (a, y), (b, z) in zip(expected, (next(resumed) for _ in range(3))):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(y, z)


def test_normalize_and_resize():
    np.testing.assert_allclose(normalize(np.array([0, 255], np.uint8)), [-1.0, 1.0])
    image = to_image(np.zeros((32, 24, 3), np.uint8), 16)
    assert image.shape == (16, 16, 3) and image.dtype == np.uint8


def test_device_batch_splits_the_batch_over_every_device():
    mesh = make_mesh(2, 4)
    images, labels = device_batch((np.zeros((16, 4, 4, 3), np.uint8), np.arange(16, dtype=np.int32)),
                                  batch_sharding(mesh))
    assert images.shape == (16, 4, 4, 3) and labels.sharding == batch_sharding(mesh)
    assert {s.data.shape[0] for s in labels.addressable_shards} == {2}
    np.testing.assert_array_equal(jax.device_get(labels), np.arange(16))


def test_hosts_take_their_rows_of_every_global_batch_and_share_one_position():
    source = ProceduralGlyphs(num_classes=6, images_per_class=4, size=16)
    whole = batches(source)
    hosts = [batches(source, rows=rows) for rows in ((0, 3), (3, 8))]
    for _ in range(4):  # into the second epoch
        images, labels = next(whole)
        parts = [next(h) for h in hosts]
        np.testing.assert_array_equal(images, np.concatenate([p[0] for p in parts]))
        np.testing.assert_array_equal(labels, np.concatenate([p[1] for p in parts]))
    assert hosts[0].get_state() == hosts[1].get_state() == whole.get_state() == {"global_batches": 4}
    expected = next(whole)
    one_host = batches(source)
    one_host.set_state(hosts[0].get_state())  # saved by two hosts, continued by one
    np.testing.assert_array_equal(next(one_host)[0], expected[0])


def test_a_position_of_the_old_per_host_format_is_refused():
    source = ProceduralGlyphs(num_classes=6, images_per_class=4, size=16)
    with pytest.raises(ValueError, match="older jaxcls"):
        batches(source).set_state({"next_index": 16})
