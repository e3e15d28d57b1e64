"""The notebooks execute from top to bottom."""

import os
import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"

pytestmark = pytest.mark.slow


def execute(name: str, cwd: Path) -> str:
    """Run ``notebooks/<name>`` in a fresh kernel; its text outputs."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}).execute()
    return "".join(o.get("text", "") for cell in nb.cells for o in cell.get("outputs", []))


def test_quickstart_runs(tmp_path, monkeypatch):
    # the kernel trains for a while: LLVM optimization pays for itself there (conftest turns it off for the tests)
    flags = os.environ["XLA_FLAGS"].replace("--xla_backend_optimization_level=0", "")
    monkeypatch.setenv("XLA_FLAGS", flags)
    outputs = execute("quickstart.ipynb", tmp_path)
    assert "dense loss" in outputs and "accuracy" in outputs


def test_scaling_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXCLS_SCALING_QUICK", "1")  # MobileFaceNet, float32 FC state, PartialFC 0.1: 4 compiles, not 32
    outputs = execute("scaling.ipynb", tmp_path)
    assert "4 compiles in" in outputs and "max classes @ 60 GiB" in outputs
    # float32 weight + momentum: 4,096 B per class on one device, an eighth of it on each of eight
    slopes = {int(d): float(b) for d, b in re.findall(r"mbf\s+float32\s+0\.1\s+(\d)\s+[\d.]+\s+([\d.]+)", outputs)}
    assert 4096 <= slopes[1] < 4096 + 32 and 512 <= slopes[8] < 512 + 4, slopes
