"""Per-device memory of a run's compiled train step, by part, and whether it fits a device.

``step_memory(run)`` compiles the real train step for the run's abstract state and one abstract global batch
(nothing is allocated) and splits XLA's per-device ``memory_analysis()`` into parts: FC weight, FC optimizer
state, backbone parameters, backbone optimizer state, other state (BatchNorm statistics, step, RNG, loss scale),
the input batch, activations and temporaries, and outputs that are not donated. Bytes are affine in
``num_classes`` once PartialFC samples full tiles (every part that grows with C is then a per-row array), which
``fit_classes`` and ``max_classes_that_fit`` use.

``check_fits(memory, devices)`` is the trainer's check before step 1: on a backend whose devices report
``memory_stats()["bytes_limit"]`` (GPUs, TPUs), a step that needs more raises ``DoesNotFit`` with the breakdown
instead of running out of memory later.
"""

from __future__ import annotations

import dataclasses
import math
import os
import typing

import jax

from jaxcls.config import MAX_CLASSES

GiB = 2**30
MEM_FRACTION_VARIABLE = "XLA_PYTHON_CLIENT_MEM_FRACTION"
DEFAULT_MEM_FRACTION = 0.75  # JAX's default share of a GPU
STATE_PARTS = {  # state key -> the part it belongs to
    "weight": "FC weight", "fc_opt": "FC optimizer state", "params": "backbone parameters",
    "opt": "backbone optimizer state",
}
OTHER_STATE = "BatchNorm statistics, step, RNG, loss scale"
PARTS = (*STATE_PARTS.values(), OTHER_STATE, "input batch", "activations and temporaries", "outputs not donated")


class DoesNotFit(RuntimeError):
    """The compiled train step needs more memory per device than the device has; ``details``: the breakdown and
    what to change, as lines (the command-line programs print them after the error)."""

    def __init__(self, message: str, details: list[str]):
        super().__init__(message)
        self.details = details


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """Bytes per device of one compiled train step; ``parts`` maps each of ``PARTS`` to bytes."""

    parts: dict
    platform: str  # the backend that compiled the step (its numbers, e.g. "cpu" for the planner)

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def table(self, limit: int | None = None) -> list[str]:
        """The parts and the total as aligned lines (against ``limit`` bytes if given)."""
        lines = [f"  {name:<44} {format_bytes(n):>10}" for name, n in self.parts.items()]
        total = f"  {'total per device':<44} {format_bytes(self.total):>10}"
        if limit is not None:
            total += f" of {format_bytes(limit)} ({self.total / limit:.0%})"
        return lines + [total]


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def parse_bytes(text: str) -> int:
    """``"80GiB"``, ``"80 GB"``, ``"512MiB"`` or a plain byte count → bytes (GB = 10⁹, GiB = 2³⁰)."""
    units = {"tib": 2**40, "gib": GiB, "mib": 2**20, "kib": 2**10, "tb": 10**12, "gb": 10**9, "mb": 10**6,
             "kb": 10**3, "b": 1}
    s = text.strip().lower().replace(" ", "")
    for unit, size in units.items():
        if s.endswith(unit):
            s, factor = s[: -len(unit)], size
            break
    else:
        factor = 1
    try:
        value = float(s)
    except ValueError:
        raise ValueError(f"cannot read {text!r} as a size: write e.g. 80GiB, 80GB or 85899345920") from None
    if value <= 0:
        raise ValueError(f"a memory size must be positive, got {text!r}")
    return int(value * factor)


def device_bytes(abstract) -> int:
    """Bytes one device holds of ``abstract`` (a pytree of ``jax.ShapeDtypeStruct`` with shardings)."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
               for x in jax.tree.leaves(abstract))


def step_memory(run, compiled=None) -> StepMemory:
    """The per-device bytes of ``run``'s train step by part; ``compiled``: the step already compiled (by
    ``run.compile_step``), else it is compiled here for the abstract state."""
    compiled = run.compile_step(run.abstract_state) if compiled is None else compiled
    stats = compiled.memory_analysis()
    if stats is None:
        raise RuntimeError(f"the {run.mesh.devices.flat[0].platform} backend reports no compiled memory")
    state = run.abstract_state
    parts = {name: device_bytes(state[key]) for key, name in STATE_PARTS.items()}
    parts[OTHER_STATE] = device_bytes({k: v for k, v in state.items() if k not in STATE_PARTS})
    parts["input batch"] = stats.argument_size_in_bytes - device_bytes(state)
    parts["activations and temporaries"] = stats.temp_size_in_bytes
    parts["outputs not donated"] = stats.output_size_in_bytes - stats.alias_size_in_bytes
    return StepMemory(parts, run.mesh.devices.flat[0].platform)


def mem_fraction(config) -> float:
    """The share of a GPU's memory XLA may allocate for a run of ``config``: ``config.mem_fraction``, else
    ``$XLA_PYTHON_CLIENT_MEM_FRACTION``, else JAX's default 0.75."""
    return float(config.mem_fraction or os.environ.get(MEM_FRACTION_VARIABLE, DEFAULT_MEM_FRACTION))


