"""Mesh-independent checkpoints of global arrays with orbax.

Arrays are saved as global arrays (each process writes its shards), so a
checkpoint knows nothing of the mesh it came from. Restoring takes an abstract
tree of ``jax.ShapeDtypeStruct`` with the *new* shardings; row counts of
class-sharded arrays may differ from the saved ones, because the FC weight is
padded to a multiple of the class-shard count: extra saved rows (padding) are
dropped and missing ones are zero-filled. ``check_num_classes`` guards against
restoring a weight of another class count.
"""

from __future__ import annotations

import os

import jax
import numpy as np
import orbax.checkpoint as ocp


def restore_args(abstract_tree):
    """Orbax restore arguments placing every leaf in its target sharding, shape and dtype (rows pad/truncate)."""
    return jax.tree.map(lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding, global_shape=s.shape, dtype=s.dtype,
                                                       strict=False), abstract_tree)


def save(directory: str | os.PathLike, tree) -> None:
    """Save a pytree of global arrays to ``directory`` (blocking)."""
    with ocp.PyTreeCheckpointer() as checkpointer:
        checkpointer.save(os.path.abspath(directory), tree, force=True)


def restore(directory: str | os.PathLike, abstract_tree):
    """Restore into the shapes, dtypes and shardings of ``abstract_tree`` (any mesh)."""
    with ocp.PyTreeCheckpointer() as checkpointer:
        return checkpointer.restore(os.path.abspath(directory),
                                    args=ocp.args.PyTreeRestore(item=abstract_tree,
                                                                restore_args=restore_args(abstract_tree)))


def abstract_like(tree):
    """``ShapeDtypeStruct`` with sharding for every leaf of ``tree``."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def check_num_classes(saved: int, expected: int) -> None:
    if int(np.asarray(saved)) != expected:
        raise ValueError(f"checkpoint holds an FC of {int(np.asarray(saved))} classes, the config asks for {expected}")
