"""insightface arcface_torch backbones into jaxcls and back: state dicts mapped tensor by tensor, checked both ways.

``import_torch`` writes a backbone's state dict as a jaxcls run at step 0 (``config.json``: that model, 112×112 input;
``checkpoints/0``: its parameters and BatchNorm statistics, with a fresh one-class placeholder FC and optimizer state,
so that ``restore_backbone``, ``Embedder``, ``jaxcls.eval``, ``jaxcls.export`` and ``jaxcls.train --init_from`` read it
as they read any run); ``export_torch`` writes a run's backbone as a ``.pth`` that
``get_model(name).load_state_dict(torch.load(path), strict=True)`` takes, written without torch.

Models (arcface_torch name → jaxcls): r18 r34 r50 r100 r200 → the IResNet of the same name (64 wide); mbf → mbf;
mbf_large → mbf with ``model_kwargs`` ``blocks=(2, 8, 12, 4), scale=4``; vit_t vit_s vit_b (and the WebFace42M
variants ``vit_t_dp005_mask0`` … ``vit_l_dp005_mask_005``, ``vit_h``) → the ViT of that size, its drop-path and mask
ratios in ``model_kwargs``. The conversion is exact: both frameworks compute the same functions (same BatchNorm and
LayerNorm epsilons, layer order and padding; the ViT's tokens in the same row-major order); only the layouts differ:

* convolutions: torch ``weight [O, I/groups, kH, kW]`` ↔ jaxcls ``kernel [kH, kW, I/groups, O]``;
* linear layers: ``weight [out, in]`` ↔ ``kernel [in, out]``;
* the IResNet's ``fc`` after the flatten: torch flattens NCHW features ``[512, 7, 7]`` as ``(c, h, w)``, jaxcls its
  NHWC ones as ``(h, w, c)``, so the kernel's input rows are permuted, not just transposed;
* BatchNorm ``weight, bias, running_mean, running_var`` ↔ ``scale, bias, mean, var``; ``num_batches_tracked`` is
  read and dropped (written back as 0); the IResNet's ``features`` BatchNorm has a weight frozen at 1 in torch and
  no scale in jaxcls: the file's must be all ones;
* LayerNorm ``weight, bias`` ↔ ``scale, bias``; the ViT's ``pos_embed`` and ``mask_token`` as they are;
* PReLU ``weight`` ↔ ``alpha``; blocks after the first of an IResNet stage (``layerK.1…``) ↔ one stacked
  ``rests[K-1].layers`` array per variable; MobileFaceNet's nested ``Residual`` groups ↔ jaxcls's flat ``layers``.

Every tensor of the state dict is used once and every jaxcls parameter and statistic filled once, shapes checked:
a missing, unexpected or misshapen tensor raises ``DataError`` listing them (a DataParallel ``module.`` prefix is
stripped). ``dropout`` and ``fp16`` are training settings of arcface_torch that no state dict records.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np
from flax import nnx

from jaxcls.checkpoint import CheckpointError, RunCheckpoints
from jaxcls.config import base_config, from_json
from jaxcls.errors import DataError
from jaxcls.interop.inference import restore_backbone
from jaxcls.interop.torch_pth import load_state_dict, save_pth
from jaxcls.models import get_model, make_model, split_model
from jaxcls.models.iresnet import STAGES
from jaxcls.models.vit import SIZES as VIT_SIZES
from jaxcls.run import build
from jaxcls.workdir import WorkdirLock

# arcface_torch backbone name → (jaxcls model, its model_kwargs)
ARCFACE_MODELS = {
    **{name: (name, {}) for name in ("r18", "r34", "r50", "r100", "r200")},
    "mbf": ("mbf", {}),
    "mbf_large": ("mbf", {"blocks": (2, 8, 12, 4), "scale": 4}),
    # the ViTs' drop-path and mask ratios are training settings no state dict records: kept for fine-tuning. The
    # "mask_005" ViTs mask 10%: arcface_torch's forward calls random_masking without its ratio, whose default is 0.1
    **{name: (name, {}) for name in ("vit_t", "vit_s", "vit_b", "vit_h")},
    "vit_t_dp005_mask0": ("vit_t", {"drop_path": 0.05, "mask_ratio": 0.0}),
    "vit_s_dp005_mask_0": ("vit_s", {"drop_path": 0.05, "mask_ratio": 0.0}),
    "vit_b_dp005_mask_005": ("vit_b", {"drop_path": 0.05}),
    "vit_l_dp005_mask_005": ("vit_l", {"drop_path": 0.05}),
}
UNSUPPORTED = {"r2060": "jaxcls has no IResNet-2060"}  # arcface_torch backbones this converter does not take, and why
INPUT_SIZE = 112  # arcface_torch's backbones are built for 112×112 (IResNet fc_scale 7·7, MobileFaceNet's 7×7 GDC)
SPATIAL = INPUT_SIZE // 16


class Layer(NamedTuple):
    """One torch module (``torch`` prefix of its keys) and the jaxcls module holding it (``jax`` path; ``index``: its
    row in a stacked ``BlockStack`` variable, else None)."""

    kind: str  # conv | conv_bias | bn | bn_unit_scale | prelu | linear | linear_bias | fc_nchw | ln | param
    torch: str
    jax: tuple
    index: int | None = None


# per kind: (torch leaf, jaxcls leaf or None, transform); "" for a parameter that is the module's own (its key and
# path are the layer's)
_BN = [("weight", "scale", "same"), ("bias", "bias", "same"), ("running_mean", "mean", "same"),
       ("running_var", "var", "same"), ("num_batches_tracked", None, "count")]
_BIAS = ("bias", "bias", "same")
LEAVES = {
    "conv": [("weight", "kernel", "conv")],
    "conv_bias": [("weight", "kernel", "conv"), _BIAS],
    "bn": _BN,
    "bn_unit_scale": [("weight", None, "ones")] + _BN[1:],
    "prelu": [("weight", "alpha", "same")],
    "linear": [("weight", "kernel", "linear")],
    "linear_bias": [("weight", "kernel", "linear"), _BIAS],
    "fc_nchw": [("weight", "kernel", "fc_nchw"), _BIAS],
    "ln": [("weight", "scale", "same"), _BIAS],
    "param": [("", "", "same")],
}


def _iresnet_layers(stages) -> list[Layer]:
    out = [Layer("conv", "conv1", ("conv1",)), Layer("bn", "bn1", ("bn1",)), Layer("prelu", "prelu", ("prelu",))]
    for s, depth in enumerate(stages):
        for b in range(depth):
            t = f"layer{s + 1}.{b}."
            j, i = (("firsts", s), None) if b == 0 else (("rests", s, "layers"), b - 1)
            out += [Layer(kind, t + name, j + (name,), i) for kind, name in
                    (("bn", "bn1"), ("conv", "conv1"), ("bn", "bn2"), ("prelu", "prelu"), ("conv", "conv2"),
                     ("bn", "bn3"))]
            if b == 0:  # every stage starts with a strided block: a 1×1 conv + BN shortcut
                out += [Layer("conv", t + "downsample.0", j + ("downsample", "layers", 0)),
                        Layer("bn", t + "downsample.1", j + ("downsample", "layers", 1))]
    return out + [Layer("bn", "bn2", ("bn2",)), Layer("fc_nchw", "fc", ("fc",)),
                  Layer("bn_unit_scale", "features", ("features",))]


def _mbf_layers(blocks) -> list[Layer]:
    def conv_block(t, j, linear=False):  # torch ConvBlock / LinearBlock: layers.0 conv, .1 BN, .2 PReLU
        out = [Layer("conv", t + ".layers.0", j + ("conv",)), Layer("bn", t + ".layers.1", j + ("bn",))]
        return out if linear else out + [Layer("prelu", t + ".layers.2", j + ("prelu",))]

    def depthwise(t, j):
        return (conv_block(t + ".layers.0", j + ("expand",)) + conv_block(t + ".layers.1", j + ("depthwise",))
                + conv_block(t + ".layers.2", j + ("project",), linear=True))

    out, j = conv_block("layers.0", ("layers", 0)), 1
    # torch's layers: 1 a ConvBlock or Residual, then DepthWise, Residual, DepthWise, Residual, DepthWise, Residual;
    # jaxcls lists the Residuals' blocks one by one
    groups = [(1, blocks[0]), (2, None), (3, blocks[1]), (4, None), (5, blocks[2]), (6, None), (7, blocks[3])]
    for t, count in groups:
        if t == 1 and count == 1:
            out += conv_block("layers.1", ("layers", j))
            j += 1
            continue
        for k in [None] if count is None else range(count):
            out += depthwise(f"layers.{t}" if k is None else f"layers.{t}.layers.{k}", ("layers", j))
            j += 1
    return out + conv_block("conv_sep", ("conv_sep",)) + conv_block("features.layers.0", ("gdc",), linear=True) + [
        Layer("linear", "features.layers.2", ("linear",)), Layer("bn", "features.layers.3", ("features",))]


def vit_layers(depth: int) -> list[Layer]:
    """arcface_torch's ``VisionTransformer`` of ``depth`` blocks (any width): its modules in torch's order (the
    model's own parameters first, then its children as registered)."""
    out = [Layer("param", "pos_embed", ("pos_embed",)), Layer("param", "mask_token", ("mask_token",)),
           Layer("conv_bias", "patch_embed.proj", ("patch_embed",))]
    for i in range(depth):
        t, j = f"blocks.{i}.", ("blocks", i)
        out += [Layer("ln", t + "norm1", j + ("norm1",)), Layer("ln", t + "norm2", j + ("norm2",)),
                Layer("linear", t + "attn.qkv", j + ("qkv",)), Layer("linear_bias", t + "attn.proj", j + ("proj",)),
                Layer("linear_bias", t + "mlp.fc1", j + ("fc1",)), Layer("linear_bias", t + "mlp.fc2", j + ("fc2",))]
    return out + [Layer("ln", "norm", ("norm",)), Layer("linear", "feature.0", ("head_fc1",)),
                  Layer("bn", "feature.1", ("head_bn1",)), Layer("linear", "feature.2", ("head_fc2",)),
                  Layer("bn", "feature.3", ("head_bn2",))]


def arcface_layers(name: str) -> list[Layer]:
    """arcface_torch backbone ``name``'s modules, in torch's order, each with its jaxcls module."""
    jax_name, kwargs = jaxcls_model(name)
    if jax_name == "mbf":
        return _mbf_layers(kwargs.get("blocks", (1, 4, 6, 2)))
    if jax_name.startswith("vit"):
        return vit_layers(VIT_SIZES[jax_name][1])
    return _iresnet_layers(STAGES[jax_name])


def jaxcls_model(name: str) -> tuple[str, dict]:
    """arcface_torch backbone ``name`` → ``(jaxcls model, model_kwargs)``; ``ValueError`` for any other."""
    if name in ARCFACE_MODELS:
        jax_name, kwargs = ARCFACE_MODELS[name]
        return jax_name, dict(kwargs)
    why = UNSUPPORTED.get(name, "not an arcface_torch backbone")
    raise ValueError(f"cannot convert arcface_torch model {name!r}: {why}; supported: {', '.join(ARCFACE_MODELS)}")


def torch_keys(name: str) -> list[str]:
    """The keys of arcface_torch backbone ``name``'s ``state_dict()``, in its order."""
    return layer_keys(arcface_layers(name))


def layer_keys(layers: list[Layer]) -> list[str]:
    """The state dict keys of ``layers``, in their order."""
    return [key for key, *_ in _slots(layers)]


# ---- layouts ------------------------------------------------------------------------------------------------------

def _torch_shape(transform: str, jax_shape: tuple) -> tuple:
    if transform == "conv":  # [kH, kW, I/groups, O] → [O, I/groups, kH, kW]
        return (jax_shape[3], jax_shape[2], jax_shape[0], jax_shape[1])
    if transform in ("linear", "fc_nchw"):
        return (jax_shape[1], jax_shape[0])
    if transform == "count":
        return ()
    return tuple(jax_shape)


def _to_jax(transform: str, array: np.ndarray) -> np.ndarray:
    if transform == "conv":
        return array.transpose(2, 3, 1, 0)
    if transform == "linear":
        return array.T
    if transform == "fc_nchw":  # [out, C·H·W] flattened (c, h, w) → [H·W·C, out] flattened (h, w, c)
        out = array.shape[0]
        return array.reshape(out, -1, SPATIAL, SPATIAL).transpose(2, 3, 1, 0).reshape(-1, out)
    return array


def _to_torch(transform: str, array: np.ndarray) -> np.ndarray:
    if transform == "conv":
        return array.transpose(3, 2, 0, 1)
    if transform == "linear":
        return array.T
    if transform == "fc_nchw":
        out = array.shape[1]
        return array.reshape(SPATIAL, SPATIAL, -1, out).transpose(3, 2, 0, 1).reshape(out, -1)
    return array


def _slots(layers: list[Layer]):
    """``(torch key, jaxcls path or None, stack index, transform)`` for every tensor of the state dict."""
    for layer in layers:
        for leaf, jax_leaf, transform in LEAVES[layer.kind]:
            if transform == "ones":  # no jaxcls variable; shaped like the BatchNorm's bias
                path = layer.jax + ("bias",)
            elif jax_leaf is None:
                path = None
            else:  # "": the layer is the parameter itself
                path = layer.jax + (jax_leaf,) if jax_leaf else layer.jax
            yield f"{layer.torch}.{leaf}" if leaf else layer.torch, path, layer.index, transform


def _flat(state) -> dict:
    return {path: var for path, var in nnx.to_flat_state(state)}


def _split(model):
    """``(graphdef, Params, BatchStats, the rest (RNG state))``."""
    return nnx.split(model, nnx.Param, nnx.BatchStat, ...)


# ---- torch → jaxcls -----------------------------------------------------------------------------------------------

def strip_module_prefix(state: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``state`` without DataParallel's ``module.`` in front of every key (unchanged if any key lacks it)."""
    if state and all(k.startswith("module.") for k in state):
        return {k[len("module."):]: v for k, v in state.items()}
    return dict(state)


def embedding_size(state: Mapping[str, np.ndarray], name: str) -> int | None:
    """The embedding size of an arcface_torch ``name`` state dict (its last BatchNorm's size), None if absent."""
    key = arcface_layers(name)[-1].torch + ".running_mean"
    value = strip_module_prefix(state).get(key)
    return None if value is None or np.ndim(value) != 1 else int(np.shape(value)[0])


def torch_to_jaxcls(state: Mapping[str, np.ndarray], model: str, num_features: int = 512, *,
                    source: str = "the state dict", **model_kwargs) -> nnx.Module:
    """arcface_torch backbone ``model``'s state dict (``{key: array}``, e.g. ``torch_pth.load_state_dict``'s)
    → the jaxcls backbone of the same architecture, in eval mode, computing in float32 unless ``model_kwargs`` (passed
    to ``jaxcls.models.get_model``: ``dtype``, ``remat``...) say otherwise.

    ``DataError`` (its message starting with ``source``) when the keys or shapes are not exactly those of that
    backbone with ``num_features``-d embeddings, or when the IResNet's frozen ``features.weight`` is not all ones.
    """
    jax_name, kwargs = jaxcls_model(model)
    make = lambda: get_model(jax_name, num_features, input_size=INPUT_SIZE, **kwargs, **model_kwargs)
    return load_torch_state(state, model, make, source=source)


def load_torch_state(state: Mapping[str, np.ndarray], name: str, make: Callable[[], nnx.Module], *,
                     source: str = "the state dict", layers: list[Layer] | None = None) -> nnx.Module:
    """``make()``'s jaxcls model (built abstractly, never initialised: its RNG state alone is computed) with every
    parameter and BatchNorm statistic from arcface_torch ``name``'s ``state``; in eval mode. ``layers``: the mapping,
    if not ``name``'s (e.g. ``vit_layers(depth)`` for a ViT of another size)."""
    state = strip_module_prefix(state)
    layers = arcface_layers(name) if layers is None else layers
    _check_keys(state, name, source, layer_keys(layers))
    graphdef, params, stats, rest = _abstract_model(make)
    targets = {**_flat(params), **_flat(stats)}
    values, filled, shape_errors = {}, {}, []
    for key, path, index, transform in _slots(layers):
        array = state[key]
        if transform == "count":  # torch's count of training batches: jaxcls keeps none (its momentum is fixed)
            if np.shape(array) != ():
                shape_errors.append(f"{key}: {tuple(np.shape(array))} in the file, () expected")
            continue
        if path not in targets:
            raise RuntimeError(f"the {name} mapping names {'/'.join(map(str, path))}, which jaxcls's model lacks")
        full = tuple(targets[path].get_value().shape)
        want = _torch_shape(transform, full if index is None else full[1:])
        if tuple(np.shape(array)) != want:
            shape_errors.append(f"{key}: {tuple(np.shape(array))} in the file, {want} expected")
            continue
        kind = np.asarray(array).dtype
        if not (np.issubdtype(kind, np.floating) or kind.name == "bfloat16"):
            shape_errors.append(f"{key}: {kind} values, floating point expected")
            continue
        array = np.asarray(array, np.float32)
        if transform == "ones":
            if not np.all(array == 1):
                raise DataError(f"{source}: {key} is not all ones (values {array.min():g} … {array.max():g}): "
                                f"arcface_torch freezes this BatchNorm weight at 1 and jaxcls's {name} has no scale "
                                "there, so it cannot hold this model")
            continue
        target = values.setdefault(path, np.zeros(full, np.float32))
        done = filled.setdefault(path, np.zeros(full[:1] if index is not None else (), bool))
        slot = () if index is None else (index,)
        if done[slot]:
            raise RuntimeError(f"the {name} mapping fills {'/'.join(map(str, path))}{list(slot)} twice")
        target[slot] = _to_jax(transform, array)
        done[slot] = True
    if shape_errors:  # a model of another size with the same keys (the ViTs), or another embedding size
        others = [other for other in ARCFACE_MODELS if jaxcls_model(other)[0] != jaxcls_model(name)[0]
                  and same_architecture(other, state)]
        if others:
            hint = f" (its widths are those of arcface_torch's {' / '.join(others)} (--model {others[0]}))"
        elif any(e.startswith(layers[-1].torch + ".") for e in shape_errors):
            hint = f" (embedding size: {embedding_size(state, name)} in the file; --num_features?)"
        else:
            hint = ""
        raise DataError(f"{source}: {len(shape_errors)} tensor(s) of another shape than arcface_torch's {name} "
                        f"has{hint}: " + _listing(shape_errors))
    unfilled = [p for p in targets if p not in filled or not filled[p].all()]
    if unfilled:
        raise RuntimeError(f"the {name} mapping leaves jaxcls's " + _listing(["/".join(map(str, p)) for p in unfilled])
                           + " unfilled")
    fill = lambda tree: nnx.from_flat_state([(p, v.replace(jax.device_put(values[p])))
                                             for p, v in nnx.to_flat_state(tree)])
    model = nnx.merge(graphdef, fill(params), fill(stats), rest)
    model.eval()
    return model


def _abstract_model(make: Callable[[], nnx.Module]):
    """``(graphdef, Params, BatchStats, the rest)`` of ``make()``: the Params and BatchStats as ``ShapeDtypeStruct``s,
    the rest (the RNG state of dropout) as ``make`` creates it, computed by one small program (the random initializers
    are pruned from it). One trace of ``make`` gives both (tracing a deep model's construction takes seconds)."""
    traced = {}

    def build():
        graphdef, params, stats, rest = _split(make())
        shape = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
        traced.update(graphdef=graphdef, params=jax.tree.map(shape, params), stats=jax.tree.map(shape, stats))
        return rest

    rest = jax.jit(build)()
    return traced["graphdef"], traced["params"], traced["stats"], rest


def _listing(items: list[str], limit: int = 20) -> str:
    return ", ".join(items[:limit]) + (f" … and {len(items) - limit} more" if len(items) > limit else "")


def same_architecture(name: str, state: Mapping) -> bool:
    """Whether ``state`` has arcface_torch ``name``'s keys and, for a ViT (whose sizes share their keys), its width."""
    if set(torch_keys(name)) != set(state):
        return False
    model = jaxcls_model(name)[0]
    return model not in VIT_SIZES or np.shape(state["pos_embed"])[-1:] == (VIT_SIZES[model][0],)


def _check_keys(state: Mapping, name: str, source: str, expected: list[str] | None = None) -> None:
    """``DataError`` listing the missing and unexpected keys (against ``name``'s unless ``expected`` is given), with a
    guess at what the file holds."""
    expected = torch_keys(name) if expected is None else expected
    known = set(expected)
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in known]
    if not missing and not unexpected:
        return
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing key(s): {_listing(missing)}")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected key(s): {_listing(unexpected)}")
    fits = [other for other in ARCFACE_MODELS if other != name and same_architecture(other, state)]
    if fits:
        hint = f"its keys are those of arcface_torch's {' / '.join(fits)} (--model {fits[0]})"
    elif not set(state) & set(expected):
        hint = ("none of its keys is a backbone's: is it the backbone's state dict (arcface_torch's model.pt, or a "
                "training checkpoint's 'state_dict_backbone'), not the FC's?")
    else:
        hint = None
    raise DataError(f"{source}: not the state dict of arcface_torch's {name} backbone: " + "; ".join(parts)
                    + (f" ({hint})" if hint else ""))


