"""Five-landmark alignment: the similarity transform and the warp against known transforms."""

import numpy as np
import pytest

from jaxcls.data.align import ARCFACE_TEMPLATE, align_face, similarity_transform, template, warp_affine


def rotation(angle, scale):
    return scale * np.array([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]])


def test_similarity_transform_recovers_a_known_transform_and_never_reflects(rng):
    matrix = np.hstack([rotation(rng.uniform(-np.pi, np.pi), rng.uniform(0.3, 3)), rng.normal(0, 50, (2, 1))])
    points = rng.uniform(0, 200, (5, 2))
    np.testing.assert_allclose(similarity_transform(points, points @ matrix[:, :2].T + matrix[:, 2]), matrix,
                               rtol=1e-9, atol=1e-9)
    mirrored = points * [-1, 1]  # the best similarity onto a mirror image is still a rotation
    assert np.linalg.det(similarity_transform(points, mirrored)[:, :2]) > 0


def test_warp_affine_moves_pixels_where_the_matrix_says(rng):
    image = rng.integers(0, 256, (20, 30, 3), dtype=np.uint8)
    np.testing.assert_array_equal(warp_affine(image, np.eye(2, 3), 20), image[:, :20])
    shifted = warp_affine(image, np.array([[1.0, 0, 3], [0, 1, -2]]), 20)  # output (x, y) = input (x − 3, y + 2)
    np.testing.assert_array_equal(shifted[:18, 3:], image[2:20, :17])
    assert not shifted[:, :3].any() and not shifted[18:].any()  # outside the input: black
    half = warp_affine(image, np.array([[1.0, 0, 0.5], [0, 1, 0]]), 20)  # half a pixel: the mean of neighbours
    np.testing.assert_array_equal(half[:, 1:19], np.rint((image[:20, :18].astype(float) + image[:20, 1:19]) / 2))


def test_align_face_maps_the_landmarks_onto_the_template_and_refuses_bad_ones(rng):
    image = np.zeros((200, 200, 3), np.uint8)
    matrix = np.hstack([rotation(0.3, 1.2), [[20.0], [30.0]]])
    landmarks = ARCFACE_TEMPLATE @ matrix[:, :2].T + matrix[:, 2]
    for (x, y), value in zip(np.rint(landmarks).astype(int), (50, 100, 150, 200, 250)):
        image[y - 1:y + 2, x - 1:x + 2] = value  # a 3×3 dot at each landmark
    aligned = align_face(image, landmarks)
    for (x, y), value in zip(np.rint(ARCFACE_TEMPLATE).astype(int), (50, 100, 150, 200, 250)):
        assert abs(int(aligned[y, x, 0]) - value) <= 40  # each dot lands on its template point
    with pytest.raises(ValueError, match="five finite"):
        align_face(image, landmarks[:4])
    with pytest.raises(ValueError, match="five finite"):
        align_face(image, np.where(np.eye(5, 2, dtype=bool), np.nan, landmarks))
    with pytest.raises(ValueError, match="all coincide"):
        align_face(image, np.full((5, 2), 60.0))


def test_the_template_at_other_sizes_is_insightfaces():
    """insightface's estimate_norm: a multiple of 112 scales the 112 px points; a multiple of 128 (not of 112) scales
    them by size / 128 and moves them 8 · size / 128 to the right; the first point at 128 px: (46.2946, 51.6963)."""
    np.testing.assert_allclose(template(224), ARCFACE_TEMPLATE * 2)
    np.testing.assert_allclose(template(128)[0], [46.2946, 51.6963])
    np.testing.assert_allclose(template(256), (ARCFACE_TEMPLATE + [8, 0]) * 2)
    np.testing.assert_allclose(template(896), ARCFACE_TEMPLATE * 8)  # both: 112's, as insightface checks it first
