"""Backbones, precision policies, remat and fused ops."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxcls.mesh import make_mesh
from jaxcls.models import MODELS, count_params, create, get_model
from jaxcls.models.iresnet import STAGES
from jaxcls.models.layers import BN_BACKWARDS, BatchNorm, PReLU, bn_backward_forced, fused_silu
from jaxcls.models.vit import Block
from jaxcls.precision import all_finite
from jaxcls.registry import lowered_for
from reference import rel_err


def iresnet_params(stages, nf=512):
    """Trainable parameters of insightface's IResNet, counted from its definition (features BN: bias only)."""
    total = 3 * 64 * 9 + 2 * 64 + 64  # stem conv, BN, PReLU
    cin = 64
    for depth, width in zip(stages, (64, 128, 256, 512)):
        for i in range(depth):
            total += 2 * cin + cin * width * 9 + 2 * width + width + width * width * 9 + 2 * width
            if i == 0:
                total += cin * width + 2 * width  # 1×1 downsample + BN
            cin = width
    return total + 2 * 512 + (512 * 49 * nf + nf) + nf


def mbf_params(blocks=(1, 4, 6, 2), scale=2, nf=512):
    """arcface_torch's MobileFaceNet: conv(no bias) + BN (2/ch) + PReLU (1/ch) per ConvBlock."""
    conv_block = lambda cin, cout, k, groups=1, prelu=True: (cin // groups * cout * k * k + 2 * cout
                                                             + (cout if prelu else 0))
    depthwise = lambda cin, cout, g: (conv_block(cin, g, 1) + conv_block(g, g, 3, g)
                                      + conv_block(g, cout, 1, prelu=False))
    c1, c2 = 64 * scale, 128 * scale
    total = conv_block(3, c1, 3) + conv_block(c1, c1, 3, 64)
    total += depthwise(c1, c1, 128) + blocks[1] * depthwise(c1, c1, 128)
    total += depthwise(c1, c2, 256) + blocks[2] * depthwise(c2, c2, 256)
    total += depthwise(c2, c2, 512) + blocks[3] * depthwise(c2, c2, 256)
    total += conv_block(c2, 512, 1) + conv_block(512, 512, 7, 512, prelu=False)
    return total + 512 * nf + 2 * nf


def vit_params(dim, depth, nf=512, tokens=144, patch=9):
    block = 2 * dim + 3 * dim * dim + dim * dim + dim + 2 * dim + dim * 4 * dim + 4 * dim + 4 * dim * dim + dim
    head = dim * tokens * dim + 2 * dim + dim * nf + 2 * nf
    return 3 * dim * patch * patch + dim + tokens * dim + dim + depth * block + 2 * dim + head


EXPECTED = {  # also in docs/models.md
    "r18": 24_025_088, "r34": 34_138_816, "r50": 43_590_336, "r100": 65_155_648, "r200": 118_833_408,
    "mbf": 2_059_520, "vit_t": 19_137_792, "vit_s": 76_023_296, "vit_b": 113_833_472, "vit_l": 255_684_352,
    "vit_h": 756_393_984,
}


def test_expected_counts_follow_from_the_architectures():
    for name, stages in STAGES.items():
        assert iresnet_params(stages) == EXPECTED[name], name
    assert mbf_params() == EXPECTED["mbf"]
    assert [vit_params(256, 12), vit_params(512, 12), vit_params(512, 24), vit_params(768, 24),
            vit_params(1024, 48)] == [EXPECTED[n] for n in ("vit_t", "vit_s", "vit_b", "vit_l", "vit_h")]


LARGEST = ("vit_b", "vit_l", "vit_h", "r200")  # ~5–20 s to build each: slow lane, counted but not traced (their
# smaller kin trace the same code in both dtypes)


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] if n in LARGEST else [])
                                  for n in sorted(MODELS)])
def test_parameter_count_and_output_shape(name):
    model = nnx.eval_shape(lambda: get_model(name))
    assert count_params(model) == EXPECTED[name]
    for dtype in () if name in LARGEST else (jnp.float32, jnp.bfloat16):
        model = nnx.eval_shape(lambda: get_model(name, num_features=128, dtype=dtype))
        out = nnx.eval_shape(lambda m, x: m(x), model, jax.ShapeDtypeStruct((2, 112, 112, 3), jnp.float32))
        assert out.shape == (2, 128) and out.dtype == jnp.float32


