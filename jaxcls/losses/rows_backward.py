"""A tile's backward pass from the rows it picks by index: the embeddings' gradient, and one optimizer step on the rows
with their gradient formed where they are updated, each row written once (and read from memory once in the kernels'
form: its repeated reads there, a slice at a time per block of embeddings and once more for the rule, are meant to
hit L1/L2; not yet measured).

``tile_backward(arrays, index, where, e_n, lse, g, margin, gathered, keep, rule, *scalars)`` returns
``(d_e, arrays)``: the gradient ``[N, D]`` float32 of ``Σ_n g[n]·loss[n]`` w.r.t. ``e_n`` through the tile of rows
``index`` of ``arrays[0]`` (the weight), and ``arrays`` (the weight and its optimizer slots, all ``[C_local, ...]``)
with the rows ``index`` replaced where ``keep`` holds by ``rule(rows, (product, radial), index, *scalars)``, the
rows' gradient in ``tiles.tile_grad_parts``' two parts. Two forms compute it, the first in two variants:

- ``"pallas"`` (on CUDA GPUs, where ``KERNEL_ON_CUDA``, for an optimizer's update, not a gradient written; or when
  forced), in two variants. By default (``GEMMS_IN_KERNELS`` off, ``"pallas_update"``) XLA's GEMMs give ``d_e``
  (rounded as in XLA's form) and the rows' gradient parts from a gathered copy of the weight's rows, and only the
  update is a kernel: one program per block of rows reads the rows' product, the rows and their slots by index and
  stores the new rows in place, each row read and written once, with no loop over the batch. An H100 timed the r50
  step (batch 128, PartialFC 0.1) 6% faster at 8M classes with a float32 FC state and 11% faster at 36.9M with a
  bfloat16 one than in XLA's form (2026-11-27).
  With ``GEMMS_IN_KERNELS`` on (``"pallas"``) two Triton kernels read the rows by index and recompute each block's
  cosines and their gradient on chip from the tile's log-sum-exp (no ``[N, T]`` array and no ``[T, D]`` copy or
  gradient is written). The first gives ``d_e``: each program owns a block of embeddings and a share of the tile's
  rows, and writes its partial sum, which XLA adds. The second, one program per block of rows, sums the rows'
  gradient over the batch, applies ``rule`` in registers and stores the rows back in place. It runs after the first,
  which needs the rows as they were. ``d_e`` stays float32 over the whole tile. They move the fewest bytes, and an
  H100 timed them 2-3x slower than XLA's form per tile. (Two more variants, the rows' product multiplied in the
  update kernel and its factor from a kernel of its own, were timed slower than the update alone and removed.)
- ``"xla"`` (the default on every other platform, and for the loss's backward, which writes a gradient; always for
  rows a Triton block does not fit, and for rows replicated over mesh axes that hold other embeddings, whose gradient
  is a sum over devices that autodiff forms and no kernel sees): ``gathered()`` (the rows as the caller reads them),
  ``tiles.tile_grad_parts``, and per array a gather and a scatter (``array.at[index].set``).

Without ``keep`` only ``d_e`` is computed and ``arrays`` come back untouched. With ``reads=k`` the first ``k`` arrays
are only read (the loss's backward reads the weight and writes its gradient). ``forced(form)`` picks one form while
tracing; ``"pallas_interpret"`` runs the kernels in Pallas' interpreter on any platform (inside ``shard_map`` only
with ``check_vma=False``), which is how the tests hold them to XLA's form and to float64.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pallas_triton

from jaxcls.losses import rows_stats, tiles
from jaxcls.losses.kernel_forms import (block_batch, block_columns, block_index, compiler_params, kernel_forms,
                                        pad_rows, run, sliced_products)
from jaxcls.losses.margins import CombinedMargin
from jaxcls.mesh import varying_axes, varying_like

GRAD_BLOCK_BATCH = 16  # embeddings per program of the embeddings' gradient
GRAD_BLOCK_ROWS = 32  # rows it multiplies at a time
GRAD_PROGRAMS = 256  # it splits the tile's rows into shares until about this many programs run
GRAD_WARPS = 8  # Triton's warps per program
UPDATE_BLOCK_ROWS = 16  # rows per program of the update (its loop's Triton products need 16 or more); the looped
UPDATE_BLOCK_BATCH = 16  # update reads the whole batch, this many embeddings at a time (from L2: N·D a block of rows)
UPDATE_WARPS = 8
GRAD_BLOCK_DIM = UPDATE_BLOCK_DIM = 64  # the cosines' products take the embedding dimension in slices of this many
GRAD_STAGES = UPDATE_STAGES = 1  # Triton's software-pipelining stages of each kernel's loop
# Chosen by registers, compiled for an H100 (benchmarks/fc_kernels.py --registers): 128 a thread in both kernels, no
# spills, two programs an SM. Timed on an H100 for a 65,536-row tile at N = 128: the looped kernels at 2-3x XLA's form's
# time, the update kernel alone at 0.71-0.81x (2026-11-27); then the whole r50 step with the update kernel alone
# (docs/benchmarks.md, the fifth lease): 3,908 img/s against 3,691 at 8M classes, 2,494 against 2,251 at 36.9M.
KERNEL_ON_CUDA = True
GEMMS_IN_KERNELS = False  # True: the looped kernels form d_e and the rows' gradient too (the "pallas" variant)
# the kernel form's variants, by the benchmarks' --fc-kernels names: their values of VARIANT_FLAGS
VARIANT_FLAGS = ("GEMMS_IN_KERNELS",)
VARIANTS = {"pallas": (True,), "pallas_update": (False,)}
_FORM = kernel_forms("rows-backward form")
forced = _FORM.forced  # forced(form): within the block, trace every tile_backward in that form (None: by platform)

@contextmanager
def variant(name: str | None):
    """Within the block, trace the kernel form in ``VARIANTS[name]`` (None: as the module's constants are)."""
    before = tuple(globals()[n] for n in VARIANT_FLAGS)
    globals().update(zip(VARIANT_FLAGS, VARIANTS[name] if name else before))
    try:
        yield
    finally:
        globals().update(zip(VARIANT_FLAGS, before))


# A rule maps (rows: tuple of [B, ...] arrays as stored, (product [B, D], radial [B]), their indices [B], *scalars)
# to the new rows, as stored.
Rule = Callable[..., tuple]


def tile_backward(arrays: tuple, index, where: tiles.TileColumns, e_n, lse, g, margin: CombinedMargin,
                  gathered: Callable[[], jax.Array], keep=None, rule: Rule | None = None, *scalars, reads: int = 0):
    """``(d_e [N, D] float32, arrays)``, see the module docstring.

    ``index`` ``[T]`` int32 distinct local rows; ``where`` the tile's columns (``tiles.tile_columns``); ``e_n``
    ``[N, D]`` normalized embeddings in the compute dtype; ``lse``, ``g`` ``[N]`` float32; ``keep`` ``[T]`` bool;
    ``scalars``: 0-d arrays the rule needs (a learning rate, a step count). The first ``reads`` arrays are only read:
    the rule gets the rows of every array and returns those of the others, which alone are written (e.g. the weight
    read and its gradient written, ``sharded_margin_loss``' backward). Donate the written arrays to the enclosing jit
    to update them in place.
    """
    xla = partial(_xla_form, margin=margin, rule=rule, gathered=gathered, reads=reads)
    args = (arrays, index, where, e_n, lse, g, keep, *scalars)
    if not (rows_stats.fits_a_block(arrays[0], e_n) and all(w & (w - 1) == 0 for a in arrays for w in a.shape[1:])):
        return xla(*args)
    if keep is not None and varying_axes(e_n) - varying_axes(arrays[0]):
        # rows replicated over mesh axes that hold other embeddings (class_axes=('class',) with data > 1): their
        # gradient is a sum over those devices, which autodiff forms in XLA's form and no kernel sees
        return xla(*args)
    # a gradient written (reads > 0, the loss's backward) keeps XLA's form on GPUs: the kernel reads back the rows a
    # tile does not keep, which XLA's scatter drops (compiled for an H100: 24.7 GiB at C = 1M, N = 512, against 22.7)
    return run(_FORM, partial(_pallas_form, margin=margin, rule=rule, reads=reads, gathered=gathered), xla, *args,
               kernel_on_cuda=KERNEL_ON_CUDA and not reads)


def _xla_form(arrays, index, where, e_n, lse, g, keep, *scalars, margin, rule, gathered, reads, update=None):
    """XLA's GEMMs on the gathered rows (``tiles.tile_grad_parts``): ``(d_e, *row_grad)``; then ``update(arrays,
    index, row_grad, keep, scalars, rule, reads)``: XLA's gather and scatter (``_xla_update``), or the update kernel
    (``_update_given``)."""
    d_e, *row_grad = tiles.tile_grad_parts(e_n, gathered(), where, margin, lse, g)
    d_e = d_e.astype(jnp.float32)
    if keep is None:
        return d_e, arrays
    return d_e, (update or _xla_update)(arrays, index, tuple(row_grad), keep, scalars, rule, reads)


def _xla_update(arrays, index, row_grad, keep, scalars, rule, reads):
    old = tuple(a[index] for a in arrays)
    new = rule(old, row_grad, index, *scalars)
    if reads or arrays[0].dtype.itemsize >= 4:
        # rows not kept go to distinct indices past the end, which the scatter drops: outputs filled tile by tile never
        # hold them (a select would read each tile's old rows of the outputs for them), and XLA:GPU fuses the update
        # of a float32 weight and momentum into these scatters better than a select (28.9 KB a sampled row against
        # 32.8 at batch 128, D = 512; 34.4 against 38.3 at 512: benchmarks/fc_bytes_per_row.py --margin cosface)
        target = jnp.where(keep, index, arrays[0].shape[0] + jnp.arange(index.shape[0], dtype=index.dtype))
        return arrays[:reads] + tuple(a.at[target].set(n, mode="drop", unique_indices=True)
                                      for a, n in zip(arrays[reads:], new))
    # 16-bit rows (or their bits, on CPU) updated in place: the rule read the old rows, and the select of old and new
    # fuses into the scatters, 2.0 KB a sampled row less than dropping with a bfloat16 weight and momentum (18.1 KB
    # against 20.0 at batch 128, 23.5 against 25.5 at 512, CosFace)
    return tuple(a.at[index].set(jnp.where(keep[:, None], n, o), unique_indices=True)
                 for a, n, o in zip(arrays, new, old))  # (reads is 0)


def _pallas_form(arrays, index, where, e_n, lse, g, keep, *scalars, margin, rule, reads, gathered, interpret: bool):
    if not GEMMS_IN_KERNELS:
        return _xla_form(arrays, index, where, e_n, lse, g, keep, *scalars, margin=margin, rule=rule,
                         gathered=gathered, reads=reads, update=partial(_update_given, interpret=interpret))
    d_e = _embedding_grad(arrays[0], index, where, e_n, lse, g, margin, interpret)
    if keep is None:
        return d_e, arrays
    return d_e, arrays[:reads] + _update(arrays, index, where, e_n, lse, g, keep, scalars, margin, rule, reads,
                                         interpret)


def _embedding_grad(weight, index, where, e_n, lse, g, margin, interpret):
    n, d = e_n.shape
    batch_blocks = -(-n // GRAD_BLOCK_BATCH)
    shares = max(1, min(GRAD_PROGRAMS // batch_blocks, -(-index.shape[0] // GRAD_BLOCK_ROWS)))
    index = block_index(index, shares * GRAD_BLOCK_ROWS)  # padding rows: copies of the last, never kept
    where = block_columns(where, shares * GRAD_BLOCK_ROWS)
    e_n, rel, lse, g = block_batch(GRAD_BLOCK_BATCH, e_n, where.rel, lse, g)
    share = index.shape[0] // shares
    rows = pl.BlockSpec((share,), lambda b, s: (s,))
    batch = pl.BlockSpec((GRAD_BLOCK_BATCH,), lambda b, s: (b,))
    partial_sums = pl.pallas_call(
        partial(_embedding_grad_kernel, margin=margin),
        grid=(batch_blocks, shares),
        in_specs=[rows, rows, rows, batch, batch, batch, pl.BlockSpec((GRAD_BLOCK_BATCH, d), lambda b, s: (b, 0)),
                  pl.BlockSpec(weight.shape, lambda b, s: (0, 0))],
        out_specs=pl.BlockSpec((1, GRAD_BLOCK_BATCH, d), lambda b, s: (s, b, 0)),
        out_shape=varying_like(e_n, (shares, *e_n.shape), jnp.float32),
        interpret=interpret, name="rows_embedding_grad",
        compiler_params=compiler_params(interpret, GRAD_WARPS, GRAD_STAGES),
    )(index, where.columns, where.kept, rel, lse, g, e_n, weight)
    return jnp.sum(partial_sums, axis=0)[:n]


def _embedding_grad_kernel(index_ref, columns_ref, kept_ref, rel_ref, lse_ref, g_ref, e_ref, weight_ref, out_ref, *,
                           margin):
    e, rel, lse, g = e_ref[...], rel_ref[...], lse_ref[...], g_ref[...]
    dtype = tiles.gradient_product_dtype(e.dtype)

    def add_block(r, d_e):  # the gradient through GRAD_BLOCK_ROWS of this program's rows
        at = pl.ds(r * GRAD_BLOCK_ROWS, GRAD_BLOCK_ROWS)
        index = index_ref[at]
        products, squares = sliced_products(lambda columns: e_ref[:, columns],
                                            lambda columns: weight_ref[index, columns], e.shape[1], GRAD_BLOCK_DIM)
        where = tiles.TileColumns(rel, columns_ref[at], kept_ref[at])
        d_products, _ = tiles.cosine_grads(products, tiles.inverse_of_squares(squares), where, margin, lse, g)
        rows = weight_ref[index, :].astype(e.dtype).astype(dtype)
        return d_e + pallas_triton.dot(d_products.astype(dtype), rows).astype(jnp.float32)

    d_e = lax.fori_loop(0, index_ref.shape[0] // GRAD_BLOCK_ROWS, add_block, jnp.zeros(e.shape, jnp.float32))
    out_ref[...] = d_e[None]


def _update(arrays, index, where, e_n, lse, g, keep, scalars, margin, rule, reads, interpret):
    """The update kernel that sums the rows' gradient over the batch itself (``_summed_row_grad``)."""
    e_n, rel, lse, g = block_batch(UPDATE_BLOCK_BATCH, e_n, where.rel, lse, g)
    return _update_call(arrays, index, keep, (where.columns, where.kept), (rel, lse, g, e_n), scalars,
                        partial(_summed_row_grad, margin=margin), rule, reads, interpret)


def _update_given(arrays, index, row_grad, keep, scalars, rule, reads, interpret):
    """The update kernel on the rows' gradient parts that XLA's GEMMs formed (``tiles.tile_grad_parts``): ``arrays``
    with the written ones updated."""
    return arrays[:reads] + _update_call(arrays, index, keep, row_grad, (), scalars, _given_row_grad, rule, reads,
                                         interpret)


def _update_call(arrays, index, keep, by_row, whole, scalars, row_grad, rule, reads, interpret):
    """One program per ``UPDATE_BLOCK_ROWS`` rows of ``index``: ``row_grad(index, weight_ref, *by_row blocks, *whole)``
    gives their gradient parts, ``rule`` their new rows, stored in place where ``keep``. ``by_row``: ``[T, ...]``
    arrays read a block of rows at a time; ``whole``: arrays each program reads whole. The rows are padded to whole
    blocks with copies of the last (``pad_rows``), which store what it stores."""
    index = block_index(index, UPDATE_BLOCK_ROWS)
    by_row = tuple(pad_rows(x, UPDATE_BLOCK_ROWS) for x in (keep, *by_row))
    scalars = tuple(jnp.reshape(s, (1,)) for s in scalars)
    rows = lambda x: pl.BlockSpec((UPDATE_BLOCK_ROWS, *x.shape[1:]), lambda i: (i,) + (0,) * (x.ndim - 1))
    whole_spec = lambda x: pl.BlockSpec(x.shape, lambda i: (0,) * x.ndim)
    written = arrays[reads:]
    first_array = 1 + len(by_row) + len(whole) + len(scalars)
    return tuple(pl.pallas_call(
        partial(_update_kernel, row_grad=row_grad, rule=rule, num_by_row=len(by_row) - 1, num_whole=len(whole),
                num_scalars=len(scalars), num_written=len(written)),
        grid=(index.shape[0] // UPDATE_BLOCK_ROWS,),
        in_specs=[rows(x) for x in (index, *by_row)] + [whole_spec(x) for x in (*whole, *scalars, *arrays)],
        out_specs=[whole_spec(a) for a in written],
        out_shape=[varying_like(a) for a in written],
        input_output_aliases={first_array + reads + i: i for i in range(len(written))},
        interpret=interpret, name="rows_update",
        compiler_params=compiler_params(interpret, UPDATE_WARPS, UPDATE_STAGES),
    )(index, *by_row, *whole, *scalars, *arrays))


def _update_kernel(index_ref, keep_ref, *refs, row_grad, rule, num_by_row, num_whole, num_scalars, num_written):
    by_row, whole, refs = refs[:num_by_row], refs[num_by_row:num_by_row + num_whole], refs[num_by_row + num_whole:]
    scalar_refs, array_refs, out_refs = refs[:num_scalars], refs[num_scalars:-num_written], refs[-num_written:]
    index = index_ref[...]
    grad = row_grad(index, array_refs[0], *by_row, *whole)
    # the rows and slots as stored are read here, not held through _summed_row_grad's loop (255 registers and spills)
    old = tuple(a[index, :] for a in array_refs)
    new = rule(old, grad, index, *(s[0] for s in scalar_refs))
    keep = keep_ref[...]
    for out, n, o in zip(out_refs, new, old[len(old) - num_written:]):
        out[index, :] = jnp.where(keep[:, None], n, o)


def _given_row_grad(index, weight_ref, product_ref, radial_ref):
    return product_ref[...], radial_ref[...]


def _summed_row_grad(index, weight_ref, columns_ref, kept_ref, rel_ref, lse_ref, g_ref, e_ref, *, margin):
    """The rows' gradient parts summed over the batch, ``UPDATE_BLOCK_BATCH`` embeddings at a time, their cosines
    recomputed on chip."""
    batch, d = e_ref.shape
    dtype = tiles.gradient_product_dtype(e_ref.dtype)
    columns, kept = columns_ref[...], kept_ref[...]

    def add_block(b, sums):  # the rows' gradient parts through UPDATE_BLOCK_BATCH embeddings
        product, d_inverse, _ = sums
        at = pl.ds(b * UPDATE_BLOCK_BATCH, UPDATE_BLOCK_BATCH)
        products, squares = sliced_products(lambda dims: e_ref[at, dims], lambda dims: weight_ref[index, dims], d,
                                            UPDATE_BLOCK_DIM)  # the rows' slices come from L1/L2 after the first
        where = tiles.TileColumns(rel_ref[at], columns, kept)
        inverse = tiles.inverse_of_squares(squares)
        d_products, d_block = tiles.cosine_grads(products, inverse, where, margin, lse_ref[at], g_ref[at])
        e = e_ref[at, :].astype(dtype)
        product += pallas_triton.dot(d_products.astype(dtype), e, trans_a=True).astype(jnp.float32)
        return product, d_inverse + d_block, squares  # the rows' squared norms, the same in every block

    no_rows = jnp.zeros(index.shape, jnp.float32)
    product, d_inverse, squares = lax.fori_loop(0, batch // UPDATE_BLOCK_BATCH, add_block,
                                                (jnp.zeros((index.shape[0], d), jnp.float32), no_rows, no_rows))
    # carried out of the loop rather than recomputed from the rows read below: that held 174 registers, this 128
    inverse = tiles.inverse_of_squares(squares)
    return product.astype(dtype), tiles.radial_part(d_inverse, inverse, squares)
