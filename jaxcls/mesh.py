"""Layout: the device mesh and where every array of the FC and the batch lives on it.

The mesh has a ``data`` axis and a ``class`` axis. The backbone is data parallel over *every* device
(its batch is sharded over ``('data', 'class')``); the FC weight ``[C, D]`` is sharded over the
*class axes*: by default also every device (as arcface_torch and PLSC do), or ``('class',)`` alone,
replicating the weight over ``data``. Every module that places or splits an array asks this one.

Both axes are ``AxisType.Auto``, chosen deliberately: ``jax.make_mesh`` would default to
``Explicit``, which makes shardings part of every array's type and asks user backbones to annotate
reshapes and reductions. jaxcls spells out the one place where layout matters (the class-parallel
loss) with ``shard_map``, and lets jit's sharding propagation handle the data-parallel backbone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

DATA = "data"
CLASS = "class"
AXES = (DATA, CLASS)
DEFAULT_CLASS_AXES = AXES  # the FC split over every device
CLASS_AXES = {"data,class": AXES, "class": (CLASS,)}  # the config's names for the two layouts

BATCH = P(AXES)  # [N] over every device
BATCH_ROWS = P(AXES, None)  # [N, D] over every device
REPLICATED = P()


def make_mesh(data: int = 1, classes: int | None = None, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``(data, classes)`` mesh with axis names ``('data', 'class')``.

    Defaults put every device on the class axis (``data=1``), as arcface_torch does.
    Raises ``ValueError`` when ``data * classes`` is not the number of devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    if data < 1 or (classes is not None and classes < 1):
        raise ValueError(f"mesh sizes must be positive, got data={data}, classes={classes}")
    if classes is None:
        if n % data:
            raise ValueError(f"data={data} does not divide the {n} devices")
        classes = n // data
    if data * classes != n:
        raise ValueError(f"mesh data={data} x classes={classes} = {data * classes} devices, but {n} devices were given")
    return jax.make_mesh((data, classes), AXES, axis_types=(AxisType.Auto, AxisType.Auto), devices=devices)


def check_class_axes(mesh: Mesh, class_axes: Sequence[str]) -> tuple[str, ...]:
    """``class_axes`` as a tuple; raises ``ValueError`` for a name that is not an axis of ``mesh``."""
    class_axes = tuple(class_axes)
    for a in class_axes:
        if a not in mesh.axis_names:
            raise ValueError(f"class axis {a!r} is not a mesh axis {mesh.axis_names}")
    return class_axes


def data_axes(class_axes: Sequence[str]) -> tuple[str, ...]:
    """The mesh axes the FC weight is replicated over (``()`` with the default layout)."""
    return tuple(a for a in AXES if a not in tuple(class_axes))


def class_shards(mesh: Mesh, class_axes: Sequence[str] = DEFAULT_CLASS_AXES) -> int:
    """Number of blocks the FC weight's rows are split into."""
    return math.prod(mesh.shape[a] for a in class_axes)


def padded_num_classes(num_classes: int, shards: int) -> int:
    """Rows of a weight holding ``num_classes`` split evenly into ``shards`` (padding at the end)."""
    return -(-num_classes // shards) * shards


def weight_spec(class_axes: Sequence[str] = DEFAULT_CLASS_AXES) -> P:
    """``P(class_axes, None)``: an FC weight ``[C_pad, D]`` (or its optimizer slots, or sampled rows)."""
    return P(tuple(class_axes), None)


def row_spec(class_axes: Sequence[str] = DEFAULT_CLASS_AXES) -> P:
    """``P(class_axes)``: one value per FC row, e.g. the class id of each sampled row."""
    return P(tuple(class_axes))


def weight_sharding(mesh: Mesh, class_axes: Sequence[str] = DEFAULT_CLASS_AXES) -> NamedSharding:
    """``P(class_axes, None)`` on ``mesh``: rows split over the class axes, replicated over the rest."""
    return NamedSharding(mesh, weight_spec(class_axes))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of a batch (leading axis) over every device: ``P(('data', 'class'))``."""
    return NamedSharding(mesh, BATCH)


def replicated(mesh: Mesh) -> NamedSharding:
    """A fully replicated sharding on ``mesh``."""
    return NamedSharding(mesh, REPLICATED)


def varying_like(x, shape=None, dtype=None) -> jax.ShapeDtypeStruct:
    """``shape`` and ``dtype`` (default ``x``'s) varying, inside ``shard_map``, over the mesh axes ``x`` varies over:
    what a Pallas call's ``out_shape`` needs there (JAX 0.10 names those axes ``manual_axis_type``, earlier ones
    ``vma``)."""
    aval, shape, dtype = jax.typeof(x), x.shape if shape is None else shape, x.dtype if dtype is None else dtype
    if hasattr(aval, "manual_axis_type"):
        return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=aval.manual_axis_type)
    return jax.ShapeDtypeStruct(shape, dtype, vma=aval.vma)


def on_cpu(mesh: Mesh) -> bool:
    """Whether ``mesh``'s devices are CPUs (where some dtypes need ``precision.cpu_scatter_converts``' workaround)."""
    return mesh.devices.flat[0].platform == "cpu"


def varying_axes(x) -> frozenset:
    """The mesh axes ``x`` varies over inside ``shard_map`` (empty outside)."""
    aval = jax.typeof(x)
    return aval.manual_axis_type.varying if hasattr(aval, "manual_axis_type") else frozenset(aval.vma)


def host_rows(mesh: Mesh, global_batch: int) -> tuple[int, int]:
    """``(start, stop)``: the rows of a global batch that this process's devices hold in the batch sharding.

    Raises ``ValueError`` when they are not one contiguous block (a mesh whose device order interleaves hosts).
    """
    index_map = batch_sharding(mesh).addressable_devices_indices_map((global_batch,))
    rows = sorted({r for index in index_map.values() for r in range(*index[0].indices(global_batch))})
    if rows != list(range(rows[0], rows[-1] + 1)):
        raise ValueError(f"process {jax.process_index()}'s devices hold rows {rows} of the global batch: not one "
                         "contiguous block; order the mesh's devices host by host")
    return rows[0], rows[-1] + 1


def state_shardings(state: dict, mesh: Mesh, class_axes) -> dict:
    """FC weight and its per-row optimizer slots: ``P(class_axes, None)``; everything else replicated."""
    shardings = jax.tree.map(lambda _: replicated(mesh), state)
    fc = weight_sharding(mesh, class_axes)
    shardings["weight"] = fc
    shardings["fc_opt"] = state["fc_opt"]._replace(slots=tuple(fc for _ in state["fc_opt"].slots),
                                                   count=replicated(mesh))
    return shardings