def test_mbf_draws_its_weights_as_arcface_torch():
    """kaiming_normal_(mode="fan_out") for every convolution and the linear layer: std √(2 / (outputs × kernel area)),
    a plain normal (the fan-in's truncated normal made them up to 23× larger: a far smaller effective step)."""
    model = create(lambda: get_model("mbf", blocks=(1, 1, 1, 1)))
    kernels = {"stem": model.layers[0].conv.kernel, "grouped": model.layers[1].conv.kernel,
               "depthwise": model.layers[2].depthwise.conv.kernel, "gdc": model.gdc.conv.kernel,
               "linear": model.linear.kernel}
    for name, kernel in kernels.items():
        w = np.asarray(kernel[...], np.float64)
        fan_out = w.shape[-1] * (w.shape[0] * w.shape[1] if w.ndim == 4 else 1)
        assert abs(w.std() / np.sqrt(2 / fan_out) - 1) < 0.1, (name, w.shape, w.std())
        assert np.abs(w).max() > 2.5 * w.std(), name  # not truncated at 2 σ


@pytest.mark.parametrize("name, smallest, words", [("r18", 16, "an IResNet halves four times"),
                                                    ("mbf", 16, "a MobileFaceNet halves four times"),
                                                    ("vit_t", 9, "of a ViT's patch")])
def test_an_input_smaller_than_the_last_feature_map_is_refused(name, smallest, words):
    """Below it the last feature map has no pixel (an IResNet's FC had 0 inputs: a ZeroDivisionError)."""
    nnx.eval_shape(lambda: get_model(name, num_features=8, input_size=smallest))
    with pytest.raises(ValueError, match=rf"^input_size {smallest - 1} is below the {smallest} pixels {words}"):
        nnx.eval_shape(lambda: get_model(name, num_features=8, input_size=smallest - 1))


@pytest.mark.parametrize("name", ["r18", "mbf"])
def test_a_cnn_takes_an_input_that_is_not_a_multiple_of_16(name):
    """Its stride-2 convolutions keep a partial last window (40 px → 20 → 10 → 5 → 3), as torch's do; the head was
    sized for 40 // 16 = 2 and the forward failed in a dot_general."""
    for size in (40, 50):
        model = nnx.eval_shape(lambda: get_model(name, num_features=8, input_size=size, **small_kwargs(name)))
        out = nnx.eval_shape(lambda m, x: m(x), model, jax.ShapeDtypeStruct((2, size, size, 3), jnp.float32))
        assert out.shape == (2, 8)


@pytest.mark.slow
def test_a_vits_residual_stream_is_float32_whatever_its_layers_compute_in(rng):
    """As under torch's autocast: the blocks' branches in bfloat16, their sums in float32. An 8-block narrow ViT's
    bfloat16 embeddings then differ from float32's by 5–6e-6 in mean 1 − cosine; added in bfloat16, 2–4e-5."""
    make = lambda dtype: create(lambda: get_model("vit_t", num_features=16, input_size=18, dim=32, heads=4, depth=8,
                                                  dtype=dtype))
    models = [make(dtype) for dtype in (jnp.float32, jnp.bfloat16)]  # the same weights (one seed)
    for model in models:
        model.eval()
    images = jnp.asarray(rng.normal(size=(16, 18, 18, 3)), jnp.float32)
    full, half = (np.asarray(jax.jit(lambda m, x: m(x))(model, images), np.float64) for model in models)
    cosine = (full * half).sum(1) / np.linalg.norm(full, axis=1) / np.linalg.norm(half, axis=1)
    assert np.mean(1 - cosine) < 1.2e-5, np.mean(1 - cosine)


def test_a_vit_whose_heads_do_not_divide_its_width_is_refused():
    with pytest.raises(ValueError, match="a ViT's dim 36 must be a multiple of its 8 heads"):
        nnx.eval_shape(lambda: get_model("vit_t", num_features=8, dim=36, depth=1))


def test_an_iresnets_stages_set_its_depth_and_bad_ones_are_refused():
    """``stages`` overrides the name's blocks per stage: an r50 with r34's stages is an r34; a stage of one block has
    no stack of identical ones."""
    assert count_params(nnx.eval_shape(lambda: get_model("r50", stages=STAGES["r34"]))) == EXPECTED["r34"]
    shallow = nnx.eval_shape(lambda: get_model("r18", width=8, stages=[1, 1, 1, 2]))
    assert [r is None for r in shallow.rests] == [True, True, True, False] and shallow.rests[3].depth == 1
    for bad in [(2, 2, 2), (2, 0, 2, 2), (2, 2, 2, 1.5), (2, 2, 2, True)]:  # True is an int in Python
        with pytest.raises(ValueError, match=rf"IResNet stages: 4 block counts of at least 1 .*{re.escape(repr(bad))}"):
            get_model("r18", stages=bad)


