"""Host-side augmentations: each op against a plain reference or its intended effect, the draws' determinism."""

import dataclasses

import numpy as np
import pytest
from PIL import Image

from jaxcls.data import augment as aug
from jaxcls.data.align import warp_affine
from jaxcls.data.augment import Augment, draws, flip_coins
from jaxcls.data.pipeline import HostBatches
from jaxcls.data.sources import ProceduralGlyphs

EVERY_OP = Augment(**{name: 1.0 for name in aug.PROBABILITIES})


def photo(rng, size=32, frame=0):
    """A smooth random colour image (an upsampled random grid plus noise), ``frame`` black pixels at the edge."""
    grid = rng.integers(0, 256, (6, 6, 3), dtype=np.uint8)
    image = np.asarray(Image.fromarray(grid).resize((size, size), Image.BICUBIC)).astype(np.int16)
    image = np.clip(image + rng.integers(-10, 11, image.shape), 0, 255).astype(np.uint8)
    if frame:
        image[:frame], image[-frame:], image[:, :frame], image[:, -frame:] = 0, 0, 0, 0
    return image


def test_draws_are_uniform_deterministic_and_each_column_its_own_stream(rng):
    n = 16_000
    seed, positions = int(rng.integers(2**32)), rng.integers(0, 2**40, n)
    u = draws(seed, positions, aug.NUM_DRAWS)
    assert u.shape == (n, aug.NUM_DRAWS) and u.dtype == np.float64 and u.min() >= 0 and u.max() < 1
    np.testing.assert_array_equal(u, draws(seed, positions, aug.NUM_DRAWS))
    np.testing.assert_array_equal(u[7:9, :3], draws(seed, positions[7:9], 3))  # per position, not per call
    assert np.all(np.abs(u.mean(0) - 0.5) < 0.03) and np.all(np.abs(u.var(0) - 1 / 12) < 0.01)
    # a sample correlation of independent columns has standard deviation 1/√n: 6 of them are exceeded by one of the
    # 210 pairs in fewer than one run in a million (0.06 with n = 4,000 failed at seed 20 of a 20-seed sweep)
    bound = 6 / np.sqrt(n)
    assert np.all(np.abs(np.corrcoef(u.T) - np.eye(aug.NUM_DRAWS)) < bound)  # columns uncorrelated
    coins = flip_coins(seed, positions)
    assert abs(np.corrcoef(coins, u[:, 0])[0, 1]) < bound  # the flip coin is a stream of its own
    assert np.mean(draws(seed + 1, positions, 1) == u[:, :1]) < 0.01
    assert sorted(c for cols in aug.COLUMNS.values() for c in cols) == list(range(aug.NUM_DRAWS))


def reference_warp(image, matrix):
    """``warp`` by align.warp_affine (plain numpy bilinear, zero outside): continuous coordinates (pixel centres at
    +0.5) turned into pixel indices, the output → input map inverted into warp_affine's input → output one."""
    to_input = np.vstack([matrix, [0, 0, 1]])
    shift = np.array([[1, 0, 0.5], [0, 1, 0.5], [0, 0, 1]])
    index_map = np.linalg.inv(shift) @ to_input @ shift  # output index → input index
    return warp_affine(image, np.linalg.inv(index_map)[:2], image.shape[0])


@pytest.mark.parametrize("trial", range(4))
def test_warp_is_bilinear_resampling_at_the_crop_and_rotation(trial, rng):
    image = photo(rng, 32, frame=3)  # a black frame: the border colour is 0, as warp_affine's outside
    params = dict(area=rng.uniform(0.3, 1), ratio=rng.uniform(0.75, 4 / 3), x=rng.uniform(), y=rng.uniform(),
                  degrees=rng.uniform(-30, 30))
    matrix = aug.warp_matrix(32, **params)
    out, expected = aug.warp(image, matrix), reference_warp(image, matrix)
    assert out.shape == image.shape and out.dtype == np.uint8
    difference = out.astype(int) - expected
    assert difference.min() >= -1 and difference.max() <= 0, params  # Pillow rounds its fixed-point result down


