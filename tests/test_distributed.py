"""Launch settings of ``jaxcls.distributed``: explicit flags, environment variables, and their errors."""

import pytest

from jaxcls.distributed import launch_settings, local_device_ids


def test_flags_win_over_the_environment_and_are_converted():
    environ = {"JAX_COORDINATOR_ADDRESS": "envhost:1", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}
    assert launch_settings(environ=environ) == {"coordinator_address": "envhost:1", "num_processes": 4,
                                                "process_id": 3}
    assert launch_settings("host:2", None, 1, environ=environ) == {"coordinator_address": "host:2",
                                                                   "num_processes": 4, "process_id": 1}


def test_nothing_given_means_cluster_detection():
    assert launch_settings(environ={}) == {}


def test_partial_or_inconsistent_settings_are_errors():
    with pytest.raises(ValueError, match=r"missing --num_processes \(or \$JAX_NUM_PROCESSES\), --process_id"):
        launch_settings("host:1", environ={})
    with pytest.raises(ValueError, match="process_id 2 is not in 0 … 1"):
        launch_settings("host:1", 2, 2, environ={})


SLURM = {"SLURM_JOB_ID": "123", "SLURM_STEP_NODELIST": "node[1-4]", "SLURM_NTASKS": "4", "SLURM_PROCID": "2",
         "SLURM_LOCALID": "0", "SLURM_NODEID": "2", "SLURM_STEP_TASKS_PER_NODE": "1(x4)"}


@pytest.mark.parametrize("environ,expected", [
    (SLURM, []),  # one process on the node: every local GPU
    (dict(SLURM, SLURM_STEP_TASKS_PER_NODE="8(x2),1(x2)"), []),
    (dict(SLURM, SLURM_STEP_TASKS_PER_NODE="1(x2),8(x2)"), None),  # eight on this node: one GPU each, JAX's rule
    (dict(SLURM, SLURM_NODEID="0", SLURM_STEP_TASKS_PER_NODE="2,1,1,1"), None),
    (dict(SLURM, JAX_LOCAL_DEVICE_IDS="0,1"), None),  # the user's own choice, read by JAX
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "1"}, []), ({"OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, None),
    ({}, None),  # no cluster launcher: JAX makes every local device visible anyway
])
def test_a_cluster_launchers_single_process_on_a_node_gets_every_local_device(environ, expected):
    assert local_device_ids(environ) == expected


def test_jax_keeps_an_empty_device_list_under_slurm(monkeypatch):
    """What ``initialize`` relies on: given ``local_device_ids=[]`` JAX's cluster detection does not replace it by the
    local rank's GPU (given ``None`` it does, which left one of a node's eight GPUs to its one process)."""
    from jax._src import clusters

    for key, value in SLURM.items():
        monkeypatch.setenv(key, value)
    detect = clusters.ClusterEnv.auto_detect_unset_distributed_params
    assert detect(None, None, None, None, None, 1)[3] == [0]
    assert detect(None, None, None, [], None, 1)[1:] == (4, 2, [])  # initialize's call: all detected but the devices
    assert detect("host0:1234", 4, 2, [], None, 1) == ("host0:1234", 4, 2, [])


def test_initialize_passes_the_device_list_under_slurm(monkeypatch):
    import jax

    from jaxcls import distributed

    for key, value in SLURM.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("JAX_LOCAL_DEVICE_IDS", raising=False)
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kwargs: calls.append(kwargs))
    distributed.initialize()
    assert calls[0]["local_device_ids"] == [] and "coordinator_address" not in calls[0]
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "8(x4)")
    distributed.initialize()
    assert "local_device_ids" not in calls[1]
