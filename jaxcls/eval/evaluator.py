"""Verification of a run's state, during training and from ``python -m jaxcls.eval``: every configured set.

The sets are the ``.bin`` files of ``config.eval_bins`` plus, for a generated source that can make them,
pairs of identities it never trains on (``heldout``). The backbone runs in eval mode (running BatchNorm
statistics) with the batch split over every device and the embeddings gathered to every process, which
each score the pairs (the same numbers everywhere); the protocol is ``jaxcls.eval.verification``'s.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from jaxcls.data.pipeline import normalize
from jaxcls.eval.verification import embed_views, evaluate, load_bin
from jaxcls.mesh import batch_sharding, replicated
from jaxcls.registry import lowered_for

log = logging.getLogger("jaxcls")


def eval_bin_paths(config) -> list[Path]:
    """``config.eval_bins``: a bare file name is in ``data.root`` (as arcface_torch finds its ``val_targets``), any
    other entry a path."""
    return [Path(config.data.root) / p if os.path.basename(p) == p else Path(p) for p in config.eval_bins]


def eval_sets(config, source) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """``(name, uint8 images [2P, S, S, 3], issame [P])`` for every configured verification set, named by its
    file's stem; two sets of one name are refused before any is read (their results would share keys)."""
    size = config.data.input_size
    loaders = [(p.stem, str(p), functools.partial(load_bin, p, size)) for p in eval_bin_paths(config)]
    if hasattr(source, "heldout_pairs"):
        loaders.append(("heldout", "the data source's held-out pairs", source.heldout_pairs))
    for i, (name, where, _) in enumerate(loaders):
        clash = [other for n, other, _ in loaders[:i] if n == name]
        if clash:
            raise ValueError(f"two verification sets are named {name!r} ({clash[0]} and {where}): their results "
                             f"would be logged under one name; rename one .bin file")
    return [(name, *load()) for name, _, load in loaders]


class Evaluator:
    """``evaluator(state) -> {'val/<set>/<metric>': value}``; warns when the embeddings collapse."""

    def __init__(self, run):
        self.config = run.config
        self.sets = eval_sets(run.config, run.source)
        self.sharding = batch_sharding(run.mesh)
        self.batch = -(-run.config.eval_batch_size // run.mesh.size) * run.mesh.size  # a multiple of the devices

        @functools.partial(jax.jit, out_shardings=replicated(run.mesh))  # gathered: readable on every host
        def embed(params, stats, images):
            with lowered_for(run.mesh):
                return nnx.merge(run.eval_graphdef, params, stats)(normalize(images))

        self._embed = embed

    def embed(self, state: dict, images: np.ndarray) -> jax.Array:
        """Float32 embeddings ``[B, D]``, replicated, of uint8 ``images`` ``[B, S, S, 3]`` (B a multiple of the
        devices). Every process passes the same ``images``; each places the rows its devices hold."""
        images = jax.make_array_from_callback(images.shape, self.sharding, lambda index: images[index])
        return self._embed(state["params"], state["stats"], images)

    def embeddings(self, state: dict) -> dict:
        """``{set name: (embeddings of the images and of their mirrors [2, 2P, D], issame [P])}``."""
        return {name: (embed_views(lambda x: self.embed(state, x), images, self.batch), issame)
                for name, images, issame in self.sets}

    def __call__(self, state: dict) -> dict:
        return self.metrics(self.embeddings(state))

    def metrics(self, embeddings: dict) -> dict:
        """``{'val/<set>/<metric>': value}`` of ``embeddings(state)``; warns on collapse and on non-finite
        embeddings (whose set's metrics are NaN)."""
        out = {}
        for name, (views, issame) in embeddings.items():
            result = evaluate(views, issame)
            out.update({f"val/{name}/{k}": v for k, v in result.items()})
            if "non_finite" in result:
                log.warning("%s: %d of its %d images have non-finite embeddings (an overflow in the compute dtype, "
                            "or diverged weights); its metrics are NaN", name, result["non_finite"], views.shape[1])
            if result["mean_cosine"] > self.config.collapse_warning:
                log.warning("embedding collapse on %s: eval embeddings have mean cosine %.2f (accuracy %.3f); "
                            "try CosFace or a smaller margin, a lower lr or a longer warmup",
                            name, result["mean_cosine"], result["accuracy"])
        return out
