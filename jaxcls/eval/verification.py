"""Face verification on insightface ``.bin`` pairs (LFW, CFP-FP, AgeDB-30), insightface's protocol exactly.

Each image and its horizontal flip are embedded, the two embeddings **summed** and L2-normalized; the
distance is the squared L2 distance; thresholds ``arange(0, 4, 0.01)``; 10 folds without shuffling: the
best threshold on 9 folds is applied to the 10th. Reported: mean and std accuracy over folds, the
mean best threshold, and XNorm (the mean norm of the unnormalized embeddings of the images and of their mirrors,
each counted alone, as insightface averages them). Beyond insightface's
accuracy: the ROC of the pairs' cosine similarities, its AUC and TAR at FAR 1e-1 … 1e-4 (those the impostor
pairs can resolve; ``jaxcls.eval.roc``).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

from jaxcls.data.pipeline import to_image
from jaxcls.data.safe_pickle import restricted_loads
from jaxcls.errors import DataError
from jaxcls.eval.roc import has_both_kinds, roc_metrics

FARS = (1e-1, 1e-2, 1e-3, 1e-4)


def _latin1(text, encoding="latin1") -> bytes:
    """``_codecs.encode``: how Python 3 pickles ``bytes`` at protocols 0–2 (text holding one byte per character)."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise ValueError(f"_codecs.encode({type(text).__name__}, {encoding!r}) is not how bytes are pickled")
    return text.encode("latin1")


def _bytes(*args) -> bytes:
    """``bytes()`` (an empty image) or ``bytes(b)``; never ``bytes(n)``, which would allocate n zeros."""
    if args and not (len(args) == 1 and isinstance(args[0], (bytes, bytearray))):
        raise ValueError(f"bytes{tuple(type(a).__name__ for a in args)} is not how bytes are pickled")
    return bytes(*args)


def _bytearray(*args) -> bytearray:
    """``bytearray(b)`` (protocols 3–4) or ``bytearray(text, 'latin-1')`` (0–2)."""
    return bytearray(_latin1(*args) if args and isinstance(args[0], str) else _bytes(*args))


class _Uint8:
    """``numpy.dtype`` as a .bin's pickle calls it (``dtype('u1', False, True)``, then its state set): uint8 alone,
    and never a real dtype, whose state the pickle would set for the whole process."""

    __slots__ = ()

    def __init__(self, code, align=False, copy=True):
        if code != "u1":
            raise ValueError(f"a numpy array of dtype {code!r}: a .bin's encoded images are uint8")

    def __setstate__(self, state):
        if not (isinstance(state, tuple) and len(state) > 1 and state[1] in ("|", "=")):
            raise ValueError(f"numpy.dtype state {state!r} is not uint8's")


class _EncodedImage:
    """A 1-D or 2-D uint8 numpy array of encoded image bytes (insightface's ``build_eval_pack.py`` stores
    ``cv2.imencode``'s arrays), checked as it is rebuilt and kept as its bytes."""

    __slots__ = ("data",)

    def __init__(self, data=b"", dtype=None, shape=(0,)):
        if not isinstance(dtype, _Uint8) or not isinstance(data, (bytes, bytearray)):
            raise ValueError("a numpy array that is not uint8 bytes")
        if not (isinstance(shape, tuple) and 1 <= len(shape) <= 2 and all(isinstance(n, int) and n >= 0
                                                                            for n in shape)
                and math.prod(shape) == len(data)):
            raise ValueError(f"a numpy array of shape {shape!r} over {len(data)} bytes: not an encoded image's")
        self.data = bytes(data)

    def __setstate__(self, state):  # protocols 2–4: (version, shape, dtype, is_fortran, raw bytes) after _reconstruct
        if not (isinstance(state, tuple) and len(state) == 5 and state[0] == 1):
            raise ValueError("a numpy array state that is not (1, shape, dtype, fortran, bytes)")
        _, shape, dtype, _, data = state
        self.data = _EncodedImage(_latin1(data) if isinstance(data, str) else data, dtype, shape).data