# ---- jaxcls → torch -----------------------------------------------------------------------------------------------

def jaxcls_to_torch(model: nnx.Module, name: str) -> dict[str, np.ndarray]:
    """A jaxcls backbone with arcface_torch ``name``'s architecture → that backbone's state dict (float32 arrays,
    ``num_batches_tracked`` int64 0, keys in torch's order) for ``load_state_dict(..., strict=True)``.

    ``ValueError`` when ``model``'s variables are not exactly those of jaxcls's counterpart of ``name`` (another
    width, input size, ...)."""
    jax_name, kwargs = jaxcls_model(name)
    _, params, stats, _ = _split(model)
    variables = {**_flat(params), **_flat(stats)}
    shapes = {p: tuple(v.get_value().shape) for p, v in variables.items()}
    features = shapes.get(arcface_layers(name)[-1].jax + ("bias",), ())
    if len(features) != 1:
        raise ValueError(f"the model is not jaxcls's counterpart of arcface_torch's {name}: it has no "
                         f"{'/'.join(arcface_layers(name)[-1].jax)} BatchNorm")
    reference = nnx.eval_shape(lambda: get_model(jax_name, features[0], input_size=INPUT_SIZE, **kwargs))
    _, ref_params, ref_stats, _ = _split(reference)
    want = {p: tuple(v.get_value().shape) for p, v in {**_flat(ref_params), **_flat(ref_stats)}.items()}
    path = lambda p: "/".join(map(str, p))
    problems = [f"{path(p)}: absent" for p in want if p not in shapes]
    problems += [f"{path(p)}: not in arcface_torch's {name}" for p in shapes if p not in want]
    problems += [f"{path(p)}: {shapes[p]}, {want[p]} in {name}" for p in want
                 if p in shapes and shapes[p] != want[p]]
    if problems:
        described = f"{jax_name}{f' {kwargs}' if kwargs else ''} at {INPUT_SIZE}×{INPUT_SIZE}"
        raise ValueError(f"the model is not jaxcls's counterpart of arcface_torch's {name} ({described}): "
                         + _listing(problems))
    got = {p: np.asarray(v.get_value(), np.float32) for p, v in variables.items()}
    out, used = {}, set()
    for key, p, index, transform in _slots(arcface_layers(name)):
        if transform == "count":
            out[key] = np.zeros((), np.int64)
        elif transform == "ones":
            out[key] = np.ones(shapes[p], np.float32)
        else:
            array = got[p] if index is None else got[p][index]
            out[key] = np.ascontiguousarray(_to_torch(transform, array), np.float32)
            used.add(p)
    if set(got) - used:
        raise RuntimeError(f"the {name} mapping leaves {_listing(sorted(path(p) for p in set(got) - used))} out")
    return out


