"""One optimizer step on rows picked by index, written back in place: each row read once and written once.

``update_rows(arrays, index, inputs, keep, rule, *scalars)`` replaces, in every array of ``arrays`` (the weight and
its optimizer slots, all ``[C_local, ...]`` with the same rows), the rows ``index`` where ``keep`` holds by what
``rule`` makes of them and of ``inputs`` (per row: the parts of the rows' gradient). Two forms compute it, chosen by
platform (``lax.platform_dependent``):

- ``"pallas"`` (CUDA GPUs): a Triton kernel that loads each block of rows by index from every array, applies the
  rule in registers and stores them back. XLA's form, a gather and a scatter per array, re-reads the gathered rows
  of every array in each scatter fusion, and with a float32 state materializes the new slot before scattering
  (``benchmarks/fc_bytes_per_row.py``, compiled for an H100: 7.9 KB a sampled row for a bfloat16 weight and momentum
  where the kernel moves 5, with the gradient's product read).
- ``"xla"`` (every other platform, and rows whose width is not a power of two, which Triton blocks need):
  ``array.at[index].set(...)``.

``forced(form)`` picks one form while tracing; ``"pallas_interpret"`` runs the kernel in Pallas' interpreter on any
platform (outside ``shard_map`` only), which is how the tests hold it to XLA's form and to float64.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxcls.fc.kernel_forms import block_index, compiler_params, kernel_forms, run
from jaxcls.mesh import varying_like

BLOCK_ROWS = 8  # rows per kernel program: with D = 512 and float32 AdamW, five [8, 512] arrays fit in registers
_FORM = kernel_forms("rows-update form")
forced = _FORM.forced  # forced(form): within the block, trace every update_rows in that form (None: by platform)

# A rule maps (rows: tuple of [B, ...] arrays as stored, inputs: tuple of [B, ...] arrays, *scalars) to the new
# rows, as stored.
Rule = Callable[..., tuple]


def update_rows(arrays: tuple, index: jax.Array, inputs: tuple, keep: jax.Array, rule: Rule, *scalars) -> tuple:
    """``arrays`` with the rows ``index`` (``[T]`` int32, distinct, in ``[0, C_local)``) replaced where ``keep``
    (``[T]`` bool) by ``rule(tuple(a[index] for a in arrays), inputs, *scalars)``; other rows untouched.

    ``inputs``: arrays ``[T]`` or ``[T, D]``, row ``t`` going with ``index[t]``; ``scalars``: 0-d arrays the rule
    needs (a learning rate, a step count). Donate ``arrays`` to the enclosing jit to update them in place.
    """
    xla, args = partial(_xla_form, rule=rule), (arrays, index, inputs, keep, *scalars)
    if not _fits_a_block(arrays + inputs):
        return xla(*args)
    return run(_FORM, partial(_pallas_form, rule=rule), xla, *args)


def _fits_a_block(arrays) -> bool:
    """Triton blocks are powers of two: every row width must be one."""
    return all(w & (w - 1) == 0 for a in arrays for w in a.shape[1:])


def _xla_form(arrays, index, inputs, keep, *scalars, rule):
    old = tuple(a[index] for a in arrays)
    new = rule(old, inputs, *scalars)
    return tuple(a.at[index].set(jnp.where(keep[:, None], n, o), unique_indices=True)
                 for a, n, o in zip(arrays, new, old))


def _pallas_form(arrays, index, inputs, keep, *scalars, rule, interpret: bool):
    index = block_index(index, BLOCK_ROWS)  # padding repeats the last row: both copies store the same values
    pad = index.shape[0] - keep.shape[0]
    keep, *inputs = (jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1), mode="edge") for x in (keep, *inputs))
    scalars = tuple(jnp.reshape(s, (1,)) for s in scalars)
    by_block = lambda shape: pl.BlockSpec((BLOCK_ROWS, *shape[1:]), lambda i: (i,) + (0,) * (len(shape) - 1))
    whole = lambda shape: pl.BlockSpec(shape, lambda i: (0,) * len(shape))
    kernel = partial(_kernel, rule=rule, num_inputs=len(inputs), num_scalars=len(scalars), num_arrays=len(arrays))
    first_array = 2 + len(inputs) + len(scalars)
    return tuple(pl.pallas_call(
        kernel, grid=(index.shape[0] // BLOCK_ROWS,),
        in_specs=[by_block(index.shape), by_block(keep.shape), *(by_block(x.shape) for x in inputs),
                  *(whole(s.shape) for s in scalars), *(whole(a.shape) for a in arrays)],
        out_specs=[whole(a.shape) for a in arrays],
        out_shape=[varying_like(a) for a in arrays],
        input_output_aliases={first_array + i: i for i in range(len(arrays))},
        interpret=interpret, name="rows_update",
        compiler_params=compiler_params(interpret),
    )(index, keep, *inputs, *scalars, *arrays))


def _kernel(index_ref, keep_ref, *refs, rule, num_inputs, num_scalars, num_arrays):
    input_refs, scalar_refs = refs[:num_inputs], refs[num_inputs:num_inputs + num_scalars]
    array_refs, out_refs = refs[num_inputs + num_scalars:-num_arrays], refs[-num_arrays:]
    index, keep = index_ref[...], keep_ref[...]
    old = tuple(a[index, :] for a in array_refs)
    new = rule(old, tuple(x[...] for x in input_refs), *(s[0] for s in scalar_refs))
    for out, n, o in zip(out_refs, new, old):
        out[index, :] = jnp.where(keep[:, None], n, o)