def apply_mem_fraction(config) -> None:
    """Give XLA ``config.mem_fraction`` of each GPU (when set): ``XLA_PYTHON_CLIENT_MEM_FRACTION``, which JAX reads
    when its GPU backend starts, so call this first. A different value already in the environment is an error."""
    if not config.mem_fraction:
        return
    current = os.environ.get(MEM_FRACTION_VARIABLE)
    if current is not None and float(current) != config.mem_fraction:
        raise ValueError(f"config.mem_fraction={config.mem_fraction:g} but the environment has "
                         f"{MEM_FRACTION_VARIABLE}={current}: set one of them")
    os.environ[MEM_FRACTION_VARIABLE] = str(config.mem_fraction)


def device_limit(devices) -> int | None:
    """The smallest ``memory_stats()["bytes_limit"]`` of ``devices`` (what XLA may allocate), None if unknown
    (a CPU reports none)."""
    limits = [(d.memory_stats() or {}).get("bytes_limit") for d in devices]
    return None if None in limits or not limits else min(limits)


def check_fits(memory: StepMemory, devices, advice: str = "") -> str | None:
    """Raise ``DoesNotFit`` when ``memory`` exceeds the devices' ``bytes_limit``; else the use as a line (None
    without a limit to check against)."""
    limit = device_limit(devices)
    if limit is not None and memory.total > limit:
        raise DoesNotFit(
            f"the train step needs {format_bytes(memory.total)} per device, more than the {format_bytes(limit)} "
            f"XLA may allocate on {devices[0].device_kind}",
            [*memory.table(limit), "lower batch_size or sample_rate (PartialFC), set fc_dtype=bfloat16 (and "
             "fc_state_dtype=int8) or remat=full, or add devices; config.mem_fraction raises XLA's share of the "
             "device (default 0.75)"
             + advice])
    return None if limit is None else (f"train step: {format_bytes(memory.total)} per device of the "
                                       f"{format_bytes(limit)} XLA may allocate ({memory.total / limit:.0%})")


def fit_classes(memory_at, probes: tuple[int, int]) -> tuple[float, float]:
    """``(a, b)`` with total bytes per device ≈ ``a + b · num_classes``, from the steps at two ``probes`` class
    counts; ``memory_at(num_classes) -> StepMemory`` compiles one."""
    (c1, c2), (m1, m2) = probes, [memory_at(c).total for c in probes]
    slope = (m2 - m1) / (c2 - c1)
    return m1 - slope * c1, slope


class ClassFit(typing.NamedTuple):
    """The largest class count that fits, its step's memory, and the affine fit it was solved from (bytes per device
    ≈ ``fixed + per_class · num_classes``)."""

    classes: int
    memory: StepMemory
    fixed: float
    per_class: float
    capped: bool = False  # at ``config.MAX_CLASSES`` (int32 labels), whatever more would fit


def probe_rows(chunk_size: int, sample_rate: float) -> int:
    """FC rows per device at which to probe the class count: 1M, or more where PartialFC needs it to sample whole
    tiles of ``chunk_size`` rows (two tiles), so every part that grows with the classes is a per-row array."""
    return max(2**20, math.ceil(2 * chunk_size / sample_rate))


def max_classes_that_fit(memory_at, limit: int, shards: int, rows: int = 2**20) -> ClassFit:
    """The largest ``num_classes`` (a multiple of ``shards``) whose step fits in ``limit`` bytes per device, and
    its memory: solved from ``fit_classes`` at ``rows`` and ``2 · rows`` FC rows per device (enough that PartialFC
    samples full tiles, so every part that grows with C is a per-row array; never past ``MAX_CLASSES``), confirmed
    by a third compile and, where that lands over the line, stepped down by the excess (whole rows per device, at
    least one) until one fits. ``DoesNotFit`` where not even one row per device does."""
    cap = MAX_CLASSES // shards * shards
    rows = min(rows, cap // (2 * shards))
    a, b = fit_classes(memory_at, (shards * rows, shards * 2 * rows))
    classes = min(int((limit - a) / b) // shards * shards, cap)
    memory = memory_at(classes) if classes >= shards else None  # else not even the fit's fixed part fits
    while memory is not None and memory.total > limit:
        classes -= max(1, math.ceil((memory.total - limit) / (b * shards))) * shards
        memory = memory_at(classes) if classes >= shards else None
    if memory is None:
        raise DoesNotFit(f"not even {shards} classes (one FC row per device) fit in the {format_bytes(limit)} XLA may "
                         f"allocate: the step takes {format_bytes(a)} per device besides its FC rows",
                         ["lower batch_size, set remat=full or a 16-bit precision, or add devices"])
    return ClassFit(classes, memory, a, b, capped=classes == cap)
