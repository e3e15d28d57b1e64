"""Training augmentations of uint8 images on the host, each draw a hash of (seed, global position).

Every random number here is a counter-based hash of the run's seed and the image's global position in the data
stream (its epoch and index), never the state of a generator: the same image gets the same augmentation on any
host, thread or worker process and after a resume, and switching one op on or off leaves the draws of the others
as they were (each op owns fixed columns of ``draws``).

``Augment`` holds one probability per op and the op's strength; ``Augment.apply`` changes a batch in place, in this
order: a geometric warp (random resized crop: scale and translation; rotation) in one bilinear resampling, low
resolution (down- then up-sampling), Gaussian blur, brightness and contrast, grayscale, random erasing. The
horizontal flip (``flip_coins``) stays a separate switch, ``data.flip``.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from PIL import Image, ImageFilter


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on uint64 ``[...]`` (wrapping arithmetic): every input bit moves every output bit."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _hash(seed: int, positions: np.ndarray, streams: np.ndarray) -> np.ndarray:
    """uint64 ``[n, k]``: a hash of (seed + stream, position) for global ``positions`` (int ``[n]``) and ``streams``
    (uint64 ``[k]``)."""
    with np.errstate(over="ignore"):
        keys = _mix(np.uint64(seed % 2**64) + streams)
        return _mix(np.asarray(positions).astype(np.uint64)[:, None] * _GOLDEN + keys[None, :])


def flip_coins(seed: int, positions: np.ndarray) -> np.ndarray:
    """bool ``[n]``: whether the images at global ``positions`` (int ``[n]``) are mirrored."""
    return _hash(seed, positions, np.zeros(1, np.uint64))[:, 0] >> np.uint64(63) == 1


def draws(seed: int, positions: np.ndarray, count: int) -> np.ndarray:
    """float64 ``[n, count]`` uniform in [0, 1): ``count`` independent draws for each global position (streams
    1 … count, apart from the flip coin's stream 0)."""
    bits = _hash(seed, positions, np.arange(1, count + 1, dtype=np.uint64))
    return (bits >> np.uint64(11)).astype(np.float64) * 2.0**-53


# the columns of ``draws`` each op reads: whether it applies, then its parameters
COLUMNS = dict(crop=range(0, 5), rotate=range(5, 7), lowres=range(7, 9), blur=range(9, 11), color=range(11, 14),
               grayscale=range(14, 15), erase=range(15, 21))
NUM_DRAWS = 21
PROBABILITIES = tuple(COLUMNS)
# (field, predicate, the rule in words): every field of ``Augment``
RANGES = [(name, lambda v: 0 <= v <= 1, "in [0, 1]") for name in PROBABILITIES] + [
    ("crop_scale", lambda v: 0 < v <= 1, "in (0, 1]"), ("lowres_min", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("erase_area", lambda v: 0.02 < v <= 1, "in (0.02, 1]"), ("rotate_degrees", lambda v: 0 <= v <= 180, "in [0, 180]"),
    ("brightness", lambda v: 0 <= v < 1, "in [0, 1)"), ("contrast", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("blur_sigma", lambda v: v >= 0.1, ">= 0.1")]


def _pillow(image: np.ndarray) -> Image.Image:
    return Image.fromarray(image, "RGB")


def border_colour(image: np.ndarray) -> tuple[int, int, int]:
    """The mean RGB of the outermost pixels of uint8 ``[S, S, 3]``: what a warp shows where the image ends."""
    ring = np.concatenate([image[0], image[-1], image[1:-1, 0], image[1:-1, -1]])
    return tuple(int(v) for v in np.rint(ring.mean(0)))


def warp_matrix(size: int, area: float = 1.0, ratio: float = 1.0, x: float = 0.5, y: float = 0.5,
                degrees: float = 0.0) -> np.ndarray:
    """The ``[2, 3]`` map from output to input coordinates (continuous, pixel centres at +0.5) of a ``size``-sided
    image: rotate by ``degrees`` (counter-clockwise on screen) about the centre, then show the box of ``area`` (a
    fraction of the image) and aspect ``ratio`` (width / height) at relative place ``x, y`` ∈ [0, 1] (0: left / top
    edge, 1: right / bottom)."""
    width = min(size * math.sqrt(area * ratio), size)
    height = min(size * math.sqrt(area / ratio), size)
    left, top = x * (size - width), y * (size - height)
    scale = np.diag([width / size, height / size])
    angle = math.radians(degrees)
    rotation = np.array([[math.cos(angle), -math.sin(angle)], [math.sin(angle), math.cos(angle)]])
    centre = np.full(2, size / 2)
    linear = scale @ rotation
    # out → rotate about the centre → scale into the box: in = scale·(R·(out − c) + c) + (left, top)
    offset = scale @ (centre - rotation @ centre) + np.array([left, top])
    return np.hstack([linear, offset[:, None]])


def warp(image: np.ndarray, matrix: np.ndarray) -> np.ndarray:
    """uint8 ``[S, S, 3]`` resampled bilinearly at ``matrix`` (output → input, continuous coordinates); outside the
    image: its ``border_colour``."""
    size = image.shape[0]
    out = _pillow(image).transform((size, size), Image.AFFINE, tuple(np.asarray(matrix).ravel()), Image.BILINEAR,
                                   fillcolor=border_colour(image))
    return np.asarray(out)


def low_resolution(image: np.ndarray, side: int) -> np.ndarray:
    """uint8 ``[S, S, 3]`` shrunk to ``side`` pixels a side (Pillow's antialiased bilinear) and enlarged back."""
    size = image.shape[0]
    return np.asarray(_pillow(image).resize((side, side), Image.BILINEAR).resize((size, size), Image.BILINEAR))


def blur(image: np.ndarray, sigma: float) -> np.ndarray:
    """uint8 ``[S, S, 3]`` convolved with a Gaussian of standard deviation ``sigma`` pixels (Pillow's)."""
    return np.asarray(_pillow(image).filter(ImageFilter.GaussianBlur(sigma)))


def brightness_contrast(image: np.ndarray, brightness: float, contrast: float) -> np.ndarray:
    """uint8 ``[S, S, 3]``: every value × ``brightness``, then pulled towards (``contrast`` < 1) or pushed from
    (> 1) the image's mean grey level by ``contrast``; rounded and clipped to [0, 255]."""
    x = image.astype(np.float32) * brightness
    mean = float((x @ np.array([0.299, 0.587, 0.114], np.float32)).mean())
    return np.clip(np.rint((x - mean) * contrast + mean), 0, 255).astype(np.uint8)


def grayscale(image: np.ndarray) -> np.ndarray:
    """uint8 ``[S, S, 3]`` with each pixel's ITU-R 601 luma (Pillow's ``convert("L")``) in all three channels."""
    return np.repeat(np.asarray(_pillow(image).convert("L"))[..., None], 3, axis=2)


def erase(image: np.ndarray, top: int, left: int, height: int, width: int, value: int) -> np.ndarray:
    """uint8 ``[S, S, 3]`` with the box ``[top, top + height) × [left, left + width)`` set to grey ``value``."""
    out = image.copy()
    out[top:top + height, left:left + width] = value
    return out


@dataclasses.dataclass(frozen=True)
class Augment:
    """Which augmentations a run uses, each with its probability per image (0: off) and strength.

    crop: random resized crop, a box of area uniform in [``crop_scale``, 1] of the image, aspect ratio
    log-uniform in [3/4, 4/3], placed uniformly, shown at the full size (scale and translation);
    rotate: an angle uniform in ±``rotate_degrees``; lowres: down to a side uniform in [``lowres_min``·S, S] and back;
    blur: σ uniform in [0.1, ``blur_sigma``] pixels; color: brightness and contrast factors uniform in
    1 ± ``brightness`` and 1 ± ``contrast``; grayscale; erase: a box of area uniform in [0.02, ``erase_area``] of
    the image, aspect log-uniform in [0.3, 3.3], filled with one grey level uniform in [0, 255].
    """

    crop: float = 0.0
    crop_scale: float = 0.6
    rotate: float = 0.0
    rotate_degrees: float = 10.0
    lowres: float = 0.0
    lowres_min: float = 0.25
    blur: float = 0.0
    blur_sigma: float = 1.5
    color: float = 0.0
    brightness: float = 0.3
    contrast: float = 0.3
    grayscale: float = 0.0
    erase: float = 0.0
    erase_area: float = 0.25

    def __post_init__(self):
        for name, rule, words in RANGES:
            if not rule(getattr(self, name)):
                raise ValueError(f"data.augment.{name} must be {words}, got {getattr(self, name)!r}")

    @classmethod
    def from_config(cls, augment) -> Augment:
        """From ``config.data.augment`` (any mapping of these fields)."""
        return cls(**dict(augment))

    def names(self) -> list[str]:
        """``op p`` for every op in use, e.g. ``["crop 0.5", "blur 0.2"]``."""
        return [f"{name} {getattr(self, name):g}" for name in PROBABILITIES if getattr(self, name) > 0]

    def apply(self, images: np.ndarray, seed: int, positions: np.ndarray) -> None:
        """Augment uint8 ``images`` ``[n, S, S, 3]`` in place, image ``i`` with the draws of global position
        ``positions[i]``."""
        if not self.names():
            return
        u = draws(seed, positions, NUM_DRAWS)
        for i in range(len(images)):
            images[i] = self.one(images[i], u[i])

    def one(self, image: np.ndarray, u: np.ndarray) -> np.ndarray:
        """uint8 ``[S, S, 3]`` augmented with the uniform draws ``u`` ``[NUM_DRAWS]`` (see ``COLUMNS``)."""
        size = image.shape[0]
        takes = {name: u[COLUMNS[name][0]] < getattr(self, name) for name in PROBABILITIES}
        if takes["crop"] or takes["rotate"]:
            c = u[COLUMNS["crop"]]
            crop = dict(area=self.crop_scale + (1 - self.crop_scale) * c[1], ratio=(4 / 3) ** (2 * c[2] - 1),
                        x=c[3], y=c[4]) if takes["crop"] else {}
            degrees = self.rotate_degrees * (2 * u[COLUMNS["rotate"][1]] - 1) if takes["rotate"] else 0.0
            image = warp(image, warp_matrix(size, degrees=degrees, **crop))
        if takes["lowres"]:
            side = round(size * (self.lowres_min + (1 - self.lowres_min) * u[COLUMNS["lowres"][1]]))
            image = low_resolution(image, max(side, 1))
        if takes["blur"]:
            image = blur(image, float(0.1 + (self.blur_sigma - 0.1) * u[COLUMNS["blur"][1]]))
        if takes["color"]:
            c = u[COLUMNS["color"]]
            image = brightness_contrast(image, 1 + self.brightness * (2 * c[1] - 1),
                                        1 + self.contrast * (2 * c[2] - 1))
        if takes["grayscale"]:
            image = grayscale(image)
        if takes["erase"]:
            c = u[COLUMNS["erase"]]
            area = size * size * (0.02 + (self.erase_area - 0.02) * c[1])
            ratio = 3.3 ** (2 * c[2] - 1)  # log-uniform in [1/3.3, 3.3] ≈ [0.3, 3.3]
            height = min(size, max(1, round(math.sqrt(area * ratio))))
            width = min(size, max(1, round(math.sqrt(area / ratio))))
            image = erase(image, int(c[3] * (size - height + 1)), int(c[4] * (size - width + 1)), height, width,
                          int(c[5] * 256))
        return image
