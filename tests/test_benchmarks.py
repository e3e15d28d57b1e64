"""Every benchmark's --small mode runs and writes well-formed JSON (no timing asserts)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import COMPILATION_CACHE

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = {
    "loss.py": {"loss", "ms", "temp_bytes"},
    "fc_memory.py": {"C", "sample_rate", "dtype", "temp_bytes", "bytes_per_class"},
    "backbone_memory.py": {"model", "dtype", "remat", "saved_bytes", "temp_bytes"},
    "train.py": {"model", "batch", "classes", "img_per_s", "temp_bytes"},
    "max_classes.py": {"classes", "img_per_s", "is_max"},
    "data.py": {"stage", "threads", "img_per_s"},
    "cross_host.py": {"class_axes", "mesh", "cross_host_MB_per_host", "collectives"},
    "inference.py": {"runtime", "model", "batch", "img_per_s", "max_rel_err"},
    "planner.py": {"model", "classes", "planner_GiB", "planner_parts", "device_GiB", "peak_GiB"},
    "gpu_plan.py": {"model", "fc_state_dtype", "gpus", "fixed_GiB", "bytes_per_class", "max_classes_75",
                    "max_classes_95"},
    "gpu_program.py": {"program", "kind", "kernels", "result_MiB", "moved_GiB"},
    "profile_step.py": {"program", "wall_ms", "device_ms", "fusion_ms"},
}
NEEDS = {"inference.py": "jax2onnx"}
GPU_TARGET = {"gpu_plan.py", "gpu_program.py"}  # compile for a GPU: JAX's CUDA plugin

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("script", [pytest.param(s, marks=pytest.mark.gpu_target if s in GPU_TARGET else ())
                                    for s in sorted(SCRIPTS)])
def test_small_mode_writes_json(script, tmp_path):
    if script in NEEDS and importlib.util.find_spec(NEEDS[script]) is None:
        pytest.skip(f"{script} needs {NEEDS[script]}: see docs/deploy.md")
    out = tmp_path / "result.json"
    # the script sets up its own devices; programs that this process already compiled for 8 devices are reused
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_COMPILATION_CACHE_DIR": COMPILATION_CACHE}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--small", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["environment"]["backend"] and result["rows"]
    for row in result["rows"]:
        assert SCRIPTS[script] <= row.keys()
    if script == "inference.py":  # every runtime embeds as JAX does
        assert {r["runtime"] for r in result["rows"]} == {"jax", "stablehlo", "onnxruntime"}
        assert all(r["max_rel_err"] <= 1e-4 for r in result["rows"])
