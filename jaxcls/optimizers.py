"""Optimizers by name for the backbone (optax) and the FC rows (``jaxcls.fc.optimizers``), and the LR schedule.

Both run at unit learning rate: the train step multiplies the backbone update by the schedule at the global
step and passes the same rate to the sparse FC update, so a skipped float16 step (optimizer state untouched)
does not delay the schedule, as torch's per-iteration scheduler.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import optax

from jaxcls.fc import optimizers as fc_optimizers
from jaxcls.registry import lookup


class OptimizerFamily(NamedTuple):
    """One optimizer for both halves of the model: ``backbone(momentum, weight_decay)`` an optax transformation,
    ``fc(momentum, weight_decay, state_dtype, weight_rounding)`` the same rule applied to sampled FC rows."""

    backbone: Callable[[float, float], optax.GradientTransformation]
    fc: Callable[[float, float, object, str], fc_optimizers.SparseOptimizer]


OPTIMIZERS = {
    # torch SGD with momentum and L2 weight decay (arcface_torch's default)
    "sgd": OptimizerFamily(
        backbone=lambda momentum, wd: optax.chain(optax.add_decayed_weights(wd), optax.sgd(1.0, momentum=momentum)),
        fc=lambda momentum, wd, state_dtype, rounding: fc_optimizers.sgd(momentum, wd, state_dtype, rounding)),
    # AdamW with decoupled weight decay (arcface_torch's ViT recipes); ``momentum`` is not used
    "adamw": OptimizerFamily(
        backbone=lambda momentum, wd: optax.adamw(1.0, weight_decay=wd),
        fc=lambda momentum, wd, state_dtype, rounding: fc_optimizers.adamw(weight_decay=wd, state_dtype=state_dtype,
                                                                           weight_rounding=rounding)),
}


def make_optimizers(name: str, *, momentum: float, weight_decay: float, clip: float, fc_state_dtype=None,
                    fc_weight_rounding: str = "nearest"):
    """``(backbone optax transformation, FC SparseOptimizer)`` for optimizer ``name``.

    ``clip > 0`` clips the backbone gradient's global norm first (the FC is not clipped, as arcface_torch).
    """
    family = lookup(OPTIMIZERS, name, "optimizer")
    tx = family.backbone(momentum, weight_decay)
    if clip > 0:
        tx = optax.chain(optax.clip_by_global_norm(clip), tx)
    return tx, family.fc(momentum, weight_decay, fc_state_dtype, fc_weight_rounding)


def lr_schedule(lr: float, warmup_steps: int, total_steps: int, power: float = 2.0):
    """Linear warmup from 0, then ``lr·(1 − t)^power`` to 0 at ``total_steps``; stepped per iteration."""
    return optax.join_schedules([
        optax.linear_schedule(0.0, lr, warmup_steps),
        optax.polynomial_schedule(lr, 0.0, power, total_steps - warmup_steps),
    ], [warmup_steps])
