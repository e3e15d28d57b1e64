"""JAX started quietly where its CUDA plugin cannot work: a machine with the plugin (the ``plan-gpu`` extra, for
XLA:GPU's programs without a GPU) and no NVIDIA driver.

There the plugin's C++ code writes "Could not find cuda drivers" lines straight to file descriptor 2 when jax is
imported and again when JAX starts its backends with JAX_PLATFORMS=cpu, and without JAX_PLATFORMS JAX logs the
traceback of the plugin's failed initialization: noise before a CLI's own first line, about a GPU the machine does not
have. ``start_jax()``, called by ``jaxcls/__init__.py`` before anything imports jax, drops exactly those; every other
line is written back. Wherever the driver or JAX's own test finds a GPU, or the plugin is absent, it does nothing;
JAX_PLATFORMS is left alone (a TPU machine keeps its backend).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import logging
import os
import re
import sys
import tempfile

PLUGINS = ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")
# any of them: a GPU may be here (the driver's own file, then the devices jax._src.hardware_utils looks for)
NVIDIA_DRIVER = ("/proc/driver/nvidia/version", "/dev/nvidiactl", "/dev/nvidia0", "/dev/dxg")
# the lines the plugin writes to descriptor 2 when it finds no driver
NOISE = re.compile(r"WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
                   r"|[IWEF]\d{4} \S+ +\d+ cudart_stub\.cc:\d+\] .*")
FAILED_INITIALIZE = "Jax plugin configuration error: Exception when calling {}.initialize()"
DEVICE_COUNT = "--xla_force_host_platform_device_count"  # XLA's flag: the CPU backend's devices
NO_LLVM_OPTIMIZATION = "--xla_backend_optimization_level=0"


def plugin_installed(plugins: tuple[str, ...] = PLUGINS) -> bool:
    """Whether one of ``plugins`` can be imported (without importing it)."""
    return any(importlib.util.find_spec(p.split(".")[0]) and importlib.util.find_spec(p) for p in plugins)


def without_plugin_noise(text: str) -> str:
    """``text`` without the plugin's lines about a missing driver; every other line as it was."""
    return "".join(line for line in text.splitlines(keepends=True) if not NOISE.fullmatch(line.rstrip("\r\n")))


def not_a_failed_initialize(record: logging.LogRecord) -> bool:
    """A logging filter: False only for JAX's record of a CUDA plugin's failed ``initialize()``."""
    return record.getMessage() not in {FAILED_INITIALIZE.format(p) for p in PLUGINS}


@contextlib.contextmanager
def stderr_into(file):
    """File descriptor 2 (where C++ libraries write, past ``sys.stderr``) into the open ``file`` meanwhile."""
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(file.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


@contextlib.contextmanager
def stderr_without_plugin_noise():
    """File descriptor 2 captured meanwhile, then written back without the plugin's noise."""
    with tempfile.TemporaryFile() as captured:
        try:
            with stderr_into(captured):
                yield
        finally:
            captured.seek(0)
            with open(2, "wb", closefd=False) as stderr:
                stderr.write(without_plugin_noise(captured.read().decode(errors="surrogateescape")).encode(
                    errors="surrogateescape"))


def quietly(initialize):
    """A plugin's ``initialize`` (JAX calls it when it starts its backends) without the plugin's noise."""
    @functools.wraps(initialize)
    def initialize_quietly():
        with stderr_without_plugin_noise():
            initialize()
    return initialize_quietly


def start_jax() -> None:
    """Where the CUDA plugin is installed and no NVIDIA driver is present: drop JAX's record of the plugin's failed
    initialization and, unless jax is already imported, import jax and the plugin without the plugin's noise and
    make the plugin's ``initialize`` quiet too. Elsewhere nothing."""
    if not plugin_installed() or any(os.path.exists(path) for path in NVIDIA_DRIVER):
        return
    logging.getLogger("jax._src.xla_bridge").addFilter(not_a_failed_initialize)
    if "jax" in sys.modules or sys.stderr is None:  # None: Python found no descriptor 2 open
        return
    with stderr_without_plugin_noise():
        import jax  # noqa: F401
        for name in filter(lambda name: plugin_installed((name,)), PLUGINS):
            plugin = importlib.import_module(name)
            plugin.initialize = quietly(plugin.initialize)


def simulate_cpu_devices(count: int, *, optimize: bool = True) -> None:
    """Give JAX's CPU backend ``count`` devices, for meshes of many devices without an accelerator. Set in
    XLA_FLAGS, which processes started from this one inherit (``jax_num_cpu_devices`` would hold for this one only).
    Call it before anything starts JAX's backends (after ``import jax`` is fine); it then starts them to check.
    ``optimize=False`` also skips LLVM's optimizations, for programs compiled only for their buffers or run a few
    times."""
    import jax  # here, not above: start_jax imports it first

    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_COUNT + "=")]
    flags.append(f"{DEVICE_COUNT}={count}")
    if not optimize and NO_LLVM_OPTIMIZATION not in flags:
        flags.append(NO_LLVM_OPTIMIZATION)
    os.environ["XLA_FLAGS"] = " ".join(flags)
    if (started := len(jax.devices("cpu"))) < count:
        raise RuntimeError(f"JAX's CPU backend has {started} devices, not {count}: it started before they were asked "
                           "for; ask before anything runs on JAX, or in a fresh process")
