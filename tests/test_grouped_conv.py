"""Grouped and depthwise convolutions in each lowering compute XLA's grouped convolution: values and gradients against
a float64 reference, the form chosen per platform visible in the compiled program, mbf the same function whatever
the form."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxcls.models import create, get_model, grouped_conv
from jaxcls.models.layers import PReLU, conv

INIT = nnx.initializers.normal(1.0)  # any kernel: the lowerings are compared with each other

# (batch, size, channels in, channels out, groups, kernel, stride, padding): mbf's stem (groups of 2), its depthwise
# layers (stride 1 and 2), its GDC head (7×7, no padding), two outputs per channel, groups of 4 → 3
CASES = {
    "stem": (2, 9, 8, 8, 4, 3, 1, 1),
    "depthwise": (2, 8, 6, 6, 6, 3, 1, 1),
    "depthwise_stride2": (3, 9, 4, 4, 4, 3, 2, 1),
    "gdc": (2, 7, 5, 5, 5, 7, 1, 0),
    "multiplier2": (1, 6, 3, 6, 3, 3, 2, 1),
    "groups_4_to_3": (2, 5, 8, 6, 2, 3, 1, 1),
}


def reference(x, kernel, groups, stride, pad, cotangent):
    """float64 numpy: the grouped convolution of ``x [N, H, W, C_in]`` by ``kernel [k, k, C_in/groups, C_out]``, and the
    gradients of ``sum(y · cotangent)`` with respect to ``x`` and ``kernel``, tap by tap."""
    x, kernel, cotangent = (np.asarray(a, np.float64) for a in (x, kernel, cotangent))
    n, h, w, c = x.shape
    k, _, per_group, out = kernel.shape
    padded = np.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
    ho, wo = (h + 2 * pad - k) // stride + 1, (w + 2 * pad - k) // stride + 1
    dy = cotangent.reshape(n, ho, wo, groups, out // groups)
    y, dx, dk = np.zeros((n, ho, wo, groups, out // groups)), np.zeros_like(padded), np.zeros_like(kernel)
    for i in range(k):
        for j in range(k):
            rows, columns = slice(i, i + (ho - 1) * stride + 1, stride), slice(j, j + (wo - 1) * stride + 1, stride)
            window = (slice(None), rows, columns)
            taps = padded[window].reshape(n, ho, wo, groups, per_group)
            weights = kernel[i, j].reshape(per_group, groups, out // groups)
            y += np.einsum("nhwgi,igo->nhwgo", taps, weights)
            dk[i, j] = np.einsum("nhwgi,nhwgo->igo", taps, dy).reshape(per_group, out)
            dx[window] += np.einsum("nhwgo,igo->nhwgi", dy, weights).reshape(n, ho, wo, c)
    return y.reshape(n, ho, wo, out), dx[:, pad:pad + h, pad:pad + w], dk


@pytest.mark.parametrize("case", CASES)
def test_every_lowering_computes_the_grouped_convolution_and_its_gradients(case, rng):
    n, size, in_ch, out_ch, groups, k, stride, pad = CASES[case]
    x = rng.standard_normal((n, size, size, in_ch)).astype(np.float32)
    kernel = rng.standard_normal((k, k, in_ch // groups, out_ch)).astype(np.float32)
    ho = (size + 2 * pad - k) // stride + 1
    cotangent = rng.standard_normal((n, ho, ho, out_ch)).astype(np.float32)
    y_ref, dx_ref, dk_ref = reference(x, kernel, groups, stride, pad, cotangent)
    for lowering in grouped_conv.usable(in_ch // groups):
        def f(x, kernel):
            return grouped_conv.conv_general_dilated(x, kernel, (stride, stride), ((pad, pad),) * 2,
                                                     dimension_numbers=grouped_conv.NHWC, feature_group_count=groups)
        with grouped_conv.forced(lowering):
            y, pullback = jax.vjp(jax.jit(f), x, kernel)
        dx, dk = pullback(cotangent)
        for got, want in ((y, y_ref), (dx, dx_ref), (dk, dk_ref)):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4 * np.abs(want).max(), err_msg=lowering)


def test_the_block_diagonal_kernel_holds_each_group_on_its_block(rng):
    kernel = rng.standard_normal((3, 3, 2, 6)).astype(np.float32)  # 3 groups: 2 inputs → 2 outputs each
    dense = np.asarray(grouped_conv.block_diagonal(jnp.asarray(kernel), 3))
    assert dense.shape == (3, 3, 6, 6)
    for g in range(3):
        for h in range(3):
            block = dense[:, :, 2 * g:2 * g + 2, 2 * h:2 * h + 2]
            np.testing.assert_array_equal(block, kernel[:, :, :, 2 * g:2 * g + 2] if g == h else 0)


def test_the_choice_by_platform_and_group_width():
    assert grouped_conv.choose("cpu", 64, 2) == grouped_conv.choose("cuda", 64, 2) == "block_diagonal"
    assert grouped_conv.choose("cpu", 128, 1) == "shifted" and grouped_conv.choose("cuda", 128, 1) == "xla"
    assert grouped_conv.choose("cpu", 1, 64) == "xla"


def test_bad_lowerings_are_refused(rng):
    with pytest.raises(ValueError, match="unknown grouped-convolution lowering 'fast': expected one of xla, "):
        with grouped_conv.forced("fast"):
            pass
    x, kernel = jnp.zeros((1, 4, 4, 4)), jnp.zeros((3, 3, 2, 4))
    with grouped_conv.forced("shifted"), pytest.raises(ValueError, match="depthwise .* this one has 2 per group"):
        grouped_conv.conv_general_dilated(x, kernel, (1, 1), ((1, 1), (1, 1)), dimension_numbers=grouped_conv.NHWC,
                                          feature_group_count=2)


def test_the_cpu_program_has_no_grouped_convolution():
    """mbf's layers, as ``layers.conv`` builds them, compile on XLA:CPU without ``feature_group_count``; forced to
    XLA's form they have it (the test can fail)."""
    layer = conv(8, 8, 3, padding=1, groups=4, dtype=jnp.float32, rngs=nnx.Rngs(0), init=INIT)
    depthwise = conv(8, 8, 3, 2, padding=1, groups=8, dtype=jnp.float32, rngs=nnx.Rngs(1), init=INIT)
    x = jnp.ones((2, 8, 8, 8))

    def program():
        loss = lambda x: jnp.sum(depthwise(layer(x)) ** 2)
        return jax.jit(jax.grad(loss)).lower(x).compile().as_text()

    assert "feature_group_count" not in program()
    with grouped_conv.forced("xla"):
        assert "feature_group_count=4" in program() and "feature_group_count=8" in program()


