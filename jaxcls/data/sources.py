"""Image sources by name: RecordIO, a folder per class, a procedural many-identity set, synthetic noise.

Every source has ``len()``, ``raw(i) -> (encoded bytes or uint8 [H, W, 3], int label)``, ``where(i)`` (the
record as errors name it: file, key, byte offset), ``num_classes()``, a class attribute ``generated`` (made on the
fly: nothing to read from disk) and ``from_config(config.data, num_classes)``; a source that can make verification
pairs of identities it never trains on has ``heldout_pairs()``. ``make_source(config.data, num_classes)`` builds
one by kind.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np

from jaxcls.data.images import IMAGE_SUFFIXES, image_files
from jaxcls.data.recordio import MXFaceDataset
from jaxcls.errors import DataError
from jaxcls.registry import lookup

log = logging.getLogger("jaxcls")


class ImageFolder:
    """``root/<class>/…/<image>``, as torchvision's ``ImageFolder`` reads it (arcface_torch's reader of folders):
    classes numbered in sorted name order, each class's images at any depth below it (``images.image_files``);
    other files are counted in a warning."""

    generated = False

    @classmethod
    def from_config(cls, data, num_classes: int) -> ImageFolder:
        return cls(data.root)

    def __init__(self, root: str | os.PathLike):
        root = Path(root)
        classes = sorted(p.name for p in root.iterdir() if p.is_dir())
        if not classes:
            raise ValueError(f"{root}: no class folders")
        self.files, labels, others, empty = [], [], [], []
        for label, name in enumerate(classes):
            images, other = image_files(root / name)
            self.files += images
            labels += [label] * len(images)
            others += other
            empty += [] if images else [name]
        if empty:  # a class no image trains: torchvision's ImageFolder refuses it too
            shown = ", ".join(empty[:10]) + (f", … ({len(empty)} in all)" if len(empty) > 10 else "")
            raise ValueError(f"{root}: no images in {len(empty)} of its {len(classes)} class folders: {shown} "
                             f"(looked for {', '.join(IMAGE_SUFFIXES)})")
        if others:
            log.warning("%s: %d files in the class folders are not images by their suffix and are not used, e.g. %s",
                        root, len(others), others[0])
        self._labels, self.classes = np.asarray(labels), classes

    def __len__(self):
        return len(self.files)

    def raw(self, i):
        try:
            return self.files[i].read_bytes(), int(self._labels[i])
        except OSError as e:
            raise DataError(f"{self.files[i]}: cannot read: {e}") from e

    def where(self, i):
        return str(self.files[i])

    def labels(self) -> np.ndarray:
        """Every image's class."""
        return self._labels

    def num_classes(self):
        return len(self.classes)


class ProceduralGlyphs:
    """A learnable many-identity image set made on the fly, needing no download.

    Identity ``k`` is a random set of strokes (seeded by ``k``); each of its images renders them
    under a random affine jitter, stroke width, contrast and noise. ``image(k, j)`` is deterministic, so
    held-out identities ``>= num_classes`` give open-set verification pairs (see ``heldout_pairs``).
    """

    generated = True

    @classmethod
    def from_config(cls, data, num_classes: int) -> ProceduralGlyphs:
        return cls(**data.procedural)

    def __init__(self, num_classes: int = 1000, images_per_class: int = 16, size: int = 32, seed: int = 0,
                 strokes: int = 5):
        self.n, self.per, self.size, self.seed, self.strokes = num_classes, images_per_class, size, seed, strokes
        grid = (np.arange(size) + 0.5) / size
        self._yx = np.stack(np.meshgrid(grid, grid, indexing="ij"), -1)  # [S, S, 2]

    def __len__(self):
        return self.n * self.per

    def num_classes(self):
        return self.n

    def raw(self, i):
        return self.image(i // self.per, i % self.per), i // self.per

    def where(self, i):
        return f"procedural image {i}"

    def image(self, identity: int, variant: int) -> np.ndarray:
        shape_rng = np.random.default_rng([self.seed, identity])
        ends = shape_rng.uniform(0.15, 0.85, size=(self.strokes, 2, 2))
        rng = np.random.default_rng([self.seed, identity, variant, 1])
        angle = rng.uniform(-0.25, 0.25)
        scale = rng.uniform(0.85, 1.15)
        rot = scale * np.array([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]])
        ends = (ends - 0.5) @ rot.T + 0.5 + rng.uniform(-0.08, 0.08, size=2)
        a, b = ends[:, 0], ends[:, 1]  # [K, 2]
        p = self._yx[:, :, None, :]  # [S, S, 1, 2]
        ab = b - a
        t = np.clip(((p - a) * ab).sum(-1) / np.maximum((ab * ab).sum(-1), 1e-6), 0, 1)
        dist = np.linalg.norm(p - (a + t[..., None] * ab), axis=-1).min(-1)  # [S, S]
        width = rng.uniform(0.03, 0.06)
        ink = np.clip(1.5 - dist / width, 0, 1)
        fg, bg = rng.uniform(0, 0.35, 3), rng.uniform(0.65, 1.0, 3)
        img = bg + ink[..., None] * (fg - bg) + rng.normal(0, 0.05, (self.size, self.size, 3))
        return (np.clip(img, 0, 1) * 255).astype(np.uint8)

    def heldout_pairs(self, num_pairs: int = 600, first_identity: int | None = None):
        """``(images uint8 [2P, S, S, 3], issame bool [P])`` from identities never used in training.

        Alternating same/different pairs, as LFW-style ``.bin`` files are.
        """
        first = self.n if first_identity is None else first_identity
        rng = np.random.default_rng([self.seed, 2])
        images, issame = [], []
        for k in range(num_pairs):
            same = k % 2 == 0
            i, j = rng.choice(num_pairs, size=2, replace=False) + first
            v = rng.choice(1000, size=2, replace=False) + self.per  # variants never seen in training
            images += [self.image(i, v[0]), self.image(i if same else j, v[1])]
            issame.append(same)
        return np.stack(images), np.asarray(issame)


class SyntheticNoise:
    """Random images with random labels, for throughput benchmarks (nothing to learn)."""

    generated = True

    @classmethod
    def from_config(cls, data, num_classes: int) -> SyntheticNoise:
        return cls(num_classes, size=data.input_size)

    def __init__(self, num_classes: int, size: int = 112, length: int = 1 << 20):
        self.n, self.size, self.length = num_classes, size, length

    def __len__(self):
        return self.length

    def num_classes(self):
        return self.n

    def raw(self, i):
        rng = np.random.default_rng(i)
        return rng.integers(0, 256, (self.size, self.size, 3), dtype=np.uint8), int(rng.integers(self.n))

    def where(self, i):
        return f"synthetic image {i}"


SOURCES = {"recordio": MXFaceDataset, "folder": ImageFolder, "procedural": ProceduralGlyphs,
           "synthetic": SyntheticNoise}


def make_source(data, num_classes: int):
    """The source ``data.kind`` (recordio | folder | procedural | synthetic) built from ``config.data``."""
    return lookup(SOURCES, data.kind, "data source").from_config(data, num_classes)