# ---- runs ---------------------------------------------------------------------------------------------------------

def run_config(name: str, num_features: int = 512):
    """The config of a run holding arcface_torch backbone ``name``: its jaxcls model, 112×112 input, float32, and a
    one-class placeholder FC (the backbone is what was converted); the data source is left unset."""
    jax_name, kwargs = jaxcls_model(name)
    c = base_config()
    c.model, c.model_kwargs, c.num_features = jax_name, kwargs, num_features
    c.data.kind, c.data.root, c.data.input_size = "recordio", "", INPUT_SIZE
    c.num_classes = 1
    c.precision = "float32"
    return c


def arcface_name(config) -> str:
    """The arcface_torch backbone a run's config describes; ``ValueError`` when it has none."""
    kwargs = dict(config.model_kwargs)
    if config.data.input_size != INPUT_SIZE:
        raise ValueError(f"arcface_torch's backbones take {INPUT_SIZE}×{INPUT_SIZE} images; this run's take "
                         f"{config.data.input_size}×{config.data.input_size}")
    if config.model.startswith("r") and config.model in ARCFACE_MODELS:
        if kwargs.get("width", 64) != 64:
            raise ValueError(f"arcface_torch's IResNets are 64 wide; this run's {config.model} is {kwargs['width']} "
                             "wide (model_kwargs.width)")
        if tuple(kwargs.get("stages", STAGES[config.model])) != STAGES[config.model]:
            raise ValueError(f"arcface_torch's {config.model} has {STAGES[config.model]} blocks per stage; this run's "
                             f"has {tuple(kwargs['stages'])} (model_kwargs.stages)")
        return config.model
    if config.model == "mbf":
        shape = (tuple(kwargs.get("blocks", (1, 4, 6, 2))), kwargs.get("scale", 2))
        for name in ("mbf", "mbf_large"):
            wanted = ARCFACE_MODELS[name][1]
            if shape == (tuple(wanted.get("blocks", (1, 4, 6, 2))), wanted.get("scale", 2)):
                return name
        raise ValueError(f"mbf with blocks {shape[0]} and scale {shape[1]} is neither arcface_torch's mbf nor "
                         "mbf_large")
    if config.model in VIT_SIZES:
        if kwargs.get("act", "relu6") != "relu6" or kwargs.get("patch", 9) != 9:
            raise ValueError(f"arcface_torch's ViTs take 9×9 patches and ReLU6; this run's {config.model} has "
                             f"{kwargs.get('patch', 9)}×{kwargs.get('patch', 9)} and {kwargs.get('act', 'relu6')}")
        wanted = dict(zip(("dim", "depth", "heads"), VIT_SIZES[config.model]))
        found = {key: kwargs.get(key, value) for key, value in wanted.items()}
        if found != wanted:
            raise ValueError(f"arcface_torch's {config.model} has {wanted}; this run's has {found} (model_kwargs)")
        # drop path and masking are training settings: any of the names with this size holds the same state dict
        names = [name for name, (model, _) in ARCFACE_MODELS.items() if model == config.model]
        same = [name for name in names if ARCFACE_MODELS[name][1] == kwargs]
        return (same or names)[0]
    raise ValueError(f"jaxcls model {config.model!r} has no arcface_torch counterpart here; convertible: "
                     + ", ".join(ARCFACE_MODELS))


