"""Mesh-independent checkpoints of global arrays with orbax: single trees, and a run's checkpoint series.

Arrays are saved as global arrays (each process writes its shards), so a checkpoint knows nothing of
the mesh it came from. Restoring takes an abstract tree of ``jax.ShapeDtypeStruct`` with the *new*
shardings; row counts of class-sharded arrays may differ from the saved ones, because the FC weight is
padded to a multiple of the class-shard count: extra saved rows (padding) are dropped and missing ones
are zero-filled. That re-padding is the only difference a run's restore accepts (``RunCheckpoints.restore``
refuses any other, naming the arrays); ``check_num_classes`` guards against a weight of another class count.

``RunCheckpoints`` is a run's ``<workdir>/checkpoints``: every save holds the whole train state and the
data iterator's position, written asynchronously, the last ``keep`` kept. A save that fails in the
background is raised at the next ``check()`` as one ``CheckpointError`` naming the step folder and the
cause, and its partial folder is removed.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxcls.config import from_json
from jaxcls.reporting import one_line


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


# state keys whose leading (row) dimension is the padded class count, re-padded for the mesh on restore
CLASS_ROWS = ("weight", "fc_opt")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written, or that does not fit the run restoring it."""


def run_config(workdir: str | os.PathLike):
    """The config a jaxcls run in ``workdir`` saved (``config.json``); ``CheckpointError`` if there is none."""
    path = Path(workdir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{workdir} is not a jaxcls run: it has no config.json")
    return from_json(path.read_text())


def restore_args(abstract_tree):
    """Orbax restore arguments placing every leaf in its target sharding, shape and dtype (rows pad/truncate)."""
    return jax.tree.map(lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding, global_shape=s.shape, dtype=s.dtype,
                                                       strict=False), abstract_tree)


