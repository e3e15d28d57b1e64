"""Backbones by name: ``get_model(name, num_features=512, **kwargs)``.

Names: r18 r34 r50 r100 r200 (IResNet), mbf (MobileFaceNet), vit_t vit_s vit_b (arcface_torch's ViTs).
Common kwargs: ``dtype`` (compute dtype), ``remat`` (none | full | save_dots | save_block_outputs),
``input_size`` (112), ``rngs`` (default ``nnx.Rngs(0)``).
"""

from __future__ import annotations

from functools import partial

import jax
from flax import nnx

from jaxcls.models.iresnet import STAGES, IResNet
from jaxcls.models.layers import REMAT_POLICIES
from jaxcls.models.mobilefacenet import MobileFaceNet
from jaxcls.models.vit import VisionTransformer

MODELS = {
    **{name: partial(IResNet, stages) for name, stages in STAGES.items()},
    "mbf": MobileFaceNet,
    "vit_t": partial(VisionTransformer, 256, 12, 8),
    "vit_s": partial(VisionTransformer, 512, 12, 8),
    "vit_b": partial(VisionTransformer, 512, 24, 8),
}


def get_model(name: str, num_features: int = 512, *, rngs: nnx.Rngs | None = None, **kwargs) -> nnx.Module:
    """Build backbone ``name``; it maps ``[N, H, W, 3]`` float images to ``[N, num_features]`` float32."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(MODELS)}")
    if kwargs.get("remat", "none") not in REMAT_POLICIES:
        raise ValueError(f"unknown remat policy {kwargs['remat']!r}; choose one of {sorted(REMAT_POLICIES)}")
    rngs = nnx.Rngs(0) if rngs is None else rngs
    return MODELS[name](num_features=num_features, rngs=rngs, **kwargs)


def count_params(model: nnx.Module) -> int:
    """Number of trainable parameters (``nnx.Param`` leaves)."""
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
