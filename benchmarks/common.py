"""Shared helpers of the benchmark scripts: timing, compiled memory, tables and JSON."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time

import jax


def force_cpu_devices(n: int = 8) -> None:
    """On a machine without an accelerator, simulate ``n`` devices (call before jax initializes)."""
    if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}"


def time_ms(fn, *args, warmup: int = 3, iters: int = 20) -> float:
    """Median wall time in ms of ``fn(*args)``, synchronized on its outputs, after warm-up."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def compiled_memory(compiled) -> dict:
    """Per-device bytes from ``compiled.memory_analysis()`` (None where the backend gives none)."""
    stats = compiled.memory_analysis()
    if stats is None:
        return {"temp_bytes": None, "argument_bytes": None, "output_bytes": None}
    return {"temp_bytes": int(stats.temp_size_in_bytes), "argument_bytes": int(stats.argument_size_in_bytes),
            "output_bytes": int(stats.output_size_in_bytes)}


def peak_device_bytes() -> int | None:
    """Peak bytes in use on device 0 so far (GPU/TPU), else None."""
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def environment() -> dict:
    dev = jax.devices()[0]
    return {"jax": jax.__version__, "backend": dev.platform, "device_kind": dev.device_kind,
            "device_count": jax.device_count(), "python": platform.python_version(), "argv": sys.argv}


def select(grid: list[tuple], keys: list[str], conditions: list[str]) -> list[tuple]:
    """The specs of ``grid`` (tuples named by ``keys``) matching every ``KEY=VALUE`` of ``conditions``."""
    for condition in conditions:
        key, value = condition.split("=", 1)
        if key not in keys:
            sys.exit(f"--only {condition}: KEY must be one of {', '.join(keys)}")
        grid = [spec for spec in grid if str(spec[keys.index(key)]) == value]
    return grid


def print_table(rows: list[dict], columns: list[str]) -> None:
    def fmt(v):
        if v is None or isinstance(v, bool):
            return "-" if v is None else str(v)
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
        return f"{v:,}" if isinstance(v, int) else str(v)

    cells = [[fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print(" | ".join(c.ljust(w) for c, w in zip(columns, widths)))
    print("-|-".join("-" * w for w in widths))
    for row in cells:
        print(" | ".join(v.ljust(w) for v, w in zip(row, widths)))


def write_json(path: str, rows: list[dict]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"environment": environment(), "rows": rows}, f, indent=1)
    print(f"wrote {path}")