def test_warp_geometry_identity_quarter_turn_and_crop_box(rng):
    image = photo(rng, 32)
    np.testing.assert_array_equal(aug.warp(image, aug.warp_matrix(32)), image)
    turned = aug.warp(image, aug.warp_matrix(32, degrees=90)).astype(int)
    assert np.abs(turned - np.rot90(image)).max() <= 1  # +90° turns the image counter-clockwise on screen
    # a quarter of the area, square, at the bottom-right: the bottom-right quadrant enlarged twice
    corner = aug.warp(image, aug.warp_matrix(32, area=0.25, x=1, y=1)).astype(int)
    enlarged = np.asarray(Image.fromarray(image[16:, 16:]).resize((32, 32), Image.BILINEAR)).astype(int)
    assert np.abs(corner[1:-1, 1:-1] - enlarged[1:-1, 1:-1]).max() <= 1  # edges: Pillow's resize clamps alike


def test_rotation_fills_the_corners_with_the_border_colour(rng):
    image = photo(rng, 32)
    out = aug.warp(image, aug.warp_matrix(32, degrees=45))
    np.testing.assert_array_equal(out[0, 0], aug.border_colour(image))
    np.testing.assert_array_equal(out[-1, -1], aug.border_colour(image))


def high_frequency(image):
    """Mean absolute difference of horizontally and vertically adjacent pixels."""
    x = image.astype(float)
    return np.abs(np.diff(x, axis=0)).mean() + np.abs(np.diff(x, axis=1)).mean()


def test_low_resolution_loses_detail_keeps_the_colours_and_full_size_is_identity(rng):
    image = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
    np.testing.assert_array_equal(aug.low_resolution(image, 32), image)
    coarse, coarser = aug.low_resolution(image, 16), aug.low_resolution(image, 8)
    assert coarse.shape == image.shape and coarse.dtype == np.uint8
    assert high_frequency(coarser) < high_frequency(coarse) < 0.7 * high_frequency(image)
    assert np.abs(coarser.mean((0, 1)) - image.mean((0, 1))).max() < 3


def test_blur_smooths_more_with_larger_sigma_and_keeps_the_mean(rng):
    image = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
    soft, softer = aug.blur(image, 0.7), aug.blur(image, 2.0)
    assert soft.shape == image.shape and soft.dtype == np.uint8
    assert high_frequency(softer) < high_frequency(soft) < 0.8 * high_frequency(image)
    assert np.abs(softer.mean((0, 1)) - image.mean((0, 1))).max() < 3
    flat = np.full((16, 16, 3), 77, np.uint8)
    np.testing.assert_array_equal(aug.blur(flat, 1.5), flat)


@pytest.mark.parametrize("brightness,contrast", [(1.0, 1.0), (1.25, 1.0), (0.8, 0.6), (1.1, 1.3)])
def test_brightness_contrast_is_the_formula_rounded_and_clipped(brightness, contrast, rng):
    image = photo(rng, 16)
    x = image.astype(np.float64) * brightness
    mean = (x @ [0.299, 0.587, 0.114]).mean()
    expected = np.clip(np.rint((x - mean) * contrast + mean), 0, 255)
    out = aug.brightness_contrast(image, brightness, contrast)
    assert out.dtype == np.uint8 and np.abs(out - expected).max() <= 1  # float32 inside
    if (brightness, contrast) == (1.0, 1.0):
        np.testing.assert_array_equal(out, image)
    grey = lambda im: im.astype(float) @ [0.299, 0.587, 0.114]
    if contrast < 1:  # pulled towards the mean: the spread shrinks by the factor
        assert grey(out).std() == pytest.approx(contrast * brightness * grey(image).std(), rel=0.05)


def test_grayscale_is_pillows_luma_in_every_channel(rng):
    image = photo(rng, 16)
    out = aug.grayscale(image)
    assert out.shape == image.shape and out.dtype == np.uint8
    np.testing.assert_array_equal(out[..., 0], out[..., 2])
    luma = image.astype(float) @ [0.299, 0.587, 0.114]
    assert np.abs(out[..., 1] - luma).max() <= 1


