"""Backbones by name: ``get_model(name, num_features=512, **kwargs)``.

Names: r18 r34 r50 r100 r200 (IResNet), mbf (MobileFaceNet), vit_t vit_s vit_b vit_l vit_h (arcface_torch's
ViTs).
Common kwargs: ``dtype`` (compute dtype), ``remat`` (none | full | save_dots | save_block_outputs),
``input_size`` (112), ``bn_groups`` (1: training BatchNorm statistics over the whole batch; G: per block of
B/G consecutive rows, one block per device), ``rngs`` (default ``nnx.Rngs(0)``). IResNets also take ``width`` and
``stages`` (blocks per stage, the name's by default), mbf ``blocks`` and ``scale``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax
from flax import nnx

from jaxcls.models.iresnet import STAGES, IResNet
from jaxcls.models.layers import REMAT_POLICIES
from jaxcls.models.mobilefacenet import MobileFaceNet
from jaxcls.models.vit import NAME_DEFAULTS as VIT_DEFAULTS, SIZES as VIT_SIZES, VisionTransformer
from jaxcls.precision import compute_dtype
from jaxcls.registry import lookup

MODELS = {
    **{name: partial(IResNet, stages=stages) for name, stages in STAGES.items()},  # model_kwargs may set stages
    "mbf": MobileFaceNet,
    **{name: partial(VisionTransformer, dim=dim, depth=depth, heads=heads, **VIT_DEFAULTS.get(name, {}))
       for name, (dim, depth, heads) in VIT_SIZES.items()},  # model_kwargs may set any of them
}


def get_model(name: str, num_features: int = 512, *, rngs: nnx.Rngs | None = None, **kwargs) -> nnx.Module:
    """Build backbone ``name``; it maps ``[N, H, W, 3]`` float images to ``[N, num_features]`` float32."""
    model = lookup(MODELS, name, "model")
    lookup(REMAT_POLICIES, kwargs.get("remat", "none"), "remat policy")
    return model(num_features=num_features, rngs=nnx.Rngs(0) if rngs is None else rngs, **kwargs)


def one_off_compile_options(platform: str) -> dict | None:
    """XLA options for programs that run once, such as initialisation: on CPU no LLVM optimization (it spends
    ~20 s on the random initializers of an IResNet-18, ~4 s without); elsewhere the defaults."""
    return {"xla_backend_optimization_level": 0} if platform == "cpu" else None


def create(make: Callable[[], nnx.Module]) -> nnx.Module:
    """``make()``'s model with every variable created by one compiled program on the default device.

    Eagerly, NNX runs each initializer op by op (~20 s for an IResNet-18 on a CPU).
    """
    graphdef = nnx.split(nnx.eval_shape(make))[0]
    program = jax.jit(lambda: nnx.split(make())[1]).lower()
    return nnx.merge(graphdef, program.compile(one_off_compile_options(jax.devices()[0].platform))())


def count_params(model: nnx.Module) -> int:
    """Number of trainable parameters (``nnx.Param`` leaves)."""
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def make_model(config, dtype=None, seed=None, bn_groups: int = 1) -> nnx.Module:
    """The backbone of ``config`` in training mode, its parameters drawn from ``seed`` (default ``config.seed``),
    its training BatchNorm statistics per block of ``B / bn_groups`` rows (``bn_groups(config, mesh)``)."""
    dtype = compute_dtype(config.precision) if dtype is None else dtype
    seed = config.seed if seed is None else seed
    rngs = nnx.Rngs(params=jax.random.key(seed), dropout=jax.random.key(seed + 1))  # seed may be traced
    return get_model(config.model, config.num_features, dtype=dtype, remat=config.remat,
                     input_size=config.data.input_size, bn_groups=bn_groups, rngs=rngs,
                     **config.model_kwargs)


def split_model(model: nnx.Module):
    """``(graphdef, params, everything else)``: BatchNorm statistics, RNG state."""
    return nnx.split(model, nnx.Param, ...)
