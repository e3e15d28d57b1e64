"""One run over several processes (one per host) on JAX's multi-controller runtime: the launch flags.

``--distributed`` calls ``jax.distributed.initialize``. With no address given it detects SLURM or Open MPI;
where such a launcher starts one process on a node, that process gets every local GPU (JAX alone would give it the
one GPU of its local rank: one process per GPU, which a node running several processes gets); any other launcher
passes ``--coordinator_address host:port``, ``--num_processes`` and ``--process_id`` (or the
environment variables ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``). CPU collectives
between processes use gloo. A process that stops sending heartbeats for ``--heartbeat_timeout`` seconds is
declared dead and every other process exits with an error naming it, instead of waiting in a collective.
"""

from __future__ import annotations

import inspect
import os

import jax
import numpy as np
from absl import flags
from jax.experimental import multihost_utils

ENVIRONMENT = {"coordinator_address": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES",
               "process_id": "JAX_PROCESS_ID"}
DEFAULT_HEARTBEAT_TIMEOUT = 60


def define_flags() -> None:
    flags.DEFINE_bool("distributed", False, "one process per host: initialize jax.distributed (SLURM / Open MPI "
                      "detected, else the three flags below or their JAX_* environment variables)")
    flags.DEFINE_string("coordinator_address", None, "host:port of process 0's coordination service "
                        "(default $JAX_COORDINATOR_ADDRESS)")
    flags.DEFINE_integer("num_processes", None, "number of processes (default $JAX_NUM_PROCESSES)")
    flags.DEFINE_integer("process_id", None, "this process's index, 0 … num_processes−1 (default $JAX_PROCESS_ID)")
    flags.DEFINE_integer("heartbeat_timeout", DEFAULT_HEARTBEAT_TIMEOUT,
                         "seconds without a heartbeat after which a process counts as dead and the run stops")


def launch_settings(coordinator_address=None, num_processes=None, process_id=None, environ=os.environ) -> dict:
    """The explicit settings, each from its argument or else its environment variable; ``{}`` means auto-detect."""
    given = {"coordinator_address": coordinator_address, "num_processes": num_processes, "process_id": process_id}
    settings = {k: v if v is not None else environ.get(ENVIRONMENT[k]) for k, v in given.items()}
    settings = {k: v for k, v in settings.items() if v is not None}
    if settings and len(settings) < 3:
        missing = [f"--{k} (or ${ENVIRONMENT[k]})" for k in given if k not in settings]
        raise ValueError(f"a launch without SLURM or Open MPI needs all three settings; missing {', '.join(missing)}")
    for key in ("num_processes", "process_id"):
        if key in settings:
            settings[key] = int(settings[key])
    if settings and not 0 <= settings["process_id"] < settings["num_processes"]:
        raise ValueError(f"process_id {settings['process_id']} is not in 0 … {settings['num_processes'] - 1}")
    return settings


def processes_on_this_node(environ=os.environ) -> int | None:
    """How many processes SLURM or Open MPI started on this node (``None`` for another launcher): Open MPI's
    ``OMPI_COMM_WORLD_LOCAL_SIZE``, or this node's entry (``SLURM_NODEID``) of SLURM's step tasks per node, a list
    such as ``8(x3),4`` for 8, 8, 8, 4."""
    if "OMPI_COMM_WORLD_LOCAL_SIZE" in environ:
        return int(environ["OMPI_COMM_WORLD_LOCAL_SIZE"])
    per_node = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    if per_node is None or "SLURM_NODEID" not in environ:
        return None
    counts = []
    for entry in per_node.split(","):
        count, _, repeat = entry.partition("(x")
        counts += [int(count)] * (int(repeat.rstrip(")")) if repeat else 1)
    return counts[int(environ["SLURM_NODEID"])]


def local_device_ids(environ=os.environ) -> list[int] | None:
    """``[]`` (every local device) where a cluster launcher put one process on this node; else ``None``, JAX's own
    choice: ``$JAX_LOCAL_DEVICE_IDS`` if set, under SLURM or Open MPI the GPU of the local rank, else all."""
    if "JAX_LOCAL_DEVICE_IDS" in environ or processes_on_this_node(environ) != 1:
        return None
    return []


def initialize(coordinator_address=None, num_processes=None, process_id=None,
               heartbeat_timeout: int = DEFAULT_HEARTBEAT_TIMEOUT) -> None:
    """``jax.distributed.initialize`` with explicit or detected settings, gloo CPU collectives and the timeout."""
    settings = launch_settings(coordinator_address, num_processes, process_id)
    if (devices := local_device_ids()) is not None:  # an empty list: JAX does not pick the local rank's GPU
        settings["local_device_ids"] = devices
    if "jax_cpu_collectives_implementation" in jax.config.values:  # gloo is the default since jax 0.5.1
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    accepted = inspect.signature(jax.distributed.initialize).parameters
    timeouts = {"heartbeat_timeout_seconds": heartbeat_timeout, "shutdown_timeout_seconds": heartbeat_timeout}
    jax.distributed.initialize(**settings, **{k: v for k, v in timeouts.items() if k in accepted})


def initialize_from_flags() -> None:
    """Initialize when ``--distributed`` is given (the CLIs call this before touching any device)."""
    f = flags.FLAGS
    if f.distributed:
        initialize(f.coordinator_address, f.num_processes, f.process_id, f.heartbeat_timeout)
    elif f.coordinator_address or f.num_processes or f.process_id is not None:
        raise ValueError("--coordinator_address / --num_processes / --process_id need --distributed")


def summed_over_processes(value: int) -> int:
    """``value`` summed over every process (each must call it at the same point), e.g. each host's count of its own
    rows' bad records."""
    if jax.process_count() == 1:
        return int(value)
    return int(np.sum(multihost_utils.process_allgather(np.asarray(value, np.int32))))


def barrier(name: str, timeout: int = 1800) -> None:
    """Return once every process has reached the barrier ``name`` (each name once per run; nothing to wait for
    with one process).

    It waits on the coordination service, not in a device collective: gloo gives up on a peer after 30 s,
    which a process still compiling the step (slower than its peers on a loaded machine) can exceed.
    """
    if jax.process_count() == 1:
        return
    from jax._src import distributed as runtime  # the coordination service client; no public handle to it

    client = getattr(runtime.global_state, "client", None)
    if client is None or not hasattr(client, "wait_at_barrier"):
        multihost_utils.sync_global_devices(name)
    else:
        client.wait_at_barrier(name, timeout_in_ms=timeout * 1000)
