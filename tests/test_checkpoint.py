"""Mesh-independent checkpoints: FC trees onto other meshes, and a run's checkpoint series with its data position."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxcls import checkpoint, make_mesh, weight_sharding
from jaxcls.losses import init_weight
from jaxcls.fc.optimizers import SparseState, adamw, sgd


ADAMW, SGD_INT8 = partial(adamw, state_dtype=jnp.float32), partial(sgd, state_dtype=jnp.int8)  # bfloat16 weight


@pytest.mark.parametrize("target, optimizer", [((2, 4, 8), ADAMW), ((1, 4, 4), ADAMW),
                                               ((1, 3, 3), ADAMW), ((1, 3, 3), SGD_INT8)],
                         ids=["(2,4)", "4 devices", "3 devices", "3 devices, int8 momentum"])
def test_fc_checkpoint_restores_onto_another_mesh(target, optimizer, tmp_path, rng):
    c, d = 37, 8  # padded to 40 rows on 8 shards, 40 on 4, 39 on 3
    mesh = make_mesh(1, 8)
    weight = init_weight(jax.random.key(1), c, d, mesh, dtype=jnp.bfloat16, stddev=1.0)
    state = optimizer().init(weight)
    real_rows = (np.arange(weight.shape[0]) < c)[:, None]  # padding rows hold zeros, as in training
    state = SparseState(tuple(jax.device_put((rng.normal(size=s.shape) * real_rows).astype(s.dtype), s.sharding)
                              for s in state.slots), jnp.int32(17))
    tree = {"weight": weight, "opt": state, "num_classes": jnp.int32(c)}
    checkpoint.save(tmp_path / "fc", tree)

    data, classes, n = target
    new_mesh = make_mesh(data, classes, devices=jax.devices()[:n])
    new_weight = init_weight(jax.random.key(9), c, d, new_mesh, dtype=jnp.bfloat16)
    abstract = checkpoint.abstract_like({"weight": new_weight, "opt": optimizer().init(new_weight),
                                         "num_classes": jnp.int32(0)})
    restored = checkpoint.restore(tmp_path / "fc", abstract)
    checkpoint.check_num_classes(restored["num_classes"], c)
    assert restored["weight"].sharding.is_equivalent_to(weight_sharding(new_mesh), 2)
    for old, new in zip(jax.tree.leaves(tree), jax.tree.leaves(restored)):
        if old.ndim == 2:
            np.testing.assert_array_equal(np.asarray(new)[:c], np.asarray(old)[:c])
            assert np.all(np.asarray(new)[c:] == 0)
        else:
            assert int(new) == int(old)
    with pytest.raises(ValueError, match="37 classes, the config asks for 40"):
        checkpoint.check_num_classes(restored["num_classes"], 40)


def test_run_checkpoints_keep_the_last_and_restore_state_and_data_position(tmp_path, rng):
    mesh = make_mesh(2, 4)
    weight = jax.device_put(rng.normal(size=(16, 4)).astype(np.float32), weight_sharding(mesh))
    state = {"step": jnp.int32(0), "weight": weight, "key": jax.random.key_data(jax.random.key(3))}
    series = checkpoint.RunCheckpoints(tmp_path / "checkpoints", keep=2)
    assert series.latest_step() is None
    for step in (10, 20, 30):
        series.save(step, {**state, "step": jnp.int32(step), "weight": weight + step}, {"position": step * 7})
    series.close()  # waits for the asynchronous saves

    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir()) == [20, 30]
    other = make_mesh(1, 4, devices=jax.devices()[4:])
    abstract = checkpoint.abstract_like({**state, "weight": jax.device_put(weight, weight_sharding(other))})
    series = checkpoint.RunCheckpoints(tmp_path / "checkpoints", keep=2)
    restored, position = series.restore(abstract)
    assert series.latest_step() == 30 and int(restored["step"]) == 30 and position == {"position": 210}
    np.testing.assert_array_equal(restored["weight"], np.asarray(weight) + 30)
    assert restored["weight"].sharding.is_equivalent_to(weight_sharding(other), 2)
    restored, position = series.restore(abstract, step=20)
    assert int(restored["step"]) == 20 and position == {"position": 140}
    np.testing.assert_array_equal(restored["key"], state["key"])
    series.close()


def test_run_checkpoints_restore_exactly_or_name_what_differs(tmp_path, rng):
    """Only the FC rows may differ (re-padded for the mesh); any other shape, dtype, missing or extra array is
    refused with its name before anything is read."""
    mesh = make_mesh(1, 8)
    put = lambda x, sharding=None: jax.device_put(x, sharding or jax.sharding.NamedSharding(mesh, P()))
    state = {"params": {"conv": {"kernel": put(rng.normal(size=(3, 3, 3, 8)).astype(np.float32))},
                        "bn": {"scale": put(np.ones(8, np.float32))}},
             "weight": put(rng.normal(size=(16, 4)).astype(np.float32), weight_sharding(mesh)), "step": put(jnp.int32(7))}
    series = checkpoint.RunCheckpoints(tmp_path, keep=1)
    series.save(7, state, {})
    series.close()
    series = checkpoint.RunCheckpoints(tmp_path, keep=1)
    abstract = checkpoint.abstract_like(state)
    padded = {**abstract, "weight": jax.ShapeDtypeStruct((24, 4), jnp.float32, sharding=weight_sharding(mesh))}
    restored, _ = series.restore(padded)
    np.testing.assert_array_equal(restored["weight"][:16], state["weight"])
    assert not np.any(restored["weight"][16:])

    wider = {**abstract, "params": {**abstract["params"], "conv": {"kernel": jax.ShapeDtypeStruct(
        (3, 3, 3, 16), jnp.float32, sharding=abstract["params"]["conv"]["kernel"].sharding)}}}
    with pytest.raises(checkpoint.CheckpointError, match=r"does not fit this run: params/conv/kernel: shape "
                                                         r"\(3, 3, 3, 8\) in the checkpoint, \(3, 3, 3, 16\) in this run"):
        series.restore(wider)
    other_dim = {**abstract, "weight": jax.ShapeDtypeStruct((16, 8), jnp.float32, sharding=weight_sharding(mesh))}
    with pytest.raises(checkpoint.CheckpointError, match=r"weight: shape \(16, 4\) in the checkpoint, \(16, 8\)"):
        series.restore(other_dim)
    halved = {**abstract, "weight": jax.ShapeDtypeStruct((16, 4), jnp.bfloat16, sharding=weight_sharding(mesh))}
    with pytest.raises(checkpoint.CheckpointError, match="weight: dtype float32 in the checkpoint, bfloat16 in"):
        series.restore(halved)
    renamed = {**abstract, "params": {"conv": abstract["params"]["conv"], "norm": abstract["params"]["bn"]}}
    with pytest.raises(checkpoint.CheckpointError, match="fit this run: params/bn/scale: in the checkpoint, not in "
                                                         "this run; params/norm/scale: not in the checkpoint$"):
        series.restore(renamed)
    with pytest.raises(checkpoint.CheckpointError, match=f"no checkpoint 3 in {tmp_path}"):
        series.restore(abstract, step=3)
    series.close()


def test_a_failed_save_is_one_error_naming_the_step_folder_and_leaves_nothing(tmp_path, monkeypatch):
    series = checkpoint.RunCheckpoints(tmp_path, keep=2)
    state = {"w": jnp.ones(4)}
    series.save(1, state, {})

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(series.manager, "save", full)
    with pytest.raises(checkpoint.CheckpointError, match=rf"saving checkpoint {tmp_path}/2 failed: \[Errno 28\] No "
                                                         "space left on device"):
        series.save(2, state, {})
    assert series.latest_step() == 1 and sorted(p.name for p in tmp_path.iterdir()) == ["1"]
    series.close()
