"""Export: ONNX in onnxruntime and serialized StableHLO embed real glyph images as the run's backbone does."""

import importlib.util
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcls.config import base_config
from jaxcls.data.pipeline import normalize
from jaxcls.data.recordio import MXFaceDataset
from jaxcls.interop.export import ONNX_OPSET, export_run, load_jax_export
from jaxcls.interop.inference import OnnxEmbedder, agreement, deployed_input, restore_backbone
from test_recordio import GLYPHS, needs_glyphs
from tiny import get_config as tiny_config
from tiny import saved_run

pytestmark = [pytest.mark.slow,  # compiles and converts whole backbones
              pytest.mark.skipif(importlib.util.find_spec("jax2onnx") is None,
                                 reason="jax2onnx is not installed: pip install --no-deps jax2onnx==0.17.1")]
onnx = pytest.importorskip("onnx", reason="the export extra is not installed: pip install -e '.[export]'")

BACKBONES = {  # small versions of each family (every layer kind, fewer repeats), at the deployed 112×112 input
    "r18": ("r18", dict(width=16, dropout=0.2)),  # dropout: arcface_torch's r-models train with it
    "mbf": ("mbf", dict(blocks=(1, 1, 1, 1))),
    "vit_t": ("vit_t", dict(depth=2)),
}


def backbone_config(name, **overrides):
    model, kwargs = BACKBONES[name]
    c = base_config()
    c.model, c.model_kwargs, c.num_features, c.num_classes, c.batch_size = model, kwargs, 64, 1000, 8
    c.data.input_size = 112
    c.update(overrides)
    return c


def glyph_images(n):
    data = MXFaceDataset(GLYPHS)
    return np.stack([data[i * 997 % len(data)][0] for i in range(n)])


def check_interface(path, step, model, size, features):
    """The ONNX file's declared interface: names, dynamic batch, float32 only, opset, producer, metadata."""
    proto = onnx.load(str(path))
    assert proto.producer_name == "jaxcls" and [(o.domain, o.version) for o in proto.opset_import] == [("", ONNX_OPSET)]
    props = {p.key: p.value for p in proto.metadata_props}
    assert props["model"] == model and props["step"] == str(step) and props["converter"].startswith("jax2onnx ")
    (inp,), (out,) = proto.graph.input, proto.graph.output
    dims = lambda v: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
    assert inp.name == "images" and dims(inp) == ["B", 3, size, size] and dims(out) == ["B", features]
    float32 = onnx.TensorProto.FLOAT
    assert inp.type.tensor_type.elem_type == out.type.tensor_type.elem_type == float32
    other_floats = {onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE}
    assert float32 in {t.data_type for t in proto.graph.initializer}
    assert not other_floats & {t.data_type for t in proto.graph.initializer}
    assert not [n for n in proto.graph.node if n.op_type == "Cast" and
                any(a.name == "to" and a.i in other_floats for a in n.attribute)]


def check_insightface_accepts(path, features):
    """What insightface's own loaders check before they use a model (``onnx_helper.ArcFaceORT.check`` of
    arcface_torch's onnx_ijbc.py, ``model_zoo.ArcFaceONNX``): one 4-d input of 112×112 with a symbolic batch, one
    output of at most 512 dimensions, a graph of at least 8 nodes, every initializer at least 4 bytes an element,
    and the input normalisation they infer from the first 8 nodes' names (Sub and Mul there would mean "raw pixels,
    normalised in the graph") being (x − 127.5) / 127.5, the deployed convention. Nothing from training (Dropout)."""
    proto = onnx.load(str(path))
    (inp,), outputs = proto.graph.input, proto.graph.output
    dims = [d.dim_param or d.dim_value for d in inp.type.tensor_type.shape.dim]
    assert len(dims) == 4 and isinstance(dims[0], str) and tuple(dims[2:4][::-1]) == (112, 112)
    assert len(outputs) == 1 and 0 < outputs[0].type.tensor_type.shape.dim[1].dim_value == features <= 512
    assert len(proto.graph.node) >= 8
    small = [(t.name, onnx.numpy_helper.to_array(t).dtype) for t in proto.graph.initializer
             if onnx.numpy_helper.to_array(t).dtype.itemsize < 4]
    assert not small, f"insightface refuses initializers of fewer than 4 bytes an element: {small}"
    first = [n.name for n in proto.graph.node[:8]]
    subtracts = any(n.startswith(("Sub", "_minus")) for n in first)
    multiplies = any(n.startswith(("Mul", "_mul")) for n in first)
    assert not (subtracts and multiplies)
    assert not [n.op_type for n in proto.graph.node if n.op_type in ("Dropout", "BatchNormalization") and
                any(a.name == "training_mode" and a.i for a in n.attribute)]
    assert "Dropout" not in {n.op_type for n in proto.graph.node}