def test_erase_fills_the_box_and_leaves_the_rest(rng):
    image = photo(rng, 16)
    out = aug.erase(image, 3, 5, 4, 7, 200)
    assert np.all(out[3:7, 5:12] == 200)
    mask = np.ones((16, 16), bool)
    mask[3:7, 5:12] = False
    np.testing.assert_array_equal(out[mask], image[mask])
    assert not np.shares_memory(out, image)


def apply(augment, images, seed=11, positions=None):
    out = images.copy()
    augment.apply(out, seed, np.arange(len(images)) if positions is None else positions)
    return out


def test_apply_is_deterministic_per_position_and_in_range(rng):
    images = np.stack([photo(rng, 24) for _ in range(6)])
    out = apply(EVERY_OP, images)
    assert out.shape == images.shape and out.dtype == np.uint8
    assert all(not np.array_equal(a, b) for a, b in zip(out, images))
    np.testing.assert_array_equal(out, apply(EVERY_OP, images))
    np.testing.assert_array_equal(out[2:4], apply(EVERY_OP, images[2:4], positions=np.arange(2, 4)))  # any split
    assert not np.array_equal(apply(EVERY_OP, images, positions=np.arange(6) + 6), out)  # another epoch or index
    assert not np.array_equal(apply(EVERY_OP, images, seed=12), out)
    np.testing.assert_array_equal(apply(Augment(), images), images)  # every op off: untouched


@pytest.mark.parametrize("name", aug.PROBABILITIES)
def test_each_op_applies_with_its_probability(name):
    images = np.stack([photo(np.random.default_rng(k), 16) for k in range(4)])
    images = np.tile(images, (100, 1, 1, 1))  # 400 images, 4 distinct
    out = apply(Augment(**{name: 0.3}), images)
    changed = np.array([not np.array_equal(a, b) for a, b in zip(out, images)])
    # exactly where its own draw falls under the probability: never elsewhere, and nearly always there (an op can
    # leave an image as it was, e.g. a crop of the whole image)
    taken = draws(11, np.arange(len(images)), aug.NUM_DRAWS)[:, aug.COLUMNS[name][0]] < 0.3
    assert not np.any(changed & ~taken) and np.mean(changed[taken]) > 0.9
    assert 0.22 < changed.mean() <= 0.38


def test_an_op_switched_on_leaves_the_draws_of_the_others(rng):
    images = np.stack([photo(rng, 24) for _ in range(8)])
    cropped = apply(Augment(crop=1.0, rotate=0.5), images)
    then_grey = np.stack([aug.grayscale(im) for im in cropped])
    np.testing.assert_array_equal(apply(Augment(crop=1.0, rotate=0.5, grayscale=1.0), images), then_grey)


def test_fields_out_of_range_are_refused_by_name():
    for name, value in [("crop", 1.5), ("erase", -0.1), ("crop_scale", 0.0), ("rotate_degrees", 200),
                        ("brightness", 1.0), ("blur_sigma", 0.05), ("erase_area", 0.01)]:
        with pytest.raises(ValueError, match=rf"^data\.augment\.{name} must be"):
            Augment(**{name: value})
    assert {f.name for f in dataclasses.fields(Augment)} == {name for name, _, _ in aug.RANGES}


def test_the_pipeline_augments_each_image_at_its_global_position_before_the_flip():
    source = ProceduralGlyphs(num_classes=6, images_per_class=4, size=16)
    make = lambda **kw: HostBatches(source, global_batch=8, rows=(0, 8), size=16, seed=3, **kw)
    plain = make(flip=False)
    augmented = make(flip=True, augment=EVERY_OP, threads=1)
    for b in range(4):  # into the second epoch
        images, _ = next(plain)
        positions = np.arange(8 * b, 8 * b + 8)
        expected = apply(EVERY_OP, images, seed=3, positions=positions)
        mirrored = flip_coins(3, positions)
        expected[mirrored] = expected[mirrored, :, ::-1]
        np.testing.assert_array_equal(next(augmented)[0], expected)