def test_mbf_computes_the_same_function_and_gradients_whatever_the_lowering(rng):
    """mbf at 32 px in the platform's forms and in XLA's grouped form: the same embeddings and parameter gradients
    (in eval mode: training-mode BatchNorm over the few values of a small test amplifies float32 rounding, which the
    layer tests above bound without it)."""
    model = create(lambda: get_model("mbf", 16, input_size=32, blocks=(1, 1, 1, 1)))  # stem: 64 groups of 2
    model.eval()
    # PReLU slopes of 1 and a linear loss: a smooth function of the parameters, so that float32 rounding, which
    # differs between the forms, cannot move an activation across PReLU's kink (or into tanh's saturation, where
    # the untrained network's embeddings of ~50 lie) and change a gradient wholesale
    for _, module in nnx.iter_graph(model):
        if isinstance(module, PReLU):
            module.alpha.set_value(jnp.ones_like(module.alpha.get_value()))
    graphdef, state = nnx.split(model)
    images = jnp.asarray(rng.standard_normal((4, 32, 32, 3)), jnp.float32)
    cotangent = jnp.asarray(rng.standard_normal((4, 16)), jnp.float32)

    def loss(params):
        embeddings = nnx.merge(graphdef, params)(images)
        return jnp.sum(embeddings * cotangent), embeddings

    default = jax.jit(jax.grad(loss, has_aux=True))(state)[::-1]
    with grouped_conv.forced("xla"):
        grouped = jax.jit(jax.grad(loss, has_aux=True))(state)[::-1]
    np.testing.assert_allclose(default[0], grouped[0], rtol=1e-5, atol=1e-5 * np.abs(grouped[0]).max())
    for path, got, want in zip(jax.tree_util.tree_leaves_with_path(default[1]), jax.tree.leaves(default[1]),
                               jax.tree.leaves(grouped[1])):
        np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-4 * (np.abs(want).max() + 1e-6),
                                   err_msg=jax.tree_util.keystr(path[0]))


@pytest.mark.gpu_target
def test_on_a_gpu_the_stem_is_a_dense_convolution_and_depthwise_layers_stay_grouped():
    """mbf's layers compiled for an H100 (no GPU needed): the 64 groups of 2 become one dense cuDNN convolution per
    pass; depthwise layers stay cuDNN's grouped ones; forced to XLA's form, the stem is grouped again."""
    import re

    from jaxcls.plan import gpu_target
    from jaxcls.plan.kernels import kernels

    placed = jax.sharding.SingleDeviceSharding(gpu_target.gpu_devices("h100", 1)[0])
    stem = conv(128, 128, 3, padding=1, groups=64, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), init=INIT)
    depthwise = conv(128, 128, 3, 2, padding=1, groups=128, dtype=jnp.bfloat16, rngs=nnx.Rngs(1), init=INIT)
    x = jax.ShapeDtypeStruct((8, 16, 16, 128), jnp.bfloat16, sharding=placed)

    def group_counts():  # feature_group_count of each cuDNN convolution, forward and gradients
        graphdef, state = nnx.split((stem, depthwise))
        state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=placed), state)

        def loss(state, x):
            first, second = nnx.merge(graphdef, state)
            return jnp.sum(second(first(x)).astype(jnp.float32) ** 2)
        text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(state, x).compile(gpu_target.COMPILE_OPTIONS).as_text()
        found = [k.detail for k in kernels(text) if k.kind == "cuDNN convolution"]
        return sorted(int(m.group(1)) if (m := re.search(r"feature_group_count=(\d+)", d)) else 1 for d in found)

    assert group_counts() == [1, 1, 1, 128, 128, 128]  # the stem's three passes dense; the depthwise layer's grouped
    with grouped_conv.forced("xla"):
        assert group_counts() == [64, 64, 64, 128, 128, 128]
