"""The train state and the one jitted train step.

State (a pytree, donated every step): ``step``, backbone ``params`` and ``stats`` (BatchNorm statistics,
RNG counters), backbone optimizer state ``opt``, FC ``weight`` and its sparse optimizer state ``fc_opt``,
the loss ``scale`` state and a raw PRNG ``key``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxcls.data.pipeline import normalize
from jaxcls.fc import FCHead
from jaxcls.precision import DynamicLossScale, all_finite, select_tree


def lr_schedule(lr: float, warmup_steps: int, total_steps: int, power: float = 2.0):
    """Linear warmup from 0, then ``lr·(1 − t)^power`` to 0 at ``total_steps``; stepped per iteration."""
    return optax.join_schedules([
        optax.linear_schedule(0.0, lr, warmup_steps),
        optax.polynomial_schedule(lr, 0.0, power, total_steps - warmup_steps),
    ], [warmup_steps])


def backbone_optimizer(name: str, schedule, *, momentum: float, weight_decay: float, clip: float):
    """Gradient-norm clip on the backbone, then SGD-momentum with L2 decay or AdamW (arcface_torch)."""
    if name == "sgd":
        tx = optax.chain(optax.add_decayed_weights(weight_decay), optax.sgd(schedule, momentum=momentum))
    elif name == "adamw":
        tx = optax.adamw(schedule, weight_decay=weight_decay)
    else:
        raise ValueError(f"unknown optimizer {name!r}; choose sgd or adamw")
    return optax.chain(optax.clip_by_global_norm(clip), tx) if clip > 0 else tx


@dataclasses.dataclass(frozen=True)
class Trainer:
    """The pieces a step needs: backbone graph, FC head, optimizer, schedule, loss scaling, precision."""

    graphdef: Any
    head: FCHead
    tx: optax.GradientTransformation
    schedule: Any
    scaler: DynamicLossScale
    compute_dtype: Any
    accum_steps: int = 1

    def init_state(self, params, stats, key) -> dict:
        weight, fc_opt = self.head.init(jax.random.fold_in(key, 1))
        return {"step": jnp.int32(0), "params": params, "stats": stats, "opt": self.tx.init(params),
                "weight": weight, "fc_opt": fc_opt, "scale": self.scaler.init(),
                "key": jax.random.key_data(jax.random.fold_in(key, 2))}

    def train_step(self, state: dict, images: jax.Array, labels: jax.Array) -> tuple[dict, dict]:
        """One update on a global batch ``images`` uint8 ``[B, S, S, 3]``, ``labels`` int32 ``[B]``."""
        key = jax.random.fold_in(jax.random.wrap_key_data(state["key"]), state["step"])
        sample, rows = self.head.select(key, state["weight"], labels)
        (loss, stats), (g_params, g_rows) = self._grads(state, rows, sample, images, labels)
        g_params, g_rows = self.scaler.unscale((g_params, g_rows), state["scale"])
        finite = all_finite((g_params, g_rows))
        lr = self.schedule(state["step"])
        updates, opt = self.tx.update(g_params, state["opt"], state["params"])
        weight, fc_opt = self.head.update(state["weight"], state["fc_opt"], sample, g_rows, lr)
        new = {"params": optax.apply_updates(state["params"], updates), "opt": opt, "stats": stats,
               "weight": weight, "fc_opt": fc_opt}
        if self.scaler.enabled:  # a non-finite step changes nothing but the scale
            new = select_tree(finite, new, {k: state[k] for k in new})
        new.update(step=state["step"] + 1, key=state["key"], scale=self.scaler.adjust(state["scale"], finite))
        metrics = {"loss": loss, "lr": lr, "grad_norm": optax.tree.norm(g_params), "finite": finite,
                   "loss_scale": state["scale"].scale}
        return new, metrics

    def _grads(self, state, rows, sample, images, labels):
        """Mean loss and gradients w.r.t. (params, FC rows), accumulated over ``accum_steps`` micro-batches.

        The loss of each micro-batch is its mean; gradients are averaged over micro-batches, so the
        update equals that of one batch of the full size (arcface_torch #2258).
        """
        micro = lambda x: x.reshape(x.shape[0] // self.accum_steps, self.accum_steps, *x.shape[1:]).swapaxes(0, 1)

        def loss_fn(model, rows, images, labels):
            emb = model(normalize(images)).astype(self.compute_dtype)
            loss = self.head.loss(emb, rows, labels, sample)
            return self.scaler.scale_loss(loss, state["scale"]), loss

        def one(carry, batch):  # params and rows ride in the carry: NNX merges only same-trace values
            params, rows, stats, g_acc, loss_acc = carry
            model = nnx.merge(self.graphdef, params, stats)
            grad_fn = nnx.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)
            (_, loss), (g_model, g_rows) = grad_fn(model, rows, *batch)
            g_acc = jax.tree.map(lambda a, g: a + g / self.accum_steps, g_acc, (g_model, g_rows))
            stats = nnx.state(model, nnx.Not(nnx.Param))
            return (params, rows, stats, g_acc, loss_acc + loss / self.accum_steps), None

        zeros = jax.tree.map(jnp.zeros_like, (state["params"], rows))
        carry = (state["params"], rows, state["stats"], zeros, jnp.float32(0))
        if self.accum_steps == 1:  # no loop, no accumulator buffers
            (_, _, stats, grads, loss), _ = one(carry, (images, labels))
        else:
            (_, _, stats, grads, loss), _ = jax.lax.scan(one, carry, (micro(images), micro(labels)))
        return (loss, stats), grads
