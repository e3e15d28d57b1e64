"""The notebooks execute from top to bottom."""

import os
import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from conftest import TEST_COMPILE_FLAGS

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"

pytestmark = pytest.mark.slow


def execute(name: str, cwd: Path, code_cells: int | None = None) -> str:
    """Run ``notebooks/<name>`` (its first ``code_cells`` code cells, or all) in a fresh kernel; its text outputs."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nb.cells = [cell for cell in nb.cells if cell.cell_type == "code"][:code_cells]
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}).execute()
    return "".join(o.get("text", "") for cell in nb.cells for o in cell.get("outputs", []))


def test_quickstart_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXCLS_QUICKSTART_STEPS", "6")  # the notebook's cells as users run them, 6 steps for 60
    # its two evaluations embed 600 pairs each: LLVM optimization pays for itself there (conftest turns it off for the
    # tests), and with it on, XLA:CPU's fusion emitters compile faster than the elemental one (conftest's choice)
    flags = [f for f in os.environ["XLA_FLAGS"].split() if f not in TEST_COMPILE_FLAGS]
    monkeypatch.setenv("XLA_FLAGS", " ".join(flags))
    outputs = execute("quickstart.ipynb", tmp_path)
    assert "dense loss" in outputs, outputs
    assert re.search(r"\| accuracy \[[\d.]+, [\d.]+\]", outputs), outputs  # evaluated at steps 3 and 6


def test_scaling_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXCLS_SCALING_TARGET", "cpu")
    monkeypatch.setenv("JAXCLS_SCALING_QUICK", "1")  # a narrow r18 (32-d), float32 FC state, PFC 0.1, 8 devices
    outputs = execute("scaling.ipynb", tmp_path)
    assert "2 compiles in" in outputs and "(XLA:CPU)" in outputs and "max classes @ 75%" in outputs, outputs
    # float32 weight + momentum of 32 dimensions: 256 B per class, an eighth of it on each of eight devices
    slope = re.findall(r"r18\s+float32\s+0\.1\s+8\s+[\d.]+\s+([\d.]+)", outputs)
    assert len(slope) == 1 and 32 <= float(slope[0]) < 34, outputs


@pytest.mark.gpu_target
def test_scaling_plans_for_h100s_where_the_cuda_plugin_is(tmp_path, monkeypatch):
    """The setup cell's GPU branch, its default with the plugin installed. Its compiles are the planner's for a GPU
    target (test_gpu_target.py::test_the_planner_on_a_gpu_target holds their bytes)."""
    monkeypatch.delenv("JAXCLS_SCALING_TARGET", raising=False)
    outputs = execute("scaling.ipynb", tmp_path, code_cells=1)
    assert outputs == "h100: NVIDIA H100 80GB HBM3, 79.11 GiB per device, XLA:GPU, compile-only\n", outputs
