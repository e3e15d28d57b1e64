"""Margin losses and the class-parallel softmax cross-entropy.

``margins`` (the margin formulas) → ``cross_entropy`` (softmax statistics over a sharded class axis, ``combine_stats``;
``class_parallel_cross_entropy`` for logits of the user's own) → ``tiles``
(the per-shard tile kernel) → ``kernel_forms``, ``rows_stats``, ``rows_backward`` (a tile straight from the rows
picked by index: Pallas kernels on CUDA GPUs, XLA elsewhere; ``FCHead.step`` runs them too) → ``sharded``
(``sharded_margin_loss``, the loss for user code). The layout
helpers (``weight_sharding``, ``padded_num_classes``, ``class_shards``) live in ``jaxcls.mesh``.
"""

from jaxcls.losses.cross_entropy import class_parallel_cross_entropy, masked_fill_value
from jaxcls.losses.margins import MARGINS, CombinedMargin, am_softmax, arcface, combined, cosface, sphereface
from jaxcls.losses.sharded import init_weight, sharded_margin_loss
from jaxcls.losses.tiles import l2_normalize, validate_labels

__all__ = [
    "MARGINS", "CombinedMargin", "am_softmax", "arcface", "class_parallel_cross_entropy", "combined", "cosface",
    "init_weight", "l2_normalize", "masked_fill_value", "sharded_margin_loss", "sphereface", "validate_labels",
]
