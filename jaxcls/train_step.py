"""The train state and the one jitted train step.

State (a pytree, donated every step): ``step``, backbone ``params`` and ``stats`` (BatchNorm statistics,
RNG counters), backbone optimizer state ``opt``, FC ``weight`` and its sparse optimizer state ``fc_opt``,
the loss ``scale`` state and a raw PRNG ``key``.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
import optax
from flax import nnx

from jaxcls.data.pipeline import normalize
from jaxcls.fc import FCHead
from jaxcls.precision import DynamicLossScale, all_finite, select_tree
from jaxcls.registry import lowered_for


@dataclasses.dataclass(frozen=True)
class TrainStep:
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

    def __call__(self, state: dict, images: jax.Array, labels: jax.Array) -> tuple[dict, dict]:
        """One update on a global batch ``images`` uint8 ``[B, S, S, 3]``, ``labels`` int32 ``[B]``.

        Backbone forward → fused FC step (loss, d loss/d embeddings, sparse FC update) → backbone backward.
        A non-finite loss, backbone gradient, new backbone parameter or BatchNorm statistic skips the backbone
        update, and the FC skips its update when the loss or the embeddings are non-finite (``metrics["finite"]``
        is false). With
        float16 the FC update waits for the backbone gradients too, so an overflowing step changes nothing but
        the loss scale (the FC pass then runs twice).
        """
        with lowered_for(self.head.mesh):  # each platform's form of a layer traced only where the step runs
            return self._update(state, images, labels)

    def _update(self, state: dict, images: jax.Array, labels: jax.Array) -> tuple[dict, dict]:
        key = jax.random.fold_in(jax.random.wrap_key_data(state["key"]), state["step"])
        lr, scale = self.schedule(state["step"]), state["scale"]
        sample = self.head.sample(key, labels)
        # the sample drawn before the forward starts: its scratch (PartialFC's sort of every class, ~15 B a class)
        # is then freed before the activations are held, instead of adding to the step's peak where XLA's schedule
        # happened to overlap them (benchmarks/gpu_plan.py's bytes per class)
        sample, images = lax.optimization_barrier((sample, images))
        emb, stats, backbone_grads = self._embed(state, images)
        fc_step = partial(self.head.step, state["weight"], state["fc_opt"], emb, labels, sample, lr)
        loss, d_emb, weight, fc_opt = fc_step(with_update=not self.scaler.enabled)
        # scaling d loss/d embeddings scales the loss: float16 backbone gradients then stay representable
        d_emb = self.scaler.scale_loss(d_emb, scale).astype(emb.dtype)
        g_params = self.scaler.unscale(backbone_grads(d_emb), scale)
        finite = all_finite(g_params) & jnp.isfinite(loss)
        if self.scaler.enabled:
            _, _, weight, fc_opt = fc_step(keep_update=finite)
        updates, opt = self.tx.update(g_params, state["opt"], state["params"])
        updates = jax.tree.map(lambda u: lr * u, updates)
        new = {"params": optax.apply_updates(state["params"], updates), "opt": opt, "stats": stats}
        finite = finite & all_finite((new["params"], new["stats"]))  # huge activations overflow BN statistics
        new = select_tree(finite, new, {k: state[k] for k in new})  # a skipped step keeps the backbone as it was
        new.update(weight=weight, fc_opt=fc_opt, step=state["step"] + 1, key=state["key"],
                   scale=self.scaler.adjust(scale, finite))
        metrics = {"loss": loss, "lr": lr, "grad_norm": optax.tree.norm(g_params), "finite": finite,
                   "loss_scale": scale.scale}
        return new, metrics

    def _embed(self, state, images):
        """Embeddings ``[B, D]`` in the compute dtype, the new BatchNorm statistics, and
        ``d_emb ↦ backbone gradients``.

        With ``accum_steps > 1`` the backbone runs micro-batch by micro-batch, forward only (keeping just
        the embeddings); the gradient function runs each micro-batch's forward again under ``jax.vjp``, so
        activations of one micro-batch at a time are held. The update equals one full-batch step's where
        BatchNorm's statistics do not depend on the batch's split (each micro-batch normalizes by its own
        rows while training, as with arcface_torch's gradient accumulation).
        """

        def forward(params, stats, images):
            model = nnx.merge(self.graphdef, params, stats)
            emb = model(normalize(images)).astype(self.compute_dtype)  # the FC's matmul dtype
            return emb, nnx.state(model, nnx.Not(nnx.Param))

        def vjp(params, stats, images):  # (embeddings, pullback, new stats)
            # stats enter as a primal too: NNX mutates BatchStats only of the trace that made them
            return jax.vjp(partial(forward, images=images), params, stats, has_aux=True)

        params, k = state["params"], self.accum_steps
        if k == 1:
            emb, pullback, stats = vjp(params, state["stats"], images)
            return emb, stats, lambda d_emb: pullback(d_emb)[0]
        micro = lambda x: x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1)  # micro-batch j = x[j::k]

        def embed_one(carry, x):  # params ride in the carry: NNX merges only same-trace values
            params, stats = carry
            emb, stats = forward(params, stats, x)
            return (params, stats), emb

        (_, stats), embs = jax.lax.scan(embed_one, (params, state["stats"]), micro(images))

        def grads(d_emb):
            def grad_one(carry, batch):
                params, stats, acc = carry
                _, pullback, stats = vjp(params, stats, batch[0])
                return (params, stats, jax.tree.map(jnp.add, acc, pullback(batch[1])[0])), None

            init = (params, state["stats"], jax.tree.map(jnp.zeros_like, params))
            return jax.lax.scan(grad_one, init, (micro(images), micro(d_emb)))[0][2]

        return embs.swapaxes(0, 1).reshape(images.shape[0], -1), stats, grads
