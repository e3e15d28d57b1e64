"""insightface's verification protocol: 10 unshuffled folds, squared L2 on flip-summed normalized embeddings, XNorm
over every view alone."""

import io
import pickle
import struct

import numpy as np
import pytest
from PIL import Image

from jaxcls.errors import DataError
from jaxcls.eval.verification import embed_in_batches, embed_views, evaluate, kfold_accuracy, load_bin


def test_hand_computed_case():
    # Two pairs per fold, 10 folds: same pairs at distance 0.5, different pairs at distance 2.0 except fold 0,
    # where the different pair sits at 0.3 (below every same-pair distance): that fold scores 1/2.
    dist, issame = [], []
    for fold in range(10):
        dist += [0.5, 0.3 if fold == 0 else 2.0]
        issame += [True, False]
    accs, thresholds = kfold_accuracy(np.array(dist), np.array(issame), 10)
    # Fold 0 tested: trained on clean folds, every t in (0.5, 2.0] is perfect and argmax takes the first,
    # 0.51; on fold 0 the different pair at 0.3 < 0.51 is called "same": 1 of 2 right.
    # Other folds tested: fold 0's bad pair is in training; t in (0.5, 2.0] scores 17/18, the best: 0.51.
    np.testing.assert_allclose(thresholds, 0.51)
    np.testing.assert_array_equal(accs, [0.5] + [1.0] * 9)