def _named_leaves(tree) -> dict:
    """``{"params/block1/conv/kernel": leaf}`` (namedtuple fields and dict keys alike)."""
    def name(path):
        return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)
    return {name(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def mismatches(saved_metadata, abstract_tree) -> list[str]:
    """How ``abstract_tree`` differs from a checkpoint's metadata tree: missing or extra arrays, other shapes or
    dtypes; only the rows of ``CLASS_ROWS`` arrays may differ. Empty when it restores exactly."""
    saved, wanted = _named_leaves(saved_metadata), _named_leaves(abstract_tree)
    as_saved = lambda s: (jax.eval_shape(jax.random.key_data, s)  # PRNG keys are stored as their raw data
                          if jax.dtypes.issubdtype(s.dtype, jax.dtypes.prng_key) else s)
    wanted = {k: as_saved(v) for k, v in wanted.items()}
    out = [f"{k}: not in the checkpoint" for k in wanted if k not in saved]
    out += [f"{k}: in the checkpoint, not in this run" for k in saved if k not in wanted]
    for k in wanted.keys() & saved.keys():
        (old_shape, old_dtype), new = (tuple(saved[k].shape), str(saved[k].dtype)), wanted[k]
        rows_free = k.split("/")[0] in CLASS_ROWS and len(old_shape) == len(new.shape) > 0
        compared = slice(1 if rows_free else 0, None)
        if old_shape[compared] != tuple(new.shape)[compared] or len(old_shape) != len(new.shape):
            out.append(f"{k}: shape {old_shape} in the checkpoint, {tuple(new.shape)} in this run")
        if old_dtype != str(new.dtype):  # str: PRNG key dtypes are not numpy dtypes
            out.append(f"{k}: dtype {old_dtype} in the checkpoint, {new.dtype} in this run")
    return sorted(out, key=lambda line: (not line.startswith("params/"), line))  # the backbone's first


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


def typed_keys(tree, abstract_tree):
    """``tree`` with the PRNG keys of ``abstract_tree`` typed again (orbax restores their raw uint32 data), so a
    restored state has the types of a fresh one and runs a step compiled for ``abstract_tree``."""
    def typed(abstract, x):
        if not jax.dtypes.issubdtype(abstract.dtype, jax.dtypes.prng_key) or x.dtype == abstract.dtype:
            return x
        key = jax.random.wrap_key_data(x)  # the default implementation, which made the run's keys
        if key.dtype != abstract.dtype:
            raise CheckpointError(f"a PRNG key of type {abstract.dtype} was saved; this JAX makes {key.dtype}")
        return key
    return jax.tree.map(typed, abstract_tree, tree)


def check_num_classes(saved: int, expected: int) -> None:
    if int(np.asarray(saved)) != expected:
        raise ValueError(f"checkpoint holds an FC of {int(np.asarray(saved))} classes, the config asks for {expected}")


def remove_unfinished_saves(directory: str | os.PathLike, step: int | str = "*") -> list[str]:
    """Remove the folders of saves (of ``step``, default every step) that never completed in ``directory`` (a failed
    save, or a process killed mid-save, leaves its ``<step>.orbax-checkpoint-tmp-*`` folder, as large as a whole
    state); their names. Only for the one writer of the folder (the trainer holding the workdir's lock)."""
    removed = sorted(Path(directory).glob(f"{step}.orbax-checkpoint-tmp*"))
    for partial in removed:
        shutil.rmtree(partial, ignore_errors=True)
    return [p.name for p in removed]


class RunCheckpoints:
    """``directory/<step>/{state,data}``: the train state (any mesh on restore) and the data position (JSON)."""

    def __init__(self, directory: str | os.PathLike, keep: int, read_only: bool = False):
        """``read_only``: another run's checkpoints, read and never written (no folder made where there is none)."""
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True,
                                               create=not read_only, read_only=read_only)
        self.manager = ocp.CheckpointManager(
            self.directory, options=options,
            item_handlers={"state": _handler(), "data": ocp.JsonCheckpointHandler()})
        self.saving = None  # the step of the save in flight

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: dict, data_position: dict) -> None:
        """Start an asynchronous save of ``state`` and the data iterator's ``data_position`` (after checking the
        previous one)."""
        self.check(wait=True)
        self.saving = step
        try:
            self.manager.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state),
                                                            data=ocp.args.JsonSave(data_position)))
        except Exception as e:  # failed before going to the background
            self._failed(step, e)

    def _failed(self, step: int, error: Exception):
        """Remove what the failed save of ``step`` left and raise it as a ``CheckpointError``."""
        self.saving = None
        if jax.process_index() == 0:
            remove_unfinished_saves(self.directory, step)
        self.manager.reload()
        raise CheckpointError(f"saving checkpoint {self.directory / str(step)} failed: {one_line(error)}") from error

    def check(self, wait: bool = False) -> None:
        """Raise ``CheckpointError`` if the save in flight has failed (``wait``: wait for it to end first)."""
        if self.saving is None or (not wait and self.manager.is_saving_in_progress()):
            return
        try:
            self.manager.wait_until_finished()
        except Exception as e:  # orbax re-raises whatever its writer thread met (OSError, tensorstore errors, ...)
            self._failed(self.saving, e)
        self.saving = None

    def restore(self, abstract_state: dict, step: int | None = None, parts: tuple[str, ...] | None = None):
        """``(state, data position)`` of ``step`` (default: the latest) placed as ``abstract_state`` says, which
        must match the saved arrays exactly but for the rows of the FC (else ``CheckpointError`` listing the
        differences). ``parts``: restore only these top-level keys of the state (no data position)."""
        step = self.latest_step() if step is None else step
        if step is None or step not in self.manager.all_steps():
            raise CheckpointError(f"no checkpoint {'' if step is None else step} in {self.directory}")
        wanted = abstract_state if parts is None else {k: abstract_state[k] for k in parts}
        saved = self.manager.item_metadata(step)["state"]
        if parts is not None:
            saved = {k: v for k, v in _items(saved) if k in parts}
        problems = mismatches(saved, wanted)
        if problems:
            raise CheckpointError(f"checkpoint {self.directory / str(step)} does not fit this run: "
                                  + "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8
                                                               else ""))
        state_args = ocp.args.PyTreeRestore(item=wanted, restore_args=restore_args(wanted),
                                            partial_restore=parts is not None)
        if parts is not None:
            return typed_keys(self.manager.restore(step, args=ocp.args.Composite(state=state_args)).state, wanted), None
        restored = self.manager.restore(step, args=ocp.args.Composite(state=state_args, data=ocp.args.JsonRestore()))
        return typed_keys(restored.state, wanted), restored.data

    def close(self) -> None:
        """Wait for the last save to be complete on disk (``CheckpointError`` if it failed), release the manager."""
        try:
            self.check(wait=True)
        finally:
            self.manager.close()


def _items(metadata_tree):
    """Top-level ``(key, subtree)`` pairs of a checkpoint's metadata tree."""
    tree = getattr(metadata_tree, "tree", metadata_tree)
    return tree.items()
