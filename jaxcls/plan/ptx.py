"""What each Triton kernel of a program compiled for a GPU asks of an SM, on any machine (no GPU): its launch (grid,
warps, pipelining stages, from the compiled HLO) and its registers and spills (XLA writes each kernel's PTX with
``xla_dump_to``; ptxas, which JAX's CUDA plugin uses too, assembles it and reports them).

Registers bound how many programs an SM holds at once, so how well it hides the latency of loads: a program of
``w`` warps at ``r`` registers a thread takes ``w · ⌈32·r / 256⌉ · 256`` of an SM's 65,536 (Hopper and Ampere).
Shared memory, which Triton sizes at launch, is not counted here.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

REGISTERS_PER_SM = 65_536
REGISTER_UNIT = 256  # registers are given to a warp in blocks of this many
MAX_WARPS_PER_SM = 64
MAX_PROGRAMS_PER_SM = 32

_LAUNCH = re.compile(r'name = "(\w+)", num_stages = (\d+) : i32, num_warps = (\d+) : i32')
_GRID = re.compile(r"grid_x = (\d+) : i32, grid_y = (\d+) : i32, grid_z = (\d+)")
_ENTRY = re.compile(r"Compiling entry function '(\w+)'")
_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")


def ptxas() -> str:
    """The ptxas of the ``plan-gpu`` extra (``nvidia-cuda-nvcc-cu12``), else one on the PATH."""
    try:
        import nvidia.cuda_nvcc
        bundled = Path(next(iter(nvidia.cuda_nvcc.__path__))) / "bin" / "ptxas"
        if bundled.exists():
            return str(bundled)
    except ImportError:
        pass
    found = shutil.which("ptxas")
    if found is None:
        raise FileNotFoundError("ptxas not found: pip install -e '.[plan-gpu]' installs it (nvidia-cuda-nvcc-cu12)")
    return found


def triton_launches(hlo_text: str) -> dict[str, dict]:
    """``{kernel name: {"grid": (x, y, z), "warps", "stages"}}`` of each Triton call in a compiled HLO module's text."""
    launches = {}
    for line in hlo_text.splitlines():
        if "__gpu$xla.gpu.triton" in line and (launch := _LAUNCH.search(line)) and (grid := _GRID.search(line)):
            launches[launch.group(1)] = {"grid": tuple(int(g) for g in grid.groups()),
                                         "warps": int(launch.group(3)), "stages": int(launch.group(2))}
    return launches


def registers(ptx: Path, arch: str = "sm_90a") -> dict[str, dict]:
    """``{entry: {"registers", "spill_bytes", "stack_bytes"}}`` of each kernel in a PTX file, as ptxas reports them."""
    return parse_ptxas_report(subprocess.run([ptxas(), f"-arch={arch}", "-v", str(ptx), "-o", os.devnull],
                                             capture_output=True, text=True, check=True).stderr)


def parse_ptxas_report(report: str) -> dict[str, dict]:
    """``registers``' result from the text ``ptxas -v`` writes."""
    found, entry = {}, None
    for line in report.splitlines():
        if m := _ENTRY.search(line):
            entry = found.setdefault(m.group(1), {"registers": 0, "spill_bytes": 0, "stack_bytes": 0})
        elif entry is not None and (m := _SPILLS.search(line)):
            entry["stack_bytes"], entry["spill_bytes"] = int(m.group(1)), int(m.group(2))
        elif entry is not None and (m := _USED.search(line)):
            entry["registers"] = int(m.group(1))
    return found


def programs_per_sm(registers_per_thread: int, warps: int) -> int:
    """How many programs of ``warps`` warps an SM holds at once, as their registers allow: the register file is four
    quarters, each holding whole warps (CUDA's occupancy calculator), so 1- and 2-warp programs may fit fewer."""
    per_warp = -(-32 * max(registers_per_thread, 1) // REGISTER_UNIT) * REGISTER_UNIT
    warps_by_registers = 4 * (REGISTERS_PER_SM // 4 // per_warp)
    return min(warps_by_registers // warps, MAX_WARPS_PER_SM // warps, MAX_PROGRAMS_PER_SM)


def triton_resources(compile_with: Callable[[dict], object], arch: str = "sm_90a") -> dict[str, dict]:
    """Each Triton kernel's launch and registers (see the module docstring): ``compile_with(options)`` compiles the
    program for a GPU with these XLA options added and returns the compiled executable."""
    with tempfile.TemporaryDirectory() as dump:
        # a kernel that XLA takes from its kernel cache file (--xla_gpu_kernel_cache_file) is not compiled, so its PTX
        # would not be dumped: compile every kernel
        compiled = compile_with({"xla_dump_to": dump, "xla_gpu_kernel_cache_file": ""})
        launches = triton_launches(compiled.as_text())
        assembled = {}
        for ptx in sorted(Path(dump).glob("*.ptx")):
            text = ptx.read_text()
            if any(f".entry {name}(" in text for name in launches):
                assembled |= registers(ptx, arch)
    if missing := sorted(launches.keys() - assembled.keys()):
        raise RuntimeError(f"no PTX was dumped for the Triton kernel(s) {', '.join(missing)}")
    return {name: dict(launch, **assembled[name],
                       programs_per_sm=programs_per_sm(assembled[name]["registers"], launch["warps"]))
            for name, launch in launches.items()}
