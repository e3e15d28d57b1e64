"""Launch settings of ``jaxcls.distributed``: explicit flags, environment variables, and their errors."""

import pytest

from jaxcls.distributed import launch_settings


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
