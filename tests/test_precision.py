"""Precision policies: dtype names and dynamic loss scaling (torch GradScaler semantics)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcls.precision import (DynamicLossScale, all_finite, as_bits, bitcast, bits_dtype, compute_dtype,
                              select_tree)


def test_dtype_names():
    assert compute_dtype("bfloat16") == jnp.bfloat16 and compute_dtype("float16") == jnp.float16
    with pytest.raises(ValueError, match=r"unknown precision 'fp8'; choose one of \['bfloat16', 'float16', 'float32"):
        compute_dtype("fp8")


def test_all_finite_and_select_tree():
    assert bool(all_finite({"a": jnp.ones(3), "b": (jnp.zeros(2, jnp.bfloat16),)}))
    assert not bool(all_finite({"a": jnp.ones(3), "b": jnp.array([1.0, jnp.nan])}))
    picked = select_tree(jnp.bool_(False), {"a": jnp.ones(2)}, {"a": jnp.zeros(2)})
    np.testing.assert_array_equal(picked["a"], [0, 0])


class TestLossScale:
    scaler = DynamicLossScale(initial_scale=1024.0, growth_interval=3)

    def test_skips_nonfinite_step_and_halves(self):
        params = {"w": jnp.ones(3)}
        grads = {"w": jnp.array([1.0, jnp.inf, 2.0])}
        state = self.scaler.init()
        finite = all_finite(self.scaler.unscale(grads, state))
        new_params = select_tree(finite, jax.tree.map(lambda p, g: p - g, params, grads), params)
        assert not bool(finite)
        np.testing.assert_array_equal(new_params["w"], params["w"])
        state = self.scaler.adjust(state, finite)
        assert float(state.scale) == 512.0 and int(state.good_steps) == 0

    def test_grows_after_interval_of_finite_steps(self):
        state = self.scaler.init()
        scales = []
        for _ in range(7):
            state = self.scaler.adjust(state, jnp.bool_(True))
            scales.append(float(state.scale))
        assert scales == [1024, 1024, 2048, 2048, 2048, 4096, 4096]

    def test_a_growth_past_float32_is_not_taken(self):
        """As torch's GradScaler: the interval's count restarts, the scale stays (an inf scale would never recover:
        halved, it stays inf, and every step is skipped)."""
        top = DynamicLossScale(initial_scale=2.0**127, growth_interval=1)
        state = top.adjust(top.init(), jnp.bool_(True))
        assert float(state.scale) == 2.0**127 and int(state.good_steps) == 0
        assert float(top.adjust(state, jnp.bool_(False)).scale) == 2.0**126

    def test_unscale_divides_and_disabled_is_identity(self):
        state = self.scaler.init()
        g = self.scaler.unscale({"w": jnp.array([1024.0, 2048.0])}, state)
        np.testing.assert_array_equal(g["w"], [1.0, 2.0])
        off = DynamicLossScale(enabled=False)
        assert float(off.scale_loss(3.0, off.init())) == 3.0


@pytest.mark.parametrize("dtype, bits", [(jnp.bfloat16, jnp.uint16), (jnp.float8_e4m3fn, jnp.uint8),
                                         (jnp.float16, jnp.float16), (jnp.float32, jnp.float32), (jnp.int8, jnp.int8)],
                         ids=str)
def test_rows_xla_cpu_cannot_scatter_in_place_move_as_their_bits_and_back_bit_for_bit(dtype, bits, rng):
    x = jnp.asarray(rng.normal(size=(5, 7)) * 100).astype(dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        x = x.at[0, :3].set(jnp.array([jnp.nan, jnp.inf, -0.0], dtype))
    assert bits_dtype(dtype) == bits and as_bits(x).dtype == bits
    back = bitcast(as_bits(x), dtype)
    assert back.dtype == dtype and np.array_equal(np.asarray(back).view(np.uint8), np.asarray(x).view(np.uint8))