class _NdarrayName:
    """What ``numpy.ndarray`` names in such a pickle: only ``_reconstruct``'s first argument."""

    __slots__ = ()

    def __setstate__(self, state):
        raise ValueError("the pickle sets attributes of numpy.ndarray")


_NDARRAY = _NdarrayName()


def _reconstruct(cls, shape, typecode):
    """``numpy.core.multiarray._reconstruct(ndarray, (0,), b'b')``: an empty array whose state comes next."""
    if cls is not _NDARRAY or shape != (0,):
        raise ValueError("numpy's _reconstruct called as no array pickle calls it")
    return _EncodedImage.__new__(_EncodedImage)


def _frombuffer(data, dtype, shape, order="C"):
    """``numpy.core.numeric._frombuffer`` (protocol 5: an array as its buffer, dtype, shape and order)."""
    if order not in ("C", "F"):
        raise ValueError(f"numpy array order {order!r}")
    return _EncodedImage(data, dtype, shape)


# the only functions an honest .bin's pickle calls: byte strings at protocols 0–2, bytearrays at 0–4, and numpy's
# uint8 arrays (cv2.imencode's, as insightface's build_eval_pack.py stores them) at 2–5, under numpy 1's and 2's names
BIN_GLOBALS = {("_codecs", "encode"): _latin1,
               **{(module, "bytes"): _bytes for module in ("builtins", "__builtin__")},
               **{(module, "bytearray"): _bytearray for module in ("builtins", "__builtin__")},
               ("numpy", "dtype"): _Uint8, ("numpy", "ndarray"): _NDARRAY,
               **{(f"numpy.{core}.multiarray", "_reconstruct"): _reconstruct for core in ("core", "_core")},
               **{(f"numpy.{core}.numeric", "_frombuffer"): _frombuffer for core in ("core", "_core")}}


def load_bin(path: str | os.PathLike, size: int = 112) -> tuple[np.ndarray, np.ndarray]:
    """``.bin`` → ``(uint8 images [2N, size, size, 3], bool issame [N])``; pickle protocols 0–5, Python 2's too.

    The pickle is read by ``restricted_loads``: it may hold only byte strings, lists, tuples and booleans, so a file
    carrying code is refused (``RefusedPickle``) and nothing in it runs. A file that is not such a pickle, or an
    image in it that cannot be decoded or is too large (``decode_image``), raises ``DataError`` naming the file (and
    the image's index).
    """
    loaded = restricted_loads(Path(path).read_bytes(), str(path), BIN_GLOBALS, kind="verification .bin")
    if not (isinstance(loaded, (tuple, list)) and len(loaded) == 2):
        raise DataError(f"{path}: not a valid verification .bin: expected a pickled (images, issame) pair, got "
                        f"{type(loaded).__name__}")
    bins, issame = loaded
    if not isinstance(bins, (list, tuple)) or not isinstance(issame, (list, tuple)):
        raise DataError(f"{path}: expected a list of images and a list of booleans, got {type(bins).__name__} "
                        f"and {type(issame).__name__}")
    not_bool = [type(flag).__name__ for flag in issame if not isinstance(flag, bool)]
    if not_bool:
        raise DataError(f"{path}: the pair list holds {not_bool[0]} values, not only booleans")
    if len(bins) != 2 * len(issame):
        raise DataError(f"{path}: {len(bins)} images for {len(issame)} pairs (expected twice as many)")
    bins = [getattr(b, "data", None) if isinstance(b, _EncodedImage) else b for b in bins]  # (no state: None)
    for i, b in enumerate(bins):
        if not isinstance(b, (bytes, bytearray)):
            raise DataError(f"{path} (image {i}): {type(b).__name__} instead of encoded image bytes")
    images = [to_image(b, size, f"{path} (image {i})") for i, b in enumerate(bins)]
    return np.stack(images) if images else np.zeros((0, size, size, 3), np.uint8), np.array(issame, bool)


def _accuracy(threshold, dist, issame):
    return np.mean((dist < threshold) == issame)


