"""A run's backbone restored for inference: the chosen checkpoint, eval mode, batches padded over the devices."""

import re
import shlex
import sys
import tomllib
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxcls.checkpoint import CheckpointError, RunCheckpoints
from jaxcls.data.pipeline import normalize
from jaxcls.extras import INSTALL, optional_import
from jaxcls.interop.inference import Embedder, OnnxEmbedder, open_embedder, restore_backbone
from tiny import get_config, saved_run

pytestmark = pytest.mark.slow  # compiles a run's initializer and its backbone
ROOT = Path(__file__).resolve().parents[1]


def test_restore_picks_the_step_and_the_embedder_pads_batches_over_the_devices(tmp_path, rng):
    config = get_config()
    first = saved_run(tmp_path, config, rng, step=1)
    second = saved_run(tmp_path, config, rng, step=2)  # other BatchNorm statistics
    images = rng.integers(0, 256, (5, 16, 16, 3), dtype=np.uint8)  # 5 rows on 8 devices: padded
    embedder = Embedder(tmp_path)
    assert embedder.step == 2 and embedder.input_size == 16 and embedder.devices == jax.local_device_count()
    got = embedder(images)
    model, _, step = restore_backbone(tmp_path, 1)
    assert step == 1 and model.features.use_running_average  # eval mode
    latest, _, _ = restore_backbone(tmp_path)
    np.testing.assert_allclose(got, np.asarray(latest(normalize(images))), rtol=1e-5, atol=1e-5)
    assert not np.allclose(np.asarray(model(normalize(images))), got, atol=1e-3)  # step 1 differs
    mean = lambda state: jax.tree.leaves(state["stats"])[0]
    assert not np.allclose(mean(first), mean(second))


def test_clear_errors(tmp_path):
    with pytest.raises(CheckpointError, match="is not a jaxcls run: it has no config.json"):
        restore_backbone(tmp_path)
    (tmp_path / "config.json").write_text(get_config().to_json_best_effort())
    RunCheckpoints(tmp_path / "checkpoints", keep=1).close()
    with pytest.raises(CheckpointError, match="no checkpoint"):
        restore_backbone(tmp_path)
    with pytest.raises(ValueError, match="exactly one of"):
        open_embedder(tmp_path, tmp_path / "m.onnx")
    with pytest.raises(ValueError, match="exactly one of"):
        open_embedder()
    with pytest.raises(ValueError, match="a checkpoint step goes with a workdir"):
        open_embedder(onnx=tmp_path / "m.onnx", step=3)
    onnx = pytest.importorskip("onnx", reason="the export extra is not installed")
    pytest.importorskip("onnxruntime", reason="the export extra is not installed")
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["B", 8])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["B", 8])
    graph = onnx.helper.make_graph([onnx.helper.make_node("Identity", ["x"], ["y"])], "g", [x], [y])
    onnx.save(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)]),
              str(tmp_path / "flat.onnx"))
    with pytest.raises(ValueError, match=r"flat.onnx: input x has shape \['B', 8\], expected \[B, 3, S, S\]"):
        OnnxEmbedder(tmp_path / "flat.onnx")


def test_a_missing_optional_package_names_the_command_that_installs_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "jax2onnx", None)  # import fails as if it were not installed
    with pytest.raises(ImportError, match=re.escape(f"jax2onnx is not installed; install what export needs with: "
                                                    f"{INSTALL['export']}")):
        optional_import("jax2onnx", "export")
    # the command installs the export extra's packages, then jax2onnx without its orbax pin, as README and CI do
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    first, second = INSTALL["export"].split(" && ")
    assert sorted(shlex.split(first)[2:]) == sorted(project["optional-dependencies"]["export"])
    assert second == "pip install --no-deps jax2onnx==0.17.1"
    for file in ROOT / "README.md", ROOT / ".ci" / "run":
        assert second.removeprefix("pip install ") in file.read_text(), file
    assert INSTALL["plot"] == "pip install " + " ".join(project["optional-dependencies"]["plot"])
