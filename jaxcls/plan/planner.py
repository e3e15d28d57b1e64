"""Will a config fit? ``plan`` compiles the config's real train step (the state and the batch as
``jax.ShapeDtypeStruct``: nothing is allocated, no data is read) and prints the bytes per device by part, the total
against the memory XLA may use on the device (``config.mem_fraction`` of it) and a verdict; with ``max_classes`` it
finds the largest ``num_classes`` that fits (bytes are affine in the class count: two compiles and a solve, a third to
confirm).

A target ``h100`` (``h200``, ``a100-80gb``) compiles with XLA:GPU for compile-only GPUs of that model
(``jaxcls.plan.gpu_target``; needs JAX's CUDA plugin, not a GPU): the numbers are XLA:GPU's own, short only of
autotuning. ``cpu`` compiles with XLA:CPU for simulated CPU devices: the FC, parameter, optimizer and input parts are
array shapes, the same on every backend, but activations and temporaries are XLA:CPU's, which ``cpu_caveats`` says
overstate a GPU's."""

from __future__ import annotations

import dataclasses

import jax

from jaxcls.mesh import class_shards
from jaxcls.plan import gpu_target
from jaxcls.plan.memory import StepMemory, format_bytes, max_classes_that_fit, mem_fraction, probe_rows, step_memory
from jaxcls.run import build
from jaxcls.startup import simulate_cpu_devices

TARGETS = ("cpu", *gpu_target.TARGETS)


def target_devices(target: str, count: int) -> list:
    """``count`` devices to compile for: simulated CPU devices, or compile-only GPUs of ``target``. JAX runs on
    the CPU platform either way (no GPU driver is needed), so call this before anything starts a backend."""
    jax.config.update("jax_platforms", "cpu")
    if target == "cpu":
        simulate_cpu_devices(count, optimize=False)  # compiled for their buffers only: no LLVM optimization
        return jax.devices()[:count]
    return gpu_target.gpu_devices(target, count)


def usable_bytes(device_memory: int, fraction: float) -> int:
    return int(device_memory * fraction)


def cpu_caveats(config) -> list[str]:
    """Where a GPU's compiled step is known to differ from XLA:CPU's numbers for this config."""
    if config.precision == "float32":
        return []
    return [f"{config.precision} compute: XLA:CPU runs 16-bit convolutions in float32, so its activations are about "
            "float32-sized (r50: 9.5 GiB per 128 images); XLA:GPU keeps 16-bit activations and fuses more "
            "(--target h100: 3.9 GiB)"]


def verdict(total: int, usable: int, device_memory: int) -> str:
    if total <= usable:
        return f"fits: {format_bytes(total)} of {format_bytes(usable)} usable ({format_bytes(usable - total)} spare)"
    if total <= device_memory * 0.95:
        return (f"does not fit in the share XLA may use ({format_bytes(usable)}); it would with "
                f"--config.mem_fraction={min(0.95, total / device_memory + 0.02):.2f}")
    return f"does not fit: {format_bytes(total)} > {format_bytes(usable)} usable"