def kfold_accuracy(dist: np.ndarray, issame: np.ndarray, nrof_folds: int = 10):
    """Per-fold accuracy and best threshold, folds in order (``KFold(shuffle=False)``)."""
    thresholds = np.arange(0, 4, 0.01)
    folds = np.array_split(np.arange(len(dist)), nrof_folds)
    accs, best = [], []
    for k, test in enumerate(folds):
        train = np.concatenate([f for j, f in enumerate(folds) if j != k])
        train_acc = [_accuracy(t, dist[train], issame[train]) for t in thresholds]
        t = thresholds[int(np.argmax(train_acc))]
        accs.append(_accuracy(t, dist[test], issame[test]))
        best.append(t)
    return np.asarray(accs), np.asarray(best)


def evaluate(views: np.ndarray, issame: np.ndarray, nrof_folds: int = 10) -> dict:
    """``views [V, 2P, D]`` (``embed_views``: each image's embedding, and with ``V = 2`` its mirror's; any norm) in
    pair order → metrics dict (``roc_metrics``' too). The pairs are scored on the views' sum, L2-normalized. An
    image with a non-finite embedding makes every metric NaN, with ``non_finite`` the count of such images: scored,
    they would give made-up numbers (insightface's ``sklearn.preprocessing.normalize`` refuses them)."""
    views = np.asarray(views, np.float64)
    if views.ndim != 3:
        raise ValueError(f"expected views [V, 2P, D], got shape {views.shape}")
    finite = np.isfinite(views).all(axis=(0, 2))
    if not finite.all():
        return {**dict.fromkeys(("accuracy", "accuracy_std", "best_threshold", "xnorm", "mean_cosine"), math.nan),
                "non_finite": int((~finite).sum())}
    xnorm = float(np.linalg.norm(views, axis=-1).mean())  # every view's norm alone, insightface's XNorm
    e = l2_normalize(views.sum(0))
    dist = np.sum((e[0::2] - e[1::2]) ** 2, axis=1)
    accs, thresholds = kfold_accuracy(dist, np.asarray(issame, bool), nrof_folds)
    mean_direction = e.mean(0)
    return {"accuracy": float(accs.mean()), "accuracy_std": float(accs.std()),
            "best_threshold": float(thresholds.mean()), "xnorm": xnorm,
            # 1 when every embedding points the same way: collapse
            "mean_cosine": float(mean_direction @ mean_direction),
            **(roc_metrics(issame, pair_cosines(e), FARS) if has_both_kinds(issame) else {})}


def l2_normalize(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def pair_cosines(normalized: np.ndarray) -> np.ndarray:
    """Cosine similarity of pairs ``(2i, 2i + 1)`` of L2-normalized embeddings ``[2N, D]`` → ``[N]``."""
    return np.sum(normalized[0::2] * normalized[1::2], axis=1)


def embed_views(embed_fn, images: np.ndarray, batch_size: int, flip: bool = True) -> np.ndarray:
    """``embed_fn(uint8 [B, S, S, 3]) -> [B, D]`` over ``images [N, S, S, 3]`` in batches of ``batch_size`` (the
    last one padded, so one compiled program serves all) → ``[V, N, D]``: the images' embeddings and, with ``flip``
    (``V = 2``), their mirrors'."""
    views = []
    for mirror in (False, True)[:1 + flip]:
        out = []
        for start in range(0, len(images), batch_size):
            chunk = images[start:start + batch_size]
            pad = batch_size - len(chunk)
            if pad:
                chunk = np.concatenate([chunk, np.repeat(chunk[-1:], pad, 0)])
            if mirror:
                chunk = np.ascontiguousarray(chunk[:, :, ::-1])
            out.append(np.asarray(embed_fn(chunk))[:batch_size - pad])
        views.append(np.concatenate(out))
    return np.stack(views)


def embed_in_batches(embed_fn, images: np.ndarray, batch_size: int, flip: bool = True) -> np.ndarray:
    """``embed_views`` summed: ``[N, D]``, with ``flip`` each image's and its mirror's embeddings added."""
    return embed_views(embed_fn, images, batch_size, flip).sum(0)
