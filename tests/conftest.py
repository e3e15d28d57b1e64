"""Eight CPU devices for every test, so meshes like (data=2, class=4) really run.

Compiled programs go to a persistent compilation cache shared by this run's pytest processes (the xdist
workers and the subprocesses of CLI and benchmark tests), so the identical train steps, initializers and
evaluators that many tests build compile once per run. The cache is deleted when the run ends.

Random tests take a generator from the ``rng`` fixture, freshly seeded per test; the seed is printed and recorded in the
test's report, and ``JAXCLS_TEST_SEED=<seed>`` gives every test that seed, to replay a failure. ``--only-rng`` runs
just those tests, for a sweep over seeds:
``for s in $(seq 1 20); do JAXCLS_TEST_SEED=$s python -m pytest -q --only-rng || break; done``.
"""

import contextlib
import gc
import logging
import os
import shutil
import socket
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# jaxcls imports jax without the plugin's noise
from jaxcls.startup import NO_LLVM_OPTIMIZATION, simulate_cpu_devices  # noqa: E402

# No LLVM optimization: the tests' programs are small and run a few times, so compiling dominates (a quarter less
# time per compiled train step); and XLA:CPU's elemental emitter in place of its MLIR fusion emitters, which compile
# each fusion through an MLIR pipeline of their own (the tiny config's train step: 4.7 s to compile with them, 2.7 s
# without). Subprocesses inherit the XLA_FLAGS set here (benchmark scripts get theirs from test_benchmarks.script_env).
TEST_COMPILE_FLAGS = (NO_LLVM_OPTIMIZATION, "--xla_cpu_use_fusion_emitters=false")

if "JAXCLS_TEST_XLA_CACHE" not in os.environ:  # the first process of the run; xdist workers inherit its environment
    os.environ["JAXCLS_TEST_XLA_CACHE"] = tempfile.mkdtemp(prefix="jaxcls-test-xla-cache-")
COMPILATION_CACHE = os.environ["JAXCLS_TEST_XLA_CACHE"]
# XLA:GPU's compile-only programs cannot come from JAX's cache (it cannot load them without a GPU), but their kernels
# can: XLA keeps each kernel it compiles in this file, shared by the run's processes, and takes from it any kernel that
# another program compiled (the tiny config's backbone is the same in most of them). A compile of the tiny config's
# step for 8 H100s: ~22 s without, ~16 s with the file filled. Subprocesses inherit it, as every flag set here.
GPU_KERNEL_CACHE = (f"--xla_gpu_kernel_cache_file={COMPILATION_CACHE}/xla_gpu_kernels.pb",
                    "--xla_gpu_enable_llvm_module_compilation_parallelism=true")  # the file needs per-kernel modules
_flags = os.environ.get("XLA_FLAGS", "").split()  # xdist workers inherit the controller's
os.environ["XLA_FLAGS"] = " ".join(_flags + [f for f in TEST_COMPILE_FLAGS + GPU_KERNEL_CACHE if f not in _flags])
simulate_cpu_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from jaxcls.plan import gpu_target  # noqa: E402

assert jax.device_count() == 8, "tests need 8 CPU devices: JAX's CPU backend, with the devices conftest asks for"

# Tracing makes many short-lived objects, and a worker's heap grows with every test's programs: Python's default
# thresholds (700, 10, 10) then spend ~6% of a worker's time in full collections (test_sharded + test_fc: 8.1 s of GC
# in 127 s; 3.3 s with these). Objects alive after the imports are frozen out of every collection.
gc.freeze()
gc.set_threshold(10_000, 20, 100)
jax.config.update("jax_compilation_cache_dir", COMPILATION_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
# A process may read an entry another one is still writing: JAX then warns and compiles again, harmlessly, but the
# warning would come first in a CLI's stderr, which several tests read line by line; subprocesses inherit the filter
os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [
    os.environ.get("PYTHONWARNINGS"), "ignore:Error reading persistent compilation cache entry:UserWarning"]))

MESH_SHAPES = [(1, 8), (2, 4), (4, 2), (8, 1)]


@contextlib.contextmanager
def jaxcls_records(caplog):
    """``caplog`` sees jaxcls's log inside the block: a CLI's ``configure_logging`` stops that logger propagating."""
    log = logging.getLogger("jaxcls")
    log.addHandler(caplog.handler)
    try:
        yield caplog
    finally:
        log.removeHandler(caplog.handler)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pytest_sessionfinish(session):
    if not hasattr(session.config, "workerinput"):  # the controller (or a run without xdist), after all workers
        shutil.rmtree(COMPILATION_CACHE, ignore_errors=True)


def pytest_addoption(parser):
    parser.addoption("--only-rng", action="store_true", help="run only the tests that draw from the rng fixture")


def pytest_runtest_setup(item):
    """Tests marked gpu_target need JAX's CUDA plugin (the plan-gpu extra); without it they skip, saying how to
    install it."""
    if item.get_closest_marker("gpu_target") and (problem := gpu_target.missing_plugin()):
        pytest.skip(problem)


def pytest_collection_modifyitems(config, items):
    if config.getoption("--only-rng"):
        kept, dropped = [], []
        for item in items:
            (kept if "rng" in getattr(item, "fixturenames", ()) else dropped).append(item)
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


@pytest.fixture
def rng(request):
    """A generator with a fresh seed per test, or JAXCLS_TEST_SEED's when set; the seed is in the test's report for
    replay."""
    seed = int(os.environ.get("JAXCLS_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    request.node.user_properties.append(("seed", seed))
    print(f"seed={seed}")
    return np.random.default_rng(seed)