def small_kwargs(name) -> dict:
    """A CPU-sized instance's arguments: IResNets at 1/4 width, MobileFaceNets with one block of each kind, ViTs of 2
    blocks (every layer kind stays: a ViT's second block has a drop path)."""
    return dict([{"r": ("width", 16), "m": ("blocks", (1, 1, 1, 1)), "v": ("depth", 2)}[name[0]]])


def small(name, **kwargs):
    """A CPU-sized instance (``small_kwargs``) at 32×32, ViTs at 18×18."""
    size = 18 if name.startswith("vit") else 32
    kwargs = small_kwargs(name) | kwargs
    return create(lambda: get_model(name, num_features=16, input_size=size, **kwargs)), size


def loss_of(model, x):
    return jnp.sum(model(x) ** 2)


def traced_for_the_cpu():
    """Each layer traced in its CPU form alone, as the train step traces for its devices (``lowered_for``; staged,
    every platform's form would be traced and linearized: a third of these tests' time). The forms of other platforms
    are tested where they are chosen (test_grouped_conv, the BatchNorm tests below, test_registry)."""
    return lowered_for(make_mesh(1, 8))


def param_grads(model, x):
    """The gradient of ``loss_of`` w.r.t. the parameters, by one compiled program."""
    graphdef, state = nnx.split(model)
    with traced_for_the_cpu():
        return jax.jit(lambda state, x: nnx.grad(loss_of)(nnx.merge(graphdef, state), x))(state, x)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mbf", "vit_t"])  # r18: test_remat_lowers_saved_activations_not_values
def test_gradients_finite(name, rng):
    model, size = small(name)
    x = jnp.asarray(rng.normal(size=(4, size, size, 3)), jnp.float32)
    grads = param_grads(model, x)
    finite, total = jax.jit(lambda g: (all_finite(g), sum(jnp.abs(v).sum() for v in jax.tree.leaves(g))))(grads)
    assert finite and float(total) > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["r18", "mbf"])
def test_bfloat16_outputs_agree_with_float32(name, rng):
    x = jnp.asarray(rng.normal(size=(4, 32, 32, 3)), jnp.float32)
    outs = []
    for dtype in (jnp.float32, jnp.bfloat16):
        model, _ = small(name, dtype=dtype)
        model.eval()
        graphdef, state = nnx.split(model)
        with traced_for_the_cpu():
            outs.append(jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))(state, x))
    assert outs[1].dtype == jnp.float32
    assert rel_err(outs[1], outs[0]) < 5e-2


@functools.lru_cache
def residual_bytes(name, remat, bn_backward, batch=16):
    """Bytes the forward keeps for the backward (the vjp's residuals) at 112×112, by abstract evaluation, with
    BatchNorm's backward in form ``bn_backward`` (``BN_BACKWARDS``: CPUs take one, GPUs the other).

    The residuals are what remat controls directly, whatever a backend's scheduler then does.
    """
    model = nnx.eval_shape(lambda: get_model(name, remat=remat))
    model.eval()  # statistics frozen: the model is a pure function of its parameters under jax.vjp
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    x = jax.ShapeDtypeStruct((batch, 112, 112, 3), jnp.float32)
    with traced_for_the_cpu(), bn_backward_forced(bn_backward):
        pullback = jax.eval_shape(lambda p, r, x: jax.vjp(lambda p: loss_of(nnx.merge(graphdef, p, r), x), p)[1],
                                  params, rest, x)
    return sum(r.size * r.dtype.itemsize for r in jax.tree.leaves(pullback))


