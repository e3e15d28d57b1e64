"""ROC of verification scores as insightface reports it: sklearn's ``roc_curve``, TAR at FAR, AUC, a PNG plot."""

from __future__ import annotations

import os

import numpy as np

from jaxcls.extras import optional_import


def has_both_kinds(labels) -> bool:
    """Whether ``labels`` hold genuine and impostor pairs, as an ROC needs."""
    return 0 < np.count_nonzero(labels) < np.size(labels)


def roc_curve(labels, scores) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(fpr, tpr, thresholds)``, thresholds from ``inf`` down to the lowest score, exactly as sklearn's
    ``roc_curve(labels, scores)`` (which insightface's IJB script uses): one point per distinct score, and a point
    dropped where both counts grow by the same step as at the point before (``drop_intermediate``)."""
    labels, scores = np.asarray(labels, bool), np.asarray(scores, np.float64)
    if not has_both_kinds(labels):
        raise ValueError(f"an ROC needs genuine and impostor pairs; got {labels.sum()} genuine of {labels.size}")
    order = np.argsort(-scores, kind="stable")
    scores, labels = scores[order], labels[order]
    last = np.r_[np.flatnonzero(np.diff(scores)), scores.size - 1]  # the last pair at each distinct score
    tps = np.cumsum(labels)[last]
    fps = last + 1 - tps
    if len(fps) > 2:
        keep = np.r_[True, np.logical_or(np.diff(fps, 2), np.diff(tps, 2)), True]
        fps, tps, last = fps[keep], tps[keep], last[keep]
    fps, tps = np.r_[0, fps], np.r_[0, tps]
    return fps / fps[-1], tps / tps[-1], np.r_[np.inf, scores[last]]


def tar_at_far(fpr: np.ndarray, tpr: np.ndarray, far: float) -> float:
    """TAR at the ROC point whose FAR is nearest ``far`` (of equally near points, the highest TAR), as insightface."""
    distance = np.abs(fpr - far)
    return float(tpr[len(fpr) - 1 - np.argmin(distance[::-1])])


def auc(fpr: np.ndarray, tpr: np.ndarray) -> float:
    """Area under the ROC (trapezoids)."""
    return float(np.sum(np.diff(fpr) * (tpr[1:] + tpr[:-1]) / 2))


def far_key(far: float) -> str:
    return f"tar@far={far:.0e}"


def roc_metrics(labels, scores, fars) -> dict:
    """``{"auc", "tar@far=1e-04", …, "impostor_pairs"}``; a FAR below one impostor pair (``far × impostors < 1``)
    cannot be measured and has no entry."""
    fpr, tpr, _ = roc_curve(labels, scores)
    impostors = int(np.size(labels) - np.count_nonzero(labels))
    out = {"auc": auc(fpr, tpr), "impostor_pairs": impostors}
    out.update({far_key(far): tar_at_far(fpr, tpr, far) for far in fars if far * impostors >= 1})
    return out


def unmeasurable(fars, impostors: int) -> str | None:
    """A sentence naming the FARs that ``impostors`` impostor pairs cannot resolve, or None."""
    missing = [f"{far:.0e}" for far in fars if far * impostors < 1]
    if not missing:
        return None
    return (f"TAR at FAR {', '.join(missing)} not measured: {impostors:,} impostor pairs resolve FAR down to "
            f"{1 / impostors:.1e}")


def plot_roc(curves: dict, path: str | os.PathLike, title: str) -> None:
    """``curves`` ``{name: (fpr, tpr)}`` as one PNG, FAR on a log axis (needs matplotlib: ``jaxcls[plot]``)."""
    matplotlib = optional_import("matplotlib", "plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5), dpi=120)
    for name, (fpr, tpr) in curves.items():
        positive = fpr > 0
        ax.plot(fpr[positive], tpr[positive], label=f"{name} (AUC {auc(fpr, tpr):.4f})")
    ax.set(xscale="log", xlabel="false accept rate", ylabel="true accept rate", title=title, ylim=(0, 1.01))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
