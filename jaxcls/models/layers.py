"""Building blocks shared by the backbones: per-channel PReLU, BatchNorm defaults, remat policies, fused ops.

Precision: parameters are float32; ``dtype`` is the compute dtype of convolutions and matmuls
(float32, bfloat16 or float16). BatchNorm statistics are computed in float32 whatever ``dtype``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jaxcls.models import grouped_conv

BN_MOMENTUM = 0.9  # = torch momentum 0.1
BN_EPS = 1e-5


class PReLU(nnx.Module):
    """Per-channel PReLU (torch ``nn.PReLU(num_parameters=C)``), slopes initialised to 0.25."""

    def __init__(self, channels: int):
        self.alpha = nnx.Param(jnp.full((channels,), 0.25, jnp.float32))

    def __call__(self, x):
        return jnp.where(x >= 0, x, self.alpha[...].astype(x.dtype) * x)


class BatchNorm(nnx.Module):
    """BatchNorm over all but the last axis; statistics in float32, output in ``dtype``.

    torch's defaults (momentum 0.1 → running = 0.9·running + 0.1·batch, eps 1e-5, unbiased running var).
    ``use_scale=False`` freezes the scale at 1 (arcface_torch's ``features`` layer). Written here rather than
    ``nnx.BatchNorm`` because the latter's in-place statistics update makes tracing quadratic in depth
    (1.8 s of an r100 trace per 100 layers).

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

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        if self.use_running_average:
            mean, var = self.mean.get_value(), self.var.get_value()
        elif self.groups == 1:  # no reshape: the float rounding of runs from before groups existed, exactly
            mean, var = _moments(x32, tuple(range(x.ndim - 1)), one_pass=self.one_pass)
            self._update_running(mean, var, count=x32.size // x.shape[-1])
        else:
            return self._grouped(x32).reshape(x.shape).astype(self.dtype)
        return self._normalize(x32, mean, var).astype(self.dtype)

    def _grouped(self, x32):
        """``x32 [B, ..., C]`` normalized per block of ``B / groups`` rows, as ``[groups, B / groups, ..., C]``."""
        b, c = x32.shape[0], x32.shape[-1]
        if b % self.groups:
            raise ValueError(f"BatchNorm in {self.groups} groups needs a batch divisible by it, got {b}")
        blocks = x32.reshape(self.groups, b // self.groups, *x32.shape[1:])
        mean, var = _moments(blocks, tuple(range(1, blocks.ndim - 1)), keepdims=True, one_pass=self.one_pass)
        # one reduction of [2C] over the groups (an all-reduce when they lie on several devices), forward only
        both = jnp.mean(jnp.concatenate([mean, var], axis=-1).reshape(self.groups, 2 * c), axis=0)
        self._update_running(both[:c], both[c:], count=blocks[0].size // c)
        return self._normalize(blocks, mean, var)

    def _normalize(self, x32, mean, var):
        mul = jax.lax.rsqrt(var + self.epsilon)
        if self.scale is not None:
            mul = mul * self.scale[...]
        return (x32 - mean) * mul + self.bias[...]

    def _update_running(self, mean, var, count: int):
        """running ← m·running + (1 − m)·batch for the batch ``mean`` and biased ``var`` ``[C]`` of ``count``
        values per channel (the variance made unbiased)."""
        unbiased = var * count / max(count - 1, 1)
        for stat, batch in ((self.mean, mean), (self.var, unbiased)):
            stat.set_value(self.momentum * stat.get_value() + (1 - self.momentum) * jax.lax.stop_gradient(batch))


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


def conv(in_ch: int, out_ch: int, kernel: int, stride: int = 1, *, padding: int, groups: int = 1, dtype, rngs,
         use_bias: bool = False, init=nnx.initializers.kaiming_normal()):
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
