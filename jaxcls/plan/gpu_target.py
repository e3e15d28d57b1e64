"""Compiling for a GPU on a machine without one: XLA:GPU's compile-only devices for a named GPU.

JAX's CUDA plugin (``pip install -e '.[plan-gpu]'``: the plugin and ptxas, no CUDA libraries) builds devices from a
``GpuTargetConfigProto``, XLA's description of a GPU model; ``jaxcls/plan/gpu_targets/*.txtpb`` are XLA's own
(``xla/backends/gpu/target_config/specs/``, each file names its commit). Programs lowered for those devices compile
with XLA:GPU as they would on the GPU (cuDNN convolutions, Triton and cuBLAS GEMMs, NCCL collectives, GPU buffer
assignment), so ``memory_analysis()`` and ``as_text()`` are XLA:GPU's; nothing can run.

What differs from a compile on the GPU: nothing is autotuned (cuDNN algorithm ``-1`` with a 0-byte workspace,
default Triton tiles), so a real GPU's compile may need somewhat more temporaries (``AUTOTUNING_MARGIN``).
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from importlib import metadata
from pathlib import Path

import jax
from jax.experimental import topologies  # compile-only devices: no stable path exists yet

from jaxcls.startup import PLUGINS, plugin_installed, stderr_into

TARGETS = {"h100": "h100.txtpb", "h200": "h200.txtpb", "a100-80gb": "a100-80gb.txtpb"}
SPECS = Path(__file__).parent / "gpu_targets"
# Each target's memory bandwidth by its datasheet (TB/s), for reading a compile-only program's bytes as a time
DATASHEET_TB_PER_S = {"h100": 3.35, "h200": 4.8, "a100-80gb": 2.039}
# CUB's radix sort (PartialFC's top_k) asks the CUDA runtime for the device while the executable is built;
# XLA's own sort needs no device and the same buffers (measured: equal temporaries with CUB on a GPU)
COMPILE_OPTIONS = {"xla_gpu_enable_cub_radix_sort": False}
# Without autotuning XLA may find no Triton tiles for a GEMM (measured: vit_t's attention, bf16[16512, 256]); cuBLAS
# then takes the GEMMs, as it does on a GPU wherever the autotuner finds Triton slower
WITHOUT_TRITON_GEMMS = {**COMPILE_OPTIONS, "xla_gpu_enable_triton_gemm": False}
AUTOTUNING_MARGIN = 0.02  # forcing cuBLAS instead of the untuned Triton GEMMs added 88 MB (+2%) to an r50 step
GPUS_PER_HOST = 8
# The memory a card's driver reports (nvidia-smi's memory.total, which XLA's allocator takes its fraction of), where it
# is less than XLA's description of the model: an H200's says 141.0 GiB, the card 143,771 MiB (140.4 GiB). An H100's
# description (79.1 GiB) is under its card's 81,559 MiB, so it stands.
REPORTED_MEMORY = {"h200": 143_771 * 2**20}


def target_of(device_kind: str) -> str | None:
    """The target (``TARGETS``) a device's ``device_kind`` names, e.g. ``"NVIDIA H100 80GB HBM3"`` → ``"h100"``."""
    kind = device_kind.lower().replace(" ", "")
    return next((t for t in TARGETS if all(part in kind for part in t.split("-"))), None)


class MissingPlugin(RuntimeError):
    """The CUDA plugin that compiles for GPUs is not installed (the message is the command that installs it)."""


def install_command() -> str:
    version = jax.__version__
    return (f"pip install 'jax-cuda12-plugin=={version}' 'jax-cuda12-pjrt=={version}' nvidia-cuda-nvcc-cu12  "
            "(or pip install -e '.[plan-gpu]')")


def _plugin_version() -> str | None:
    for name in ("jax-cuda12-plugin", "jax-cuda13-plugin"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            return metadata.version(name)
    return None


def missing_plugin() -> str | None:
    """Why this machine cannot compile for a GPU (the plugin is absent, or of another version than jaxlib, which
    JAX ignores), with the command that fixes it; ``None`` if it can."""
    if not plugin_installed(PLUGINS):
        return f"compiling for a GPU needs JAX's CUDA plugin, which is not installed: {install_command()}"
    if (version := _plugin_version()) not in (None, jax.lib.__version__):
        return f"JAX's CUDA plugin is version {version}, jaxlib {jax.lib.__version__}: {install_command()}"
    return None


def compiler() -> str:
    """Which compiler produces the programs: the plugin's package and version."""
    return f"XLA:GPU (CUDA plugin {_plugin_version()}, jaxlib {jax.lib.__version__})"


def target_config(name: str) -> str:
    """The ``GpuTargetConfigProto`` text of ``name`` (one of ``TARGETS``)."""
    if name not in TARGETS:
        raise ValueError(f"unknown GPU target {name!r}; choose one of {', '.join(TARGETS)}")
    return (SPECS / TARGETS[name]).read_text()


def device_memory(name: str) -> int:
    """Bytes of memory of one GPU of target ``name``: its ``device_memory_size``, or what such a card's driver
    reports (``REPORTED_MEMORY``) where that is less."""
    described = int(re.search(r"device_memory_size:\s*(\d+)", target_config(name)).group(1))
    return min(described, REPORTED_MEMORY.get(name, described))


def _without_field(text: str, field: str) -> str:
    """``text`` without every ``field: value`` line and ``field { … }`` block."""
    text = re.sub(rf"(?m)^[ \t]*{field}:.*\n", "", text)
    return re.sub(rf"(?ms)^([ \t]*){field} \{{.*?^\1\}}\n", "", text)


def gpu_devices(name: str, count: int, per_host: int = GPUS_PER_HOST) -> list:
    """``count`` compile-only devices of GPU target ``name``: one host of ``count`` GPUs up to ``per_host``, else
    ``count / per_host`` hosts (processes) of ``per_host``. JAX must run on the CPU platform (no CUDA driver is
    needed); fields of XLA's newer protos that this jaxlib does not know are dropped."""
    if count < 1 or (count > per_host and count % per_host):
        raise ValueError(f"{count} GPUs: give at most {per_host} (one host) or a multiple of {per_host} (hosts of "
                         f"{per_host})")
    if problem := missing_plugin():
        raise MissingPlugin(problem)
    hosts, per_host = (1, count) if count <= per_host else (count // per_host, per_host)
    text, dropped = target_config(name), []
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "log")
        while True:
            try:  # the plugin says why a proto does not parse only in its C++ log, on descriptor 2
                with open(log, "w") as file, stderr_into(file):
                    topology = topologies.get_topology_desc(
                        platform="cuda", target_config=text, topology=f"1x{hosts}x{per_host}")
                return list(topology.devices)
            except Exception as e:
                unknown = re.search(r'has no field named "(\w+)"', Path(log).read_text())
                if not unknown or unknown.group(1) in dropped:
                    raise RuntimeError(f"the CUDA plugin could not make {name} devices: {e}") from e
                dropped.append(unknown.group(1))
                text = _without_field(text, unknown.group(1))


def compile_step(run, state):
    """``(run.compile_step(state) by XLA:GPU, whether its GEMMs had to fall back to cuBLAS)``: with
    ``COMPILE_OPTIONS``, and ``WITHOUT_TRITON_GEMMS`` when XLA finds no Triton tiles for a GEMM."""
    try:
        return run.compile_step(state, COMPILE_OPTIONS), False
    except jax.errors.JaxRuntimeError as e:
        if "Couldn't find output tile sizes" not in str(e):
            raise
        return run.compile_step(state, WITHOUT_TRITON_GEMMS), True
