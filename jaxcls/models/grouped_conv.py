"""Grouped and depthwise convolutions in the form each platform runs well: ``conv_general_dilated``.

One function, one set of parameters (the ``[kh, kw, C_in / groups, C_out]`` kernel of ``nnx.Conv`` and of XLA's
``feature_group_count``), three ways to compute it:

- ``"xla"``: XLA's grouped convolution (``lax.conv_general_dilated(feature_group_count=groups)``).
- ``"block_diagonal"``: a dense convolution whose ``[kh, kw, C_in, C_out]`` kernel is zero outside the groups'
  blocks: ``groups`` times the FLOPs, on the platform's dense convolution kernels.
- ``"shifted"`` (one input channel per group, i.e. depthwise): the sum over the ``kh·kw`` taps of strided slices of
  the padded input, each scaled per output channel, in float32: elementwise work that XLA fuses.

``choose(platform, groups, in_per_group)`` picks one, by measurement (``benchmarks/mbf_convolutions.py``,
docs/benchmarks.md "MobileFaceNet's grouped convolutions"): on XLA:CPU the grouped convolution with two channels per
group of mbf's stem takes 7.4 s for its forward and both gradients at batch 4 (block-diagonal: 0.1 s), and its
forward alone held ~0.15 GB per image (5 GB at batch 32) with 8 devices running it side by side; depthwise layers
run 4–39× faster shifted. On an H100, cuDNN's kernels for groups of two ran ~20× off the memory bound; the
block-diagonal form runs dense on tensor cores. Depthwise layers stay with cuDNN on GPUs until one times the
shifted form.

Traced in ``registry.lowered_for``'s block (the train step, the evaluators: the platform of their mesh, a
compile-only GPU's too) a layer takes that platform's form; elsewhere (a model called on its own, both branches of a
multi-platform ``jax.export``) the choice is staged with ``lax.platform_dependent``, each platform getting its own.
``forced("xla")`` fixes one form for everything traced inside it (the ONNX export, benchmarks, tests).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import jax.numpy as jnp
from jax import lax

from jaxcls.registry import Forms

LOWERINGS = ("xla", "block_diagonal", "shifted")
NHWC = ("NHWC", "HWIO", "NHWC")

_LOWERING = Forms("grouped-convolution lowering", LOWERINGS)
forced = _LOWERING.forced  # forced(lowering): trace every grouped convolution in the block so (None: by platform)


def usable(in_per_group: int) -> tuple[str, ...]:
    """The lowerings that compute a grouped convolution of ``in_per_group`` input channels per group."""
    return LOWERINGS if in_per_group == 1 else tuple(name for name in LOWERINGS if name != "shifted")


def choose(platform: str, groups: int, in_per_group: int) -> str:
    """The lowering of a convolution of ``groups`` groups of ``in_per_group`` input channels on ``platform``
    (``"cpu"``, ``"cuda"``, ``"rocm"``, ``"tpu"``)."""
    if groups == 1:
        return "xla"
    if in_per_group > 1:
        return "block_diagonal"
    return "shifted" if platform == "cpu" else "xla"


def conv_general_dilated(lhs, rhs, window_strides: Sequence[int], padding, lhs_dilation=None, rhs_dilation=None,
                         dimension_numbers=None, feature_group_count: int = 1, precision=None,
                         preferred_element_type=None, **kwargs):
    """``lax.conv_general_dilated``, with grouped convolutions of NHWC inputs and HWIO kernels (integer padding, no
    dilation) lowered as ``choose`` says for the platform; anything else goes to XLA's convolution as it is."""
    xla = partial(lax.conv_general_dilated, lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation,
                  dimension_numbers, feature_group_count, precision=precision,
                  preferred_element_type=preferred_element_type, **kwargs)
    if feature_group_count == 1:  # every ungrouped convolution, at once
        return xla()
    undilated = all(d in (None, 1) for d in (*(lhs_dilation or ()), *(rhs_dilation or ())))
    if (isinstance(padding, str) or not undilated or any(kwargs.values())
            or lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)
            != lax.conv_dimension_numbers(lhs.shape, rhs.shape, NHWC)):
        return xla()
    groups, in_per_group = feature_group_count, rhs.shape[2]
    out_dtype = preferred_element_type or lhs.dtype
    forms = {
        "xla": lambda x, w: xla(),
        "block_diagonal": lambda x, w: lax.conv_general_dilated(
            x, block_diagonal(w, groups), window_strides, padding, dimension_numbers=NHWC, precision=precision,
            preferred_element_type=preferred_element_type),
        "shifted": lambda x, w: shifted_depthwise(x, w, window_strides, padding).astype(out_dtype),
    }
    if (lowering := _LOWERING.current()) not in (None, *usable(in_per_group)):
        raise ValueError(f"the {lowering} lowering is for depthwise convolutions (one input channel per group); "
                         f"this one has {in_per_group} per group")
    by_platform = {p: choose(p, groups, in_per_group) for p in ("cpu", "cuda", "rocm")}
    return _LOWERING.pick(forms, {**by_platform, "default": choose("tpu", groups, in_per_group)})(lhs, rhs)


def block_diagonal(kernel, groups: int):
    """``[kh, kw, C_in / groups, C_out]`` grouped kernel → the dense ``[kh, kw, C_in, C_out]`` kernel that is zero
    outside group ``g``'s block (input channels ``g·C_in/groups…``, output channels ``g·C_out/groups…``)."""
    kh, kw, in_per_group, out = kernel.shape
    blocks = kernel.reshape(kh, kw, 1, in_per_group, groups, out // groups)  # [h, w, 1, i, g, o]
    same = (jnp.arange(groups)[:, None, None, None] == jnp.arange(groups)[None, None, :, None])  # [k, 1, g, 1]
    dense = jnp.where(same, blocks, jnp.zeros((), kernel.dtype))  # [h, w, k, i, g, o]: group k's inputs, g's outputs
    return dense.reshape(kh, kw, groups * in_per_group, out)


def shifted_depthwise(x, kernel, strides: Sequence[int], padding: Sequence[tuple[int, int]]):
    """Depthwise convolution of ``x [N, H, W, C]`` by ``kernel [kh, kw, 1, C·m]`` (``m`` outputs per channel) as the
    float32 sum over taps of strided input slices times per-channel weights; ``[N, H', W', C·m]`` float32."""
    n, h, w, c = x.shape
    kh, kw, _, out = kernel.shape
    (sh, sw), (ph, pw) = strides, padding
    ho, wo = (h + sum(ph) - kh) // sh + 1, (w + sum(pw) - kw) // sw + 1
    padded = jnp.pad(x.astype(jnp.float32), ((0, 0), tuple(ph), tuple(pw), (0, 0)))
    weights = kernel.astype(jnp.float32).reshape(kh, kw, c, out // c)
    total = None
    for i in range(kh):
        for j in range(kw):
            tap = lax.slice(padded, (0, i, j, 0), (n, i + (ho - 1) * sh + 1, j + (wo - 1) * sw + 1, c),
                            (1, sh, sw, 1))
            term = tap[..., None] * weights[i, j]
            total = term if total is None else total + term
    return total.reshape(n, ho, wo, out)
