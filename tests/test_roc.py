"""ROC, TAR at FAR and AUC against a brute-force reference: counts per threshold, sklearn's point dropping."""

import numpy as np
import pytest

from jaxcls.eval.roc import auc, plot_roc, roc_curve, roc_metrics, tar_at_far, unmeasurable


def reference_roc(labels, scores):
    """Every distinct score as a threshold (highest first), counting pairs at or above it; then drop each point
    whose step in both counts equals the previous step (sklearn's ``drop_intermediate``)."""
    pos, neg = scores[labels], scores[~labels]
    points = [(0, 0, np.inf)] + [(np.sum(neg >= t), np.sum(pos >= t), t) for t in sorted(set(scores), reverse=True)]
    kept = [points[0], points[1]] if len(points) > 3 else points
    if len(points) > 3:
        for i in range(2, len(points) - 1):
            before = (points[i][0] - points[i - 1][0], points[i][1] - points[i - 1][1])
            after = (points[i + 1][0] - points[i][0], points[i + 1][1] - points[i][1])
            if before != after:
                kept.append(points[i])
        kept.append(points[-1])
    fps, tps, thresholds = (np.array(x, np.float64) for x in zip(*kept))
    return fps / len(neg), tps / len(pos), thresholds


def reference_tar(fpr, tpr, far):
    best = min(abs(f - far) for f in fpr)
    return max(t for f, t in zip(fpr, tpr) if abs(f - far) == best)


@pytest.mark.parametrize("levels", [None, 7, 40])  # continuous scores, or few distinct ones (ties across labels)
def test_roc_tar_and_auc_equal_the_reference(levels, rng):
    n = int(rng.integers(20, 400))
    labels = rng.random(n) < rng.uniform(0.1, 0.9)
    labels[:2] = [True, False]
    scores = rng.normal(size=n) + 1.5 * labels
    if levels:
        scores = np.round(scores * levels / 4) / levels
    fpr, tpr, thresholds = roc_curve(labels, scores)
    want = reference_roc(labels, scores)
    for got, expected in zip((fpr, tpr, thresholds), want):
        np.testing.assert_allclose(got, expected, rtol=1e-12)
    for far in [0.0, 1e-3, 0.01, 0.05, 0.1, 0.3, 1.0, rng.uniform()]:
        assert tar_at_far(fpr, tpr, far) == reference_tar(*want[:2], far)
    # AUC = the probability that a genuine pair outscores an impostor one (ties count half)
    pos, neg = scores[labels][:, None], scores[~labels][None, :]
    np.testing.assert_allclose(auc(fpr, tpr), np.mean((pos > neg) + 0.5 * (pos == neg)), rtol=1e-12)


def test_roc_metrics_leave_out_the_fars_the_impostors_cannot_resolve():
    labels = np.r_[np.ones(50, bool), np.zeros(300, bool)]
    scores = np.r_[np.linspace(0.5, 1, 50), np.linspace(0, 0.6, 300)]
    metrics = roc_metrics(labels, scores, (1e-1, 1e-2, 1e-3))
    assert metrics["impostor_pairs"] == 300 and "tar@far=1e-03" not in metrics
    # By hand: the top impostors are 0.600, 0.598, 0.596, …; the genuine scores 0.602 and 0.5918 bracket the first five.
    # FAR 1e-2 is 3 impostors accepted, but sklearn's curve drops the points of 2, 3 and 4 impostors (equal steps),
    # leaving 1 and 5, equally far from 3: the higher TAR wins, 5 impostors with the 41 genuine scores >= 0.5918.
    assert metrics["tar@far=1e-02"] == 41 / 50
    assert unmeasurable((1e-1, 1e-2, 1e-3), 300) == (
        "TAR at FAR 1e-03 not measured: 300 impostor pairs resolve FAR down to 3.3e-03")
    assert unmeasurable((1e-1,), 300) is None
    with pytest.raises(ValueError, match="genuine and impostor"):
        roc_curve(np.ones(4, bool), np.arange(4.0))


def test_plot_roc_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib (the plot extra) is not installed")
    fpr, tpr, _ = roc_curve(np.r_[True, False, True, False], np.array([0.9, 0.8, 0.4, 0.1]))
    plot_roc({"a": (fpr, tpr)}, tmp_path / "roc.png", "test")
    assert (tmp_path / "roc.png").read_bytes().startswith(b"\x89PNG")