@needs_glyphs
@pytest.mark.parametrize("name", sorted(BACKBONES))
def test_onnx_and_jax_export_embed_glyphs_as_the_backbone(name, tmp_path, rng):
    saved_run(tmp_path / "run", backbone_config(name), rng)
    export_run(tmp_path / "run", onnx=tmp_path / "m.onnx", jax_export=tmp_path / "m.jaxexport")
    check_interface(tmp_path / "m.onnx", 1, BACKBONES[name][0], 112, 64)
    check_insightface_accepts(tmp_path / "m.onnx", 64)
    model, _, _ = restore_backbone(tmp_path / "run")
    images = glyph_images(7)
    want = np.asarray(jax.jit(lambda x: model(normalize(x)))(images), np.float64)
    onnx_embed, from_stablehlo = OnnxEmbedder(tmp_path / "m.onnx"), load_jax_export(tmp_path / "m.jaxexport")
    for batch in (images[:1], images):  # one file, any batch size
        n = len(batch)
        for got in (onnx_embed(batch), np.asarray(from_stablehlo(deployed_input(batch)))):
            assert got.shape == (n, 64) and got.dtype == np.float32
            cosine, relative = agreement(got, want[:n])
            print(f"{name} batch {n}: min cosine {cosine:.9f}, max relative error {relative:.2e}")
            assert cosine >= 0.99999 and relative <= 1e-4


def test_cli_exports_a_bfloat16_run_in_float32_and_its_errors_are_one_line(tmp_path, rng):
    saved_run(tmp_path / "run", tiny_config(precision="bfloat16"), rng, step=3)
    cli = lambda *args: subprocess.run([sys.executable, "-m", "jaxcls.export", *args], capture_output=True,
                                       text=True, timeout=600)
    done = cli("--workdir", str(tmp_path / "run"), "--onnx", str(tmp_path / "m.onnx"),
               "--jax", str(tmp_path / "m.jaxexport"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"wrote {tmp_path / 'm.onnx'} (step 3" in done.stdout and f"wrote {tmp_path / 'm.jaxexport'}" in done.stdout
    check_interface(tmp_path / "m.onnx", 3, "r18", 16, 32)
    # float32 compute of bfloat16-trained weights: the float32 backbone's embeddings, not bfloat16's rounding
    images = rng.integers(0, 256, (3, 16, 16, 3), dtype=np.uint8)
    model32, _, _ = restore_backbone(tmp_path / "run")
    model16, _, _ = restore_backbone(tmp_path / "run", dtype=jnp.bfloat16)
    want32, want16 = (np.asarray(m(normalize(images)), np.float64) for m in (model32, model16))
    for got in (OnnxEmbedder(tmp_path / "m.onnx")(images),
                np.asarray(load_jax_export(tmp_path / "m.jaxexport")(deployed_input(images)))):
        assert agreement(got, want32)[1] <= 1e-4 < agreement(got, want16)[1]
    for args, message in [((), "nothing to export"), (("--step", "5", "--onnx", "x.onnx"), "no checkpoint 5 in"),
                          (("--onnx", "x.onnx"), "is not a jaxcls run")]:
        workdir = tmp_path / ("run" if message != "is not a jaxcls run" else "nothing")
        failed = cli("--workdir", str(workdir), *args)
        assert failed.returncode == 1 and message in failed.stderr, failed.stderr[-2000:]
        assert failed.stderr.count("\n") <= 3  # one line, no traceback
