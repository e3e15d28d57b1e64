"""Margin losses and the class-parallel softmax cross-entropy."""

from jaxcls.losses.cross_entropy import class_parallel_cross_entropy, masked_fill_value
from jaxcls.losses.margins import MARGINS, CombinedMargin, am_softmax, arcface, cosface, sphereface
from jaxcls.losses.sharded import (
    class_shards,
    init_weight,
    l2_normalize,
    padded_num_classes,
    sharded_margin_loss,
    validate_labels,
    weight_sharding,
)

__all__ = [
    "MARGINS", "CombinedMargin", "am_softmax", "arcface", "class_parallel_cross_entropy", "class_shards",
    "cosface", "init_weight", "l2_normalize", "masked_fill_value", "padded_num_classes", "sharded_margin_loss",
    "sphereface", "validate_labels", "weight_sharding",
]
