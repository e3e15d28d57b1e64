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


def execute(name: str, cwd: Path) -> str:
    """Run ``notebooks/<name>`` in a fresh kernel; its text outputs."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}).execute()
    return "".join(o.get("text", "") for cell in nb.cells for o in cell.get("outputs", []))


def test_quickstart_runs(tmp_path, monkeypatch):
    # the kernel trains for a while: LLVM optimization pays for itself there (conftest turns it off for the tests),
    # and with it on, XLA:CPU's fusion emitters compile faster than the elemental one (conftest's choice without it)
    flags = [f for f in os.environ["XLA_FLAGS"].split() if f not in TEST_COMPILE_FLAGS]
    monkeypatch.setenv("XLA_FLAGS", " ".join(flags))
    outputs = execute("quickstart.ipynb", tmp_path)
    assert "dense loss" in outputs and "accuracy" in outputs


@pytest.mark.parametrize("target", ["cpu", pytest.param("h100", marks=pytest.mark.gpu_target)])
def test_scaling_runs(target, tmp_path, monkeypatch):
    monkeypatch.setenv("JAXCLS_SCALING_TARGET", target)
    monkeypatch.setenv("JAXCLS_SCALING_QUICK", "1")  # a narrow r18 (32-d), float32 FC state, PFC 0.1, 8 devices
    outputs = execute("scaling.ipynb", tmp_path)
    compiler = "XLA:CPU" if target == "cpu" else "XLA:GPU, compile-only"
    assert "2 compiles in" in outputs and f"({compiler})" in outputs and "max classes @ 75%" in outputs, outputs
    # float32 weight + momentum of 32 dimensions: 256 B per class, an eighth of it on each of eight devices
    slope = re.findall(r"r18\s+float32\s+0\.1\s+8\s+[\d.]+\s+([\d.]+)", outputs)
    assert len(slope) == 1 and 32 <= float(slope[0]) < 34, outputs
