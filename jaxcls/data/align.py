"""Face alignment with five landmarks to arcface's 112×112 template (insightface's ``norm_crop``).

The template holds the eye centres, nose tip and mouth corners; ``similarity_transform`` is Umeyama's least-squares
similarity (skimage's ``SimilarityTransform.estimate``) and ``warp_affine`` samples bilinearly with a black border as
``cv2.warpAffine`` does (cv2 rounds sub-pixel positions to 1/32 of a pixel, so its pixels can differ by a level).
"""

from __future__ import annotations

import numpy as np

ARCFACE_TEMPLATE = np.array([[38.2946, 51.6963], [73.5318, 51.5014], [56.0252, 71.7366], [41.5493, 92.3655],
                             [70.7299, 92.2041]])  # (x, y) in a 112×112 crop


def similarity_transform(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """The ``[2, 3]`` matrix of the rotation, uniform scale and translation (no reflection) that maps points
    ``src [K, 2]`` closest to ``dst [K, 2]`` in least squares (Umeyama 1991)."""
    src, dst = np.asarray(src, np.float64), np.asarray(dst, np.float64)
    src_mean, dst_mean = src.mean(0), dst.mean(0)
    s, d = src - src_mean, dst - dst_mean
    if not s.var(0).sum() > 0:
        raise ValueError(f"the points {src.tolist()} all coincide: no transform maps them")
    covariance = d.T @ s / len(src)
    u, singular, vt = np.linalg.svd(covariance)
    sign = np.array([1.0, -1.0 if np.linalg.det(covariance) < 0 else 1.0])
    rotation = u @ np.diag(sign) @ vt
    scale = (singular @ sign) / s.var(0).sum()
    return np.hstack([scale * rotation, (dst_mean - scale * rotation @ src_mean)[:, None]])


def warp_affine(image: np.ndarray, matrix: np.ndarray, size: int) -> np.ndarray:
    """uint8 ``[size, size, C]``: output pixel ``(x, y)`` is ``image`` at ``matrix⁻¹ (x, y)``, bilinear, zero outside."""
    inverse = np.linalg.inv(np.vstack([matrix, [0, 0, 1]]))[:2]
    ys, xs = np.mgrid[0:size, 0:size].astype(np.float64)
    sx = inverse[0, 0] * xs + inverse[0, 1] * ys + inverse[0, 2]
    sy = inverse[1, 0] * xs + inverse[1, 1] * ys + inverse[1, 2]
    x0, y0 = np.floor(sx).astype(np.int64), np.floor(sy).astype(np.int64)
    fx, fy = (sx - x0)[..., None], (sy - y0)[..., None]
    height, width = image.shape[:2]

    def pixel(y, x):
        inside = ((x >= 0) & (x < width) & (y >= 0) & (y < height))[..., None]
        return np.where(inside, image[np.clip(y, 0, height - 1), np.clip(x, 0, width - 1)], 0).astype(np.float64)

    out = ((1 - fy) * ((1 - fx) * pixel(y0, x0) + fx * pixel(y0, x0 + 1))
           + fy * ((1 - fx) * pixel(y0 + 1, x0) + fx * pixel(y0 + 1, x0 + 1)))
    return np.clip(np.rint(out), 0, 255).astype(np.uint8)


def align_face(image: np.ndarray, landmarks: np.ndarray, size: int = 112) -> np.ndarray:
    """``image`` ``[H, W, 3]`` with five ``landmarks`` ``[5, 2]`` (x, y) → the aligned uint8 ``[size, size, 3]`` crop."""
    landmarks = np.asarray(landmarks, np.float64)
    if landmarks.shape != (5, 2) or not np.isfinite(landmarks).all():
        raise ValueError(f"expected five finite (x, y) landmarks, got {landmarks.tolist()}")
    return warp_affine(image, similarity_transform(landmarks, template(size)), size)


def template(size: int) -> np.ndarray:
    """The five points ``[5, 2]`` in a ``size``×``size`` crop, as insightface's ``estimate_norm`` places them: scaled
    from 112 px, or for a multiple of 128 (and not of 112) scaled from 128 px and 8/128 of the size to the right."""
    if size % 112 and not size % 128:
        return ARCFACE_TEMPLATE * size / 128 + [8 * size / 128, 0]
    return ARCFACE_TEMPLATE * size / 112
