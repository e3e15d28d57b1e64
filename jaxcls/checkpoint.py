"""Mesh-independent checkpoints of global arrays with orbax: single trees, and a run's checkpoint series.

Arrays are saved as global arrays (each process writes its shards), so a checkpoint knows nothing of
the mesh it came from. Restoring takes an abstract tree of ``jax.ShapeDtypeStruct`` with the *new*
shardings; row counts of class-sharded arrays may differ from the saved ones, because the FC weight is
padded to a multiple of the class-shard count: extra saved rows (padding) are dropped and missing ones
are zero-filled. ``check_num_classes`` guards against restoring a weight of another class count.

``RunCheckpoints`` is a run's ``<workdir>/checkpoints``: every save holds the whole train state and the
data iterator's position, written asynchronously, the last ``keep`` kept.
"""

from __future__ import annotations

import os

import jax
import numpy as np
import orbax.checkpoint as ocp


def _handler() -> ocp.PyTreeCheckpointHandler:
    """Orbax's pytree handler, each array written by its first replica: orbax would otherwise, on every backend
    but GPU, slice replicated arrays among their replicas, one small compiled slice per array and device
    (seconds per save of an 8-device CPU mesh, and nothing to gain within one host)."""
    th = ocp.type_handlers
    registry = ocp.type_handlers.create_type_handler_registry(
        (jax.Array, th.ArrayHandler(use_replica_parallel=False)), (np.ndarray, th.NumpyHandler()),
        (int, th.ScalarHandler()), (float, th.ScalarHandler()), (np.number, th.ScalarHandler()),
        (str, th.StringHandler()))
    return ocp.PyTreeCheckpointHandler(type_handler_registry=registry)


def restore_args(abstract_tree):
    """Orbax restore arguments placing every leaf in its target sharding, shape and dtype (rows pad/truncate)."""
    return jax.tree.map(lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding, global_shape=s.shape, dtype=s.dtype,
                                                       strict=False), abstract_tree)


def save(directory: str | os.PathLike, tree) -> None:
    """Save a pytree of global arrays to ``directory`` (blocking)."""
    with ocp.Checkpointer(_handler()) as checkpointer:
        checkpointer.save(os.path.abspath(directory), args=ocp.args.PyTreeSave(tree), force=True)


def restore(directory: str | os.PathLike, abstract_tree):
    """Restore into the shapes, dtypes and shardings of ``abstract_tree`` (any mesh)."""
    with ocp.Checkpointer(_handler()) as checkpointer:
        return checkpointer.restore(os.path.abspath(directory),
                                    args=ocp.args.PyTreeRestore(item=abstract_tree,
                                                                restore_args=restore_args(abstract_tree)))


def abstract_like(tree):
    """``ShapeDtypeStruct`` with sharding for every leaf of ``tree``."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def check_num_classes(saved: int, expected: int) -> None:
    if int(np.asarray(saved)) != expected:
        raise ValueError(f"checkpoint holds an FC of {int(np.asarray(saved))} classes, the config asks for {expected}")


class RunCheckpoints:
    """``directory/<step>/{state,data}``: the train state (any mesh on restore) and the data position (JSON)."""

    def __init__(self, directory: str | os.PathLike, keep: int):
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True)
        self.manager = ocp.CheckpointManager(
            os.path.abspath(directory), options=options,
            item_handlers={"state": _handler(), "data": ocp.JsonCheckpointHandler()})

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: dict, data_position: dict) -> None:
        """Start an asynchronous save of ``state`` and the data iterator's ``data_position``."""
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state),
                                                        data=ocp.args.JsonSave(data_position)))

    def restore(self, abstract_state: dict, step: int | None = None) -> tuple[dict, dict]:
        """``(state, data position)`` of ``step`` (default: the latest) placed as ``abstract_state`` says."""
        step = self.latest_step() if step is None else step
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.PyTreeRestore(item=abstract_state, restore_args=restore_args(abstract_state)),
            data=ocp.args.JsonRestore()))
        return restored.state, restored.data

    def close(self) -> None:
        """Wait for the last save to be complete on disk, then release the manager."""
        self.manager.wait_until_finished()
        self.manager.close()
