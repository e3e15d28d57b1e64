"""The trainer end to end: a glyphs run, exact resume on the same and other meshes, the quiet CLI, the eval CLI."""

import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import COMPILATION_CACHE
from jaxcls.reporting import log
from jaxcls.train import train
from test_recordio import GLYPHS, needs_glyphs
from tiny import get_config as tiny_config

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def as_numpy(x):
    return np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x)


def losses(workdir):
    return [json.loads(line)["loss"] for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]


@needs_glyphs
def test_glyphs_smoke_on_2x4_mesh(tmp_path):
    c = tiny_config(num_classes=1500, mesh_data=2, batch_size=64, total_steps=40, warmup_steps=5, ckpt_every=100,
                    sample_rate=0.5)
    c.data.kind, c.data.root, c.data.input_size = "recordio", str(GLYPHS), 32
    c.margin = dict(name="cosface", s=32.0, m=0.2, straight_through=False)
    state, last = train(c, tmp_path, progress=False)
    assert dict(state["weight"].sharding.mesh.shape) == {"data": 2, "class": 4}
    history = np.array(losses(tmp_path))
    assert len(history) == 40 and np.isfinite(history).all()
    # The loss first rises while the warm-up raises the lr (seen: 24 → 28 by step 15), then falls.
    assert np.polyfit(np.arange(20), history[20:], 1)[0] < 0, history
    assert history[-5:].mean() < history[10:20].mean() - 1.0, history
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["data"]["root"] == str(GLYPHS) and saved["mesh_data"] == 2


def test_resume_is_exact_and_works_on_another_mesh(tmp_path, caplog):
    c = tiny_config(sample_rate=0.5)
    straight, _ = train(c, tmp_path / "straight", progress=False)
    train(c, tmp_path / "resumed", progress=False, stop_after=3)
    log.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="jaxcls")
    try:
        resumed, _ = train(c, tmp_path / "resumed", progress=False)
    finally:
        log.removeHandler(caplog.handler)
    assert f"resumed from step 3 in {tmp_path / 'resumed'}" in caplog.text
    assert int(resumed["step"]) == int(straight["step"]) == 6
    for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed)):
        np.testing.assert_array_equal(as_numpy(a), as_numpy(b))
    assert losses(tmp_path / "straight") == losses(tmp_path / "resumed")

    # The 8-device checkpoint of step 3 continues on 4 devices with a (2, 2) mesh.
    shutil.copytree(tmp_path / "straight" / "checkpoints" / "3", tmp_path / "moved" / "checkpoints" / "3")
    state, _ = train(tiny_config(sample_rate=0.5, mesh_data=2), tmp_path / "moved", progress=False,
                     devices=jax.devices()[:4])
    assert dict(state["weight"].sharding.mesh.shape) == {"data": 2, "class": 2}
    assert int(state["step"]) == 6 and len(losses(tmp_path / "moved")) == 3
    np.testing.assert_allclose(losses(tmp_path / "moved"), losses(tmp_path / "straight")[3:], rtol=1e-4)


def test_relative_workdir_and_resume_with_other_class_count(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    c = tiny_config(sample_rate=0.5, total_steps=2, ckpt_every=1)  # the programs of the resume test: compiled once
    train(c, "runs/relative", progress=False)
    assert sorted(p.name for p in (tmp_path / "runs/relative/checkpoints").iterdir()) == ["1", "2"]
    with pytest.raises(ValueError, match="checkpoint holds an FC of 64 classes, the config asks for 70"):
        train(tiny_config(sample_rate=0.5, total_steps=4, num_classes=70), "runs/relative", progress=False)


def cli(*args):
    """Run ``python -m <args>`` on 8 CPU devices sharing this process's compilation cache; (exit code, lines)."""
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=COMPILATION_CACHE, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=8")
    proc = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    bar = re.compile(r"\d+/\d+ \[|^\s*\d+%\|")  # tqdm redraws one line with \r
    lines = [line.split("\r")[-1] for line in (proc.stdout + proc.stderr).splitlines()]
    return proc.returncode, [line for line in lines if line.strip() and not bar.search(line)]


def test_cli_is_quiet_and_evaluates(tmp_path):
    flags = ["--config", "tests/tiny.py", "--workdir", str(tmp_path), "--config.sample_rate=0.5",
             "--config.eval_every=4", "--config.log_every=2"]
    code, lines = cli("jaxcls.train", *flags, "--config.total_steps=4")
    assert code == 0, "\n".join(lines)
    assert 4 <= len(lines) <= 15, "\n".join(lines)
    assert not any(re.match(r"[IW]\d{4} ", line) for line in lines), "absl INFO lines leaked:\n" + "\n".join(lines)
    assert lines[0].startswith("model r18") and re.search(r"done: loss [\d.]+, verification heldout", lines[-1])

    code, lines = cli("jaxcls.eval", "--workdir", str(tmp_path), "--export", str(tmp_path / "exported"))
    assert code == 0, "\n".join(lines)
    assert lines[0] == "step 4" and lines[2].startswith("heldout"), "\n".join(lines)
    result = json.loads((tmp_path / "eval_4.json").read_text())
    assert 0.4 < result["val/heldout/accuracy"] <= 1.0 and (tmp_path / "exported" / "config.json").exists()
