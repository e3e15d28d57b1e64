"""arcface_torch's ViT for 112×112 faces (patch 9 → 144 tokens, no class token), NNX, NHWC.

Pre-norm blocks (LN → attention without qkv bias → LN → MLP 4× with ReLU6), stochastic depth,
random token masking in training (``mask_ratio``, masked tokens replaced by a learned token after the
blocks), final LN, then a head ``Linear(144·D → D) → BN → Linear(D → num_features) → BN``.
Attention is ``jax.nn.dot_product_attention`` (logits and softmax in float32).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxcls.models.layers import ACTIVATIONS, BatchNorm, reduced_size, remat_call, tag_block_output

_INIT = nnx.initializers.truncated_normal(0.02)
SIZES = {"vit_t": (256, 12, 8), "vit_s": (512, 12, 8), "vit_b": (512, 24, 8), "vit_l": (768, 24, 8),
         "vit_h": (1024, 48, 8)}  # arcface_torch's: (embedding width, blocks, heads)
NAME_DEFAULTS = {"vit_h": {"mask_ratio": 0.0}}  # arcface_torch's vit_h masks no token (the others 10%)


class Block(nnx.Module):
    def __init__(self, dim, heads, drop_path, *, act, dtype, rngs):
        self.heads, self.drop_path, self.act = heads, drop_path, ACTIVATIONS[act]
        self.norm1 = nnx.LayerNorm(dim, epsilon=1e-5, dtype=dtype, rngs=rngs)
        self.qkv = nnx.Linear(dim, 3 * dim, use_bias=False, dtype=dtype, kernel_init=_INIT, rngs=rngs)
        self.proj = nnx.Linear(dim, dim, dtype=dtype, kernel_init=_INIT, rngs=rngs)
        self.norm2 = nnx.LayerNorm(dim, epsilon=1e-5, dtype=dtype, rngs=rngs)
        self.fc1 = nnx.Linear(dim, 4 * dim, dtype=dtype, kernel_init=_INIT, rngs=rngs)
        self.fc2 = nnx.Linear(4 * dim, dim, dtype=dtype, kernel_init=_INIT, rngs=rngs)
        self.rngs = rngs
        self.deterministic = False

    def _drop_path(self, x):
        if self.deterministic or self.drop_path == 0.0:
            return x
        keep = jax.random.bernoulli(self.rngs.dropout(), 1.0 - self.drop_path, (x.shape[0], 1, 1))
        return jnp.where(keep, x / (1.0 - self.drop_path), 0).astype(x.dtype)

    def _attention(self, x):
        """Multi-head self-attention of ``x [N, T, D]``; JAX picks the implementation for the backend."""
        n, t, d = x.shape
        q, k, v = jnp.moveaxis(self.qkv(x).reshape(n, t, 3, self.heads, d // self.heads), 2, 0)  # [N, T, H, D/H]
        return self.proj(jax.nn.dot_product_attention(q, k, v).reshape(n, t, d))

    def __call__(self, x):
        """``x [N, T, D]`` float32, the residual stream: the branches compute in the layers' dtype and are added in
        float32, as under torch's autocast."""
        x = x + self._drop_path(self._attention(self.norm1(x))).astype(x.dtype)
        x = x + self._drop_path(self.fc2(self.act(self.fc1(self.norm2(x))))).astype(x.dtype)
        return tag_block_output(x)


class VisionTransformer(nnx.Module):
    """``__call__(images [N, 112, 112, 3]) -> [N, num_features]`` float32."""

    def __init__(self, dim: int, depth: int, heads: int, *, num_features: int = 512, patch: int = 9,
                 input_size: int = 112, drop_path: float = 0.1, mask_ratio: float = 0.1, act: str = "relu6",
                 dtype=jnp.float32, remat: str = "none", bn_groups: int = 1, rngs: nnx.Rngs):
        """``bn_groups``: see ``BatchNorm`` (the head's two; LayerNorm needs no batch statistics)."""
        if dim % heads:
            raise ValueError(f"a ViT's dim {dim} must be a multiple of its {heads} heads")
        self.dtype, self.remat, self.mask_ratio, self.rngs = dtype, remat, mask_ratio, rngs
        self.patch = patch
        self.tokens = reduced_size(input_size, patch, "of a ViT's patch") ** 2
        self.patch_embed = nnx.Conv(3, dim, (patch, patch), (patch, patch), padding="VALID", dtype=dtype, rngs=rngs)
        self.pos_embed = nnx.Param(_INIT(rngs.params(), (1, self.tokens, dim)))
        self.mask_token = nnx.Param(_INIT(rngs.params(), (1, 1, dim)))
        rates = np.linspace(0, drop_path, depth)
        self.blocks = nnx.List([Block(dim, heads, float(r), act=act, dtype=dtype, rngs=rngs) for r in rates])
        self.norm = nnx.LayerNorm(dim, epsilon=1e-5, rngs=rngs)
        self.head_fc1 = nnx.Linear(dim * self.tokens, dim, use_bias=False, kernel_init=_INIT, rngs=rngs)
        self.head_bn1 = BatchNorm(dim, epsilon=2e-5, groups=bn_groups)
        self.head_fc2 = nnx.Linear(dim, num_features, use_bias=False, kernel_init=_INIT, rngs=rngs)
        self.head_bn2 = BatchNorm(num_features, epsilon=2e-5, groups=bn_groups)
        self.deterministic = False

    def __call__(self, x):
        n = x.shape[0]
        x = self.patch_embed(x.astype(self.dtype)).astype(jnp.float32)
        x = x.reshape(n, -1, x.shape[-1]) + self.pos_embed[...]
        masking = not self.deterministic and self.mask_ratio > 0
        if masking:  # keep a random subset of tokens per image
            keep = int(self.tokens * (1 - self.mask_ratio))
            order = jnp.argsort(jax.random.uniform(self.rngs.dropout(), (n, self.tokens)), axis=1)
            x = jnp.take_along_axis(x, order[:, :keep, None], axis=1)
        for block in self.blocks:
            x = remat_call(block, x, self.remat)
        x = self.norm(x)
        if masking:  # put the kept tokens back in place, the mask token everywhere else
            full = jnp.broadcast_to(self.mask_token[...], (n, self.tokens, x.shape[-1]))
            x = full.at[jnp.arange(n)[:, None], order[:, :keep]].set(x)
        x = self.head_bn1(self.head_fc1(x.reshape(n, -1)))
        return self.head_bn2(self.head_fc2(x))
