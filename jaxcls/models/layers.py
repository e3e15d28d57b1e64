"""Building blocks shared by the backbones: per-channel PReLU, BatchNorm defaults, remat policies, fused ops.

Precision: parameters are float32; ``dtype`` is the compute dtype of convolutions and matmuls
(float32, bfloat16 or float16). BatchNorm statistics are computed in float32 whatever ``dtype``.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jaxcls.models import grouped_conv
from jaxcls.registry import Forms

BN_MOMENTUM = 0.9  # = torch momentum 0.1
BN_EPS = 1e-5
# BatchNorm's backward in training, by platform: "written" (``batch_normalized``) on CPUs, "autodiff" of the same
# forward elsewhere. Written moves fewer bytes (compiled for an H100: mbf at batch 512 60.5 GiB a step against 67.4)
# and ran the r50 step faster on XLA:CPU; but XLA:GPU forms its sums from a stack of the terms, which it reduces with
# scalar 2-byte loads and a branch per column (autodiff's reductions load 4 values at once), and the H100 steps of the
# code that had it on GPUs ran slower (mbf at batch 512 53.4 ms against 44.9; docs/benchmarks.md, 2026-11-27).
# The next lease times both on a GPU (``step_throughput.py --bn-backward``).
BN_BACKWARDS = ("written", "autodiff")
_BN_BACKWARD = Forms("BatchNorm backward", BN_BACKWARDS)
# bn_backward_forced(form): every BatchNorm traced in the block in that form (None: by platform)
bn_backward_forced = _BN_BACKWARD.forced


def reduced_size(input_size: int, factor: int, what: str, padded: bool = False) -> int:
    """The side a backbone's last feature map has: ``input_size // factor`` (a ViT's patches), or rounded up where
    ``padded`` stride-2 convolutions keep a partial last window (a CNN's four halvings: 40 px → 3); refused below
    ``factor``."""
    if input_size < factor:
        raise ValueError(f"input_size {input_size} is below the {factor} pixels {what}")
    return -(-input_size // factor) if padded else input_size // factor


class PReLU(nnx.Module):
    """Per-channel PReLU (torch ``nn.PReLU(num_parameters=C)``), slopes initialised to 0.25; applied by the
    BatchNorm before it (``bn(x, prelu)``), which fuses it into its backward."""

    def __init__(self, channels: int):
        self.alpha = nnx.Param(jnp.full((channels,), 0.25, jnp.float32))


class BatchNorm(nnx.Module):
    """BatchNorm over all but the last axis; statistics in float32, output in ``dtype``; ``bn(x, prelu)`` applies
    a ``PReLU`` to the output.

    torch's defaults (momentum 0.1 → running = 0.9·running + 0.1·batch, eps 1e-5, unbiased running var).
    ``use_scale=False`` freezes the scale at 1 (arcface_torch's ``features`` layer). Written here rather than
    ``nnx.BatchNorm`` because the latter's in-place statistics update makes tracing quadratic in depth
    (1.8 s of an r100 trace per 100 layers). In training its backward is written out (``batch_normalized``) on
    CPUs and autodiff's elsewhere (``BN_BACKWARDS``; ``bn_backward_forced`` picks one).

    ``groups`` (static): in training, a batch ``[B, ..., C]`` is ``groups`` blocks of ``B / groups``
    consecutive rows, each normalized with its own mean and variance (with the batch split over ``groups``
    devices: per-device statistics, as arcface_torch's per-GPU BatchNorm). The running statistics move towards
    the mean over the blocks of their mean and unbiased variance. Eval mode uses the running statistics.
    """

    def __init__(self, channels: int, *, dtype=jnp.float32, epsilon: float = BN_EPS, use_scale: bool = True,
                 momentum: float = BN_MOMENTUM, groups: int = 1):
        self.scale = nnx.Param(jnp.ones((channels,), jnp.float32)) if use_scale else None
        self.bias = nnx.Param(jnp.zeros((channels,), jnp.float32))
        self.mean = nnx.BatchStat(jnp.zeros((channels,), jnp.float32))
        self.var = nnx.BatchStat(jnp.ones((channels,), jnp.float32))
        self.dtype, self.epsilon, self.momentum, self.groups = dtype, epsilon, momentum, groups
        self.use_running_average = False
        # statistics from one read of x (``_moments``); ``run.build`` turns it off where a group's rows lie on
        # several devices (bn_sync), which would each need the group's first value broadcast, layer by layer
        self.one_pass = True

    def __call__(self, x, prelu: PReLU | None = None):
        affine = (None if self.scale is None else self.scale[...], self.bias[...],
                  None if prelu is None else prelu.alpha[...])
        if self.use_running_average:
            return _normalized(x, self.mean.get_value(), self.var.get_value(), *affine, self.epsilon, self.dtype)
        if self.groups == 1:  # no reshape: the float rounding of runs from before groups existed, exactly
            y, mean, var = _training_normalized(x, *affine, tuple(range(x.ndim - 1)), self.epsilon, self.dtype,
                                                self.one_pass)
            self._update_running(mean.reshape(-1), var.reshape(-1), count=x.size // x.shape[-1])
            return y
        b, c = x.shape[0], x.shape[-1]
        if b % self.groups:
            raise ValueError(f"BatchNorm in {self.groups} groups needs a batch divisible by it, got {b}")
        blocks = x.reshape(self.groups, b // self.groups, *x.shape[1:])
        y, mean, var = _training_normalized(blocks, *affine, tuple(range(1, blocks.ndim - 1)), self.epsilon,
                                            self.dtype, self.one_pass)
        # one reduction of [2C] over the groups (an all-reduce when they lie on several devices), forward only
        both = jnp.mean(jnp.concatenate([mean, var], axis=-1).reshape(self.groups, 2 * c), axis=0)
        self._update_running(both[:c], both[c:], count=blocks[0].size // c)
        return y.reshape(x.shape)

    def _update_running(self, mean, var, count: int):
        """running ← m·running + (1 − m)·batch for the batch ``mean`` and biased ``var`` ``[C]`` of ``count``
        values per channel (the variance made unbiased)."""
        unbiased = var * count / max(count - 1, 1)
        for stat, batch in ((self.mean, mean), (self.var, unbiased)):
            stat.set_value(self.momentum * stat.get_value() + (1 - self.momentum) * jax.lax.stop_gradient(batch))


def _normalized(x, mean, var, scale, bias, alpha, epsilon: float, dtype):
    """``(x − mean) / √(var + ε) · scale + bias`` in float32, in ``dtype``, then PReLU with slopes ``alpha`` in
    ``dtype`` (``scale``, ``alpha`` None: none)."""
    mul = lax.rsqrt(var + epsilon)
    if scale is not None:
        mul = mul * scale
    y = ((x.astype(jnp.float32) - mean) * mul + bias).astype(dtype)
    return y if alpha is None else jnp.where(y >= 0, y, alpha.astype(dtype) * y)


@partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def batch_normalized(x, mean, var, scale, bias, alpha, axes: tuple, epsilon: float, dtype):
    """``_normalized`` of ``x`` by its own batch statistics ``mean``, ``var`` (over ``axes``, kept as size-1 dims;
    passed in, so that they are computed once with the running statistics), differentiated through them.

    Its backward reads ``x`` and the output's gradient twice, in two passes: one reduction for the sums the
    statistics', ``scale``'s, ``bias``'s and ``alpha``'s gradients need, then ``x``'s gradient, PReLU's recomputed
    in each (autodiff of the same function wrote and re-read PReLU's gradient and ran its sums as separate
    reductions: 7 reads and writes of the activation's size, against these 5; ``benchmarks/gpu_program.py``).
    """
    return _normalized(x, mean, var, scale, bias, alpha, epsilon, dtype)


def _batch_normalized_fwd(x, mean, var, scale, bias, alpha, axes, epsilon, dtype):
    return _normalized(x, mean, var, scale, bias, alpha, epsilon, dtype), (x, mean, var, scale, bias, alpha)


def _batch_normalized_bwd(axes, epsilon, dtype, residuals, d_out):
    x, mean, var, scale, bias, alpha = residuals
    inv = lax.rsqrt(var + epsilon)
    mul = inv if scale is None else inv * scale

    def pointwise(x, d_out):  # x̂, the gradient before PReLU, and alpha's term, in float32
        centered = x.astype(jnp.float32) - mean
        d = d_out.astype(jnp.float32)
        if alpha is None:
            return centered * inv, d, None
        # PReLU's input in float32: its sign is that of the forward's rounded input, but where that rounded to
        # zero (the slope there is a matter of convention); reading the rounded value's sign instead made XLA:GPU
        # write the sign to memory in a pass of its own
        y = centered * mul + bias
        negative = y < 0
        return (centered * inv, jnp.where(negative, alpha.astype(dtype).astype(jnp.float32) * d, d),
                jnp.where(negative, d * y, 0.0))

    # each pass recomputes PReLU's mask from the x it reads: the barriers keep XLA from sharing it between the
    # forward and the passes, as a mask written by one for the others to read (costs more than recomputing it)
    x_hat, d_y, d_alpha = pointwise(lax.optimization_barrier(x), d_out)
    terms = [d_y, d_y * x_hat] + ([] if alpha is None else [d_alpha])
    sums = jnp.sum(jnp.stack(terms, -1), axes, keepdims=True)  # [..., C, 2 or 3]: one read of x and d_out
    x, sums = lax.optimization_barrier((x, sums))
    x_hat, d_y, _ = pointwise(x, d_out)
    count = math.prod(x.shape[a] for a in axes)
    d_x = mul * (d_y - (sums[..., 0] + x_hat * sums[..., 1]) / count)
    # the sums the parameters' gradients need (x̂'s only with a scale), summed over groups: one [C, k] reduction
    kept = [0] + ([] if scale is None else [1]) + ([] if alpha is None else [2])
    per_channel = iter(jnp.moveaxis(sums[..., kept].reshape(-1, sums.shape[-2], len(kept)).sum(0), -1, 0))
    d_bias = next(per_channel)
    # no cotangent for mean and var: x's gradient went through them (None: a zero that autodiff drops)
    return (d_x.astype(x.dtype), None, None, None if scale is None else next(per_channel), d_bias,
            None if alpha is None else next(per_channel))


batch_normalized.defvjp(_batch_normalized_fwd, _batch_normalized_bwd)


def _autodiff_normalized(x, mean, var, scale, bias, alpha, axes: tuple, epsilon: float, dtype):
    """``batch_normalized`` differentiated by autodiff (``axes`` unused: the statistics' sums come from theirs)."""
    return _normalized(x, mean, var, scale, bias, alpha, epsilon, dtype)


def _training_normalized(x, scale, bias, alpha, axes: tuple, epsilon: float, dtype, one_pass: bool):
    """``(output, mean, var)``: ``x`` normalized by its own statistics over ``axes`` (``_moments``, kept as size-1
    dims; ``mean`` and ``var`` carry no gradient out), differentiated in the form forced or the platform's
    (``registry.Forms.pick``: the platform of ``lowered_for``'s block, else staged with ``lax.platform_dependent``).
    Each form takes the statistics itself: passed in, the forms' join gave them a zero cotangent that the written
    form's backward then carried through the statistics (a read of ``x``; with bn_sync an all-reduce per layer)."""

    def form(normalize):
        def apply(x, scale, bias, alpha):
            mean, var = _moments(x.astype(jnp.float32), axes, keepdims=True, one_pass=one_pass)
            out = normalize(x, mean, var, scale, bias, alpha, axes, epsilon, dtype)
            return out, lax.stop_gradient(mean), lax.stop_gradient(var)
        return apply

    forms = {"written": form(batch_normalized), "autodiff": form(_autodiff_normalized)}
    return _BN_BACKWARD.pick(forms, {"cpu": "written", "default": "autodiff"})(x, scale, bias, alpha)


def _moments(x, axes, keepdims=False, one_pass=True):
    """Mean and biased variance of ``x`` over ``axes``, from one read of ``x`` (or two: ``one_pass=False``).

    One pass takes the moments of ``d = x − shift``, the shift being the first value of each channel (a constant
    to autodiff): a draw from the batch, within a few spreads of its mean, so that ``E[d²] − E[d]²`` does not
    cancel when the mean is large against the spread, as ``E[x²] − E[x]²`` would. The two-pass
    ``E[(x − E[x])²]`` reads ``x`` again in the forward and in the backward: 13.7 GiB of an r50 step at batch 512
    on XLA:GPU (``benchmarks/gpu_program.py``).
    """
    if one_pass:
        first = tuple(slice(0, 1) if axis in axes else slice(None) for axis in range(x.ndim))
        shift = lax.stop_gradient(x[first])  # one value per channel (and per group)
        d = x - shift
        mean_d = jnp.mean(d, axes, keepdims=True)
        var = jnp.maximum(jnp.mean(d * d, axes, keepdims=True) - jnp.square(mean_d), 0.0)
        mean = mean_d + shift
    else:
        mean = jnp.mean(x, axes, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), axes, keepdims=True)
    return (mean, var) if keepdims else (jnp.squeeze(mean, axes), jnp.squeeze(var, axes))


def conv(in_ch: int, out_ch: int, kernel: int, stride: int = 1, *, padding: int, groups: int = 1, dtype, rngs, init,
         use_bias: bool = False):
    """NHWC convolution with symmetric integer padding, as torch's ``Conv2d(padding=p)``; with ``groups > 1`` in
    the form the platform runs well (``grouped_conv``), the parameters those of ``nnx.Conv`` whatever the form."""
    return nnx.Conv(in_ch, out_ch, (kernel, kernel), (stride, stride), padding=((padding, padding),) * 2,
                    feature_group_count=groups, use_bias=use_bias, dtype=dtype, kernel_init=init, rngs=rngs,
                    conv_general_dilated=grouped_conv.conv_general_dilated)


REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "save_block_outputs": jax.checkpoint_policies.save_only_these_names("block_out"),
}


def _pure(graphdef, policy: str):
    """``(state, x) -> (block(x), new state)`` for blocks of ``graphdef``, under ``jax.checkpoint`` unless 'none'."""

    def apply(state, x):
        block = nnx.merge(graphdef, state)
        return block(x), nnx.state(block)

    return apply if policy == "none" else jax.checkpoint(apply, policy=REMAT_POLICIES[policy])


def remat_call(block: nnx.Module, x, policy: str):
    """``block(x)``, under ``jax.checkpoint`` with the named policy unless ``policy == 'none'``.

    ``save_block_outputs`` keeps only activations tagged ``checkpoint_name(..., 'block_out')``.
    """
    if policy == "none":
        return block(x)
    graphdef, state = nnx.split(block)
    y, state = _pure(graphdef, policy)(state, x)
    if is_training(block):  # carry out the BatchNorm statistics and RNG counters computed inside
        nnx.update(block, state)
    return y


class BlockStack(nnx.Module):
    """``depth`` blocks of one shape applied in turn; their variables are stacked ``[depth, ...]``.

    Under remat they run in a ``lax.scan``, so the recomputation happens inside the backward loop, block by
    block, on every backend (XLA:CPU otherwise hoists it next to the forward and saves nothing). The
    parameter layout is the same with or without remat. ``make_block(rngs)`` builds one block.
    """

    def __init__(self, make_block, depth: int, *, remat: str, rngs: nnx.Rngs):
        self.remat, self.depth = remat, depth

        @nnx.split_rngs(splits=depth)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs):
            return make_block(rngs)

        self.layers = create(rngs)

    def __call__(self, x):
        graphdef, state = nnx.split(self.layers)
        apply = _pure(graphdef, self.remat)
        if self.remat == "none":  # block by block: XLA:CPU runs a conv's weight gradient ~20× slower in a loop
            states = []
            for i in range(self.depth):
                x, s = apply(jax.tree.map(lambda a: a[i], state), x)
                states.append(s)
            state = jax.tree.map(lambda *a: jnp.stack(a), *states)
        else:  # a loop, so that recomputation happens in the backward, block by block
            x, state = jax.lax.scan(lambda x, s: apply(s, x), x, state)
        if is_training(self.layers):
            nnx.update(self.layers, state)
        return x


def is_training(module: nnx.Module) -> bool:
    """Whether any BatchNorm in ``module`` updates statistics or any layer is stochastic (``model.train()``)."""
    for _, m in nnx.iter_graph(module):
        if not getattr(m, "use_running_average", True) or not getattr(m, "deterministic", True):
            return True
    return False


def tag_block_output(x):
    return checkpoint_name(x, "block_out")


@jax.custom_vjp
def fused_silu(x):
    """SiLU ``x·σ(x)`` whose backward keeps only ``x`` (autodiff would also keep ``σ(x)``)."""
    return x * jax.nn.sigmoid(x)


def _silu_fwd(x):
    return fused_silu(x), x


def _silu_bwd(x, g):
    s = jax.nn.sigmoid(x.astype(jnp.float32))
    return ((g.astype(jnp.float32) * (s * (1 + x.astype(jnp.float32) * (1 - s)))).astype(x.dtype),)


fused_silu.defvjp(_silu_fwd, _silu_bwd)


ACTIVATIONS = {"relu6": jax.nn.relu6, "silu": jax.nn.silu, "fused_silu": fused_silu}