def write_run(state: Mapping[str, np.ndarray], name: str, workdir: str | os.PathLike, num_features: int | None = None,
              *, source: str = "the state dict"):
    """Write arcface_torch backbone ``name``'s ``state`` as the jaxcls run ``workdir`` at step 0 (``config.json`` and
    ``checkpoints/0``: the backbone, a fresh one-class FC and optimizer state); ``num_features`` default: the file's.
    Refused (``CheckpointError``) if ``workdir`` already holds checkpoints. Returns the run's config."""
    workdir = Path(workdir).absolute()  # orbax writes only to absolute paths
    state = strip_module_prefix(state)
    jaxcls_model(name)  # an unsupported name fails before anything else
    _check_keys(state, name, source)  # then a file of another model, before anything is built

    def refuse_a_run(checkpoints):
        if checkpoints.latest_step() is not None:
            raise CheckpointError(f"{workdir} already holds checkpoints (step {checkpoints.latest_step()}): convert "
                                  "into a new workdir")

    if (workdir / "checkpoints").is_dir():  # before converting; again under the lock
        existing = RunCheckpoints(workdir / "checkpoints", keep=1)
        try:
            refuse_a_run(existing)
        finally:
            existing.close()
    config = run_config(name, embedding_size(state, name) if num_features is None else num_features)
    model = load_torch_state(state, name, lambda: make_model(config), source=source)  # nothing written if it fails
    _, params, stats = split_model(model)
    lock = WorkdirLock(workdir, "jaxcls.convert")
    lock.acquire()
    try:
        checkpoints = RunCheckpoints(workdir / "checkpoints", config.keep_checkpoints)
        try:
            refuse_a_run(checkpoints)
            run = build(config, devices=jax.local_devices()[:1], with_data=False)  # it restores on any mesh
            init = jax.jit(lambda p, s, seed: run.train_step.init_state(p, s, jax.random.key(seed)),
                           out_shardings=run.state_shardings)
            train_state = init(params, stats, config.seed)
            saved = workdir / "config.json"
            saved.with_suffix(".tmp").write_text(config.to_json_best_effort(indent=2))
            saved.with_suffix(".tmp").replace(saved)
            checkpoints.save(0, train_state, {"global_batches": 0})
        finally:
            checkpoints.close()
    finally:
        lock.release()
    return config


def import_torch(path: str | os.PathLike, name: str, workdir: str | os.PathLike, num_features: int | None = None,
                 key: str | None = None):
    """``.pth`` file ``path`` (arcface_torch backbone ``name``'s state dict, or its entry ``key``) → the jaxcls run
    ``workdir``."""
    return write_run(load_state_dict(path, key), name, workdir, num_features, source=str(path))


def export_torch(workdir: str | os.PathLike, path: str | os.PathLike, step: int | None = None) -> tuple[int, str]:
    """Run ``workdir``'s backbone at checkpoint ``step`` (default: the latest) → the ``.pth`` file ``path`` of its
    arcface_torch counterpart's state dict; returns ``(step, arcface_torch name)``."""
    config_path = Path(workdir) / "config.json"
    if config_path.is_file():  # refuse a run with no arcface_torch counterpart before restoring anything
        arcface_name(from_json(config_path.read_text()))
    model, config, step = restore_backbone(workdir, step)
    name = arcface_name(config)
    save_pth(path, jaxcls_to_torch(model, name))
    return step, name