@dataclasses.dataclass
class Plan:
    """One planner run: where it compiled, the step's bytes per device, and (``--max-classes``) the class count
    that fits with the affine fit ``fixed + per_class · num_classes`` it came from."""

    target: str
    device_kind: str
    devices: int
    hosts: int
    compiler: str
    device_memory: int
    mem_fraction: float
    memory: StepMemory
    summary: list
    notes: list
    fixed: float | None = None
    per_class: float | None = None
    max_classes: int | None = None
    max_classes_total: int | None = None

    @property
    def usable(self) -> int:
        return usable_bytes(self.device_memory, self.mem_fraction)

    def lines(self) -> list[str]:
        where = f"{self.devices} × {self.device_kind}" + (f" on {self.hosts} hosts" if self.hosts > 1 else "")
        lines = [*self.summary[:3], f"compiled by {self.compiler} for {where}; bytes per device:",
                 *self.memory.table(), f"device memory {format_bytes(self.device_memory)}; XLA may use "
                 f"{self.mem_fraction:.0%} of it ({format_bytes(self.usable)}, config.mem_fraction)",
                 "verdict: " + verdict(self.memory.total, self.usable, self.device_memory)]
        if self.max_classes is not None:
            lines.append(f"largest num_classes that fits: {self.max_classes:,} ({format_bytes(self.max_classes_total)}"
                         f" per device; {format_bytes(self.fixed)} + {self.per_class:,.0f} B per class)")
        return lines + [f"note: {n}" for n in self.notes]

    def to_json(self) -> dict:
        return {"target": self.target, "device_kind": self.device_kind, "devices": self.devices, "hosts": self.hosts,
                "compiler": self.compiler, "device_memory": self.device_memory, "mem_fraction": self.mem_fraction,
                "usable_bytes": self.usable, "parts": self.memory.parts, "total_bytes": self.memory.total,
                "fits": self.memory.total <= self.usable, "fixed_bytes": self.fixed,
                "bytes_per_class": self.per_class, "max_classes": self.max_classes,
                "max_classes_total_bytes": self.max_classes_total, "summary": self.summary, "notes": self.notes}


def compile_step_memory(config, devices: list, target: str, num_classes: int | None = None):
    """``(run, its step's bytes per device, whether XLA:GPU took cuBLAS GEMMs)``: ``config`` (at ``num_classes`` if
    given) built for ``devices`` of ``target`` (``target_devices``) and compiled by that target's compiler."""
    c = config.copy_and_resolve_references()
    c.num_classes = config.num_classes if num_classes is None else num_classes
    run = build(c, devices, with_data=False)
    if target == "cpu":
        return run, step_memory(run), False
    compiled, fell_back = gpu_target.compile_step(run, run.abstract_state)
    return run, step_memory(run, compiled), fell_back


def plan(config, devices: list, device_memory: int, max_classes: bool = False, target: str = "cpu") -> Plan:
    """Compile ``config``'s step for ``devices`` (``target_devices``) and size it against ``device_memory``."""
    cublas = []  # whether a GPU compile had to take cuBLAS for its GEMMs

    def memory_at(num_classes=None):
        run, memory, fell_back = compile_step_memory(config, devices, target, num_classes)
        cublas.append(fell_back)
        return run, memory

    run, memory = memory_at()
    if target == "cpu":
        compiler, notes = f"XLA:CPU (jaxlib {jax.lib.__version__}, simulated devices)", cpu_caveats(config)
    else:
        compiler = gpu_target.compiler() + ", compile-only"
        notes = [f"compile-only: nothing was autotuned (cuDNN algorithms, GEMM tiles); a compile on the GPU may "
                 f"need up to ~{gpu_target.AUTOTUNING_MARGIN:.0%} more temporaries"]
        notes += ["XLA found no Triton tiles for a GEMM without autotuning: compiled with cuBLAS GEMMs "
                  "(xla_gpu_enable_triton_gemm=false)"] * any(cublas)
    result = Plan(target, devices[0].device_kind, len(devices), len({d.process_index for d in devices}), compiler,
                  device_memory, mem_fraction(config), memory, run.summary(), notes)
    if max_classes:
        shards = class_shards(run.mesh, run.train_step.head.class_axes)
        rows = probe_rows(config.chunk_size, config.sample_rate)
        fit = max_classes_that_fit(lambda c: memory_at(c)[1], result.usable, shards, rows)
        result.max_classes, result.max_classes_total = fit.classes, fit.memory.total
        result.fixed, result.per_class = fit.fixed, fit.per_class
        if fit.capped:
            result.notes.append(f"more classes would fit, but {fit.classes:,} is the most jaxcls takes (labels and "
                                "FC rows are numbered in int32)")
    return result