def insightface_protocol(embeddings1, embeddings2, issame, folds=10):
    """insightface's ``calculate_roc`` as it reads, from normalized pair embeddings: squared distances, KFold
    without shuffling (the first ``n % folds`` folds one pair larger), each fold's threshold the first best of
    ``arange(0, 4, 0.01)`` on the other folds by (TP + TN) / n; the mean accuracy and the mean threshold."""
    diff = embeddings1 - embeddings2
    dist = np.sum(np.square(diff), 1)
    n, thresholds = len(dist), np.arange(0, 4, 0.01)
    sizes = [n // folds + (k < n % folds) for k in range(folds)]
    starts = np.cumsum([0] + sizes)
    accuracies, best = [], []

    def accuracy(t, idx):
        predict = np.less(dist[idx], t)
        tp = np.sum(np.logical_and(predict, issame[idx]))
        tn = np.sum(np.logical_and(np.logical_not(predict), np.logical_not(issame[idx])))
        return float(tp + tn) / dist[idx].size

    for k in range(folds):
        test_set = np.arange(starts[k], starts[k + 1])
        train_set = np.setdiff1d(np.arange(n), test_set)
        scores = np.zeros(len(thresholds))
        for i, t in enumerate(thresholds):
            scores[i] = accuracy(t, train_set)
        best.append(thresholds[np.argmax(scores)])
        accuracies.append(accuracy(best[-1], test_set))
    return np.mean(accuracies), np.mean(best)


def test_accuracy_and_threshold_are_insightfaces_on_random_pairs(rng):
    """Pairs of every kind of closeness (same pairs a noisy copy, different ones random), an odd count so the folds
    differ in size: the accuracy and the best threshold are the protocol's, which a distance other than the squared
    one (its root, or 1 − cos) or another fold split would move."""
    pairs, d = int(rng.integers(301, 400)) | 1, 16
    first = rng.normal(size=(pairs, d))
    issame = rng.random(pairs) < 0.5
    second = np.where(issame[:, None], first + rng.uniform(0.3, 1.5, (pairs, 1)) * rng.normal(size=(pairs, d)),
                      rng.normal(size=(pairs, d)))
    views = np.stack([first, second], 1).reshape(1, 2 * pairs, d) * rng.uniform(1, 20, size=(1, 2 * pairs, 1))
    out = evaluate(views, issame)
    unit = lambda x: x / np.linalg.norm(x, axis=1, keepdims=True)
    accuracy, threshold = insightface_protocol(unit(first), unit(second), issame)
    assert 0.6 < accuracy < 0.99  # neither trivial nor perfect: the threshold matters
    assert out["accuracy"] == pytest.approx(accuracy, abs=1e-12)
    assert out["best_threshold"] == pytest.approx(threshold, abs=1e-9)


def test_mean_cosine_is_the_squared_norm_of_the_mean_direction():
    """1 when every embedding points one way (collapse), 1/D for D orthonormal directions."""
    d, issame = 8, np.array([True, False] * 10)  # 20 pairs: two a fold
    assert evaluate(np.tile([[3.0] + [0.0] * (d - 1)], (40, 1))[None], issame)["mean_cosine"] == pytest.approx(1.0)
    assert evaluate(np.tile(np.eye(d) * 5.0, (5, 1))[None], issame)["mean_cosine"] == pytest.approx(1 / d)


def test_evaluate_on_embeddings():
    e = np.array([[1, 0], [1, 0], [1, 0], [0, 1]] * 10, float)  # same pair, different pair, ...
    issame = np.array([True, False] * 10)
    out = evaluate(e[None] * 3.0, issame)
    assert out["accuracy"] == 1.0 and out["accuracy_std"] == 0.0 and out["xnorm"] == 3.0
    assert 0.0 < out["best_threshold"] <= 2.0
    with pytest.raises(ValueError, match=r"expected views \[V, 2P, D\], got shape \(40, 2\)"):
        evaluate(e, issame)


def test_pairs_are_scored_on_the_views_sum_and_xnorm_is_insightfaces(rng):
    """insightface's ``test()`` averages the norm of every embedding of its two lists (the images', the mirrors')
    one by one; the pairs are scored on the lists' sum, normalized."""
    views = rng.normal(size=(2, 40, 8)) * rng.uniform(1, 30, size=(2, 40, 1))
    issame = rng.random(20) < 0.5
    out = evaluate(views, issame)
    norms = [np.sqrt(sum(x * x for x in embedding)) for view in views for embedding in view]
    assert out["xnorm"] == pytest.approx(sum(norms) / len(norms), rel=1e-12)
    summed = evaluate(views.sum(0)[None], issame)
    assert {k: v for k, v in out.items() if k != "xnorm"} == {k: v for k, v in summed.items() if k != "xnorm"}


def test_a_non_finite_embedding_makes_every_metric_nan_and_is_counted(rng):
    views = rng.normal(size=(2, 40, 8))
    views[1, 7, 3], views[0, 7, 0], views[0, 20, 5] = np.inf, np.nan, np.nan  # images 7 and 20
    out = evaluate(views, rng.random(20) < 0.5)
    assert out.pop("non_finite") == 2 and set(out) == {"accuracy", "accuracy_std", "best_threshold", "xnorm",
                                                       "mean_cosine"}
    assert all(np.isnan(v) for v in out.values())


def test_flip_sum_pads_last_batch():
    images = np.arange(5 * 2 * 2 * 3, dtype=np.uint8).reshape(5, 2, 2, 3)
    calls = []

    def embed(x):
        calls.append(len(x))
        return x.reshape(len(x), -1)[:, :2].astype(float)

    views = embed_views(embed, images, batch_size=4)
    assert views.shape == (2, 5, 2) and calls == [4, 4, 4, 4]
    np.testing.assert_array_equal(views[0], images.reshape(5, -1)[:, :2])
    np.testing.assert_array_equal(views[1], images[:, :, ::-1].reshape(5, -1)[:, :2])
    np.testing.assert_array_equal(embed_in_batches(embed, images, batch_size=4), views.sum(0))
    calls.clear()
    np.testing.assert_array_equal(embed_in_batches(embed, images, batch_size=4, flip=False),
                                  images.reshape(5, -1)[:, :2])
    assert calls == [4, 4]


def png(seed):
    buf = io.BytesIO()
    Image.fromarray(np.full((8, 8, 3), seed * 40, np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def test_load_bin_python3_and_python2_pickles(tmp_path):
    bins, issame = [png(i) for i in range(4)], [True, False]
    p3 = tmp_path / "p3.bin"
    p3.write_bytes(pickle.dumps((bins, issame)))
    images, same = load_bin(p3, size=8)
    assert images.shape == (4, 8, 8, 3) and list(same) == issame and images[1, 0, 0, 0] == 40
    # A Python 2 pickle stores the images as str (BINSTRING): Python 3 needs encoding='bytes'.
    body = b"".join(b"T" + struct.pack("<i", len(b)) + b for b in bins)
    p2 = tmp_path / "p2.bin"
    p2.write_bytes(b"\x80\x02](" + body + b"e](\x88\x89e\x86.")
    images2, same2 = load_bin(p2, size=8)
    np.testing.assert_array_equal(images2, images)
    assert list(same2) == issame


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_load_bin_takes_insightfaces_build_eval_pack_arrays(tmp_path, protocol):
    """insightface's build_eval_pack.py stores each image as cv2.imencode's uint8 array ([n, 1]); anything else a
    numpy array could be is refused, naming the file."""
    bins, issame = [png(i) for i in range(4)], [True, False]
    arrays = [np.frombuffer(b, np.uint8).reshape(-1, 1) for b in bins]
    path = tmp_path / "pack.bin"
    path.write_bytes(pickle.dumps((arrays[:2] + [arrays[2].ravel(), arrays[3]], issame), protocol=protocol))
    images, same = load_bin(path, size=8)
    np.testing.assert_array_equal(images, load_bin_of(tmp_path, bins, issame))
    assert list(same) == issame
    for bad, message in [(np.zeros((2, 2, 2), np.uint8), "not an encoded image's"),
                         (np.frombuffer(bins[0], np.uint8).astype(np.float32), "dtype '<f4'|dtype 'f4'")]:
        path.write_bytes(pickle.dumps(([bad] + arrays[1:], issame), protocol=protocol))
        with pytest.raises(DataError, match=rf"^{path}: not a valid verification .bin: ValueError: .*({message})"):
            load_bin(path, size=8)


def load_bin_of(tmp_path, bins, issame):
    (tmp_path / "bytes.bin").write_bytes(pickle.dumps((bins, issame)))
    return load_bin(tmp_path / "bytes.bin", size=8)[0]


def test_a_broken_bin_is_an_error_naming_the_file(tmp_path):
    good = pickle.dumps(([png(i) for i in range(4)], [True, False]))
    bad = bytearray(png(2))
    bad[:16] = bytes(16)
    cases = {
        "truncated": (good[:len(good) // 2], r"not a valid verification .bin: expected \d+ bytes in a bytes1?, but "
                                             r"only \d+ remain"),
        "empty": (b"", "the pickle ends before its STOP opcode"),
        "garbage": (bytes(range(256)), r"not a valid verification .bin: at byte 0: opcode b'\\x00' unknown"),
        "a dict": (pickle.dumps({"images": []}), "expected a pickled \\(images, issame\\) pair, got dict"),
        "numbers for flags": (pickle.dumps(([png(0)] * 2, [1])), "the pair list holds int values, not only booleans"),
        "numbers for images": (pickle.dumps((7, [True])), "expected a list of images and a list of booleans"),
        "odd count": (pickle.dumps(([png(0)] * 3, [True, False])), "3 images for 2 pairs"),
        "an image as a number": (pickle.dumps(([png(0), 10**9], [True])), r" \(image 1\): int instead of encoded"),
        "an image not decodable": (pickle.dumps(([png(0), png(1), bytes(bad), png(3)], [True, False])),
                                   r" \(image 2\): cannot decode image: cannot identify image file"),
    }
    for data, message in cases.values():
        (tmp_path / "x.bin").write_bytes(data)
        with pytest.raises(DataError, match=rf"^{tmp_path / 'x.bin'}\b.*{message}"):
            load_bin(tmp_path / "x.bin", size=8)
