"""insightface's IResNet (r18 … r200) in Flax NNX, NHWC, 112×112 → 512-d.

stem conv3×3(64)–BN–PReLU; four stages of IBasicBlocks (64, 128, 256, 512 channels), each starting with
stride 2; block = BN–conv3×3–BN–PReLU–conv3×3(stride)–BN plus a 1×1-conv+BN shortcut when the shape
changes; head BN → dropout → flatten → FC(+bias) → BN whose scale is frozen at 1 (no scale parameter).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jaxcls.models.layers import BatchNorm, BlockStack, PReLU, conv, reduced_size, remat_call, tag_block_output

STAGES = {"r18": (2, 2, 2, 2), "r34": (3, 4, 6, 3), "r50": (3, 4, 14, 3), "r100": (3, 13, 30, 3),
          "r200": (6, 26, 60, 6)}
WIDTHS = (64, 128, 256, 512)
_CONV_INIT = nnx.initializers.normal(0.1)  # arcface_torch initialises every conv with N(0, 0.1)


class IBasicBlock(nnx.Module):
    def __init__(self, in_ch: int, out_ch: int, stride: int, *, dtype, bn_groups: int, rngs: nnx.Rngs):
        self.bn1 = BatchNorm(in_ch, dtype=dtype, groups=bn_groups)
        self.conv1 = conv(in_ch, out_ch, 3, padding=1, dtype=dtype, rngs=rngs, init=_CONV_INIT)
        self.bn2 = BatchNorm(out_ch, dtype=dtype, groups=bn_groups)
        self.prelu = PReLU(out_ch)
        self.conv2 = conv(out_ch, out_ch, 3, stride, padding=1, dtype=dtype, rngs=rngs, init=_CONV_INIT)
        self.bn3 = BatchNorm(out_ch, dtype=dtype, groups=bn_groups)
        reshape = stride != 1 or in_ch != out_ch
        self.downsample = nnx.Sequential(
            conv(in_ch, out_ch, 1, stride, padding=0, dtype=dtype, rngs=rngs, init=_CONV_INIT),
            BatchNorm(out_ch, dtype=dtype, groups=bn_groups)) if reshape else None

    def __call__(self, x):
        out = self.bn3(self.conv2(self.bn2(self.conv1(self.bn1(x)), self.prelu)))
        shortcut = x if self.downsample is None else self.downsample(x)
        return tag_block_output(out + shortcut)


class IResNet(nnx.Module):
    """``__call__(images [N, 112, 112, 3]) -> [N, num_features]`` float32."""

    def __init__(self, stages=STAGES["r50"], *, num_features: int = 512, dropout: float = 0.0,
                 dtype=jnp.float32, remat: str = "none", input_size: int = 112, width: int = 64,
                 bn_groups: int = 1, rngs: nnx.Rngs):
        """``stages``: blocks per stage (r18's (2, 2, 2, 2) … r200's; fewer suit CPU recipes and tests); ``width``
        scales every stage (64 is insightface's; smaller widths suit CPU recipes); ``bn_groups``: see ``BatchNorm``."""
        counts = all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in stages)  # True is an int
        if len(stages) != len(WIDTHS) or not counts:
            raise ValueError(f"IResNet stages: {len(WIDTHS)} block counts of at least 1 (a stage starts with its "
                             f"strided block), not {stages!r}")
        self.remat = remat
        self.dtype = dtype
        widths = [w * width // 64 for w in WIDTHS]
        self.conv1 = conv(3, widths[0], 3, padding=1, dtype=dtype, rngs=rngs, init=_CONV_INIT)
        self.bn1 = BatchNorm(widths[0], dtype=dtype, groups=bn_groups)
        self.prelu = PReLU(widths[0])
        firsts, rests, in_ch = [], [], widths[0]
        for depth, width in zip(stages, widths):  # a stage: one strided block, then depth − 1 identical ones
            firsts.append(IBasicBlock(in_ch, width, 2, dtype=dtype, bn_groups=bn_groups, rngs=rngs))
            make = lambda rngs, width=width: IBasicBlock(width, width, 1, dtype=dtype, bn_groups=bn_groups, rngs=rngs)
            rests.append(BlockStack(make, depth - 1, remat=remat, rngs=rngs) if depth > 1 else None)
            in_ch = width
        self.firsts, self.rests = nnx.List(firsts), nnx.List(rests)
        self.bn2 = BatchNorm(in_ch, dtype=dtype, groups=bn_groups)
        self.dropout = nnx.Dropout(dropout, rngs=rngs)
        spatial = reduced_size(input_size, 16, "an IResNet halves four times", padded=True)
        self.fc = nnx.Linear(in_ch * spatial * spatial, num_features, dtype=jnp.float32, rngs=rngs)
        self.features = BatchNorm(num_features, dtype=jnp.float32, use_scale=False, groups=bn_groups)

    def __call__(self, x):
        x = self.bn1(self.conv1(x.astype(self.dtype)), self.prelu)
        for first, rest in zip(self.firsts, self.rests):
            x = remat_call(first, x, self.remat)
            x = x if rest is None else rest(x)
        x = self.bn2(x).reshape(x.shape[0], -1)
        if not self.dropout.deterministic and self.dropout.rate > 0:  # in eval mode not even traced: an export
            x = self.dropout(x)  # would hold a Dropout node (ONNX: with a bool initializer insightface refuses)
        return self.features(self.fc(x.astype(jnp.float32)))
