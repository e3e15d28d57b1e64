"""``jaxcls.fc.rows_update``: the Pallas kernel (run by Pallas' interpreter here) and XLA's form update the rows as
the float64 optimizers do, and nothing else. (Pallas' interpreter cannot run inside ``shard_map``, where FCHead.step
calls it: test_fc holds the step to float64 with XLA's form, which takes the same rule, and test_gpu_target finds the
kernel in the step compiled for an H100.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcls.fc import rows_update
from jaxcls.fc.head import optimizer_rule
from jaxcls.fc.optimizers import adamw, decode, encode, sgd
from reference import adamw_step, sgd_step

STEPS = {"sgd": (sgd, sgd_step), "adamw": (adamw, adamw_step)}
# (optimizer, weight dtype, state dtype)
CASES = [("sgd", jnp.float32, jnp.float32), ("sgd", jnp.bfloat16, jnp.bfloat16), ("sgd", jnp.bfloat16, jnp.int8),
         ("adamw", jnp.float32, jnp.float32)]


def draw_rows(rng, name, weight_dtype, state_dtype, c, d, t):
    """Random weight and state ``[c, d]`` as stored, ``t`` distinct sorted rows, their gradients' parts (``[t, d]``
    and ``[t]``) and a keep mask."""
    optimizer = STEPS[name][0](state_dtype=state_dtype)
    weight = jnp.asarray(rng.normal(size=(c, d)), weight_dtype)
    moments = [rng.normal(size=(c, d)) ** (i + 1) for i in range(optimizer.num_slots)]  # AdamW's nu >= 0
    slots = tuple(a for m in moments for a in encode(jnp.asarray(m, jnp.float32), jnp.dtype(state_dtype)))
    index = jnp.asarray(np.sort(rng.choice(c, t, replace=False)), jnp.int32)
    row_grad = jnp.asarray(rng.normal(size=(t, d)), weight_dtype), jnp.asarray(rng.normal(size=t), jnp.float32)
    keep = jnp.asarray(rng.random(t) < 0.8)
    return optimizer, (weight, *slots), index, row_grad, keep


def updated(form, optimizer, arrays, index, row_grad, keep, lr, count):
    with rows_update.forced(form):
        step = jax.jit(lambda *a: rows_update.update_rows(*a[:4], optimizer_rule(optimizer), *a[4:]))
        return step(arrays, index, row_grad, keep, jnp.float32(lr), jnp.int32(count))


def as_float64(arrays, per_slot):
    """Weight and decoded slots as float64 numpy."""
    weight, *slots = arrays
    return [np.asarray(weight, np.float64)] + [np.asarray(decode(tuple(slots[i:i + per_slot])), np.float64)
                                               for i in range(0, len(slots), per_slot)]


@pytest.mark.parametrize("name,weight_dtype,state_dtype", CASES, ids=str)
def test_both_forms_step_the_kept_rows_as_the_float64_optimizer_and_leave_the_rest(name, weight_dtype, state_dtype,
                                                                                   rng):
    c, d, t = int(rng.integers(40, 90)), 32, int(rng.integers(9, 30))  # t rarely a multiple of the kernel's 8 rows
    optimizer, arrays, index, row_grad, keep = draw_rows(rng, name, weight_dtype, state_dtype, c, d, t)
    lr, count = float(rng.uniform(0.01, 0.5)), int(rng.integers(1, 20))
    per_slot = (len(arrays) - 1) // optimizer.num_slots
    before = as_float64(arrays, per_slot)
    rows, kept = np.asarray(index), np.asarray(keep)
    product, radial = (np.asarray(x, np.float64) for x in row_grad)
    grads = product - radial[:, None] * before[0][rows]
    grads = np.asarray(jnp.asarray(grads, weight_dtype), np.float64)  # the optimizer takes it as stored
    ref = STEPS[name][1](before[0][rows], [s[rows] for s in before[1:]], grads, lr, count)
    ref = [ref[0], *ref[1]]
    results = {form: updated(form, optimizer, arrays, index, row_grad, keep, lr, count)
               for form in ("xla", "pallas_interpret")}
    for form, new in results.items():
        for got, want, dtype in zip(as_float64(new, per_slot), ref, [weight_dtype] + [state_dtype] * len(ref[1:])):
            # float32 arithmetic, then one rounding to the storage dtype (an int8 code step: 1/127 of the row's
            # largest magnitude)
            got, want = got[rows[kept]], want[kept]
            one_step = (np.abs(want).max(axis=1, keepdims=True) / 127 if dtype == jnp.int8 else
                        np.abs(want) * float(jnp.finfo(dtype).eps))
            assert np.all(np.abs(got - want) <= 1.01 * one_step + 1e-4 * np.abs(want).max()), (form, dtype)
        untouched = np.setdiff1d(np.arange(c), rows[kept])  # unlisted rows and listed rows not kept: bit for bit
        for a, b in zip(new, arrays):
            assert a.dtype == b.dtype and np.array_equal(np.asarray(a)[untouched], np.asarray(b)[untouched]), form
    for a, b in zip(*results.values()):  # the same rule on the same rows: the forms agree to a rounding
        step = np.abs(np.asarray(b, np.float64)).max() * float(jnp.finfo(b.dtype).eps if jnp.issubdtype(
            b.dtype, jnp.floating) else 1)
        assert np.all(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)) <= step)


def test_the_kernel_is_used_only_where_it_can_be(rng):
    optimizer, arrays, index, (product, radial), keep = draw_rows(rng, "sgd", jnp.float32, jnp.float32, 20, 12, 5)
    trace = lambda form, arrays, product: str(jax.make_jaxpr(lambda *a: updated(form, optimizer, *a, 0.1, 1))(
        arrays, index, (product, radial), keep))
    assert "pallas_call" not in trace("pallas_interpret", arrays, product)  # rows of 12: no Triton block
    square = tuple(a[:, :8] for a in arrays), product[:, :8]
    assert "pallas_call" in trace("pallas_interpret", *square)
    assert "pallas_call" not in trace("xla", *square)
    with pytest.raises(ValueError, match="unknown rows-update form 'triton': expected one of xla, "):
        with rows_update.forced("triton"):
            pass
