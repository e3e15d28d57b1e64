"""Random problems shared by several test files."""

from functools import partial

import jax
import numpy as np

from jaxcls import batch_sharding
from jaxcls.losses import init_weight
from jaxcls.fc.sampling import sample_classes


def draw(rng, mesh, c, n, rate, class_axes=("data", "class"), key=None):
    rows = init_weight(jax.random.key(0), c, 4, mesh, class_axes).shape[0]
    labels = jax.device_put(rng.integers(0, c, size=n).astype(np.int32), batch_sharding(mesh))
    key = jax.random.key(int(rng.integers(2**31))) if key is None else key
    f = jax.jit(partial(sample_classes, mesh=mesh, num_classes=c, num_rows=rows, sample_rate=rate,
                        class_axes=class_axes))
    return labels, f(key, labels), rows


def global_rows(sample_rows, rows, shards):
    """The global row of each sampled row: ``sample_rows`` holds local indices, shard after shard, of a weight of
    ``rows`` rows split into ``shards`` class shards."""
    return np.asarray(sample_rows) + np.repeat(np.arange(shards) * (rows // shards), len(sample_rows) // shards)
