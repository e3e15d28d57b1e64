"""The device mesh: a ``data`` axis and a ``class`` axis.

The backbone is data parallel over *every* device (its batch is sharded over
``('data', 'class')``); the FC weight ``[C, D]`` is sharded over the class axes
(by default also every device, as arcface_torch and PLSC do).

Both axes are ``AxisType.Auto``, chosen deliberately: ``jax.make_mesh`` would
default to ``Explicit``, which makes shardings part of every array's type and
asks user backbones to annotate reshapes and reductions. jaxcls spells out
the one place where layout matters (the class-parallel loss) with
``shard_map``, and lets jit's sharding propagation handle the data-parallel
backbone.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

DATA = "data"
CLASS = "class"
AXES = (DATA, CLASS)


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


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of a batch (leading axis) over every device: ``P(('data', 'class'))``."""
    return NamedSharding(mesh, P(AXES))


def replicated(mesh: Mesh) -> NamedSharding:
    """A fully replicated sharding on ``mesh``."""
    return NamedSharding(mesh, P())
