"""notebooks/quickstart.ipynb executes from top to bottom."""

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "quickstart.ipynb"


pytestmark = pytest.mark.slow

def test_quickstart_runs(tmp_path, monkeypatch):
    # the kernel trains for a while: LLVM optimization pays for itself there (conftest turns it off for the tests)
    flags = os.environ["XLA_FLAGS"].replace("--xla_backend_optimization_level=0", "")
    monkeypatch.setenv("XLA_FLAGS", flags)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = "".join(o.get("text", "") for cell in nb.cells for o in cell.get("outputs", []))
    assert "dense loss" in outputs and "accuracy" in outputs
