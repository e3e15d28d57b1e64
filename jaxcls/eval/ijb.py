"""IJB-B / IJB-C 1:1 verification, insightface's protocol (``recognition/_evaluation_/ijb/``) step for step.

``python -m jaxcls.eval.ijb --root DIR --target IJBC (--workdir runs/x [--step N] | --onnx model.onnx)``

``DIR`` (or ``DIR/IJBC``) holds insightface's release: ``meta/ijbc_face_tid_mid.txt`` (image, template, media),
``meta/ijbc_name_5pts_score.txt`` (image, five landmarks x y, detector score; the same images in the same order),
``meta/ijbc_template_pair_label.txt`` (template, template, 1 if the same person) and the images in ``loose_crop/``.
Each face is aligned with its landmarks to arcface's 112×112 template and embedded with its mirror image, the two
embeddings summed (flip test, F1); the embedding keeps its norm (N1) and is multiplied by the detector score (D1);
faces of one media are averaged, a template sums its media and is L2-normalised; a pair's score is the cosine of its
templates. Reported: TAR at FAR 1e-6 … 1e-1 and AUC (``jaxcls.eval.roc``), printed and written as JSON with the
pair scores as ``.npy``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
from absl import flags

from jaxcls.data.align import align_face
from jaxcls.data.images import decode_image, read_image_header
from jaxcls.errors import DataError
from jaxcls.eval.roc import far_key, roc_metrics, unmeasurable
from jaxcls.eval.verification import l2_normalize
from jaxcls.interop.inference import check_model_choice, embed_images, open_embedder
from jaxcls.reporting import configure_logging, run_cli

FARS = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1)
TARGETS = ("IJBB", "IJBC")


@dataclasses.dataclass
class Protocol:
    """One release's meta files: per image ``names``, ``landmarks [N, 5, 2]``, detector ``scores [N]``,
    ``templates [N]``, ``medias [N]``; per pair ``pairs [P, 2]`` (template ids) and ``labels [P]``."""

    root: Path
    names: list
    landmarks: np.ndarray
    scores: np.ndarray
    templates: np.ndarray
    medias: np.ndarray
    pairs: np.ndarray
    labels: np.ndarray


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text!r} is not a finite number")
    return value


def _int64(text: str) -> int:
    value = int(text)
    if not -(1 << 63) <= value < 1 << 63:
        raise ValueError(f"{text!r} is outside the 64-bit range of ids")
    return value


_FIELD = {float: _finite, int: _int64}  # how a column of each type is read: finite floats, 64-bit ids


def _table(path: Path, types: tuple, kinds: str):
    """The whitespace-separated columns of ``path`` converted by ``types`` (one per column): rows of values, or for
    an all-int file (IJB-C's 15.7 M pairs) an int64 array read by numpy. Errors name the file and line."""
    if not path.is_file():
        raise DataError(f"{path}: missing (expected insightface's IJB layout: meta/ and loose_crop/)")
    integers = all(t is int for t in types)
    if integers:
        try:
            table = np.loadtxt(path, dtype=np.int64, ndmin=2)
            if table.size == 0 or table.shape[1] == len(types):
                return _nonempty(table, path)
        except ValueError:
            pass  # read it line by line below, for an error that names the line
    try:
        lines = path.read_bytes().decode("utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not a text file ({e})") from None
    rows = []
    for number, line in enumerate(lines, 1):
        fields = line.split()
        if not fields:
            continue
        if len(fields) != len(types):
            raise DataError(f"{path} (line {number}): {len(fields)} fields, expected {len(types)} ({kinds})")
        try:
            rows.append([_FIELD.get(t, t)(f) for t, f in zip(types, fields)])
        except ValueError as e:
            raise DataError(f"{path} (line {number}): {e} ({kinds})") from e
    return _nonempty(np.array(rows, np.int64) if integers else rows, path)


def _nonempty(rows, path: Path):
    if not len(rows):
        raise DataError(f"{path}: empty")
    return rows


def read_protocol(root: str | Path, target: str) -> Protocol:
    """The meta files of ``target`` (IJBB or IJBC) under ``root`` or ``root/<target>``, checked for consistency."""
    if target not in TARGETS:
        raise ValueError(f"unknown IJB target {target!r}; choose one of {', '.join(TARGETS)}")
    root = Path(root)
    root = root / target if not (root / "meta").is_dir() and (root / target / "meta").is_dir() else root
    prefix = root / "meta" / target.lower()
    faces_path, media_path, pairs_path = (Path(f"{prefix}_{name}.txt") for name in
                                          ("name_5pts_score", "face_tid_mid", "template_pair_label"))
    faces = _table(faces_path, (str,) + (float,) * 11, "image, x1 y1 … x5 y5, detector score")
    media = _table(media_path, (str, int, int), "image, template, media")
    pairs = _table(pairs_path, (int, int, int), "template, template, label")
    names, media_names = [row[0] for row in faces], [row[0] for row in media]
    if names != media_names:
        i = next((i for i, (a, b) in enumerate(zip(names, media_names)) if a != b), min(len(names), len(media_names)))
        raise DataError(f"{faces_path} and {media_path} list different images (first at image {i + 1}; "
                        f"{len(names)} and {len(media_names)} images)")
    numbers = np.array([row[1:] for row in faces])
    protocol = Protocol(root, names, numbers[:, :10].reshape(-1, 5, 2), numbers[:, 10],
                        np.array([row[1] for row in media]), np.array([row[2] for row in media]), pairs[:, :2],
                        pairs[:, 2])
    unknown = np.setdiff1d(protocol.pairs, protocol.templates)
    if unknown.size:
        raise DataError(f"{pairs_path}: templates {unknown[:5].tolist()} have no image in {media_path}")
    if not np.isin(protocol.labels, (0, 1)).all():
        raise DataError(f"{pairs_path}: labels must be 0 or 1")
    return protocol


def check_images(protocol: Protocol) -> None:
    """Every face the protocol names is a file in ``loose_crop/`` whose image header reads (and is within the pixel
    limit): checked before the embedding starts, which on IJB-C takes hours. ``DataError`` with the count and the
    first problems."""
    problems, names = [], dict.fromkeys(protocol.names)  # each image once, in order
    for name in names:
        try:
            read_image_header(protocol.root / "loose_crop" / name)
        except DataError as e:
            problems.append(str(e))
    if problems:
        raise DataError(f"{len(problems):,} of the {len(names):,} images the protocol names cannot be read (nothing "
                        "was embedded): " + "; ".join(problems[:5]) + ("; …" if len(problems) > 5 else ""))


def aligned_loader(root: Path, name: str, landmarks: np.ndarray, size: int):
    """``loader()`` → the aligned uint8 ``[size, size, 3]`` face of ``root/loose_crop/name``."""
    path = root / "loose_crop" / name

    def load():
        image = decode_image(path.read_bytes(), str(path))
        try:
            return align_face(image, landmarks, size)
        except ValueError as e:
            raise DataError(f"{path}: {e}") from e

    return load


def template_features(features: np.ndarray, templates: np.ndarray, medias: np.ndarray):
    """``(template ids [T], L2-normalised features [T, D])``: per template, the mean feature of each of its media,
    summed over its media."""
    groups, group_of_face = np.unique(np.stack([templates, medias], 1), axis=0, return_inverse=True)
    group_of_face = group_of_face.reshape(-1)
    media_means = np.zeros((len(groups), features.shape[1]))
    np.add.at(media_means, group_of_face, features)
    media_means /= np.bincount(group_of_face, minlength=len(groups))[:, None]
    ids, template_of_group = np.unique(groups[:, 0], return_inverse=True)
    out = np.zeros((len(ids), features.shape[1]))
    np.add.at(out, template_of_group.reshape(-1), media_means)
    return ids, l2_normalize(out)


def pair_scores(ids: np.ndarray, features: np.ndarray, pairs: np.ndarray, chunk: int = 100_000) -> np.ndarray:
    """Cosine of the two templates of every pair ``[P, 2]`` (in chunks: IJB-C has 15.7 M pairs)."""
    index = np.searchsorted(ids, pairs)
    return np.concatenate([np.sum(features[i[:, 0]] * features[i[:, 1]], axis=1)
                           for i in np.array_split(index, max(1, -(-len(index) // chunk)))])


def evaluate(protocol: Protocol, face_features: np.ndarray, norm_score: bool = True,
             detector_score: bool = True) -> tuple[dict, np.ndarray]:
    """``(metrics, pair scores)`` from the (flip-summed) features ``[N, D]`` of the protocol's faces."""
    features = np.array(face_features, np.float64)  # one copy, changed in place
    if not norm_score:
        features = l2_normalize(features)
    if detector_score:
        features *= protocol.scores[:, None]
    ids, templates = template_features(features, protocol.templates, protocol.medias)
    scores = pair_scores(ids, templates, protocol.pairs)
    return roc_metrics(protocol.labels.astype(bool), scores, FARS), scores


def run(root, target, *, workdir=None, onnx=None, step=None, out=None, flip=True, norm_score=True,
        detector_score=True, batch_size=256, progress=True) -> dict:
    """The CLI as a function: prints the table, writes ``out`` (JSON) and ``<out>.scores.npy``; returns the JSON."""
    check_model_choice(workdir, onnx, step)
    protocol = read_protocol(root, target)
    check_images(protocol)
    out = Path(out or (Path(workdir) if workdir else Path(onnx).parent) / f"ijb_{target.lower()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)  # before the embedding, not after
    embedder = open_embedder(workdir, onnx, step)
    loaders = [aligned_loader(protocol.root, n, lm, embedder.input_size)
               for n, lm in zip(protocol.names, protocol.landmarks)]
    features, _, _ = embed_images(embedder, loaders, protocol.names, batch_size=batch_size, flip=flip, strict=True,
                                  progress=progress)
    metrics, scores = evaluate(protocol, features, norm_score, detector_score)
    model = str(onnx) if onnx else f"{workdir} step {embedder.step}"
    result = {"target": target, "model": model, "flip": flip, "norm_score": norm_score,
              "detector_score": detector_score, "faces": len(protocol.names),
              "templates": int(np.unique(protocol.templates).size), "pairs": int(len(scores)), **metrics}
    print(f"{target} 1:1 verification, {model}: {result['faces']:,} faces, {result['templates']:,} templates, "
          f"{result['pairs']:,} pairs")
    print(" ".join(f"{'TAR@' + f'{far:.0e}':>10}" for far in FARS) + f" {'AUC':>8}")
    print(" ".join(f"{metrics[far_key(far)] * 100:>10.2f}" if far_key(far) in metrics else f"{'-':>10}"
                   for far in FARS) + f" {metrics['auc'] * 100:>8.2f}")
    note = unmeasurable(FARS, metrics["impostor_pairs"])
    if note:
        print(note)
    out.write_text(json.dumps(result, indent=1))
    np.save(out.with_suffix(".scores.npy"), scores)
    print(f"wrote {out} and {out.with_suffix('.scores.npy')}")
    return result


def main(argv):
    del argv
    f = flags.FLAGS
    configure_logging(verbose=f["verbosity"].present)
    run(f.root, f.target, workdir=f.workdir, onnx=f.onnx, step=f.step, out=f.out, flip=f.flip,
        norm_score=f.norm_score, detector_score=f.detector_score, batch_size=f.batch_size)


if __name__ == "__main__":
    flags.DEFINE_string("root", None, "the IJB release (holding meta/ and loose_crop/, or IJBB/ and IJBC/)",
                        required=True)
    flags.DEFINE_enum("target", "IJBC", TARGETS, "which benchmark")
    flags.DEFINE_string("workdir", None, "a training run's workdir")
    flags.DEFINE_integer("step", None, "checkpoint step (default: latest)")
    flags.DEFINE_string("onnx", None, "an exported .onnx model instead of a workdir")
    flags.DEFINE_string("out", None, "results JSON (default: ijb_<target>.json in the workdir or beside the model)")
    flags.DEFINE_integer("batch_size", 256, "faces per batch (split over every local device)")
    flags.DEFINE_bool("flip", True, "add each face's mirror embedding (F1)")
    flags.DEFINE_bool("norm_score", True, "keep each face's embedding norm (N1); false: L2-normalise faces first")
    flags.DEFINE_bool("detector_score", True, "weight each face by its detector score (D1)")
    run_cli(main)
