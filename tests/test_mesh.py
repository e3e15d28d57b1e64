"""Layout: the mesh, class shards, padding, partition specs and the axes the FC is replicated over."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxcls.mesh import (
    BATCH,
    BATCH_ROWS,
    CLASS_AXES,
    batch_sharding,
    check_class_axes,
    class_shards,
    data_axes,
    host_rows,
    make_mesh,
    padded_num_classes,
    replicated,
    row_spec,
    weight_sharding,
    weight_spec,
)


@pytest.mark.parametrize("data,classes,n", [(3, 3, 8), (2, 3, 8), (16, None, 8), (3, None, 8)])
def test_make_mesh_rejects_wrong_device_count(data, classes, n):
    with pytest.raises(ValueError, match="devices"):
        make_mesh(data, classes, devices=jax.devices()[:n])


def test_make_mesh_rejects_non_positive_sizes():
    with pytest.raises(ValueError, match="must be positive"):
        make_mesh(0)


def test_make_mesh_defaults_all_devices_on_class_axis():
    mesh = make_mesh()
    assert dict(mesh.shape) == {"data": 1, "class": 8}
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
    assert dict(make_mesh(2).shape) == {"data": 2, "class": 4}


@pytest.mark.parametrize("shape", [(1, 8), (2, 4), (4, 2), (8, 1)], ids=str)
def test_class_shards_and_replica_axes_of_both_layouts(shape):
    mesh = make_mesh(*shape)
    assert class_shards(mesh) == 8 and data_axes(CLASS_AXES["data,class"]) == ()
    assert class_shards(mesh, CLASS_AXES["class"]) == shape[1] and data_axes(("class",)) == ("data",)


def test_padding_rounds_up_to_the_shards():
    assert [padded_num_classes(c, 8) for c in (1, 8, 9, 16, 1_000_001)] == [8, 8, 16, 16, 1_000_008]
    assert padded_num_classes(37, 3) == 39


def test_specs_and_shardings():
    mesh = make_mesh(2, 4)
    assert weight_spec() == P(("data", "class"), None) and weight_spec(("class",)) == P(("class",), None)
    assert row_spec(("class",)) == P(("class",)) and BATCH == P(("data", "class"))
    assert BATCH_ROWS == P(("data", "class"), None)
    x = jax.device_put(np.zeros((16, 3), np.float32), weight_sharding(mesh, ("class",)))
    assert x.addressable_shards[0].data.shape == (4, 3)  # split 4 ways, replicated over data
    assert len({str(s.index) for s in x.addressable_shards}) == 4
    y = jax.device_put(np.zeros((16, 3), np.float32), batch_sharding(mesh))
    assert len({str(s.index) for s in y.addressable_shards}) == 8
    assert replicated(mesh).is_fully_replicated


def test_unknown_class_axis():
    with pytest.raises(ValueError, match="class axis 'model' is not a mesh axis"):
        check_class_axes(make_mesh(), ("model",))
    assert check_class_axes(make_mesh(), ["class"]) == ("class",)


def test_one_process_holds_every_row_of_the_global_batch():
    assert host_rows(make_mesh(2, 4), 16) == (0, 16)
    assert host_rows(make_mesh(1, 4, devices=jax.devices()[:4]), 8) == (0, 8)