@functools.lru_cache
def compiled_temp_bytes(name, remat, batch=8, size=64):
    """``temp_size_in_bytes`` of a compiled training-mode gradient step of backbone ``name``."""
    model = nnx.eval_shape(lambda: get_model(name, remat=remat, input_size=size))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p, r, x):  # statistics are inputs too: NNX updates BatchStats only of the trace that made them
        m = nnx.merge(graphdef, p, r)
        return loss_of(m, x), nnx.state(m, nnx.Not(nnx.Param))

    grad = jax.grad(loss, argnums=(0, 1), has_aux=True, allow_int=True)
    x = jax.ShapeDtypeStruct((batch, size, size, 3), jnp.float32)
    with traced_for_the_cpu():
        lowered = jax.jit(grad).lower(params, rest, x)
    return lowered.compile().memory_analysis().temp_size_in_bytes


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["full", "save_dots", "save_block_outputs"])
def test_remat_lowers_compiled_temp_memory(policy):
    """Scanned identical blocks recompute inside the backward loop, so even XLA:CPU holds less."""
    assert compiled_temp_bytes("r34", policy) < 0.8 * compiled_temp_bytes("r34", "none")  # measured 0.67


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["full", "save_dots", "save_block_outputs"])
def test_remat_lowers_saved_activations_not_values(policy, rng):
    for bn_backward in BN_BACKWARDS:
        assert residual_bytes("r18", policy, bn_backward) < 0.8 * residual_bytes("r18", "none", bn_backward)
    x = jnp.asarray(rng.normal(size=(4, 32, 32, 3)), jnp.float32)
    shallow = dict(stages=(1, 1, 1, 2))  # the last stage keeps a stack of identical blocks (the remat loop's body)
    g_plain = param_grads(small("r18", **shallow)[0], x)
    g_remat = param_grads(small("r18", remat=policy, **shallow)[0], x)
    assert all_finite(g_plain) and all(np.any(g != 0) for g in jax.tree.leaves(g_plain))
    for a, b in zip(jax.tree.leaves(g_plain), jax.tree.leaves(g_remat)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_unknown_model_and_remat_policy():
    with pytest.raises(ValueError, match="unknown model 'r51'"):
        get_model("r51")
    for name in ("r18", "mbf", "vit_t"):
        with pytest.raises(ValueError, match="unknown remat policy 'sometimes'"):
            get_model(name, remat="sometimes")


def test_fused_silu_matches_autodiff_in_float64(rng):
    x = rng.normal(size=1000) * 6
    g = rng.normal(size=1000)
    with jax.enable_x64(True):
        out, pullback = jax.vjp(fused_silu, jnp.asarray(x))
        ref_out, ref_pullback = jax.vjp(lambda v: v * jax.nn.sigmoid(v), jnp.asarray(x))
        assert rel_err(out, ref_out) < 1e-6  # the backward computes in float32
        assert rel_err(pullback(jnp.asarray(g))[0], ref_pullback(jnp.asarray(g))[0]) < 1e-6


def test_fused_silu_saves_only_its_input():
    x = jax.ShapeDtypeStruct((256, 1024), jnp.float32)
    residual_bytes = lambda f: sum(r.size * r.dtype.itemsize for r in jax.tree.leaves(
        jax.eval_shape(lambda v: jax.vjp(f, v)[1], x)))
    assert residual_bytes(fused_silu) == 256 * 1024 * 4
    assert residual_bytes(jax.nn.silu) > residual_bytes(fused_silu)


def grouped_batchnorm_reference(x, scale, bias, mean, var, g, groups, alpha=None, momentum=0.9, eps=1e-5):
    """Per-group batch norm, then PReLU with slopes ``alpha`` (None: none), in float64: output,
    d/d (x, scale, bias, alpha) of ``sum(output · g)``, new running stats."""
    blocks = x.reshape(groups, -1, x.shape[-1])  # [G, rows·spatial, C]
    mu, sigma2 = blocks.mean(1, keepdims=True), blocks.var(1, keepdims=True)
    xhat = (blocks - mu) / np.sqrt(sigma2 + eps)
    y = xhat * scale + bias
    g = g.reshape(blocks.shape)
    out, dy = (y, g) if alpha is None else (np.where(y >= 0, y, alpha * y), np.where(y >= 0, g, alpha * g))
    dx = scale / np.sqrt(sigma2 + eps) * (dy - dy.mean(1, keepdims=True) - xhat * (dy * xhat).mean(1, keepdims=True))
    dalpha = None if alpha is None else np.where(y < 0, g * y, 0).sum((0, 1))
    n = blocks.shape[1]
    new_mean = momentum * mean + (1 - momentum) * mu.mean(axis=(0, 1))
    new_var = momentum * var + (1 - momentum) * sigma2.mean(axis=(0, 1)) * n / (n - 1)
    return (out.reshape(x.shape), (dx.reshape(x.shape), (dy * xhat).sum((0, 1)), dy.sum((0, 1)), dalpha),
            (new_mean, new_var))


@pytest.mark.parametrize("backward", (None, *BN_BACKWARDS))
@pytest.mark.parametrize("prelu,use_scale", [(False, True), (True, True), (True, False)])
@pytest.mark.parametrize("one_pass", [True, False])
@pytest.mark.parametrize("groups", [1, 4])
def test_batchnorm_in_groups_matches_float64_per_group_reference(groups, one_pass, prelu, use_scale, backward, rng):
    """Values, gradients (BatchNorm's backward written out, with the PReLU it applies, or autodiff's; None: the
    platform's, staged by ``lax.platform_dependent``) and running statistics."""
    x, g = rng.normal(1.0, 2.0, (8, 3, 3, 5)), rng.normal(size=(8, 3, 3, 5))
    scale, bias = (rng.uniform(0.5, 2, 5) if use_scale else np.ones(5)), rng.normal(size=5)
    mean, var, alpha = rng.normal(size=5), rng.uniform(0.5, 2, 5), rng.uniform(-0.5, 0.5, 5)
    bn, activation = BatchNorm(5, groups=groups, use_scale=use_scale), PReLU(5) if prelu else None
    bn.one_pass = one_pass
    for variable, value in ((bn.scale, scale), (bn.bias, bias), (bn.mean, mean), (bn.var, var),
                            (getattr(activation, "alpha", None), alpha)):
        if variable is not None:
            variable.set_value(jnp.asarray(value, jnp.float32))
    graphdef, params, stats = nnx.split((bn, activation), nnx.Param, ...)

    def apply(x, params, stats):  # stats enter as a primal: NNX mutates BatchStats only of the trace that made them
        module, activation = nnx.merge(graphdef, params, stats)
        return module(x, activation), nnx.state(module, nnx.BatchStat)

    with bn_backward_forced(backward):
        out, pullback, new = jax.vjp(apply, jnp.asarray(x, jnp.float32), params, stats, has_aux=True)
        traced = str(jax.make_jaxpr(apply)(jnp.asarray(x, jnp.float32), params, stats))
    assert ("custom_vjp_call" in traced) == (backward != "autodiff")  # the form forced is the form traced
    dx, dparams, _ = pullback(jnp.asarray(g, jnp.float32))
    ref_out, (ref_dx, ref_dscale, ref_dbias, ref_dalpha), (ref_mean, ref_var) = grouped_batchnorm_reference(
        x, scale, bias, mean, var, g, groups, alpha if prelu else None)
    checks = [(out, ref_out), (dx, ref_dx), (dparams[0]["bias"][...], ref_dbias), (new["mean"][...], ref_mean),
              (new["var"][...], ref_var)]
    checks += [(dparams[0]["scale"][...], ref_dscale)] if use_scale else []
    checks += [(dparams[1]["alpha"][...], ref_dalpha)] if prelu else []
    assert not use_scale or "scale" in dparams[0]
    for actual, expected in checks:
        assert rel_err(actual, expected) < 1e-5
    with pytest.raises(ValueError, match="BatchNorm in 4 groups needs a batch divisible by it, got 6"):
        BatchNorm(5, groups=4)(jnp.zeros((6, 5)))


def test_batchnorm_statistics_of_a_large_mean_do_not_cancel(rng):
    """One read gives the mean and variance as the moments of ``x − shift`` (each channel's first value): with a
    mean 500 times the spread, ``E[x²] − E[x]²`` in float32 would lose the variance's leading digits."""
    x = rng.normal(500.0, 1.0, (64, 2, 2, 3))
    out = BatchNorm(3)(jnp.asarray(x, jnp.float32))
    expected = (x - x.mean((0, 1, 2))) / np.sqrt(x.var((0, 1, 2)) + 1e-5)
    assert rel_err(out, expected) < 1e-4


def einsum_attention(block, x):
    """The ViT's former attention: two einsums, logits and softmax in float32."""
    n, t, d = x.shape
    q, k, v = jnp.moveaxis(block.qkv(x).reshape(n, t, 3, block.heads, d // block.heads), 2, 0)
    logits = jnp.einsum("nqhc,nkhc->nhqk", q, k, preferred_element_type=jnp.float32) / np.sqrt(d // block.heads)
    attn = jax.nn.softmax(logits, axis=-1).astype(x.dtype)
    return block.proj(jnp.einsum("nhqk,nkhc->nqhc", attn, v).reshape(n, t, d))


@pytest.mark.parametrize("dtype, tolerance", [(jnp.float32, 1e-6), (jnp.bfloat16, 2e-2)])
def test_vit_attention_equals_einsum_attention(dtype, tolerance, rng):
    block = Block(32, 4, 0.0, act="relu6", dtype=dtype, rngs=nnx.Rngs(int(rng.integers(2**31))))
    x, g = (jnp.asarray(rng.normal(size=(3, 7, 32)), dtype) for _ in range(2))
    value_and_dx = lambda f, x: (f(x), jax.vjp(f, x)[1](g)[0])
    (out, dx), (ref, ref_dx) = jax.jit(lambda x: (value_and_dx(block._attention, x),
                                                  value_and_dx(lambda v: einsum_attention(block, v), x)))(x)
    assert out.dtype == dtype and rel_err(out, ref) < tolerance and rel_err(dx, ref_dx) < tolerance
