"""MobileFaceNet (``mbf``) as in arcface_torch: blocks (1, 4, 6, 2), scale 2, GDC head, NHWC."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jaxcls.models.layers import BatchNorm, PReLU, conv, reduced_size, remat_call, tag_block_output

# arcface_torch's kaiming_normal_(mode="fan_out", nonlinearity="relu") for every convolution and linear layer: a normal
# of variance 2 / (outputs × kernel area), not the fan-in's (up to 23× larger weights, a far smaller effective step)
_INIT = nnx.initializers.variance_scaling(2.0, "fan_out", "normal")


class ConvBlock(nnx.Module):
    """conv (no bias) → BN → PReLU, or without PReLU when ``linear``."""

    def __init__(self, in_ch, out_ch, kernel=1, stride=1, padding=0, groups=1, *, linear=False, dtype, bn_groups,
                 rngs):
        self.conv = conv(in_ch, out_ch, kernel, stride, padding=padding, groups=groups, dtype=dtype, rngs=rngs,
                         init=_INIT)
        self.bn = BatchNorm(out_ch, dtype=dtype, groups=bn_groups)
        self.prelu = None if linear else PReLU(out_ch)

    def __call__(self, x):
        return self.bn(self.conv(x), self.prelu)


class DepthWise(nnx.Module):
    """1×1 expand to ``groups`` → depthwise k×k (stride) → linear 1×1 project; residual when asked."""

    def __init__(self, in_ch, out_ch, *, residual, stride, groups, **kw):
        self.residual = residual
        self.expand = ConvBlock(in_ch, groups, **kw)
        self.depthwise = ConvBlock(groups, groups, 3, stride, 1, groups, **kw)
        self.project = ConvBlock(groups, out_ch, linear=True, **kw)

    def __call__(self, x):
        y = self.project(self.depthwise(self.expand(x)))
        return tag_block_output(x + y if self.residual else y)


class MobileFaceNet(nnx.Module):
    """``__call__(images [N, 112, 112, 3]) -> [N, num_features]`` float32."""

    def __init__(self, blocks=(1, 4, 6, 2), scale: int = 2, *, num_features: int = 512, dtype=jnp.float32,
                 remat: str = "none", input_size: int = 112, bn_groups: int = 1, rngs: nnx.Rngs):
        """``bn_groups``: see ``BatchNorm``."""
        self.dtype, self.remat = dtype, remat
        c1, c2 = 64 * scale, 128 * scale
        kw = dict(dtype=dtype, bn_groups=bn_groups, rngs=rngs)
        layers = [ConvBlock(3, c1, 3, 2, 1, **kw)]
        if blocks[0] == 1:
            layers.append(ConvBlock(c1, c1, 3, 1, 1, groups=64, **kw))
        else:
            layers += [DepthWise(c1, c1, residual=True, stride=1, groups=128, **kw) for _ in range(blocks[0])]
        layers.append(DepthWise(c1, c1, residual=False, stride=2, groups=128, **kw))
        layers += [DepthWise(c1, c1, residual=True, stride=1, groups=128, **kw) for _ in range(blocks[1])]
        layers.append(DepthWise(c1, c2, residual=False, stride=2, groups=256, **kw))
        layers += [DepthWise(c2, c2, residual=True, stride=1, groups=256, **kw) for _ in range(blocks[2])]
        layers.append(DepthWise(c2, c2, residual=False, stride=2, groups=512, **kw))
        layers += [DepthWise(c2, c2, residual=True, stride=1, groups=256, **kw) for _ in range(blocks[3])]
        self.layers = nnx.List(layers)
        head = dict(kw, dtype=jnp.float32)
        self.conv_sep = ConvBlock(c2, 512, **head)
        spatial = reduced_size(input_size, 16, "a MobileFaceNet halves four times", padded=True)
        self.gdc = ConvBlock(512, 512, spatial, 1, 0, groups=512, linear=True, **head)
        self.linear = nnx.Linear(512, num_features, use_bias=False, kernel_init=_INIT, rngs=rngs)
        self.features = BatchNorm(num_features, dtype=jnp.float32, groups=bn_groups)

    def __call__(self, x):
        x = x.astype(self.dtype)
        for layer in self.layers:
            x = remat_call(layer, x, self.remat)
        x = self.gdc(self.conv_sep(x.astype(jnp.float32)))
        return self.features(self.linear(x.reshape(x.shape[0], -1)))
