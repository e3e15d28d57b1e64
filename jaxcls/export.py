"""Backbone-only export for inference: parameters and BatchNorm statistics, with the config to rebuild it."""

from __future__ import annotations

import os
from pathlib import Path

import jax
from flax import nnx

from jaxcls import checkpoint as ckpt
from jaxcls.config import from_json
from jaxcls.run import make_model, split_model


def export_backbone(config, state: dict, out: str | os.PathLike) -> None:
    """Write ``out/config.json`` and ``out/backbone`` (params + stats as global arrays, replicated).

    With several processes every one calls this (each writes its part; process 0 the config)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if jax.process_index() == 0:
        (out / "config.json").write_text(config.to_json_best_effort(indent=2))
    ckpt.save(out / "backbone", {"params": state["params"], "stats": state["stats"]})


def load_backbone(path: str | os.PathLike) -> nnx.Module:
    """The exported backbone in eval mode: ``model(float images [N, S, S, 3] in [-1, 1]) -> [N, D]``."""
    path = Path(path)
    config = from_json((path / "config.json").read_text())
    graphdef, params, stats = split_model(nnx.eval_shape(lambda: make_model(config)))
    on_device = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0])), tree)
    restored = ckpt.restore(path / "backbone", {"params": on_device(params), "stats": on_device(stats)})
    model = nnx.merge(graphdef, restored["params"], restored["stats"])
    model.eval()
    return model
